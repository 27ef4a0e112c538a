"""Start N real ranks from a notebook cell or a script, each with torch.distributed ready.

    def hello(name):
        return f"{name} from rank {dist.get_rank()} of {dist.get_world_size()}"

    pplab.launch(hello, "hi", world_size=4)      # -> list of 4 strings, index = rank

How it works, in the order it happens:

1. The caller makes a launch folder: the rendezvous file the ranks meet through (a
   torch FileStore: no port to pick, no name to look up; rank_main.py says why), and
   the call board where pplab.comm notes what each rank is inside (callboard.py).
2. It forks one *host* process, which starts `world_size` ranks and adopts whatever they
   start (see "The host" below). On Linux with CUDA untouched in the caller the ranks are
   *forked*: they inherit the function (even one defined in a notebook cell) and the
   already-imported torch, so a launch takes a fraction of a second. Otherwise they are
   *spawned* as fresh interpreters and the function is shipped by value with cloudpickle.
3. Each child joins the process group, runs fn, and sends back its result and its
   trace events through a pipe (rank_main.py). Its stdout/stderr go through pipes too,
   and the caller prints each line prefixed with "[rank r]".
4. The caller waits for all of them (watch.py). If a rank raises, dies, sits in a
   collective its peers are not in, or is still running at `timeout`, a `LaunchError`
   says which rank, why, and what each rank was doing. However the launch ends (results,
   an error, Ctrl-C, even the caller being killed), the host then kills every process
   of the launch: the ranks and anything they started.

Under torchrun, or when a process group already exists, `launch` starts nothing: it
runs fn on this rank and gathers every rank's result, so the same script runs on a
laptop (`python train.py`) and on a cluster (`torchrun --nnodes 2 ... train.py`).
"""
from __future__ import annotations

import atexit
import contextlib
import ctypes
import fcntl
import inspect
import math
import multiprocessing as mp
import os
import re
import resource
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import warnings

import cloudpickle
import torch
import torch.distributed as dist

from . import callboard
from .. import trace
from .rank_main import rank_main as _rank_main
from .rank_main import check_result, this_rank, to_cpu
from .watch import EVENT, EXITED, NOT_STARTED, STARTED  # what the host tells the caller
from .watch import LaunchError, Rank, collect  # noqa: F401 - LaunchError is public here

__all__ = ["launch", "LaunchError", "LaunchResult", "device"]

_BACKENDS = ("auto", "gloo", "nccl")


class LaunchResult(list):
    """The per-rank return values (index = rank), plus what the run recorded."""

    timeline: "trace.Timeline"
    backend: str
    start_method: str
    elapsed: float


