"""Inside a sealed rank: run the checker's job with every torch.distributed call routed
over the rank's channel to the checker's router (router.py).

The rank was forked from the zygote (zygotes.py), which never saw the seed, the inputs or
the references. `rank_main` runs, in order:

1. die with the zygote, keep only the channel and the output pipes (fds 0-2 and 100);
2. `isolate()` (isolate.py): namespaces, a read-only root, private /tmp and /dev/shm;
3. read the launch message: the job, this rank's number, the world size and this rank's
   inputs only; resolve a SourceAnswer (in /tmp/work) and look in the answer for a
   forbidden collective bound by name (`forbidden_references`);
4. `install()` the stand-ins: torch.distributed's entry points (and pplab.comm, which
   calls them) become requests to the router; the collectives the exercise forbids,
   pplab.collectives' and the functional collectives included, ask the router, which
   records the call and refuses it. There is no process group to reach around them:
   code that keeps an original torch function gets an error, not a channel;
5. run the job; send back observations, then the result or the exception; exit.
"""
from __future__ import annotations

import contextlib
import importlib
import inspect
import os
import pickle
import signal
import socket
import sys
import threading
import traceback

import torch
import torch.distributed as dist

from .answers import SourceAnswer, decode, encode
from .failures import Forbidden
from .forbidden import _COMM_COLLECTIVES, _TORCH_COLLECTIVES, _collectives_module, forbidden_references
from ...isolation import PR_SET_DUMPABLE, PR_SET_PDEATHSIG
from .isolate import isolate, prctl
from .router import Reader, pack, tensor_bytes, tensor_meta, to_tensor

# ----------------------------------------------------------------------------------
# The channel to the router


class Channel:
    def __init__(self, sock: socket.socket):
        self.sock, self.reader, self.queue, self.lock = sock, Reader(), [], threading.Lock()

    def tell(self, header: dict, blobs=()) -> None:
        with self.lock:
            self.sock.sendall(pack(header, blobs))

    def call(self, header: dict, blobs=()):
        """Send a request, wait for its reply; raise what the router says went wrong.
        One request at a time: a thread of the student's waits for another's reply."""
        with self.lock:
            return self._call(header, blobs)

    def _call(self, header, blobs):
        self.sock.sendall(pack(header, blobs))
        while not self.queue:
            data = self.sock.recv(1 << 20)
            if not data:
                os._exit(3)                              # the checker is gone
            self.queue += self.reader.feed(data)
        reply, blobs = self.queue.pop(0)
        if "error" in reply and reply["error"] != "none":
            kinds = {"Forbidden": Forbidden, "ValueError": ValueError, "RuntimeError": RuntimeError}
            raise kinds.get(reply["error"], RuntimeError)(reply["message"])
        return reply, blobs


_STATE: dict = {}                       # rank, world_size, channel, trial: set by rank_main


def begin(trial: int) -> None:
    """In a sealed job: this rank starts trial `trial` (the router files its calls under it)."""
    _STATE["trial"] = trial
    _STATE["channel"].tell({"op": "begin", "trial": trial})


def phase(name: str) -> None:
    """In a sealed job: the collectives from now on are filed under `name` ("forward", "backward")."""
    _STATE["channel"].tell({"op": "phase", "name": name})


def observe(trial: int, data) -> None:
    """In a sealed job: what the student's code left in trial `trial`, as plain data."""
    _STATE["channel"].tell({"op": "observe", "trial": trial}, [encode(data)])


# ----------------------------------------------------------------------------------
# torch.distributed, as the rank sees it: requests to the router


class Group:
    """A process group of a sealed launch: only its ranks (global numbers)."""

    def __init__(self, ranks):
        self.ranks = tuple(ranks)


