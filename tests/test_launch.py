"""pplab.launch: real ranks, results by rank, and every way a launch can go wrong."""
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import torch.distributed as dist

import pplab
from conftest import alive, descendants, interrupt_after

pytestmark = pytest.mark.usefixtures("no_leftover_processes")


def test_results_come_back_by_rank():
    def f(x, *, scale):
        return (dist.get_rank(), dist.get_world_size(), x * scale)

    for p in (1, 2, 3):
        assert pplab.launch(f, 2, world_size=p, scale=5) == [(r, p, 10) for r in range(p)]


def test_first_all_reduce_matches_sum():
    def f():
        t = torch.arange(5, dtype=torch.float64) * (dist.get_rank() + 1)
        pplab.comm.all_reduce(t)
        return t

    out = pplab.launch(f, world_size=4)
    expected = torch.arange(5, dtype=torch.float64) * (1 + 2 + 3 + 4)
    for t in out:
        assert torch.equal(t, expected)


def test_closure_and_spawn_path():
    secret = torch.tensor([1.5, 2.5])

    def f():
        return secret * (dist.get_rank() + 1)

    for method in ("fork", "spawn"):
        out = pplab.launch(f, world_size=2, start_method=method)
        assert out.start_method == method
        assert torch.equal(out[1], secret * 2)


def test_large_result_and_timeline():
    def f():
        with pplab.trace.span("work"):
            big = torch.full((1_000_000,), float(dist.get_rank()))   # 4 MB through the pipe
        return big

    out = pplab.launch(f, world_size=2)
    assert out[1].shape == (1_000_000,) and out[1][0] == 1.0
    assert len(out.timeline.select(category="compute")) == 2


def test_output_is_prefixed_with_rank(capsys):
    def f():
        print("hello", dist.get_rank())
        print("to stderr", file=sys.stderr)
        os.write(1, b"raw fd write\n")          # C-level output goes through the same pipe

    pplab.launch(f, world_size=2)
    out, err = capsys.readouterr()
    assert "[rank 0] hello 0" in out and "[rank 1] hello 1" in out
    assert "[rank 1] raw fd write" in out
    assert "[rank 0] to stderr" in err


def test_callers_environment_is_untouched():
    before = dict(os.environ)
    pplab.launch(lambda: os.environ["RANK"], world_size=2)
    assert dict(os.environ) == before


def test_one_torch_thread_per_rank_unless_told():
    assert pplab.launch(torch.get_num_threads, world_size=2) == [1, 1]
    assert pplab.launch(torch.get_num_threads, world_size=2, threads_per_rank=2) == [2, 2]


def test_raising_rank_names_rank_and_traceback():
    def f():
        if dist.get_rank() == 1:
            raise ValueError("bad shape on purpose")
        dist.barrier()            # rank 0 would wait forever for rank 1

    with pytest.raises(pplab.LaunchError) as info:
        pplab.launch(f, world_size=3, timeout=60)
    err = info.value
    assert err.rank == 1 and not err.running            # reported at once, not at the timeout
    assert "rank 1 raised ValueError: bad shape on purpose" in str(err)
    assert "bad shape on purpose" in err.tracebacks[1] and "in f" in err.tracebacks[1]
    assert pplab.launch(lambda: 7, world_size=2) == [7, 7]           # the next launch works


def test_hanging_rank_is_stopped_and_named(tmp_path):
    def f():
        if dist.get_rank() == 0:
            dist.recv(torch.zeros(1), src=1)        # rank 1 never sends
        else:
            child = subprocess.Popen(["sleep", "300"])  # a grandchild that must die too
            (tmp_path / "grandchild").write_text(str(child.pid))
            time.sleep(300)

    with pytest.raises(pplab.LaunchError) as info:
        pplab.launch(f, world_size=2, timeout=3)
    assert info.value.running == (0, 1)
    assert "ranks 0, 1 still running after 3 s" in str(info.value)
    grandchild = int((tmp_path / "grandchild").read_text())
    for _ in range(50):
        if not alive(grandchild):
            break
        time.sleep(0.1)
    assert not alive(grandchild)


def _ring_with_a_wrong_peer():
    """A ring step in which the last rank listens to rank 0 instead of its left neighbour:
    rank 0 never sends to it, so it waits forever (and its left neighbour for it)."""
    r, p = dist.get_rank(), dist.get_world_size()
    left = 0 if r == p - 1 else (r - 1) % p
    got = torch.empty(4)
    pplab.comm.exchange(torch.full((4,), float(r)), (r + 1) % p, got, left)
    return got.tolist()