def device() -> torch.device:
    """The device this rank should put its tensors on: its own GPU under NCCL, else the CPU."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# ----------------------------------------------------------------------------------
# Choosing how to start


def _in_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or all(
        k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"))


def _resolve_backend(backend: str, world_size: int) -> str:
    if backend not in _BACKENDS:
        raise ValueError(f"backend={backend!r} is not one pplab knows: use one of {_BACKENDS}")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if backend == "auto":
        return "nccl" if gpus >= world_size and not torch.cuda.is_initialized() else "gloo"
    if backend == "nccl" and gpus < world_size:
        raise ValueError(f"backend='nccl' needs one GPU per rank: world_size={world_size} but "
                         f"{gpus} GPU(s) visible. Use backend='gloo' (CPU), or world_size <= {gpus}.")
    return backend


def _start_method(backend: str, requested) -> str:
    if requested is not None:
        if requested not in ("fork", "spawn"):
            raise ValueError(f"start_method={requested!r}: use 'fork', 'spawn' or None (choose for me)")
        if requested == "fork" and (backend == "nccl" or torch.cuda.is_initialized()):
            raise ValueError("start_method='fork' is unsafe once CUDA is in use: a forked child cannot "
                             "use the parent's CUDA context. Use start_method='spawn' (or None).")
        return requested
    safe_to_fork = sys.platform.startswith("linux") and backend == "gloo" and not torch.cuda.is_initialized()
    return "fork" if safe_to_fork else "spawn"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _check_call(fn, args, kwargs) -> None:
    if not callable(fn):
        raise TypeError(f"launch() needs a function to run on every rank, got {type(fn).__name__}")
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return
    try:
        sig.bind(*args, **kwargs)
    except TypeError as exc:
        raise TypeError(f"{getattr(fn, '__name__', 'fn')}{sig} cannot be called with the arguments "
                        f"given to launch(): {exc}") from None


MAX_WORLD_SIZE = 256       # ranks are processes on this one machine
RANKS_PER_CORE = 8         # beyond this, a warning: the ranks mostly wait for a core


def _check_timeout(timeout) -> float:
    """Seconds, > 0; math.inf (or an int too large for a float) means no limit."""
    if timeout is None:
        return _default_timeout()
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        value = math.nan
    else:
        try:
            value = float(timeout)
        except OverflowError:
            value = math.inf
    if not value > 0:                   # also refuses nan, which compares false to everything
        raise ValueError(f"timeout must be a number of seconds > 0, or math.inf for no limit, got {timeout!r}")
    return value


# gloo's own limit on one collective: finite (a timedelta cannot hold inf, nor 1e300 s),
# and longer than any launch here lasts. The launch's timeout is enforced by the caller.
GROUP_TIMEOUT_MAX = 7 * 24 * 3600.0


def _default_timeout() -> float:
    """PPLAB_LAUNCH_TIMEOUT (seconds; "inf" for no limit) if set, else 120 s."""
    raw = os.environ.get("PPLAB_LAUNCH_TIMEOUT", "").strip()
    if not raw:
        return 120.0
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(f"the environment variable PPLAB_LAUNCH_TIMEOUT={raw!r} must be a number of "
                         f"seconds > 0 (it is the timeout of launches that do not pass timeout=)")
    return value


def _check_world_size(world_size: int) -> None:
    """Refuse what this machine cannot start; warn when ranks will mostly wait for a core."""
    if world_size > MAX_WORLD_SIZE:
        raise ValueError(
            f"world_size={world_size} is more than pplab starts on one machine (at most {MAX_WORLD_SIZE}): "
            f"every rank is a process with torch loaded, and gloo connects every pair of ranks "
            f"({world_size * (world_size - 1) // 2:,} connections). To reason about that many ranks use "
            f"pplab.costmodel or the pipeline simulator; to run them, use torchrun on a cluster.")
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    open_now = len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else 16
    caller = open_now + 5 * world_size + 16          # 3 pipes per rank, and the host's
    per_rank = 64 + 3 * world_size                   # a gloo connection to every other rank, and more
    need = max(caller, per_rank)
    if soft != resource.RLIM_INFINITY and need > soft:
        raise ValueError(
            f"world_size={world_size} needs about {need} open files (pipes to every rank here, and in "
            f"each rank a connection to every other rank) but a process may open only {soft} "
            f"(`ulimit -n`). Raise the limit (`ulimit -n 4096` in the shell that starts Jupyter, or "
            f"resource.setrlimit(resource.RLIMIT_NOFILE, ...)), or use fewer ranks.")
    cores = os.cpu_count() or 1
    if world_size > RANKS_PER_CORE * cores:
        warnings.warn(
            f"world_size={world_size} on {cores} CPU core(s): {world_size / cores:.0f} ranks per core take "
            f"turns, so results are right but timings mostly measure waiting for a core, and a launch "
            f"may need a larger timeout=", RuntimeWarning, stacklevel=3)


def launch(fn, *args, world_size: int = 4, backend: str = "auto", timeout: float | None = None,
           threads_per_rank: int = 1, start_method: str | None = None, safe_results: bool = False,
           **kwargs) -> LaunchResult:
    """Run `fn(*args, **kwargs)` on `world_size` processes; return their results by rank.

    backend: "auto" (NCCL with one GPU per rank when there are enough GPUs and CUDA is
      untouched here, else gloo), "gloo" or "nccl".
    timeout: seconds before ranks still running are stopped and named in the error
      (default: the environment variable PPLAB_LAUNCH_TIMEOUT, else 120). math.inf means
      no limit: the launch then ends when the ranks do, or when it is interrupted (Ctrl-C,
      the notebook's stop button). nan, 0 and negative values are refused (ValueError).
    threads_per_rank: torch threads per CPU rank (1 keeps N ranks from fighting over cores).
    start_method: None (fork when safe, else spawn), "fork" or "spawn".
    safe_results: the ranks run code this process must not trust (a student's, when
      grading): decode what they send back as plain data only (watch.plain_loads), so
      nothing they send can run code here. fn should then return plain data.

    The result list has `.timeline` (every rank's trace on one clock) and `.elapsed`.
    Raises LaunchError if any rank raises, dies, hangs, or sits in a collective its peers
    are not in. No process outlives the call: not the ranks, nor anything they started
    (DataLoader workers, a subprocess in a session of its own, a daemon). fn's result must
    be plain data: an open file, a socket, a lock, a generator... belongs to the rank's
    process and is refused. Called inside fn (a rank of another launch), it raises RuntimeError.
    """
    if this_rank() is not None:
        raise RuntimeError(
            "pplab.launch was called inside a rank of another launch: a rank cannot start ranks of its "
            "own. Call pplab.launch from the notebook or script, not from fn; inside fn, call the "
            "function you meant to launch directly: it already runs on every rank.")
    _check_call(fn, args, kwargs)
    if dist.is_initialized() or _in_torchrun():
        return _run_in_place(fn, args, kwargs, backend)
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a whole number >= 1, got {world_size!r}")
    timeout = _check_timeout(timeout)
    if not (isinstance(threads_per_rank, int) and threads_per_rank >= 1):
        raise ValueError(f"threads_per_rank must be an int >= 1, got {threads_per_rank!r}")
    _check_world_size(world_size)
    backend = _resolve_backend(backend, world_size)
    method = _start_method(backend, start_method)
    if method == "spawn":
        try:
            payload = cloudpickle.dumps((fn, args, kwargs))
        except Exception as exc:
            raise TypeError(f"launch() must send fn and its arguments to fresh processes (spawn) and "
                            f"could not serialise them: {exc}") from exc
    else:
        payload = (fn, args, kwargs)
    return _launch_once(payload, world_size, backend, method, timeout, threads_per_rank, safe_results)


def _launch_folder() -> tuple[str, int]:
    """Where the ranks meet: PPLAB_LAUNCH_DIR if set, else in memory (/dev/shm) where there is
    one, else the temporary folder; and a lock on it.

    A caller killed outright (kill -9, the OOM killer) cannot remove its folder. Its name
    holds the caller's pid, and the caller, the host and the forked ranks hold its lock (the
    kernel lets go of it when the last of them dies): the next launch removes a folder
    whose caller is gone and whose lock nobody holds, and never a live launch's folder.
    """
    where = os.environ.get("PPLAB_LAUNCH_DIR", "")
    if where and not (os.path.isdir(where) and os.access(where, os.W_OK | os.X_OK)):
        raise ValueError(f"the environment variable PPLAB_LAUNCH_DIR={where!r} must name a folder this "
                         f"process can write to; create it, or unset it to use /dev/shm")
    if not where:
        shm = "/dev/shm"
        where = shm if os.path.isdir(shm) and os.access(shm, os.W_OK) else tempfile.gettempdir()
    for name in os.listdir(where):
        owner = re.fullmatch(r"pplab-launch-(\d+)-\w+", name)
        if owner and not _alive(int(owner[1])) and _unlocked(os.path.join(where, name, "lock")):
            shutil.rmtree(os.path.join(where, name), ignore_errors=True)
    folder = tempfile.mkdtemp(prefix=f"pplab-launch-{os.getpid()}-", dir=where)
    lock = os.open(os.path.join(folder, "lock"), os.O_CREAT | os.O_RDWR, 0o600)
    fcntl.flock(lock, fcntl.LOCK_EX)
    return folder, lock


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:             # another user's: alive, and not ours to clean up anyway
        pass
    return True


def _unlocked(path: str) -> bool:
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:           # its caller died before it made one
        return True
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def _launch_once(payload, world_size, backend, method, timeout, threads, safe=False) -> LaunchResult:
    folder, lock = _launch_folder()
    rank_args = (world_size, folder, backend, threads, min(timeout + 60, GROUP_TIMEOUT_MAX))
    started = time.perf_counter()
    ranks: list[Rank] = []
    ends: list[list] = []               # the ranks' ends of their pipes: result, stdout, stderr
    host = None
    try:
        callboard.create(os.path.join(folder, "board"), world_size)
        if method == "spawn":           # fresh interpreters read fn and its arguments from here
            with open(os.path.join(folder, "payload"), "wb") as f:
                f.write(payload)
        for r in range(world_size):
            pipes = [mp.Pipe(duplex=False) for _ in range(3)]      # (read end, write end)
            ranks.append(Rank(r, *(read for read, _ in pipes), safe))
            ends.append([write for _, write in pipes])
        try:
            host = _Host(ranks, ends, method, payload, rank_args)
        finally:
            for c in (c for e in ends for c in e):      # the host has its copies; ours would hide EOF
                c.close()
        messages = collect(ranks, host.status, folder, timeout)
    finally:
        try:
            if host is not None:
                host.end()              # every process of the launch is gone when this returns
        finally:                        # (even if a second Ctrl-C cut the wait short)
            for rk in ranks:
                for fd in rk.pipes:
                    rk.pump(fd, final=True)     # what it printed before it ended still reaches us
                rk.close()
            shutil.rmtree(folder, ignore_errors=True)
            os.close(lock)
    result = LaunchResult(m[1] for m in messages)
    result.timeline = trace.Timeline([e for m in messages for e in m[2]], world_size=world_size)
    result.backend, result.start_method = backend, method
    result.elapsed = time.perf_counter() - started
    return result


# ----------------------------------------------------------------------------------
# The host: one process per launch, the parent of its ranks
#
# Why a process between the caller and the ranks. A rank may start processes of its own:
# DataLoader workers, a subprocess in a session of its own, a daemon (fork, setsid, fork
# again). Killing the rank's process group misses those that left it (setsid); walking
# the rank's children misses those orphaned when their parent exited, which the kernel
# re-parents to init. The host makes itself a *child subreaper* (Linux's
# PR_SET_CHILD_SUBREAPER): anything orphaned below it is re-parented to it instead, so
# every process of the launch stays in the host's tree, where the end of the launch finds
# and kills it. (The caller, a notebook kernel, cannot be the subreaper: it would adopt
# every orphan of the kernel's other children and never wait for them.) The host also
# learns that a rank ended from waitpid, which no file descriptor inherited by the rank's
# own children can hide, and it ends the launch by itself if the caller is killed.


class _Host:
    """The caller's handle on the host: `status`, the pipe it reports on (watch.read_events),
    and `end()`."""

    def __init__(self, ranks, ends, method, payload, rank_args):
        caller = os.getpid()
        control_r, self.control = os.pipe()         # the caller writes (or dies): the launch ends
        self.status, status_w = os.pipe()
        for stream in (sys.stdout, sys.stderr):     # else the host holds a copy of what is buffered
            with contextlib.suppress(Exception):
                stream.flush()
        with warnings.catch_warnings():
            # Python >= 3.12 warns on every fork of a process with threads (a Jupyter kernel
            # always has some). The child only runs our code, which takes no lock those
            # threads could hold; the same holds for torch's DataLoader workers.
            warnings.filterwarnings("ignore", message=".*fork.*", category=DeprecationWarning)
            self.pid = os.fork()
        if self.pid == 0:
            code = 1
            try:
                os.close(self.control)
                os.close(self.status)
                for rk in ranks:                    # the caller's ends of the pipes
                    rk.close()
                code = _host_main(caller, ends, method, payload, rank_args, control_r, status_w)
            finally:
                os._exit(code)
        os.close(control_r)
        os.close(status_w)

    def end(self) -> None:
        """Tell the host to kill every process of the launch, and wait until it has (its
        pipe closes when it exits)."""
        with contextlib.suppress(OSError):          # it is gone already
            os.write(self.control, b"end")
        os.close(self.control)
        deadline = time.monotonic() + 10
        while (left := deadline - time.monotonic()) > 0:
            if select.select([self.status], [], [], left)[0] and not os.read(self.status, 4096):
                break
        else:                                       # stuck: do its work from here
            _kill_tree(self.pid, with_root=True)
        os.close(self.status)
        with contextlib.suppress(ChildProcessError):    # reaped already (SIGCHLD set to SIG_IGN here)
            os.waitpid(self.pid, 0)


def _host_main(caller, ends, method, payload, rank_args, control_r, status_w) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)    # Ctrl-C is the caller's to handle; it ends us
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)   # SIG_IGN (the caller's?) would hide how ranks end
    # A session of our own, not only a process group: out of the terminal's group, so Ctrl-C
    # reaches the caller only; and never an orphaned group inside the caller's session. When
    # the caller dies, the kernel sends SIGHUP (whose default is to exit) to every group of
    # its session that it leaves orphaned with a stopped process in it. Ending the launch
    # stops (SIGSTOP) each rank before killing it: as a mere process group we were killed
    # halfway through, the processes stopped so far left frozen, when the caller's exit came
    # after we had seen its pipe close (the pipe closes first).
    os.setsid()
    sys.stdout = sys.stderr = open(os.devnull, "w")     # never print what the caller had buffered
    subreaper = _become_subreaper()
    woken = None
    try:
        woken = _host_watch(caller, ends, method, payload, rank_args, control_r, status_w)
    finally:
        _end_all_below(woken)
        shutil.rmtree(rank_args[1], ignore_errors=True)         # the launch folder
        if not subreaper:           # orphans went to init: those still in our process group go now
            os.killpg(0, signal.SIGKILL)
    return 0


def _host_watch(caller, ends, method, payload, rank_args, control_r, status_w) -> int:
    """Start the ranks; tell the caller when each has started and when it ends; return when
    the caller says the launch is over, or is gone. Returns a pipe that SIGCHLD wakes."""
    handles, rank_of = [], {}
    for r in range(len(ends)):
        try:
            handle = _start_rank(r, ends, method, payload, rank_args, (control_r, status_w))
        except OSError as exc:
            _tell(status_w, NOT_STARTED, r, exc.errno or 0)
            continue
        handles.append((r, handle))
        rank_of[handle.pid] = r
        _tell(status_w, STARTED, r, handle.pid)
    for c in (c for e in ends for c in e):
        c.close()
    woken, wake = os.pipe()                         # made after the forks: the ranks need none of it
    os.set_blocking(woken, False)
    os.set_blocking(wake, False)
    signal.set_wakeup_fd(wake, warn_on_full_buffer=False)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a child ended: wakes the selects below
    signal.signal(signal.SIGTERM, _exit_now)        # kill <host>: end the launch first, then go
    for r, handle in handles:       # starting a Process waits for the ones that ended before it
        code = handle.exitcode if method == "fork" else handle.poll()
        if code is not None:
            del rank_of[handle.pid]
            _tell(status_w, EXITED, r, code)
    while True:
        for pid, code in _reap():   # ranks are reported; orphans we adopted just go
            if pid in rank_of:
                _tell(status_w, EXITED, rank_of.pop(pid), code)
        ready, _, _ = select.select([control_r, woken], [], [], 1.0)
        if control_r in ready or os.getppid() != caller:        # the launch is over, or the caller gone
            return woken
        with contextlib.suppress(BlockingIOError):
            os.read(woken, 4096)


def _exit_now(signum, frame):
    raise SystemExit(1)


def _reap() -> list:
    """(pid, exit code) of each child of ours that has ended, waited for."""
    ended = []
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return ended
        if pid == 0:
            return ended
        ended.append((pid, os.waitstatus_to_exitcode(status)))


def _end_all_below(woken) -> None:
    """Kill every process below the host, and wait for each: as subreaper, every one of
    them is, or ends up (re-parented), our child. Look again each time one ends, or after
    a moment: what /proc lists can miss a process being re-parented at that moment."""
    for _ in range(200):
        _kill_tree(os.getpid(), with_root=False)
        _reap()
        try:
            os.waitpid(-1, os.WNOHANG)      # none left: ChildProcessError
        except ChildProcessError:
            return
        if woken is None:
            time.sleep(0.05)
        elif select.select([woken], [], [], 0.05)[0]:
            with contextlib.suppress(BlockingIOError):
                os.read(woken, 4096)


def _become_subreaper() -> bool:
    if sys.platform.startswith("linux"):
        try:
            return ctypes.CDLL("libc.so.6", use_errno=True).prctl(36, 1, 0, 0, 0) == 0   # PR_SET_CHILD_SUBREAPER
        except OSError:
            pass
    return False


def _kill_tree(pid: int, with_root: bool) -> None:
    """Kill every process below `pid`, and pid itself if with_root. Freeze them all first
    (SIGSTOP), so that none can start another, or exit and have its children re-parented,
    while we look for them."""
    frozen = set()
    for _ in range(100):
        found = set(([pid] if with_root else []) + _below(pid)) - frozen
        if not found:
            break
        for p in found:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGSTOP)
        frozen |= found
    for p in frozen:                # not yet waited for, so no pid here can have been reused
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGKILL)


def _below(pid: int) -> list:
    """The pids of every process below `pid`: from /proc/PID/task/*/children on Linux (only
    this tree is read: a few ms faster than psutil, which reads every process), else psutil."""
    if not os.path.exists(f"/proc/{os.getpid()}/task/{os.getpid()}/children"):
        import psutil
        try:
            return [p.pid for p in psutil.Process(pid).children(recursive=True)]
        except psutil.Error:
            return []
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for task in tasks:
            try:
                with open(f"/proc/{p}/task/{task}/children") as f:
                    children = [int(c) for c in f.read().split()]
            except OSError:
                continue
            found += children
            todo += children
    return found


def _tell(status_w, what, rank, value) -> None:
    with contextlib.suppress(OSError):             # the caller is gone: nobody to tell
        os.write(status_w, EVENT.pack(what, rank, value))


def _start_rank(r, ends, method, payload, rank_args, host_fds):
    """Start rank r: a forked multiprocessing.Process (not daemonic, so that it may start
    processes of its own: DataLoader workers, a Pool), or a fresh interpreter."""
    args = (r, *rank_args, os.getpid())
    if method == "fork":
        others = [c for i, e in enumerate(ends) if i != r for c in e]
        proc = mp.get_context("fork").Process(target=_forked_rank, name=f"pplab-rank-{r}",
                                              args=(others, host_fds, args, payload, *ends[r]))
        proc.start()
        return proc
    # multiprocessing's own spawn re-imports the caller's __main__ script in every child;
    # we ship the function by value instead (the payload file), so nothing of the caller is re-run.
    env = dict(os.environ)
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join([here] + [p for p in [env.get("PYTHONPATH")] if p])
    code = "import sys; from pplab.runtime.rank_main import spawned_main; spawned_main(sys.argv[1:])"
    fds = [c.fileno() for c in ends[r]]
    argv = [sys.executable, "-c", code] + [repr(a) for a in args] + [str(fd) for fd in fds]
    return subprocess.Popen(argv, stdin=subprocess.DEVNULL, pass_fds=fds, env=env)


def _forked_rank(others, host_fds, args, payload, conn, out, err):
    """A forked rank lets go of what is not its own (the other ranks' pipes: holding them
    would hide their EOF; the host's) before it runs."""
    for c in others:
        c.close()
    for fd in host_fds:
        os.close(fd)
    _rank_main(*args, payload, conn, out, err)


# ----------------------------------------------------------------------------------
# torchrun, or a process group that already exists


def _leave_together() -> None:
    """At exit: wait for every rank, then close the group. A rank that leaves while a peer
    still holds a connection to it makes that peer abort."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def _run_in_place(fn, args, kwargs, backend) -> LaunchResult:
    """Run fn on this rank only; every rank gets everyone's results (an all_gather)."""
    if not dist.is_initialized():
        if backend == "auto":
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend)
        atexit.register(_leave_together)    # we opened the group, so we close it, all together
    trace.reset(dist.get_rank())
    started = time.perf_counter()
    out = fn(*args, **kwargs)
    timeline = trace.gather()
    results = [None] * dist.get_world_size()
    out = to_cpu(out)
    check_result(out)
    dist.all_gather_object(results, out)
    result = LaunchResult(results)
    result.timeline = timeline
    result.backend, result.start_method = dist.get_backend(), "in-place"
    result.elapsed = time.perf_counter() - started
    return result