class Work:
    """What isend/irecv/async collectives return: wait() blocks until the router completes it."""

    def __init__(self, handle, into=None, what="isend/irecv"):
        self.handle, self.into, self.what, self.done = handle, into, what, False

    def _finish(self, reply, blobs):
        self.done = True
        if self.into is not None and reply.get("data"):
            _write_into(self.into, blobs[0])

    def wait(self, timeout=None) -> bool:
        if not self.done:
            self._finish(*_STATE["channel"].call({"op": "wait", "handle": self.handle, "what": self.what}))
        return True

    def is_completed(self) -> bool:
        if not self.done:
            reply, blobs = _STATE["channel"].call({"op": "test", "handle": self.handle})
            if not reply.get("pending"):
                self._finish(reply, blobs)
        return self.done


def _write_into(tensor, blob: bytes) -> None:
    """The bytes that arrived, as this tensor's dtype and shape (as gloo does: bytes, not values)."""
    with torch.no_grad():
        if isinstance(tensor, _IntoList):
            dtype = tensor.tensors[0].dtype
            tensor.copy_(to_tensor({"dtype": str(dtype).replace("torch.", ""),
                                    "shape": [sum(t.numel() for t in tensor.tensors)]}, blob))
        else:
            tensor.copy_(to_tensor(tensor_meta(tensor), blob))


def _ranks(group) -> tuple:
    return tuple(range(_STATE["world_size"])) if group is None else tuple(group.ranks)


def _p2p(op, tensor, peer, group, tag, name):
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{op} needs a tensor, got {type(tensor).__name__}")
    if not tensor.is_contiguous():
        raise ValueError(f"{op}: the tensor must be contiguous (pass .contiguous(), or a tensor of its own)")
    header = {"op": op, name: peer, "tag": tag, "tensor": tensor_meta(tensor),
              "nbytes": tensor.numel() * tensor.element_size()}
    blobs = [tensor_bytes(tensor)] if op in ("send", "isend") else []
    if op in ("isend", "irecv"):                         # no reply: the router files it under our handle
        _STATE["handles"] = handle = _STATE.get("handles", 0) + 1
        _STATE["channel"].tell({**header, "handle": handle}, blobs)
        return Work(handle, tensor if op == "irecv" else None, op)
    reply, blobs = _STATE["channel"].call(header, blobs)
    if op == "recv":
        _write_into(tensor, blobs[0])
    return None


def send(tensor, dst=None, group=None, tag=0, group_dst=None):
    _p2p("send", tensor, dst, group, tag, "dst")


def recv(tensor, src=None, group=None, tag=0, group_src=None):
    if src is None:
        raise ValueError("recv needs src in a check: name the rank you receive from")
    _p2p("recv", tensor, src, group, tag, "src")
    return src


def isend(tensor, dst=None, group=None, tag=0, group_dst=None):
    return _p2p("isend", tensor, dst, group, tag, "dst")


def irecv(tensor, src=None, group=None, tag=0, group_src=None):
    if src is None:
        raise ValueError("irecv needs src in a check: name the rank you receive from")
    return _p2p("irecv", tensor, src, group, tag, "src")


_OPS = {dist.ReduceOp.SUM: "sum", dist.ReduceOp.MAX: "max", dist.ReduceOp.MIN: "min",
        dist.ReduceOp.PRODUCT: "product"}


def _op_name(op) -> str:
    if isinstance(op, str) or op in _OPS:
        return op if isinstance(op, str) else _OPS[op]
    raise RuntimeError(f"the reduce op {op} is not available in a sealed check: use SUM, MAX, MIN or PRODUCT")


def _all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
    sizes = {"output_split_sizes": None if output_split_sizes is None else [int(n) for n in output_split_sizes],
             "input_split_sizes": None if input_split_sizes is None else [int(n) for n in input_split_sizes],
             "out_nbytes": output.numel() * output.element_size()}
    return _collective("all_to_all_single", "torch.distributed.all_to_all_single", group, output, input, async_op,
                       **sizes)


class _IntoList:
    """all_gather's output list, written as one tensor: the ranks' tensors one after another."""

    def __init__(self, tensors):
        self.tensors = list(tensors)

    def copy_(self, flat):
        at = 0
        for t in self.tensors:
            t.copy_(flat[at:at + t.numel()].view(t.shape))
            at += t.numel()


