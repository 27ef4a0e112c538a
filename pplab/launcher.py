"""Start N real ranks from a notebook cell or a script, each with torch.distributed ready.

    def hello(name):
        return f"{name} from rank {dist.get_rank()} of {dist.get_world_size()}"

    pplab.launch(hello, "hi", world_size=4)      # -> list of 4 strings, index = rank

How it works, in the order it happens:

1. The caller makes a launch folder: the rendezvous file the ranks meet through (a
   torch FileStore: no port to pick, no name to look up; rank_main.py says why), and
   the call board where pplab.comm notes what each rank is inside (callboard.py).
2. It starts `world_size` processes. On Linux with CUDA untouched in the caller it
   *forks*: the children inherit the function (even one defined in a notebook cell)
   and the already-imported torch, so a launch takes a fraction of a second. Otherwise
   it *spawns* fresh interpreters and ships the function by value with cloudpickle.
3. Each child joins the process group, runs fn, and sends back its result and its
   trace events through a pipe (rank_main.py). Its stdout/stderr go through pipes too,
   and the caller prints each line prefixed with "[rank r]".
4. The caller waits for all of them (watch.py). If a rank raises, dies, sits in a
   collective its peers are not in, or is still running at `timeout`, or if the caller
   is interrupted, every rank is killed (with anything it started) and a `LaunchError`
   says which rank, why, and what each rank was doing.

Under torchrun, or when a process group already exists, `launch` starts nothing: it
runs fn on this rank and gathers every rank's result, so the same script runs on a
laptop (`python train.py`) and on a cluster (`torchrun --nnodes 2 ... train.py`).
"""
from __future__ import annotations

import atexit
import inspect
import multiprocessing as mp
import os
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import warnings

import cloudpickle
import torch
import torch.distributed as dist

from . import callboard, trace
from .rank_main import rank_main as _rank_main
from .rank_main import spawned_main as _spawned_main  # noqa: F401 - old import path
from .rank_main import _to_cpu, check_result
from .watch import LaunchError, Rank, collect, ranks_text  # noqa: F401 - LaunchError is public here

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


def _default_timeout() -> float:
    """PPLAB_LAUNCH_TIMEOUT (seconds) if set, else 120 s."""
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
    caller = open_now + 5 * world_size + 16          # 3 pipes and an exit sentinel per rank
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
      (default: the environment variable PPLAB_LAUNCH_TIMEOUT, else 120).
    threads_per_rank: torch threads per CPU rank (1 keeps N ranks from fighting over cores).
    start_method: None (fork when safe, else spawn), "fork" or "spawn".
    safe_results: the ranks run code this process must not trust (a student's, when
      grading): decode what they send back as plain data only (watch.plain_loads), so
      nothing they send can run code here. fn should then return plain data.

    The result list has `.timeline` (every rank's trace on one clock) and `.elapsed`.
    Raises LaunchError if any rank raises, dies, hangs, or sits in a collective its peers
    are not in; no child outlives the call. fn's result must be plain data: an open file,
    a socket, a lock, a generator... belongs to the rank's process and is refused.
    """
    _check_call(fn, args, kwargs)
    if dist.is_initialized() or _in_torchrun():
        return _run_in_place(fn, args, kwargs, backend)
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a whole number >= 1, got {world_size!r}")
    if timeout is None:
        timeout = _default_timeout()
    if isinstance(timeout, bool) or not (isinstance(timeout, (int, float)) and timeout > 0):
        raise ValueError(f"timeout must be a number of seconds > 0, got {timeout!r}")
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
    return _launch_once(payload, world_size, backend, method, float(timeout), threads_per_rank, safe_results)


class _Spawned:
    """A fresh interpreter started with subprocess, shaped like a multiprocessing.Process.

    multiprocessing's own spawn re-imports the caller's __main__ script in every child;
    we ship the function by value instead, so nothing of the caller is re-run.
    """

    def __init__(self, args, payload, fds):
        alive_r, alive_w = os.pipe()        # only the child holds alive_w: EOF means it ended
        env = dict(os.environ)
        here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env["PYTHONPATH"] = os.pathsep.join([here] + [p for p in [env.get("PYTHONPATH")] if p])
        code = "import sys; from pplab.rank_main import spawned_main; spawned_main(sys.argv[1:])"
        argv = [sys.executable, "-c", code] + [repr(a) for a in args] + [str(fd) for fd in fds]
        self.popen = subprocess.Popen(argv, stdin=subprocess.PIPE, pass_fds=list(fds) + [alive_w], env=env)
        os.close(alive_w)
        self.pid, self.sentinel = self.popen.pid, alive_r
        self.popen.stdin.write(payload)
        self.popen.stdin.close()

    def is_alive(self):
        return self.popen.poll() is None

    def join(self, timeout=None):
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    def kill(self):
        self.popen.kill()

    @property
    def exitcode(self):
        return self.popen.poll()

    def close(self):
        os.close(self.sentinel)


def _launch_folder() -> str:
    """Where the ranks meet: in memory (/dev/shm) where there is one."""
    shm = "/dev/shm"
    where = shm if os.path.isdir(shm) and os.access(shm, os.W_OK) else None
    return tempfile.mkdtemp(prefix="pplab-launch-", dir=where)


def _launch_once(payload, world_size, backend, method, timeout, threads, safe=False) -> LaunchResult:
    ctx = mp.get_context("fork" if method == "fork" else "spawn")
    folder = _launch_folder()
    callboard.create(os.path.join(folder, "board"), world_size)
    started = time.perf_counter()
    ranks: list[Rank] = []
    try:
        for r in range(world_size):
            conn_r, conn_w = ctx.Pipe(duplex=False)
            out_r, out_w = ctx.Pipe(duplex=False)
            err_r, err_w = ctx.Pipe(duplex=False)
            args = (r, world_size, folder, backend, threads, timeout, os.getpid())
            if method == "fork":
                proc = ctx.Process(target=_rank_main, name=f"pplab-rank-{r}", daemon=True,
                                   args=args + (payload, conn_w, out_w, err_w))
                with warnings.catch_warnings():
                    # Python >= 3.12 warns on every fork of a process with threads (a Jupyter
                    # kernel always has some). The child only runs our code, which takes no lock
                    # those threads could hold; the same holds for torch's DataLoader workers.
                    warnings.filterwarnings("ignore", message=".*fork.*", category=DeprecationWarning)
                    proc.start()
            else:
                proc = _Spawned(args, payload, [c.fileno() for c in (conn_w, out_w, err_w)])
            for c in (conn_w, out_w, err_w):       # the child has its copies; ours would hide EOF
                c.close()
            ranks.append(Rank(r, proc, conn_r, out_r, err_r, safe))
        messages = collect(ranks, folder, timeout)
    finally:
        for rk in ranks:
            rk.kill()
        for rk in ranks:
            for fd in rk.pipes:
                rk.pump(fd, final=True)     # what it printed before it ended still reaches us
            rk.close()
        shutil.rmtree(folder, ignore_errors=True)
    result = LaunchResult(m[1] for m in messages)
    result.timeline = trace.Timeline([e for m in messages for e in m[2]], world_size=world_size)
    result.backend, result.start_method = backend, method
    result.elapsed = time.perf_counter() - started
    return result


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
    out = _to_cpu(out)
    check_result(out)
    dist.all_gather_object(results, out)
    result = LaunchResult(results)
    result.timeline = timeline
    result.backend, result.start_method = dist.get_backend(), "in-place"
    result.elapsed = time.perf_counter() - started
    return result
