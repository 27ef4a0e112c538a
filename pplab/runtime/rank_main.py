"""What runs in each rank that pplab.launch starts: join the group, run fn, answer once.

The caller (launcher.py) gives each rank a launch folder: the rendezvous file (a FileStore,
see the note on the 5 s stall below), the call board (callboard.py), and one file where
the rank's Python stack is written when the caller asks for it (SIGUSR1), so that a
timeout can say where every rank was stuck.
"""
from __future__ import annotations

import ctypes
import datetime
import faulthandler
import io
import mmap
import os
import signal
import socket
import sys
import threading
import traceback
import types

import cloudpickle
import torch
import torch.distributed as dist

from . import callboard
from .. import trace

# Why a FileStore and not a TCPStore (the 5 s stall). torch's TCPStore names every socket it
# opens in a string made with getnameinfo() *without* NI_NUMERICHOST: a reverse DNS lookup of
# the peer, on the client at connect and on the server at accept. The store listens on a
# dual-stack socket, so the peer is "::ffff:127.0.0.1", which /etc/hosts does not list, and
# glibc asks the DNS server. Where a resolver drops one of those UDP queries (containers,
# sandboxes, some laptops on a VPN) glibc waits its default 5 s and asks again: about one
# launch in ten had every rank joining 5.0x s late. A store in a file needs no socket and no
# name; gloo's own connections between ranks use numeric addresses on the loopback device.


_this_rank = None          # (rank, world_size) in a rank of a launch, and in what it forks


def this_rank():
    """(rank, world_size) if this process is a rank that pplab.launch started (or was forked
    by one, like a DataLoader worker), else None."""
    return _this_rank


def _die_with_parent(parent_pid: int) -> None:
    """Never outlive the launch's host process: if it is killed, so are we."""
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


def to_cpu(x):
    """Results cross a pipe to a caller that may not (and should not) touch CUDA."""
    if isinstance(x, torch.Tensor):
        return x.detach().cpu()
    if isinstance(x, (list, tuple)) and type(x) in (list, tuple):
        return type(x)(to_cpu(v) for v in x)
    if isinstance(x, dict) and type(x) is dict:
        return {k: to_cpu(v) for k, v in x.items()}
    return x


# Things that belong to the rank's process and would arrive in the caller as something else
# (an open file as a StringIO of its contents) or not at all: refused, with what to return instead.
_LOCK_TYPES = (type(threading.Lock()), type(threading.RLock()), threading.Condition, threading.Event,
               threading.Semaphore, threading.Thread)
_PROCESS_BOUND = [
    (io.IOBase, "an open file", "return its contents or its path"),
    (socket.socket, "a socket", "return the data it received"),
    (_LOCK_TYPES, "a lock or thread", "synchronise inside fn; return plain data"),
    ((types.GeneratorType, types.CoroutineType, types.AsyncGeneratorType), "a generator",
     "return list(...) of it"),
    (mmap.mmap, "a memory map", "return its bytes"),
    (types.ModuleType, "a module", "return the values you need from it"),
    (dist.ProcessGroup, "a process group", "groups exist only inside the launch"),
]
if hasattr(torch, "cuda"):
    _PROCESS_BOUND.append(((torch.cuda.Stream, torch.cuda.Event), "a CUDA stream or event",
                           "return the tensors or timings you measured"))


def check_result(x, where="the result", depth=0) -> None:
    """Raise TypeError if the result holds something that cannot mean the same in the caller."""
    for types_, what, instead in _PROCESS_BOUND:
        if isinstance(x, types_):
            raise TypeError(f"fn returned {what} ({type(x).__module__}.{type(x).__qualname__} at {where}): "
                            f"it belongs to the rank's process, which ends with the launch, and cannot "
                            f"mean the same thing in the caller; {instead}")
    if depth >= 4 or isinstance(x, (torch.Tensor, str, bytes, int, float)):
        return
    if isinstance(x, (list, tuple)):
        for i, v in enumerate(x[:10_000]):
            check_result(v, f"{where}[{i}]", depth + 1)
    elif isinstance(x, (set, frozenset)):
        for v in list(x)[:10_000]:
            check_result(v, f"an element of {where}", depth + 1)
    elif isinstance(x, dict):
        for k, v in list(x.items())[:10_000]:
            check_result(v, f"{where}[{k!r}]", depth + 1)
    elif hasattr(x, "__dict__") and not isinstance(x, type):
        for k, v in list(vars(x).items())[:1000]:
            check_result(v, f"{where}.{k}", depth + 1)


def _everyone_joined(store, world_size):
    """Wait until every rank has finished joining the group. Gloo's joining is pairwise: without
    this, a rank could finish first, fail in fn, exit, and break a peer that was still connecting
    (which would then report a lost connection instead of reaching the same error itself)."""
    if store.add("joined", 1) == world_size:
        store.set("all joined", "1")
    store.wait(["all joined"])


def rank_main(rank, world_size, folder, backend, threads, group_timeout, parent_pid, payload, conn, out_conn,
              err_conn):
    """group_timeout: seconds a collective may wait before gloo gives up (finite; the launch's
    own timeout is enforced by the caller)."""
    global _this_rank
    _this_rank = (rank, world_size)
    _die_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)    # the caller handles Ctrl-C and stops us
    _redirect_output(out_conn, err_conn)
    faulthandler.disable()     # the caller's (pytest, ipykernel) writes past our pipes: gloo says why it aborts
    stack_file = open(os.path.join(folder, f"stack.{rank}"), "w")
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    phase = "init"
    try:
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                          LOCAL_WORLD_SIZE=str(world_size), OMP_NUM_THREADS=str(threads))
        if sys.platform.startswith("linux"):
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")   # one machine: talk over loopback
        torch.set_num_threads(threads)
        if backend == "nccl":
            torch.cuda.set_device(rank)
        store = dist.FileStore(os.path.join(folder, "store"), world_size)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=group_timeout))
        _everyone_joined(store, world_size)
        fn, args, kwargs = cloudpickle.loads(payload) if isinstance(payload, bytes) else payload
        trace.reset(rank)
        callboard.attach(os.path.join(folder, "board"), rank)
        phase = "run"
        result = fn(*args, **kwargs)
        phase = "return"
        result = to_cpu(result)
        check_result(result)
        message = cloudpickle.dumps(("ok", result, trace.events()))
    except BaseException as exc:  # noqa: BLE001 - everything goes back to the caller
        tb = exc.__traceback__
        if phase == "run" and tb is not None and tb.tb_next is not None:
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
            callboard.enter(callboard.RETURNED)     # a collective on the world group, like any other
            dist.barrier()              # nobody leaves until all are done: a peer may still talk to us
            dist.destroy_process_group()
    finally:
        sys.stdout.flush(), sys.stderr.flush()
        os._exit(0)


def spawned_main(argv):
    """Entry point of a rank started as a fresh interpreter (launcher._spawn_rank)."""
    import ast
    from multiprocessing.connection import Connection

    *args, conn_fd, out_fd, err_fd = argv
    args = [ast.literal_eval(a) for a in args]
    with open(os.path.join(args[2], "payload"), "rb") as f:       # args[2]: the launch folder
        payload = f.read()
    rank_main(*args, payload, Connection(int(conn_fd)), Connection(int(out_fd)), Connection(int(err_fd)))