def _all_gather(tensor_list, tensor, group=None, async_op=False):
    if len(tensor_list) != len(_ranks(group)):
        raise ValueError(f"all_gather: tensor_list has {len(tensor_list)} tensors for a group of "
                         f"{len(_ranks(group))} ranks")
    return _collective("all_gather", "torch.distributed.all_gather", group, _IntoList(tensor_list), tensor, async_op)


_WATCHERS: list = []                   # a job's callbacks, told (kind, output) of every collective


@contextlib.contextmanager
def watch_collectives(callback):
    """In a sealed job: callback(kind, output tensor or None) at every collective the rank starts
    (e.g. where the all-gathers write, to see whether autograd keeps it). The router's record,
    not this, says what was sent."""
    _WATCHERS.append(callback)
    try:
        yield
    finally:
        _WATCHERS.remove(callback)


def _reduce_scatter(output, input_list, op=dist.ReduceOp.SUM, group=None, async_op=False):
    """The list form: input_list[i] summed over the ranks lands in rank i's output."""
    if len(input_list) != len(_ranks(group)):
        raise ValueError(f"reduce_scatter: input_list has {len(input_list)} tensors for a group of "
                         f"{len(_ranks(group))} ranks")
    flat = torch.cat([t.detach().reshape(-1) for t in input_list])
    return _collective("reduce_scatter", "torch.distributed.reduce_scatter", group, output, flat, async_op,
                       reduce=_op_name(op), sizes=[t.numel() for t in input_list])


def _all_gather_object(object_list, obj, group=None):
    """Pickled here, passed on by the router unread, unpickled by the other ranks."""
    reply, blobs = _STATE["channel"].call({"op": "collective", "kind": "all_gather_object", "shown":
                                           "torch.distributed.all_gather_object", "group": list(_ranks(group))},
                                          [pickle.dumps(obj)])
    object_list[:len(blobs)] = [pickle.loads(b) for b in blobs]


def _broadcast_object_list(object_list, src=None, group=None, device=None, group_src=None):
    reply, blobs = _STATE["channel"].call({"op": "collective", "kind": "broadcast_object_list", "shown":
                                           "torch.distributed.broadcast_object_list", "group": list(_ranks(group)),
                                           "src": src}, [pickle.dumps(list(object_list))])
    object_list[:] = pickle.loads(blobs[0])


def _collective(kind, shown, group, into=None, tensor=None, async_op=False, **params):
    """One collective through the router; async_op=True returns a Work whose wait() gets the result."""
    for watch in list(_WATCHERS):
        watch(kind, into.tensors if isinstance(into, _IntoList) else into)
    header = {"op": "collective", "kind": kind, "shown": shown, "group": list(_ranks(group)), **params}
    blobs = []
    if tensor is not None:
        header["tensor"] = tensor_meta(tensor)
        blobs = [tensor_bytes(tensor)]
    if async_op:                                         # no reply now: the router files it under our handle
        _STATE["handles"] = handle = _STATE.get("handles", 0) + 1
        _STATE["channel"].tell({**header, "handle": handle}, blobs)
        return Work(handle, into, kind)
    reply, blobs = _STATE["channel"].call(header, blobs)
    if into is not None and reply.get("data"):
        _write_into(into, blobs[0])
    return None


