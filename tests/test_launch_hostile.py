"""A launch ends, whatever a rank does (issue #21, section 3): it prints without pause,
starts worker processes, starts processes in sessions of their own or daemons, forks a
helper and dies, launches again, or the caller is given a timeout of inf or is killed outright.

Besides the conftest fixture (nothing left below this test process), each test names the
processes its ranks start (`mark`) and checks that none is alive anywhere on the machine
afterwards, wherever it was re-parented.
"""
import contextlib
import ctypes
import fcntl
import functools
import glob
import io
import math
import multiprocessing
import os
import re
import secrets
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

import psutil
import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

import pplab
from conftest import alive, descendants, interrupt_after
from pplab.runtime import watch

pytestmark = pytest.mark.usefixtures("no_leftover_processes")

SLEEPER = "import sys, time; open(sys.argv[1], 'w').close(); time.sleep(600)"     # argv: ready file, mark


def ours(mark):
    """Live processes on this machine whose name or command line holds `mark`, whatever their parent."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        name, state = stat[stat.index("(") + 1:stat.rindex(")")], stat.rsplit(")", 1)[1].split()[0]
        if state != "Z" and (name == mark or mark.encode() in cmdline):
            found.append(int(entry))
    return found


@pytest.fixture
def mark():
    """A name for the processes this test's ranks start; none may be alive when it ends."""
    name = "pph" + secrets.token_hex(4)         # 11 characters: fits a process name (15)
    yield name
    left = ours(name)
    seen = {pid: _describe(pid) for pid in left}    # before they go: what each was, for the message
    for pid in left:                            # not left to trouble the other tests
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    assert not left, f"processes started by ranks outlived the launch: {seen}"


