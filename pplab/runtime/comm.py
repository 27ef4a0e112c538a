"""torch.distributed calls that leave a record in `pplab.trace`.

Same arguments and in-place behaviour as torch.distributed. Every call appends one
Event to this rank's trace: its kind, start and end time, the peer (send/recv) or
the group (collectives), and bytes:

* point-to-point (`send`, `recv`, `isend`, `irecv`, `exchange`): `bytes_sent` and
  `bytes_recv` are exactly the tensor bytes this rank put on / took off the wire,
  so the bytes of any algorithm built from them can be checked against a formula;
* collectives forwarded to the backend (`all_reduce`, `broadcast`, ...): what crosses
  the wire depends on the backend's own algorithm, which pplab cannot see, so
  `bytes_sent`/`bytes_recv` stay 0 and `meta["payload"]` holds the tensor bytes.

Peers are global ranks, as in torch.distributed.

Under pplab.launch every call is also noted on the launch's call board (callboard.py)
while it runs, so that a launch that hangs can say which rank is in which call, and
two ranks in mismatched collectives are stopped at once. Arguments each rank can check
alone (a root that is not in the group, an output of the wrong size) raise a ValueError
on every rank, before anything is sent.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from . import callboard
from .. import trace
from ..trace import Event, now


def _entry_point(name: str, old: str):
    """torch.distributed's function `name`, or `old` before torch 2.13 renamed the tensor forms (the
    old names still work there, with a warning). Looked up at each call, never kept: a sealed check's
    rank replaces torch.distributed's functions with its own (pplab/checks/sealed/rank.py)."""
    return getattr(dist, name, None) or getattr(dist, old)


_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN,
        "product": dist.ReduceOp.PRODUCT}
_SHORT = {"all_reduce": "AR", "broadcast": "BC", "reduce": "R", "all_gather": "AG",
          "reduce_scatter": "RS", "gather": "G", "scatter": "S", "all_to_all": "A2A",
          "barrier": "BAR"}


def rank(group=None) -> int:
    return dist.get_rank(group) if dist.is_initialized() else 0


def world_size(group=None) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def group_ranks(group=None) -> tuple:
    """The global ranks in `group` (None: every rank), in the group's order; (0,) outside a launch."""
    if not dist.is_initialized():
        return (0,)
    if group is None or group is dist.group.WORLD:
        return tuple(range(dist.get_world_size()))
    return tuple(dist.get_process_group_ranks(group))


def _op(op):
    if isinstance(op, str):
        if op not in _OPS:
            raise ValueError(f"unknown reduce op {op!r}: use one of {sorted(_OPS)}")
        return _OPS[op]
    return op


# ----------------------------------------------------------------------------------
# Point-to-point


def _p2p_event(kind, tensor, peer, start, end=None) -> Event:
    sending = kind in ("send", "isend")
    n = _nbytes(tensor)
    arrow = f"→{peer}" if sending else f"←{peer}"
    return trace.record(Event(
        trace.recording_rank(), "send" if sending else "recv", "comm", start, end, arrow,
        bytes_sent=n if sending else 0, bytes_recv=0 if sending else n, peer=peer,
        seq=trace.next_seq(peer, sending) if trace.enabled() else None,
        meta={"shape": tuple(tensor.shape), "dtype": str(tensor.dtype).replace("torch.", "")}))


def _check_peer(peer, what):
    if not isinstance(peer, int):
        raise TypeError(f"{what} must be a rank number (int), got {peer!r}")
    p = dist.get_world_size()
    if not 0 <= peer < p:
        raise ValueError(f"{what}={peer} is not a rank: ranks are 0..{p - 1}")
    if peer == dist.get_rank():
        raise ValueError(f"{what}={peer} is this rank itself: a rank cannot send to or receive from itself")


