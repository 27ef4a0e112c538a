"""What exercise linear_3d's checker (linear_3d.py) runs in its sealed ranks."""
from __future__ import annotations


from types import SimpleNamespace
import torch
import torch.distributed as dist

from .. import sealed
from ..sealed.forbidden import refuse_module


WORLD, Q = 8, 2                                      # a 2x2x2 cube of ranks


def _rank_job(fn, trials):
    """In each sealed rank: the cube's groups (every rank makes every line, in one order), then the
    answer forward and backward, each phase named for the router's record."""
    rank = dist.get_rank()
    i, j, l = _place(rank)
    at = lambda a, b, c: (a * Q + b) * Q + c
    group_i = group_j = group_l = None
    for u in range(Q):                               # the lines along i, then j, then l, the same order everywhere
        for v in range(Q):
            g = dist.new_group([at(a, u, v) for a in range(Q)])
            group_i = g if (u, v) == (j, l) else group_i
    for u in range(Q):
        for v in range(Q):
            g = dist.new_group([at(u, a, v) for a in range(Q)])
            group_j = g if (u, v) == (i, l) else group_j
    for u in range(Q):
        for v in range(Q):
            g = dist.new_group([at(u, v, a) for a in range(Q)])
            group_l = g if (u, v) == (i, j) else group_l
    cube = SimpleNamespace(q=Q, i=i, j=j, l=l, group_i=group_i, group_j=group_j, group_l=group_l)
    for n, t in enumerate(trials):
        sealed.begin(n)
        x, w = t["x"].requires_grad_(), t["w"].requires_grad_()
        sealed.phase("forward")
        y = fn(x, w, cube)
        sealed.phase("")
        out = {"y": y.detach().clone() if torch.is_tensor(y) else repr(y)[:80]}
        if torch.is_tensor(y) and y.requires_grad and y.shape == t["up"].shape:
            sealed.phase("backward")
            (y * t["up"]).sum().backward()
            sealed.phase("")
        out.update({"x.grad": x.grad, "w.grad": w.grad})
        sealed.observe(n, out)


def _refuse_tp3d(fn) -> None:
    """In the sealed rank: Forbidden if the answer uses the library's own 3D layer."""
    refuse_module(fn, "linear_3d", "the 3D linear layer", "pplab.tensor_parallel.tp3d", ("Linear3D", "_Matmul3D"))


def _place(rank):
    i, rest = divmod(rank, Q * Q)
    return (i, *divmod(rest, Q))
