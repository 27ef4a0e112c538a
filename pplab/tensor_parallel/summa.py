"""2D tensor parallelism: a Linear layer on a q x q grid of ranks, by SUMMA (Colossal-AI's "2D").

    grid = Grid2D()                          # 4 ranks = 2 x 2; rank i*q + j sits at row i, column j
    layer = Linear2D.from_dense(dense, grid)
    y_ij = layer(split_2d(x, grid))          # x: [B, in] -> this rank's block [B/q, in/q]
                                             # y_ij: block (i, j) of y = x W^T + b, [B/q, out/q]

In 1D (Megatron) tensor parallelism every rank holds the whole activation [B, h] and the
all-reduce of it costs each rank about 2·B·h bytes, however many ranks there are. In 2D, X
and W are both cut into q x q blocks and rank (i, j) holds X_ij and W_ij only: activations and
weights per rank both shrink by p = q², and each rank communicates blocks of size 1/p, q
times, so its traffic shrinks like 1/sqrt(p).

SUMMA (van de Geijn & Watts, 1997) computes Y_ij = sum_k X_ik W_kj in q steps: at step k, the
owner of X_ik broadcasts it along grid row i, the owner of W_kj broadcasts it along grid
column j, and every rank adds one block product. (W here is [in, out], the transpose of
nn.Linear's weight, so that the blocks read like the formula.) Backward runs the same idea
twice, with reduces instead of some broadcasts:

    dX_it = sum_j dY_ij W_tj^T : W_tj broadcast down column j, partial products reduced along row i
    dW_tj = sum_i X_it^T dY_ij : X_it broadcast along row i, partial products reduced down column j

The bias b_j lives on every rank of column j; its gradient is summed down the column (f).
Every size must divide by q (the blocks of a broadcast must have one shape).

What a rank hands to its collectives (the payload) is not what it sends: in a binomial-tree
broadcast every rank but the root receives the block once, so q ranks send q-1 copies in all.
`traced_collectives()` runs the broadcasts and reduces as chapter 1's trees built from traced
sends, so the trace counts the bytes each rank puts on the wire.
"""
from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist
from torch import nn

from .. import collectives
from ..runtime import comm
from .layers import copy_to_parallel


class Grid2D:
    """The ranks of `group` (None = the world) as a q x q grid, with a process group per grid
    row and per grid column. Every rank of `group` must create it, in the same order."""

    def __init__(self, group=None):
        ranks = list(comm.group_ranks(group))
        p, q = len(ranks), math.isqrt(len(ranks))
        if q * q != p:
            raise ValueError(f"a 2D grid needs a square number of ranks, and {p} is not one: "
                             f"use {q * q} or {(q + 1) ** 2} ranks")
        self.q, self.ranks = q, [ranks[i * q:(i + 1) * q] for i in range(q)]    # ranks[i][j]: global rank
        self.i, self.j = divmod(ranks.index(dist.get_rank()), q)
        # only the members of a row/column create it (local synchronization), so a grid can live on
        # a sub-group of a larger world
        self.row_group = dist.new_group(self.ranks[self.i], use_local_synchronization=True)
        self.col_group = dist.new_group([row[self.j] for row in self.ranks], use_local_synchronization=True)

    def at(self, i, j) -> int:
        """The global rank at grid row i, column j."""
        return self.ranks[i][j]


def _check(n, q, what):
    if n % q:
        raise ValueError(f"{what} {n} does not split into {q} equal blocks for a {q}x{q} grid: "
                         f"use a multiple of {q}")


@contextlib.contextmanager
def traced_collectives():
    """Inside this block, pplab.comm's broadcast and reduce run as pplab.collectives' binomial trees
    and its all-reduce as pplab.collectives' ring, all built from traced sends.

    gloo hides its own algorithms, so a plain run's trace holds only each collective's payload;
    in here it holds every message, and summing `bytes_sent` gives what each rank put on the wire.
    These are the collectives of Linear2D (and of the 1D layers' f and g), all called blocking.
    """
    def blocking(name, async_op):
        if async_op:
            raise ValueError(f"inside traced_collectives() {name} runs as blocking sends: call it with async_op=False")

    def broadcast(tensor, src, group=None, async_op=False):
        blocking("broadcast", async_op)
        collectives.broadcast(tensor, src, group=group)

    def reduce(tensor, dst, op="sum", group=None, async_op=False):
        blocking("reduce", async_op)
        collectives.reduce(tensor, dst, op, group=group)

    def all_reduce(tensor, op="sum", group=None, async_op=False):
        blocking("all_reduce", async_op)
        collectives.all_reduce(tensor, op, group=group)

    saved = {"broadcast": comm.broadcast, "reduce": comm.reduce, "all_reduce": comm.all_reduce}
    comm.broadcast, comm.reduce, comm.all_reduce = broadcast, reduce, all_reduce
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(comm, name, fn)