def _blocking(kind, tensor, group, call, **where):
    """Run a blocking call with this rank's board slot saying it is inside it."""
    callboard.enter(kind, tensor, group, group_ranks(group), collective=False, **where)
    try:
        call()
    finally:
        callboard.leave()


def send(tensor: torch.Tensor, dst: int, group=None, tag: int = 0) -> None:
    _check_peer(dst, "dst")
    start = now()
    _blocking("send", tensor, group, lambda: dist.send(tensor, dst, group=group, tag=tag), dst=dst)
    _p2p_event("send", tensor, dst, start, now())


def recv(tensor: torch.Tensor, src: int, group=None, tag: int = 0) -> None:
    """Receive into `tensor` from rank `src` (src is required: traces pair each recv with a send)."""
    _check_peer(src, "src")
    start = now()
    _blocking("recv", tensor, group, lambda: dist.recv(tensor, src, group=group, tag=tag), src=src)
    _p2p_event("recv", tensor, src, start, now())


class Handle:
    """An async operation in flight; `wait()` completes it and closes its trace event."""

    def __init__(self, work, event: Event):
        self.work, self.event = work, event

    def wait(self) -> None:
        if self.work is not None:
            e = self.event
            peer = {"recv": "src", "send": "dst"}.get(e.kind)
            callboard.enter(f"wait for {e.kind}", None, None, e.group or (), collective=False,
                            **({peer: e.peer} if peer and e.peer is not None else {}))
            try:
                self.work.wait()
            finally:
                callboard.leave()
        if self.event.end is None:
            self.event.end = now()

    def is_completed(self) -> bool:
        return self.work is None or self.work.is_completed()


def isend(tensor: torch.Tensor, dst: int, group=None, tag: int = 0) -> Handle:
    _check_peer(dst, "dst")
    start = now()
    return Handle(dist.isend(tensor, dst, group=group, tag=tag), _p2p_event("isend", tensor, dst, start))


def irecv(tensor: torch.Tensor, src: int, group=None, tag: int = 0) -> Handle:
    _check_peer(src, "src")
    start = now()
    return Handle(dist.irecv(tensor, src, group=group, tag=tag), _p2p_event("irecv", tensor, src, start))


def exchange(send_tensor: torch.Tensor, dst: int, recv_tensor: torch.Tensor, src: int, group=None) -> None:
    """Send to `dst` and receive from `src` at the same time (the step of every ring).

    Posting both before waiting is what keeps a ring from deadlocking: if every rank
    did a blocking send first, all would wait for a receiver that is itself sending.
    """
    handles = [isend(send_tensor, dst, group), irecv(recv_tensor, src, group)]
    for h in handles:
        h.wait()


# ----------------------------------------------------------------------------------
# Collectives (forwarded to the backend's own implementation)


def _collective(kind, tensor, group, fn, async_op=False, **call):
    """Forward one collective to the backend, noting it on the trace and on the call board."""
    start = now()
    callboard.enter(kind, tensor, group, group_ranks(group), **call)
    try:
        work = fn()
    finally:
        callboard.leave()
    event = trace.record(Event(trace.recording_rank(), kind, "comm", start, None, _SHORT.get(kind, kind),
                               group=group_ranks(group), meta={"payload": 0 if tensor is None else _nbytes(tensor)}))
    handle = Handle(work if async_op else None, event)
    if not async_op:
        handle.wait()
        return None
    return handle


def _check_root(kind, name, root, group):
    """The same ValueError on every rank for a root that is not in the group."""
    ranks = group_ranks(group)
    if isinstance(root, bool) or not isinstance(root, int) or root not in ranks:
        raise ValueError(f"{kind}: {name}={root!r} is not a rank of the group: use one of {list(ranks)} "
                         f"({name} is a global rank, as in torch.distributed)")