def _describe(pid):
    """State, parent, session and command line of a process, read from /proc (for a failure's message)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")[:160]
    except OSError as exc:
        return f"gone ({exc.strerror})"
    return f"state {fields[0]}, parent {fields[1]}, session {fields[3]}: {cmdline}"


class HangDetected(Exception):
    pass


@contextlib.contextmanager
def no_hang(seconds):
    """Fail (instead of hanging) if what runs inside takes more than `seconds`: a bound on a hang."""
    def alarm(signum, frame):
        raise HangDetected(f"still running after {seconds} s")

    old = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def _name_this_process(mark):
    ctypes.CDLL("libc.so.6").prctl(15, mark.encode())      # PR_SET_NAME: what /proc/PID/stat shows


def _wait_for(path, seconds=60):
    deadline = time.monotonic() + seconds
    while not os.path.exists(path):
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.01)


# ----------------------------------------------------------------------------------
# 1. Output without pause


class Sink(io.TextIOBase):
    """A stream that counts what it is given and keeps nothing."""

    def __init__(self):
        self.chars = 0

    def write(self, text):
        self.chars += len(text)
        return len(text)


@contextlib.contextmanager
def rss_growth():
    """{"bytes": the most this process's resident memory grew above its start} (sampled)."""
    me, out, stop = psutil.Process(), {}, threading.Event()
    start = peak = me.memory_info().rss

    def sample():
        nonlocal peak
        while not stop.wait(0.05):
            peak = max(peak, me.memory_info().rss)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        yield out
    finally:
        stop.set()
        sampler.join()
        out["bytes"] = peak - start


def _flood_of_lines():
    if dist.get_rank() == 0:
        line = "x" * 1_000_000
        while True:
            print(line)                         # 1 MB lines, as fast as it can
    return "done"


def _one_endless_line():
    if dist.get_rank() == 0:
        print("the line before")
        chunk = b"y" * 65536
        while True:
            os.write(1, chunk)                  # never a newline
    return "done"


@pytest.mark.parametrize("fn, first", [(_flood_of_lines, "x"), (_one_endless_line, "y")])
def test_a_rank_printing_without_pause_ends_at_its_timeout(fn, first, monkeypatch):
    sink = Sink()
    monkeypatch.setattr(sys, "stdout", sink)
    monkeypatch.setattr(sys, "stderr", sink)
    with rss_growth() as growth, no_hang(5 + 60), pytest.raises(pplab.LaunchError) as info:
        pplab.launch(fn, world_size=2, timeout=5)
    err = info.value
    assert err.running == (0,) and "rank 0 still running after 5 s" in str(err)
    assert sink.chars > 0                                       # relayed while it ran
    lines = err.output[0]                                       # its last lines, bounded
    assert lines and len(lines) <= watch.TAIL_LINES and lines[-1].startswith(first * 100)
    assert all(len(line) <= watch.TAIL_CHARS + 10 for line in lines)
    assert "last output of rank 0: " in str(err) and first * 100 in str(err)
    assert growth["bytes"] < 200e6, f"the caller's memory grew by {growth['bytes'] / 1e6:.0f} MB"


def test_long_lines_are_printed_cut(capsys):
    def f():
        print("z" * (watch.LINE_MAX + 10))
        print("after")

    pplab.launch(f, world_size=1)
    out = capsys.readouterr().out
    assert f"[rank 0] {'z' * watch.LINE_MAX} [... line cut: longer than {watch.LINE_MAX:,} bytes]\n" in out
    assert "[rank 0] after\n" in out and "zzzzzzzzz\n" not in out


# ----------------------------------------------------------------------------------
# 2. Worker processes inside a rank


def _square(x):
    return x * x


def _workers_and_a_pool():
    loader = DataLoader(TensorDataset(torch.arange(8.0)), batch_size=2, num_workers=2)
    total = sum(batch.sum().item() for (batch,) in loader)
    with multiprocessing.Pool(2) as pool:
        squares = pool.map(_square, range(4))
    return total, squares


def test_ranks_can_use_dataloader_workers_and_pools():
    assert pplab.launch(_workers_and_a_pool, world_size=2, timeout=120) == [(28.0, [0, 1, 4, 9])] * 2


def _note_worker(mark, folder, worker_id):
    _name_this_process(mark)
    open(os.path.join(folder, f"worker.{os.environ['RANK']}.{os.getpid()}"), "w").close()


_KEEP = []


def _end(ending):
    """How a rank's fn ends, once every rank is ready: it returns, raises, or outlives the timeout."""
    dist.barrier()
    if ending == "raises":
        raise RuntimeError("on purpose")
    if ending == "times out":
        time.sleep(600)
    return "ok"


def _workers_left_running(mark, folder, ending):
    loader = DataLoader(TensorDataset(torch.arange(8.0)), batch_size=2, num_workers=2, persistent_workers=True,
                        worker_init_fn=functools.partial(_note_worker, mark, folder))
    _KEEP.append(iter(loader))
    next(_KEEP[-1])
    deadline = time.monotonic() + 60
    while len(glob.glob(os.path.join(folder, f"worker.{dist.get_rank()}.*"))) < 2:      # both are up
        assert time.monotonic() < deadline
        time.sleep(0.01)
    return _end(ending)                         # once every rank's workers are up


def _launch_and_end(ending, fn, *args):
    """Launch fn on 2 ranks that end as `ending` says: returned, raised, or stopped at the timeout."""
    launch = functools.partial(pplab.launch, fn, *args, world_size=2, timeout=5 if ending == "times out" else 120)
    if ending == "returns":
        assert launch() == ["ok", "ok"]
    else:
        with pytest.raises(pplab.LaunchError):
            launch()


@pytest.mark.parametrize("ending", ["returns", "raises", "times out"])
def test_dataloader_workers_end_with_the_launch(ending, mark, tmp_path):
    _launch_and_end(ending, _workers_left_running, mark, str(tmp_path), ending)
    workers = [int(p.name.split(".")[2]) for p in tmp_path.glob("worker.*")]
    assert len(workers) == 4 and not any(alive(pid) for pid in workers)


# ----------------------------------------------------------------------------------
# 3. Processes a rank starts in a session of their own


def _start_and_end(mark, folder, how, ending):
    ready = os.path.join(folder, f"ready.{dist.get_rank()}")
    command = [sys.executable, "-c", SLEEPER, ready, mark]
    if how == "new session":
        subprocess.Popen(command, start_new_session=True)
    else:                               # a daemon: fork, setsid, fork again; orphaned at once
        pid = os.fork()
        if pid == 0:
            os.setsid()
            if os.fork() == 0:
                os.execv(sys.executable, command)
            os._exit(0)
        os.waitpid(pid, 0)
    _wait_for(ready)
    return _end(ending)                         # once every rank's process is up


@pytest.mark.parametrize("ending", ["returns", "raises", "times out"])
@pytest.mark.parametrize("how", ["new session", "daemon"])
def test_nothing_a_rank_starts_outlives_the_launch(how, ending, mark, tmp_path):
    _launch_and_end(ending, _start_and_end, mark, str(tmp_path), how, ending)
    assert len(list(tmp_path.glob("ready.*"))) == 2         # each rank did start one
    # the `mark` fixture checks that none of them is alive


# ----------------------------------------------------------------------------------
# 4. A rank that forks a helper and dies


def _fork_a_helper_then_die(mark, folder, how):
    if dist.get_rank() == 1:
        ready = os.path.join(folder, "helper")
        if os.fork() == 0:              # holds every pipe the rank had
            _name_this_process(mark)
            open(ready, "w").close()
            time.sleep(600)
            os._exit(0)
        _wait_for(ready)
        if how == "exits":
            os._exit(3)
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()                      # rank 0 waits for rank 1, forever


@pytest.mark.parametrize("how, said", [("exits", "exit code 3"), ("is killed", "killed by signal SIGKILL")])
def test_a_rank_that_forks_a_helper_and_dies_is_reported_at_once(how, said, mark, tmp_path):
    with no_hang(90), pytest.raises(pplab.LaunchError) as info:
        pplab.launch(_fork_a_helper_then_die, mark, str(tmp_path), how, world_size=2, timeout=600)
    err = info.value
    assert err.rank == 1 and not err.running
    assert f"rank 1 exited without returning a result ({said})" in str(err)


# ----------------------------------------------------------------------------------
# 5. A launch inside a rank


def test_a_launch_inside_a_rank_is_refused():
    def outer():
        return pplab.launch(lambda: 1, world_size=2)

    with pytest.raises(pplab.LaunchError) as info:
        pplab.launch(outer, world_size=2)
    head = str(info.value).split("\n\n")[0]         # "ranks 0, 1 raised ...", or rank 0 alone on a busy machine
    assert re.match(r"ranks? [0-9, ]+ raised RuntimeError: pplab.launch was called inside a rank of another "
                    r"launch: .* Call pplab.launch from the notebook or script, not from fn", head), head


def test_a_process_group_made_here_still_runs_fn_in_place(tmp_path):
    """Not a rank of a launch, but a process group exists (as under torchrun): fn runs here."""
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        out = pplab.launch(lambda: dist.get_world_size() * 10, world_size=4)
        assert out == [10] and out.start_method == "in-place"
    finally:
        dist.destroy_process_group()


# ----------------------------------------------------------------------------------
# 6. Timeouts


def test_an_infinite_timeout_means_no_limit(monkeypatch):
    assert pplab.launch(lambda: 5, world_size=2, timeout=math.inf) == [5, 5]
    assert pplab.launch(lambda: 6, world_size=1, timeout=1e300) == [6]
    assert pplab.launch(lambda: 7, world_size=1, timeout=10 ** 400) == [7]      # too large for a float
    monkeypatch.setenv("PPLAB_LAUNCH_TIMEOUT", "inf")
    assert pplab.launch(lambda: 8, world_size=1) == [8]


def test_a_launch_without_a_limit_still_ends_when_interrupted():
    with interrupt_after(2.0), pytest.raises(KeyboardInterrupt):
        pplab.launch(time.sleep, 600, world_size=2, timeout=math.inf)
    assert not descendants()


@pytest.mark.parametrize("timeout", [math.nan, -math.inf, -1, 0, "10", True])
def test_timeouts_that_mean_no_time_are_refused(timeout):
    with pytest.raises(ValueError, match=r"timeout must be a number of seconds > 0, or math.inf for no limit"):
        pplab.launch(lambda: 1, world_size=1, timeout=timeout)


# ----------------------------------------------------------------------------------
# 7. A caller killed outright

CALLER = textwrap.dedent(f'''
    import os, subprocess, sys, time, pplab

    def f(mark, folder):
        ready = os.path.join(folder, "ready." + os.environ["RANK"])
        subprocess.Popen([sys.executable, "-c", {SLEEPER!r}, ready, mark], start_new_session=True)
        time.sleep(600)

    if __name__ == "__main__":
        pplab.launch(f, sys.argv[1], sys.argv[2], world_size=2, timeout=600)
''')


def _launch_folders(pid, tmp_path):
    return glob.glob(os.path.join(tmp_path / "meet", f"pplab-launch-{pid}-*"))


def _start_a_caller(mark, tmp_path):
    """A python process in the middle of a launch whose ranks each started a process of their own.

    Its ranks meet in a folder of this test's own (PPLAB_LAUNCH_DIR): in /dev/shm, a launch
    in another test running at the same time would remove a killed caller's folder first."""
    script = tmp_path / "caller.py"
    script.write_text(CALLER)
    (tmp_path / "meet").mkdir()
    here = os.path.dirname(os.path.dirname(os.path.abspath(pplab.__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([here, os.environ.get("PYTHONPATH", "")]),
           "PPLAB_LAUNCH_DIR": str(tmp_path / "meet")}
    caller = subprocess.Popen([sys.executable, str(script), mark, str(tmp_path)], env=env, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while len(list(tmp_path.glob("ready.*"))) < 2:
        assert time.monotonic() < deadline and caller.poll() is None, caller.stderr.read().decode()[-3000:]
        time.sleep(0.05)
    assert len(_launch_folders(caller.pid, tmp_path)) == 1
    return caller


def test_a_caller_killed_outright_leaves_no_process_and_no_folder(mark, tmp_path):
    caller = _start_a_caller(mark, tmp_path)
    caller.kill()                               # SIGKILL: no finally, no atexit in the caller
    caller.wait()
    deadline = time.monotonic() + 30            # the host sees the caller go and ends the launch
    while (ours(mark) or _launch_folders(caller.pid, tmp_path)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _launch_folders(caller.pid, tmp_path)
    # the `mark` fixture checks that the ranks' own processes are gone too


def test_a_caller_killed_while_a_rank_is_stopped_leaves_nothing(mark, tmp_path):
    """A rank stopped (Ctrl-Z in its terminal, a debugger) when the caller is killed. Had
    the host been only a process group of the caller's session, the caller's death would
    leave that group orphaned with a stopped process in it: the kernel then sends SIGHUP to
    the whole group, the host included, and the processes the ranks started would live on."""
    caller = _start_a_caller(mark, tmp_path)
    (host,) = _children(caller.pid)
    rank = _children(host)[0]
    os.kill(rank, signal.SIGSTOP)
    caller.kill()
    caller.wait()
    deadline = time.monotonic() + 30
    while (ours(mark) or _launch_folders(caller.pid, tmp_path)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _launch_folders(caller.pid, tmp_path)


def _children(pid):
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(c) for c in f.read().split()]


def test_the_next_launch_removes_what_a_killed_launch_left(mark, tmp_path, monkeypatch):
    caller = _start_a_caller(mark, tmp_path)
    everyone = [caller.pid] + sorted(descendants(caller.pid))
    for pid in everyone:                        # the caller and its host at once (the OOM killer, say)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    caller.wait()
    deadline = time.monotonic() + 30
    while any(alive(pid) for pid in everyone) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(_launch_folders(caller.pid, tmp_path)) == 1            # nobody was left to remove it
    lock = os.open(os.path.join(_launch_folders(caller.pid, tmp_path)[0], "lock"), os.O_RDONLY)
    try:                # the kernel lets go of a dead process's lock a moment after it died
        while time.monotonic() < deadline:
            with contextlib.suppress(BlockingIOError):
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            time.sleep(0.01)
    finally:
        os.close(lock)
    where = os.path.dirname(_launch_folders(caller.pid, tmp_path)[0])
    live = tempfile.mkdtemp(prefix=f"pplab-launch-{os.getpid()}-", dir=where)
    monkeypatch.setenv("PPLAB_LAUNCH_DIR", where)
    try:
        assert pplab.launch(lambda: 1, world_size=1) == [1]
        assert not _launch_folders(caller.pid, tmp_path)              # its owner is gone: removed
        assert os.path.isdir(live)                          # this (live) process's: kept
    finally:
        os.rmdir(live)
