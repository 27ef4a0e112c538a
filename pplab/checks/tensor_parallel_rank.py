"""The jobs and probes that tensor_parallel.py runs in its exercises' sealed ranks.

Kept apart from the checker, which holds the references: a graded check's ranks may import
this module and nothing of the checker (fresh_zygote.py), and there the library modules the
exercise asks the student to write are not available at all (denied.py)."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from . import sealed
from .sealed.forbidden import refuse_library


def _ce_rank(fn, trials):
    """In every sealed rank: the loss of this rank's slice of the logits, then backward."""
    t = trials[0]
    sealed.begin(0)
    shard = t["shard"].requires_grad_()
    sealed.phase("forward")
    loss = fn(shard, t["targets"], t["start"], None)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        sealed.observe(0, {"error": f"vocab_parallel_ce must return the mean loss as a 1-element tensor, got "
                                    f"{type(loss).__name__} {getattr(loss, 'shape', '')}"})
        return
    sealed.phase("backward")
    if loss.requires_grad:
        loss.backward()
    sealed.phase("")
    sealed.observe(0, {"loss": loss.detach().reshape(()), "grad": shard.grad, "shard": shard.shape[1]})


def _fg_rank(fn, trials):
    """In every sealed rank: f then g, forward and backward, each phase named for the router's record."""
    t = trials[0]
    sealed.begin(0)
    group, ranks = _groups(t["members"])
    pair = fn()
    if not (isinstance(pair, (tuple, list)) and len(pair) == 2 and all(callable(h) for h in pair)):
        got = f"a tuple of {len(pair)}" if isinstance(pair, (tuple, list)) else type(pair).__name__
        sealed.observe(0, {"error": f"f_and_g() must return (f, g), two functions called as f(x, group); got {got}"})
        return
    f, g = pair
    x, w, xg = t["x"].requires_grad_(), t["w"], t["xg"].requires_grad_()   # x: the same on every rank
    sealed.phase("f forward")
    y = f(x, group)
    sealed.phase("f backward")
    (y * w).sum().backward()
    sealed.phase("g forward")
    z = g(xg, group)
    sealed.phase("g backward")
    (z * w).sum().backward()
    sealed.phase("")
    sealed.observe(0, {"ranks": ranks, "x": x.detach(), "y": y.detach(), "x_grad": x.grad, "z": z.detach(),
                       "xg_grad": xg.grad, "numel": x.numel()})


def _groups(members):
    """Every rank creates every sub-group (torch requires it); returns this rank's (group, ranks)."""
    if members is None:
        return None, list(range(dist.get_world_size()))
    groups = [dist.new_group(m) for m in members]
    return next((g, m) for g, m in zip(groups, members) if dist.get_rank() in m)


def _refuse_row_parallel(fn) -> None:
    """In the sealed rank: Forbidden if the answer uses the library's RowParallelLinear."""
    from .. import tensor_parallel
    refuse_library(fn, "row_parallel_linear", "the row-parallel layer",
                   {"RowParallelLinear": tensor_parallel.RowParallelLinear}, "pplab.tensor_parallel.RowParallelLinear")


def _refuse_vocab_parallel_ce(fn) -> None:
    """In the sealed rank: Forbidden if the answer uses the library's vocabulary-parallel loss."""
    from ..tensor_parallel import transformer as tpt
    refuse_library(fn, "vocab_parallel_ce", "the vocabulary-parallel loss",
                   {"vocab_parallel_cross_entropy": tpt.vocab_parallel_cross_entropy},
                   "pplab.tensor_parallel.transformer.vocab_parallel_cross_entropy")


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