def test_a_rank_waiting_for_the_wrong_peer_is_named_at_a_short_timeout():
    with pytest.raises(pplab.LaunchError) as info:
        pplab.launch(_ring_with_a_wrong_peer, world_size=3, timeout=5)
    err = info.value
    assert err.rank is None and 2 in err.running            # a hang, not a crash: rank 2 is stuck
    assert f"{', '.join(map(str, err.running))} still running after 5 s" in str(err)


def test_launches_in_tests_time_out_from_the_environment(monkeypatch):
    """tests/conftest.py sets PPLAB_LAUNCH_TIMEOUT so that a launch naming no timeout= stops a
    hang after that many seconds (not the launcher's own default): here 4."""
    assert os.environ["PPLAB_LAUNCH_TIMEOUT"]               # conftest's, unless the caller set one
    monkeypatch.setenv("PPLAB_LAUNCH_TIMEOUT", "4")
    with pytest.raises(pplab.LaunchError) as info:
        pplab.launch(_ring_with_a_wrong_peer, world_size=3)
    assert 2 in info.value.running and "still running after 4 s" in str(info.value)


def test_rank_that_dies_without_answering():
    def f():
        if dist.get_rank() == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        dist.barrier()

    with pytest.raises(pplab.LaunchError, match="rank 1 exited without returning a result .killed by signal SIGKILL"):
        pplab.launch(f, world_size=2, timeout=60)


def test_interrupt_in_process_ends_every_rank():
    with interrupt_after(1.0), pytest.raises(KeyboardInterrupt):
        pplab.launch(time.sleep, 60, world_size=3, timeout=120)
    assert not descendants()
    assert pplab.launch(lambda: 1, world_size=2) == [1, 1]


def test_ctrl_c_of_a_script_ends_every_rank(tmp_path):
    script = tmp_path / "hang.py"
    script.write_text(textwrap.dedent(f"""
        import os, time, pplab
        def f():
            open(os.path.join({str(tmp_path)!r}, f"rank{{os.environ['RANK']}}"), "w").write(str(os.getpid()))
            time.sleep(300)
        if __name__ == "__main__":
            pplab.launch(f, world_size=2, timeout=300)
    """))
    # Run under nohup or `trap '' INT`, this test would hand the script SIGINT ignored (an
    # ignored signal stays ignored across exec) and Ctrl-C would do nothing: give it the
    # default, as a terminal would. Its own session, so that whatever happens we can end it.
    proc = subprocess.Popen([sys.executable, str(script)], stderr=subprocess.PIPE, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    pid_files = [tmp_path / "rank0", tmp_path / "rank1"]
    try:
        deadline = time.monotonic() + 30
        while not all(p.exists() and p.read_text() for p in pid_files):
            if proc.poll() is not None:
                pytest.fail(f"the script ended before its ranks started:\n{proc.stderr.read().decode()}")
            assert time.monotonic() < deadline, "the ranks did not start within 30 s"
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
        assert proc.returncode != 0 and b"KeyboardInterrupt" in err
        for p in pid_files:
            assert not alive(int(p.read_text()))
    finally:            # on any failure above: the script, then its ranks (in their own groups)
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:      # it had ended, and nothing else in its group was left
            pass
        proc.wait()
        proc.stderr.close()
        for p in pid_files:
            if p.exists() and p.read_text() and alive(int(p.read_text())):
                os.kill(int(p.read_text()), signal.SIGKILL)


def test_twenty_launches_leak_nothing():
    def f():
        t = torch.ones(3)
        pplab.comm.all_reduce(t)
        return t[0].item()

    pplab.launch(f, world_size=2)                  # warm-up: lazy imports open their files once
    fds_before = len(os.listdir("/proc/self/fd"))
    for _ in range(20):             # a file leaked by every launch shows at once; 20 also catch most leaks in 1 of 10
        assert pplab.launch(f, world_size=2) == [2.0, 2.0]
    assert len(os.listdir("/proc/self/fd")) == fds_before
    assert not descendants()


@pytest.mark.parametrize("kwargs, message", [
    (dict(world_size=0), "world_size must be a whole number >= 1"),
    (dict(world_size=2.5), "world_size must be a whole number >= 1"),
    (dict(backend="mpi"), "backend='mpi' is not one pplab knows"),
    (dict(timeout=-1), "timeout must be a number of seconds > 0"),
    (dict(threads_per_rank=0), "threads_per_rank must be an int >= 1"),
    (dict(start_method="forkserver"), "start_method='forkserver'"),
])
def test_bad_arguments_are_explained(kwargs, message):
    with pytest.raises((ValueError, TypeError), match=message.replace("(", r"\(").replace(")", r"\)")):
        pplab.launch(lambda: None, **kwargs)


@pytest.mark.skipif(torch.cuda.device_count() >= 8, reason="has 8 GPUs")
def test_nccl_without_enough_gpus_is_explained():
    with pytest.raises(ValueError, match="backend='nccl' needs one GPU per rank"):
        pplab.launch(lambda: None, world_size=8, backend="nccl")


def test_arguments_that_do_not_fit_fn_fail_before_starting():
    def f(a, b):
        return a + b

    with pytest.raises(TypeError, match=r"cannot be called with the arguments given to launch\(\)"):
        pplab.launch(f, 1, world_size=2)
    with pytest.raises(TypeError, match="needs a function"):
        pplab.launch(42, world_size=2)


def test_unsendable_result_is_explained():
    def f():
        import threading
        return threading.Lock()

    with pytest.raises(pplab.LaunchError, match="its result could not be sent back"):
        pplab.launch(f, world_size=2)


SCRIPT = '''
import torch, torch.distributed as dist, pplab

def f(scale):
    t = torch.ones(2) * (dist.get_rank() + 1)
    pplab.comm.all_reduce(t)
    return t[0].item() * scale

if __name__ == "__main__":
    out = pplab.launch(f, 10, world_size=2)
    if dist.is_initialized() and dist.get_rank() != 0:
        raise SystemExit(0)
    print("RESULT", out, out.start_method, len(out.timeline.select(kind="all_reduce")))
'''


@pytest.mark.timeout(600)       # its own waits (a fresh interpreter or kernel) add up to more than 300 s
def test_same_script_runs_under_python_and_torchrun(tmp_path):
    """The function written for pplab.launch runs unchanged under torchrun (in place, gathered)."""
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    plain = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env)
    assert "RESULT [30.0, 30.0] fork 2" in plain.stdout, plain.stderr
    from pplab.runtime.launcher import _free_port
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                "--master-port", str(_free_port()), str(script)]
    # its own session, so that on a timeout torchrun *and its workers* are killed, not just torchrun
    proc = subprocess.Popen(torchrun, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=180)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert "RESULT [30.0, 30.0] in-place 2" in out, err[-3000:]
    assert proc.returncode == 0, err[-3000:]


