"""Start N real ranks from a notebook cell or a script, each with torch.distributed ready.

    def hello(name):
        return f"{name} from rank {dist.get_rank()} of {dist.get_world_size()}"

    pplab.launch(hello, "hi", world_size=4)      # -> list of 4 strings, index = rank

How it works, in the order it happens:

1. The caller picks one free TCP port; rank 0 will host the rendezvous store there.
2. It starts `world_size` processes. On Linux with CUDA untouched in the caller it
   *forks*: the children inherit the function (even one defined in a notebook cell)
   and the already-imported torch, so a launch takes a fraction of a second. Otherwise
   it *spawns* fresh interpreters and ships the function by value with cloudpickle.
3. Each child joins the process group, runs fn, and sends back its result and its
   trace events through a pipe. Its stdout/stderr go through pipes too, and the
   caller prints each line prefixed with "[rank r]".
4. The caller waits for all of them. If a rank raises, exits without answering, or
   is still running at `timeout`, or if the caller is interrupted, every rank is
   killed (with anything it started) and a `LaunchError` says which rank and why.

Under torchrun, or when a process group already exists, `launch` starts nothing: it
runs fn on this rank and gathers every rank's result, so the same script runs on a
laptop (`python train.py`) and on a cluster (`torchrun --nnodes 2 ... train.py`).
"""
from __future__ import annotations

import atexit
import ctypes
import datetime
import inspect
import io
import multiprocessing as mp
import multiprocessing.connection
import os
import pickle
import signal
import socket
import subprocess
import sys
import time
import traceback
import warnings

import cloudpickle
import torch
import torch.distributed as dist

from . import trace

_BACKENDS = ("auto", "gloo", "nccl")


class LaunchError(RuntimeError):
    """One or more ranks failed, hung or were interrupted; all of them were stopped.

    rank: the rank blamed first (None for a timeout); tracebacks: {rank: text} of
    ranks that raised; running: ranks still running at the timeout; output: {rank:
    last lines printed}.
    """

    def __init__(self, message, rank=None, tracebacks=None, running=(), output=None):
        super().__init__(message)
        self.rank = rank
        self.tracebacks = tracebacks or {}
        self.running = tuple(running)
        self.output = output or {}


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


# ----------------------------------------------------------------------------------
# What runs in each child