def split_2d(x, grid: Grid2D):
    """Block (i, j) of a [rows, cols] matrix held whole on every rank (no communication)."""
    _check(x.shape[0], grid.q, "a batch of")
    _check(x.shape[1], grid.q, "a feature size of")
    r, c = x.shape[0] // grid.q, x.shape[1] // grid.q
    return x[grid.i * r:(grid.i + 1) * r, grid.j * c:(grid.j + 1) * c].contiguous()


class SummaMatmul(torch.autograd.Function):
    """x @ w with both cut in blocks over the 2D grid, forward and backward by SUMMA (2.5D runs it in each of its d layers)."""

    @staticmethod
    def forward(ctx, x, w, grid):
        ctx.save_for_backward(x, w)
        ctx.grid = grid
        y = x.new_zeros(x.shape[0], w.shape[1])
        for k in range(grid.q):
            x_ik = x.clone() if grid.j == k else torch.empty_like(x)     # from the rank at (i, k)
            comm.broadcast(x_ik, src=grid.at(grid.i, k), group=grid.row_group)
            w_kj = w.clone() if grid.i == k else torch.empty_like(w)     # from the rank at (k, j)
            comm.broadcast(w_kj, src=grid.at(k, grid.j), group=grid.col_group)
            y += x_ik @ w_kj
        return y

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        g = ctx.grid
        dx, dw = torch.empty_like(x), torch.empty_like(w)
        for t in range(g.q):
            w_tj = w.clone() if g.i == t else torch.empty_like(w)
            comm.broadcast(w_tj, src=g.at(t, g.j), group=g.col_group)
            part = dy @ w_tj.T                                   # my share of dX_it
            comm.reduce(part, dst=g.at(g.i, t), group=g.row_group)
            if g.j == t:
                dx = part
            x_it = x.clone() if g.j == t else torch.empty_like(x)
            comm.broadcast(x_it, src=g.at(g.i, t), group=g.row_group)
            part = x_it.T @ dy                                   # my share of dW_tj
            comm.reduce(part, dst=g.at(t, g.j), group=g.col_group)
            if g.i == t:
                dw = part
        return dx, dw, None


class Linear2D(nn.Module):
    """y = x W^T + b on a q x q grid: rank (i, j) holds block (i, j) of W^T ([in/q, out/q]) and
    b_j; it takes block (i, j) of x ([B/q, in/q]) and returns block (i, j) of y ([B/q, out/q])."""

    def __init__(self, in_features, out_features, grid: Grid2D, bias=True):
        super().__init__()
        _check(in_features, grid.q, "in_features")
        _check(out_features, grid.q, "out_features")
        self.grid, self.in_features, self.out_features = grid, in_features, out_features
        bound = 1 / math.sqrt(in_features)                          # nn.Linear's initialisation
        self.weight = nn.Parameter(torch.empty(in_features // grid.q, out_features // grid.q).uniform_(-bound, bound))
        self.bias = nn.Parameter(torch.empty(out_features // grid.q).uniform_(-bound, bound)) if bias else None

    @classmethod
    def from_dense(cls, dense: nn.Linear, grid: Grid2D):
        m = cls(dense.in_features, dense.out_features, grid, dense.bias is not None).to(dense.weight.dtype)
        with torch.no_grad():
            m.weight.copy_(split_2d(dense.weight.T, grid))
            if dense.bias is not None:
                n = dense.out_features // grid.q
                m.bias.copy_(dense.bias[grid.j * n:(grid.j + 1) * n])
        return m

    def forward(self, x):
        q = self.grid.q
        if x.dim() != 2 or x.shape[1] * q != self.in_features:
            raise ValueError(f"Linear2D takes this rank's block of x, [B/{q}, {self.in_features}/{q}]; "
                             f"got shape {tuple(x.shape)} (use split_2d(x, grid))")
        _check(x.shape[0] * q, q, "a batch of")
        y = SummaMatmul.apply(x, self.weight, self.grid)
        return y if self.bias is None else y + copy_to_parallel(self.bias, self.grid.col_group)