def _check_sizes(kind, output, input, out_numel, formula):
    problems = []
    if output.dtype != input.dtype:
        problems.append(f"output is {_describe(output)} but input is {_describe(input)}: use one dtype")
    if output.numel() != out_numel:
        problems.append(f"output is {_describe(output)}: it must hold {formula} = {out_numel} elements")
    if not (output.is_contiguous() and input.is_contiguous()):
        problems.append("output and input must be contiguous: pass .contiguous()")
    if problems:
        raise ValueError(f"{kind}: " + "; ".join(problems))


def _describe(t) -> str:
    return f"{str(t.dtype).replace('torch.', '')}{list(t.shape)}"


def all_reduce(tensor, op="sum", group=None, async_op=False):
    return _collective("all_reduce", tensor, group,
                       lambda: dist.all_reduce(tensor, op=_op(op), group=group, async_op=async_op), async_op,
                       op=str(op))


def broadcast(tensor, src, group=None, async_op=False):
    _check_root("broadcast", "src", src, group)
    return _collective("broadcast", tensor, group,
                       lambda: dist.broadcast(tensor, src, group=group, async_op=async_op), async_op, src=src)


def reduce(tensor, dst, op="sum", group=None, async_op=False):
    _check_root("reduce", "dst", dst, group)
    return _collective("reduce", tensor, group,
                       lambda: dist.reduce(tensor, dst, op=_op(op), group=group, async_op=async_op), async_op,
                       dst=dst, op=str(op))


def all_gather(tensor_list, tensor, group=None, async_op=False):
    p = len(group_ranks(group))
    if tensor_list is None or len(tensor_list) != p:
        raise ValueError(f"all_gather: tensor_list must hold one tensor per rank of the group ({p}), "
                         f"got {0 if tensor_list is None else len(tensor_list)}")
    return _collective("all_gather", tensor, group,
                       lambda: dist.all_gather(tensor_list, tensor, group=group, async_op=async_op), async_op)


def all_gather_into_tensor(output, input, group=None, async_op=False):
    p = len(group_ranks(group))
    _check_sizes("all_gather_into_tensor", output, input, input.numel() * p, f"input.numel() * {p} ranks")
    return _collective("all_gather", input, group,
                       lambda: _entry_point("all_gather_single", "all_gather_into_tensor")(
                           output, input, group=group, async_op=async_op), async_op)


def reduce_scatter_tensor(output, input, op="sum", group=None, async_op=False):
    p = len(group_ranks(group))
    if input.numel() % p:
        raise ValueError(f"reduce_scatter_tensor: input is {_describe(input)}, {input.numel()} elements, "
                         f"which do not split evenly over the {p} ranks of the group: pad it to a multiple "
                         f"of {p}")
    _check_sizes("reduce_scatter_tensor", output, input, input.numel() // p, f"input.numel() / {p} ranks")
    return _collective("reduce_scatter", input, group,
                       lambda: _entry_point("reduce_scatter_single", "reduce_scatter_tensor")(
                           output, input, op=_op(op), group=group, async_op=async_op), async_op, op=str(op))


def gather(tensor, gather_list=None, dst=0, group=None, async_op=False):
    _check_root("gather", "dst", dst, group)
    return _collective("gather", tensor, group,
                       lambda: dist.gather(tensor, gather_list, dst, group=group, async_op=async_op), async_op,
                       dst=dst)


def scatter(tensor, scatter_list=None, src=0, group=None, async_op=False):
    _check_root("scatter", "src", src, group)
    return _collective("scatter", tensor, group,
                       lambda: dist.scatter(tensor, scatter_list, src, group=group, async_op=async_op), async_op,
                       src=src)


def all_to_all_single(output, input, group=None, async_op=False):
    _check_sizes("all_to_all_single", output, input, input.numel(), "input.numel()")
    return _collective("all_to_all", input, group,
                       lambda: dist.all_to_all_single(output, input, group=group, async_op=async_op), async_op)


def barrier(group=None):
    return _collective("barrier", None, group, lambda: dist.barrier(group=group))