def test_ranks_failing_together_end_the_launch_at_once():
    """Several ranks raising at the same moment must not leave the launch waiting for its timeout."""
    def f():
        raise NotImplementedError("every rank")

    class WaitedForTheTimeout(Exception):
        pass

    def alarm(signum, frame):
        raise WaitedForTheTimeout

    old = signal.signal(signal.SIGALRM, alarm)
    try:
        for _ in range(5):
            signal.alarm(60)          # a hang detector: the launch's own timeout is 600 s
            with pytest.raises(pplab.LaunchError) as info:
                pplab.launch(f, world_size=4, timeout=600)
            signal.alarm(0)
            # under load a rank may still be connecting when the others have raised and gone: it is
            # then reported as having lost the connection, which is true; the first rank that raised leads
            assert 0 <= info.value.rank < 4 and not info.value.running
            head = str(info.value).split("\n\n")[0]        # before the traceback
            assert head.startswith("rank") and str(info.value.rank) in head.split(" raised")[0]
            assert head.count("raised NotImplementedError: every rank") == 1      # said once, not per rank
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


@pytest.mark.timeout(600)       # its own waits (a fresh interpreter or kernel) add up to more than 300 s
def test_the_kernels_stop_button_ends_every_rank(tmp_path):
    """In JupyterLab: a cell is stuck in a launch, the student presses stop (the kernel gets
    an interrupt); every rank ends, the cell reports KeyboardInterrupt, the next launch works."""
    from jupyter_client.manager import start_new_kernel

    km, kc = start_new_kernel(kernel_name="python3", startup_timeout=180)
    try:
        kc.execute_interactive(textwrap.dedent(f"""
            import os, time, pplab
            def stuck():
                open(os.path.join({str(tmp_path)!r}, os.environ["RANK"]), "w").write(str(os.getpid()))
                time.sleep(300)
        """), timeout=120)
        msg_id = kc.execute("pplab.launch(stuck, world_size=3, timeout=300)")
        pid_files = [tmp_path / str(r) for r in range(3)]
        deadline = time.monotonic() + 120
        while not all(p.exists() and p.read_text() for p in pid_files):
            assert time.monotonic() < deadline, "the ranks never started"
            time.sleep(0.05)
        km.interrupt_kernel()
        while True:
            reply = kc.get_shell_msg(timeout=60)
            if reply["parent_header"].get("msg_id") == msg_id:
                break
        assert reply["content"]["status"] == "error" and reply["content"]["ename"] == "KeyboardInterrupt"
        for p in pid_files:
            assert not alive(int(p.read_text()))
        for _ in range(3):      # ipykernel aborts a request that reaches it while it still handles the error
            again = kc.execute_interactive("print(pplab.launch(lambda: 5, world_size=2))", timeout=120)
            if again["content"]["status"] != "aborted":
                break
            time.sleep(1)
        assert again["content"]["status"] == "ok"
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