def _entry_points():
    """{name: stand-in} for torch.distributed (the sealed rank's process group is the router)."""
    return {
        "is_initialized": lambda: True, "get_backend": lambda group=None: "gloo",
        "get_rank": lambda group=None: _ranks(group).index(_STATE["rank"]) if _STATE["rank"] in _ranks(group) else -1,
        "get_world_size": lambda group=None: len(_ranks(group)),
        "get_process_group_ranks": lambda group: list(_ranks(group)),
        "get_global_rank": lambda group, group_rank: _ranks(group)[group_rank],
        "new_group": lambda ranks=None, *a, **k: Group(range(_STATE["world_size"]) if ranks is None else ranks),
        "destroy_process_group": lambda group=None: None,
        "send": send, "recv": recv, "isend": isend, "irecv": irecv,
        "barrier": lambda group=None, async_op=False, device_ids=None:
            _collective("barrier", "torch.distributed.barrier", group, async_op=async_op),
        "all_reduce": lambda tensor, op=dist.ReduceOp.SUM, group=None, async_op=False:
            _collective("all_reduce", "torch.distributed.all_reduce", group, tensor, tensor, async_op,
                        reduce=_op_name(op)),
        "broadcast": lambda tensor, src=None, group=None, async_op=False, group_src=None:
            _collective("broadcast", "torch.distributed.broadcast", group, tensor, tensor, async_op, src=src),
        "reduce": lambda tensor, dst=None, op=dist.ReduceOp.SUM, group=None, async_op=False, group_dst=None:
            _collective("reduce", "torch.distributed.reduce", group, tensor, tensor, async_op, reduce=_op_name(op), dst=dst),
        "all_gather_into_tensor": lambda output, input, group=None, async_op=False:
            _collective("all_gather_into_tensor", "torch.distributed.all_gather_into_tensor", group, output, input,
                        async_op),
        "reduce_scatter_tensor": lambda output, input, op=dist.ReduceOp.SUM, group=None, async_op=False:
            _collective("reduce_scatter_tensor", "torch.distributed.reduce_scatter_tensor", group, output, input,
                        async_op, reduce=_op_name(op)),
        "all_to_all_single": _all_to_all_single, "all_gather": _all_gather, "reduce_scatter": _reduce_scatter,
        "all_gather_object": _all_gather_object, "broadcast_object_list": _broadcast_object_list,
    }


_TORCH_ALIASES = {"all_gather_single": "all_gather_into_tensor", "reduce_scatter_single": "reduce_scatter_tensor",
                  "_all_gather_base": "all_gather_into_tensor", "_reduce_scatter_base": "reduce_scatter_tensor"}
_FUNCTIONAL = {"all_reduce": "all_reduce", "all_reduce_inplace": "all_reduce", "broadcast": "broadcast",
               "all_gather_tensor": "all_gather_into_tensor", "all_gather_single": "all_gather_into_tensor",
               "all_gather_tensor_inplace": "all_gather_into_tensor", "reduce_scatter_tensor": "reduce_scatter_tensor",
               "reduce_scatter_single": "reduce_scatter_tensor", "all_to_all_single": "all_to_all_single",
               "all_gather_inplace": "all_gather", "reduce_scatter_tensor_inplace": "reduce_scatter_tensor",
               "all_to_all_inplace": "all_to_all_single"}


def _refused(kind: str, shown: str):
    def collective(*args, **kwargs):
        _STATE["channel"].call({"op": "forbidden", "kind": kind, "shown": shown})
        raise RuntimeError(f"{shown} is not available in a sealed check")
    collective.__name__ = shown.rsplit(".", 1)[-1]
    return collective


def _no_process_group(*args, **kwargs):
    raise RuntimeError("a check's ranks have no process group: communicate with pplab.comm or torch.distributed "
                       "send/recv/isend/irecv (their messages go through the checker)")


def preload() -> None:
    """Import what install() patches (in the zygote: its ranks then start faster)."""
    _collectives_module()
    with contextlib.suppress(ImportError):
        importlib.import_module("torch.distributed._functional_collectives")


