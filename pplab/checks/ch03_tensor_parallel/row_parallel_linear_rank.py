"""What exercise row_parallel_linear's checker (row_parallel_linear.py) runs in its sealed ranks."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from .. import sealed
from ..sealed.forbidden import refuse_library
from .tp_groups_rank import _groups


def _refuse_row_parallel(fn) -> None:
    """In the sealed rank: Forbidden if the answer uses the library's RowParallelLinear."""
    from ... import tensor_parallel
    refuse_library(fn, "row_parallel_linear", "the row-parallel layer",
                   {"RowParallelLinear": tensor_parallel.RowParallelLinear}, "pplab.tensor_parallel.RowParallelLinear")


def _row_rank(fn, trials):
    """In every sealed rank: the student's module from the dense layer, forward and backward."""
    t = trials[0]
    sealed.begin(0)
    group, ranks = _groups(t["members"])
    c_in, c_out = t["c_in"], t["c_out"]
    dense = nn.Linear(c_in, c_out, bias=t["bias"] is not None).double()
    with torch.no_grad():
        dense.weight.copy_(t["weight"])
        if t["bias"] is not None:
            dense.bias.copy_(t["bias"])
    module = fn(dense, group)
    weight, b = getattr(module, "weight", None), getattr(module, "bias", None)
    out = {"ranks": ranks, "r": t["r"], "weight": None if weight is None else weight.detach().clone(),
           "bias": None if b is None else b.detach().clone(), "is_module": isinstance(module, nn.Module)}
    x = t["x"].requires_grad_()
    fits = torch.tensor([int(weight is not None and tuple(weight.shape) == (c_out, x.shape[1]) and out["is_module"])])
    sealed.phase("setup")
    dist.all_reduce(fits, op=dist.ReduceOp.MIN)         # run forward only if every rank can (else: a hang)
    if fits.item():
        sealed.phase("forward")
        y = module(x)
        sealed.phase("backward")
        (y * t["upstream"]).sum().backward()
        sealed.phase("")
        out.update(y=y.detach(), x_grad=x.grad, w_grad=weight.grad, b_grad=None if b is None else b.grad)
    sealed.observe(0, out)                               # the checker says what is wrong