def _die_with_parent(parent_pid: int) -> None:
    """Never outlive the caller: if it is killed (a kernel restart), so are we."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            libc.prctl(1, signal.SIGKILL)            # PR_SET_PDEATHSIG
        except OSError:
            pass
    if os.getppid() != parent_pid:                  # the parent died before prctl took hold
        os._exit(1)


def _redirect_output(out_conn, err_conn) -> None:
    """Point fd 1/2 (so C++ warnings too) and sys.stdout/err at the pipes to the caller."""
    os.dup2(out_conn.fileno(), 1)
    os.dup2(err_conn.fileno(), 2)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)


def _to_cpu(x):
    """Results cross a pipe to a caller that may not (and should not) touch CUDA."""
    if isinstance(x, torch.Tensor):
        return x.detach().cpu()
    if isinstance(x, (list, tuple)) and type(x) in (list, tuple):
        return type(x)(_to_cpu(v) for v in x)
    if isinstance(x, dict) and type(x) is dict:
        return {k: _to_cpu(v) for k, v in x.items()}
    return x


def _rank_main(rank, world_size, port, backend, threads, timeout, parent_pid, payload, conn, out_conn, err_conn):
    _die_with_parent(parent_pid)
    os.setpgid(0, 0)                                # our own process group: killpg ends our children too
    signal.signal(signal.SIGINT, signal.SIG_IGN)    # the caller handles Ctrl-C and stops us
    _redirect_output(out_conn, err_conn)
    phase = "init"
    try:
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                          LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(port), OMP_NUM_THREADS=str(threads))
        if sys.platform.startswith("linux"):
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")   # one machine: talk over loopback
        torch.set_num_threads(threads)
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout + 60))
        fn, args, kwargs = cloudpickle.loads(payload) if isinstance(payload, bytes) else payload
        trace.reset(rank)
        phase = "run"
        result = fn(*args, **kwargs)
        phase = "return"
        message = cloudpickle.dumps(("ok", _to_cpu(result), trace.events()))
    except BaseException as exc:  # noqa: BLE001 - everything goes back to the caller
        tb = exc.__traceback__
        if phase != "init" and tb is not None and tb.tb_next is not None:
            tb = tb.tb_next                 # start the traceback in the user's code, not here
        text = "".join(traceback.format_exception(type(exc), exc, tb))
        message = cloudpickle.dumps(("err", phase, f"{type(exc).__name__}: {exc}", text))
        sys.stdout.flush(), sys.stderr.flush()
        conn.send_bytes(message)
        os._exit(1)
    sys.stdout.flush(), sys.stderr.flush()
    conn.send_bytes(message)
    try:
        if dist.is_initialized():
            dist.barrier()              # nobody leaves (rank 0 hosts the store) until all are done
            dist.destroy_process_group()
    finally:
        sys.stdout.flush(), sys.stderr.flush()
        os._exit(0)


# ----------------------------------------------------------------------------------
# What the caller does


class _Rank:
    """The caller's handle on one child: its process, result pipe and output pipes."""

    def __init__(self, rank, proc, conn, out_conn, err_conn):
        self.rank, self.proc, self.conn = rank, proc, conn
        self.pipes = {out_conn.fileno(): (out_conn, sys.stdout), err_conn.fileno(): (err_conn, sys.stderr)}
        self.partial = {fd: b"" for fd in self.pipes}
        self.tail: list[str] = []       # last lines printed, for error messages
        self.message = None

    def pump(self, fd, final=False) -> None:
        """Print whatever the child wrote, a whole line at a time, with a rank prefix."""
        conn, stream = self.pipes[fd]
        data = b""
        while conn.poll(0):
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            data += chunk
        buf = self.partial[fd] + data
        *lines, rest = buf.split(b"\n")
        if final and rest:
            lines, rest = lines + [rest], b""
        self.partial[fd] = rest
        for line in lines:
            text = line.decode(errors="replace")
            self.tail = (self.tail + [text])[-20:]
            print(f"[rank {self.rank}] {text}", file=stream, flush=True)

    def kill(self) -> None:
        """Kill the rank and anything it started (its process group), dead or alive:
        a rank that exited may have left children behind. Not yet reaped, so the pid
        cannot have been reused."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        if self.proc.is_alive():        # not yet in its own group (killed right after start)
            self.proc.kill()

    def close(self) -> None:
        self.proc.join(5)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()
        self.proc.close()               # releases the sentinel's file descriptor
        for c in [self.conn] + [c for c, _ in self.pipes.values()]:
            c.close()


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


def launch(fn, *args, world_size: int = 4, backend: str = "auto", timeout: float = 120.0,
           threads_per_rank: int = 1, start_method: str | None = None, safe_results: bool = False,
           **kwargs) -> LaunchResult:
    """Run `fn(*args, **kwargs)` on `world_size` processes; return their results by rank.

    backend: "auto" (NCCL with one GPU per rank when there are enough GPUs and CUDA is
      untouched here, else gloo), "gloo" or "nccl".
    timeout: seconds before ranks still running are stopped and named in the error.
    threads_per_rank: torch threads per CPU rank (1 keeps N ranks from fighting over cores).
    start_method: None (fork when safe, else spawn), "fork" or "spawn".
    safe_results: the ranks run code this process must not trust (a student's, when
      grading): decode what they send back as plain data only (see _plain_loads), so
      nothing they send can run code here. fn should then return bytes or plain data.

    The result list has `.timeline` (every rank's trace on one clock) and `.elapsed`.
    Raises LaunchError if any rank raises, dies or hangs; no child outlives the call.
    """
    _check_call(fn, args, kwargs)
    if dist.is_initialized() or _in_torchrun():
        return _run_in_place(fn, args, kwargs, backend)
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a whole number >= 1, got {world_size!r}")
    if not (isinstance(timeout, (int, float)) and timeout > 0):
        raise ValueError(f"timeout must be a number of seconds > 0, got {timeout!r}")
    if not (isinstance(threads_per_rank, int) and threads_per_rank >= 1):
        raise ValueError(f"threads_per_rank must be an int >= 1, got {threads_per_rank!r}")
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
    for attempt in range(3):
        try:
            return _launch_once(payload, world_size, backend, method, float(timeout), threads_per_rank,
                                safe_results)
        except LaunchError as err:
            port_taken = "address already in use" in str(err).lower() and "during start-up" in str(err)
            if not port_taken or attempt == 2:
                raise
    raise AssertionError("unreachable")


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
        code = "import sys; from pplab.launcher import _spawned_main; _spawned_main(sys.argv[1:])"
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


def _spawned_main(argv):
    import ast
    from multiprocessing.connection import Connection

    *args, conn_fd, out_fd, err_fd = argv
    args = [ast.literal_eval(a) for a in args]
    payload = sys.stdin.buffer.read()
    _rank_main(*args, payload, Connection(int(conn_fd)), Connection(int(out_fd)), Connection(int(err_fd)))


def _launch_once(payload, world_size, backend, method, timeout, threads, safe=False) -> LaunchResult:
    ctx = mp.get_context("fork" if method == "fork" else "spawn")
    port = _free_port()
    started = time.perf_counter()
    ranks: list[_Rank] = []
    try:
        for r in range(world_size):
            conn_r, conn_w = ctx.Pipe(duplex=False)
            out_r, out_w = ctx.Pipe(duplex=False)
            err_r, err_w = ctx.Pipe(duplex=False)
            args = (r, world_size, port, backend, threads, timeout, os.getpid())
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
            ranks.append(_Rank(r, proc, conn_r, out_r, err_r))
        return _collect(ranks, started, timeout, backend, method, safe)
    finally:
        for rk in ranks:
            rk.kill()
        for rk in ranks:
            for fd in rk.pipes:
                rk.pump(fd, final=True)     # what it printed before it ended still reaches us
            rk.close()


def _receive(rk, safe=False) -> None:
    """Read the child's one message, if it sent one before its pipe closed."""
    try:
        data = rk.conn.recv_bytes(64 << 20 if safe else None)   # untrusted: a bogus length is refused
    except (EOFError, OSError):
        rk.message = None
        return
    rk.message = _plain_loads(data) if safe else cloudpickle.loads(data)


class _PlainUnpickler(pickle.Unpickler):
    """Builds numbers, strings, bytes, lists, tuples, dicts, sets and trace events, nothing else:
    unpickling plain data needs no import, so refusing every import refuses any code."""

    def find_class(self, module, name):
        if (module, name) == ("pplab.trace", "Event"):
            return trace.Event
        raise pickle.UnpicklingError(f"{module}.{name} is not plain data")


def _plain_loads(data: bytes):
    """A rank's message decoded with _PlainUnpickler; one that is not plain data, or not
    shaped like a rank's message, becomes that rank's error."""
    try:
        message = _PlainUnpickler(io.BytesIO(data)).load()
        if isinstance(message, tuple) and len(message) == 3 and message[0] == "ok" and \
                isinstance(message[2], list) and all(isinstance(e, trace.Event) for e in message[2]):
            return message
        if isinstance(message, tuple) and len(message) == 4 and message[0] == "err" and \
                all(isinstance(m, str) for m in message[1:]):
            return message
        problem = "a message not shaped like a rank's result"
    except Exception as exc:  # noqa: BLE001 - whatever the bytes were, they are refused
        problem = f"{type(exc).__name__}: {exc}"
    return ("err", "return", f"ResultError: its result is not plain data ({problem})", "")


def _collect(ranks, started, timeout, backend, method, safe=False) -> LaunchResult:
    deadline = time.monotonic() + timeout
    pending = {rk.rank for rk in ranks}
    by_fd = {fd: rk for rk in ranks for fd in rk.pipes}
    by_conn = {rk.conn: rk for rk in ranks}
    by_sentinel = {rk.proc.sentinel: rk for rk in ranks}
    failed: dict[int, tuple] = {}

    def settle(rk):
        if rk.message is not None and rk.message[0] == "ok":
            pending.discard(rk.rank)
        elif rk.message is not None:
            failed[rk.rank] = rk.message

    in_grace = False
    while pending:
        if failed and not in_grace:
            # Ranks often fail together (each checks its own result): wait a moment for the
            # others so the lowest failing rank is reported every run, not whichever came first.
            in_grace, deadline = True, min(deadline, time.monotonic() + 0.25)
        left = deadline - time.monotonic()
        if left <= 0:
            break
        ready = mp.connection.wait(list(by_fd) + list(by_conn) + list(by_sentinel), timeout=min(left, 1.0))
        for obj in ready:
            if obj in by_fd:
                by_fd[obj].pump(obj)
            elif obj in by_conn:
                rk = by_conn.pop(obj)
                _receive(rk, safe)
                settle(rk)
        for obj in ready:
            if obj in by_sentinel:                  # a child ended: did it answer first?
                rk = by_sentinel.pop(obj)
                if rk.conn in by_conn:
                    del by_conn[rk.conn]
                    _receive(rk, safe)
                    settle(rk)
                if rk.message is None:
                    rk.proc.join(1)
                    failed[rk.rank] = ("died", rk.proc.exitcode)
    for fd, rk in by_fd.items():
        rk.pump(fd)
    if failed:
        raise _failure(ranks, failed)
    if pending:
        running = sorted(pending)
        output = {r: ranks[r].tail[-5:] for r in running}
        shown = "".join(f"\n  last output of rank {r}: " + " | ".join(lines) for r, lines in output.items() if lines)
        raise LaunchError(
            f"rank{'s' if len(running) > 1 else ''} {', '.join(map(str, running))} still running after "
            f"{timeout:g} s (timeout={timeout:g}) and {'were' if len(running) > 1 else 'was'} stopped; "
            f"{len(ranks) - len(running)} of {len(ranks)} had finished. A rank waiting in recv() or in a "
            f"collective that some peer never joins waits forever; if the work is only slow, pass a larger "
            f"timeout=.{shown}", running=running, output=output)
    result = LaunchResult(rk.message[1] for rk in ranks)
    events = [e for rk in ranks for e in rk.message[2]]
    result.timeline = trace.Timeline(events, world_size=len(ranks))
    result.backend, result.start_method = backend, method
    result.elapsed = time.perf_counter() - started
    return result


# What a rank says when it failed only because a peer it was talking to had gone away.
_PEER_GONE = ("connection closed by peer", "connection reset by peer", "broken pipe", "remote worker crash")


def _knock_on(info) -> bool:
    return info[0] == "err" and any(s in info[2].lower() for s in _PEER_GONE)


def _failure(ranks, failed) -> LaunchError:
    """Blame the lowest rank that really failed; ranks that failed *because* it stopped
    (their connection to it closed) are listed after it as knock-on failures."""
    causes = [r for r in failed if not _knock_on(failed[r])]
    first = min(causes) if causes else min(failed)
    tracebacks, lines = {}, []
    for r in sorted(failed, key=lambda r: (r != first, _knock_on(failed[r]), r)):
        info = failed[r]
        if info[0] == "died":
            code = info[1]
            how = (f"killed by signal {signal.Signals(-code).name}" if code is not None and code < 0
                   else f"exit code {code}")
            lines.append(f"rank {r} exited without returning a result ({how})")
        elif _knock_on(info) and r != first:
            tracebacks[r] = info[3]
            lines.append(f"rank {r} lost its connection to a rank that had stopped")
        else:
            _, phase, summary, text = info
            tracebacks[r] = text
            where = "during start-up (joining the process group)" if phase == "init" else \
                "after fn returned: its result could not be sent back" if phase == "return" else ""
            lines.append(f"rank {r} raised {summary}" + (f" {where}" if where else ""))
    message = "; ".join(lines) + ". All ranks were stopped."
    if first in tracebacks:
        message += f"\n\n--- traceback of rank {first} ---\n{tracebacks[first]}"
    return LaunchError(message, rank=first, tracebacks=tracebacks,
                       output={r: ranks[r].tail[-5:] for r in failed})


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
    dist.all_gather_object(results, _to_cpu(out))
    result = LaunchResult(results)
    result.timeline = timeline
    result.backend, result.start_method = dist.get_backend(), "in-place"
    result.elapsed = time.perf_counter() - started
    return result