def install(forbidden: list) -> None:
    """Route torch.distributed (and pplab.comm through it) to the router; refuse, at the
    router, the collectives in `forbidden` ("*": all) wherever they are called from."""
    from ...runtime import comm

    c10d = dist.distributed_c10d
    stand_ins = _entry_points()
    for name, alias in _TORCH_ALIASES.items():
        stand_ins[name] = stand_ins[alias]
    every = "*" in forbidden

    def refuses(kind):
        return every or kind in forbidden
    for name in _TORCH_COLLECTIVES + tuple(_TORCH_ALIASES):
        kind = _TORCH_ALIASES.get(name, name)
        if refuses(kind) or name not in stand_ins:
            stand_ins[name] = _refused(kind, f"torch.distributed.{name}")
    for module in (dist, c10d):
        for name, fn in stand_ins.items():
            setattr(module, name, fn)
    c10d._get_default_group = _no_process_group
    for name in _COMM_COLLECTIVES:
        if refuses(name):
            setattr(comm, name, _refused(name, f"pplab.comm.{name}"))
    library = _collectives_module()
    if library is not None and every:
        for name, fn in list(vars(library).items()):
            if inspect.isfunction(fn) and fn.__module__ == library.__name__ and not name.startswith("_"):
                setattr(library, name, _refused(name, f"pplab.collectives.{name}"))
    with contextlib.suppress(ImportError):
        from torch.distributed import _functional_collectives as funcol
        for name, kind in _FUNCTIONAL.items():
            if hasattr(funcol, name):
                setattr(funcol, name, _refused(kind, f"torch.distributed._functional_collectives.{name}")
                        if refuses(kind) else _no_process_group)


# ----------------------------------------------------------------------------------
# The rank's life


def rank_main(zygote_pid: int, chan_fd: int, out_fd: int, err_fd: int) -> None:
    """In a freshly forked rank (never returns)."""
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != zygote_pid:
        os._exit(1)
    os.setsid()                                          # kill(0, ...) reaches only this rank
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(out_fd, 1)
    os.dup2(err_fd, 2)
    chan = 100                                           # high: out of the way of the fds student code opens
    if chan_fd != chan:
        os.dup2(chan_fd, chan)
    os.closerange(3, chan)
    os.closerange(chan + 1, 1 << 16)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    missing = isolate(_STATE.get("hide", ()))               # hide: set in a fresh zygote (fresh_zygote.py)
    prctl(PR_SET_DUMPABLE, 0)                           # no other process may read this one's memory
    torch.set_num_threads(1)                             # p ranks share the cores
    channel = Channel(socket.socket(fileno=chan))
    try:
        _run(channel, missing)
        code = 0
    except BaseException:  # noqa: BLE001 - whatever happened, the checker has been told
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _run(channel: Channel, missing: str) -> None:
    from ... import trace

    while not channel.queue:                              # the launch message, from the checker
        data = channel.sock.recv(1 << 20)
        if not data:
            os._exit(3)
        channel.queue += channel.reader.feed(data)
    launch, blobs = channel.queue.pop(0)
    rank, p = launch["rank"], launch["world_size"]
    _STATE.update(rank=rank, world_size=p, channel=channel, trial=None)
    trace.reset(rank)
    channel.tell({"op": "hello", "isolation": missing, "pid": os.getpid()})
    try:
        module, _, name = launch["job"].partition(":")
        job = getattr(importlib.import_module(module), name)
        answer = _STATE.pop("answer")
        # /tmp/work on the rank's private /tmp wherever it has one (the checker's TMPDIR lies
        # under the /tmp that tmpfs covers), even if some other part of the isolation was missing
        private_tmp = not missing.startswith("no namespaces") and "private /tmp" not in missing
        workdir = "/tmp/work" if private_tmp else None
        if workdir:
            os.makedirs(workdir, exist_ok=True)
            os.chdir(workdir)
        if isinstance(answer, SourceAnswer):
            answer = answer.resolve(workdir)
        if launch.get("refuse"):                          # a collective imported by name: before install()
            message = forbidden_references(answer, *launch["refuse"])
            if message:
                channel.tell({"op": "refused", "message": message})
        if launch.get("probe"):                           # the library's own answer, used by the student's code
            module, _, name = launch["probe"].partition(":")
            try:
                getattr(importlib.import_module(module), name)(answer)
            except Forbidden as refused:
                channel.tell({"op": "refused", "message": str(refused)})
        install(launch["forbidden"])
        result = job(answer, decode(blobs[0]))
        channel.tell({"op": "done"}, [encode(result)])
    except BaseException as exc:  # noqa: BLE001 - reported to the checker, which decides
        channel.tell({"op": "raised", "kind": type(exc).__name__, "message": str(exc)[:2000],
                      "traceback": traceback.format_exc()[-20000:]})
        raise
