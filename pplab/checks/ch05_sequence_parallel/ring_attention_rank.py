"""What exercise ring_attention's checker (ring_attention.py) runs in its sealed ranks.

In a graded check pplab.sequence_parallel.ring_attention is not available at all (denied.py), so the
probe has nothing to refuse."""
from __future__ import annotations

import torch
import torch.distributed as dist

from .. import sealed
from ..sealed.forbidden import refuse_library
from ..sealed.library_view import unavailable


def _ring_rank(fn, trials):
    """The student's ring_attention forward on this rank's shard, then backward with the checker's dO."""
    t = trials[0]
    sealed.begin(0)
    q, k, v = (t[n].clone().requires_grad_() for n in ("q", "k", "v"))
    sealed.phase("forward")
    out = fn(q, k, v, None)
    fits = isinstance(out, torch.Tensor) and tuple(out.shape) == tuple(q.shape) and out.requires_grad
    res = {"out": out.detach().clone() if fits else None,
           "out_shape": list(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__,
           "requires_grad": bool(getattr(out, "requires_grad", False))}
    sealed.phase("checker")                      # every rank goes on only if all can (else: a hang)
    go = torch.tensor([int(fits)])
    dist.all_reduce(go, op=dist.ReduceOp.MIN)
    if go.item():
        sealed.phase("backward")
        out.backward(t["dout"])
        res.update({"dq": q.grad, "dk": k.grad, "dv": v.grad})
    sealed.phase("")
    sealed.observe(0, res)


def _refuse_library_ring(fn) -> None:
    """In the sealed rank: Forbidden if the answer uses the library's own ring attention."""
    import importlib
    ra = importlib.import_module("pplab.sequence_parallel.ring_attention")   # the package's name is the function
    if unavailable(ra):                                     # a graded check: the answer cannot reach it
        return
    library = {"ring_attention": ra.ring_attention, "_RingAttention": ra._RingAttention,
               "gathered_kv_attention": ra.gathered_kv_attention, "_GatheredKV": ra._GatheredKV,
               "pplab.sequence_parallel.ring_attention.merge": ra.merge}     # by object only: a common name
    refuse_library(fn, "ring_attention", "ring attention's forward and backward", library,
                   "pplab.sequence_parallel's own ring attention")
