"""2.5D tensor parallelism: a Linear layer Y = XW on d stacked q x q grids (p = d·q² ranks).

    grid = Grid2p5D(depth=2)                    # 8 ranks = 2 layers of 2 x 2
    layer = Linear2p5D.from_dense(dense, grid)  # dense: nn.Linear(in, out, bias=False)
    y = layer(split_2p5d(x, grid))              # x: [B, in] -> this rank's block [B/(d·q), in/q]
                                                # y: the same block of Y = X W, [B/(d·q), out/q]

Wang, Xu, Bian and You (*2.5-dimensional distributed model training*, 2021, later *Tesseract*;
Colossal-AI's "2.5D", after Solomonik and Demmel's 2.5D matrix multiply, 2011) stack d copies of chapter 3's
SUMMA grid. Rank (k, i, j) sits in layer k at row i, column j (global rank k·q² + i·q + j).

- X [B, in] is cut into d·q row blocks and q column blocks; rank (k, i, j) holds block
  (k·q + i, j), [B/(d·q), in/q]. Activations are split over all p ranks.
- W [in, out] is cut into q x q blocks; rank (k, i, j) holds W_ij, [in/q, out/q]: every layer
  keeps a copy, so weights are split over q² ranks only (d times the 2D/3D share).
- Forward: each layer runs SUMMA on its slice of the batch, independently of the other layers.
- Backward: SUMMA's backward in each layer gives dX and each layer's part of dW_ij (from its
  own batch rows); the d parts are summed over the depth (an all-reduce among the d ranks
  that hold W_ij). That is Megatron's f on the weight: identity forward, all-reduce backward.

With d = 1 it is SUMMA (2D) exactly: the depth group has one rank and the all-reduce is nothing.

Bytes on the wire per rank (elements x element size; binomial-tree broadcasts and reduces,
ring all-reduce, as `summa.traced_collectives()` runs them). A tree broadcast of s elements
over q ranks puts (q-1)·s on the wire in all, and over SUMMA's q steps each rank is the root
once, so every rank sends (q-1)·s per q broadcasts; the same for reduces. With
x = B·in/(d·q²) (an X block) and w = in·out/q² (a W block):

    forward   (q-1)·(x + w)                         q broadcasts of X blocks, q of W blocks
    backward  2·(q-1)·(x + w) + 2·(d-1)/d · w       the same again, q reduces of dX and of dW
                                                    parts, and the ring all-reduce of dW over d

Memory per rank: the weight block w (and its gradient), and for backward the input block x
(SUMMA keeps its own blocks and re-broadcasts in backward, so nothing gathered is kept).

Every size must divide: B by d·q, in and out by q, as in summa.py. Uneven blocks would not break
the algorithm (each broadcast moves one block, whose shape every rank of the row can work out),
but every block would then have its own size and the formulas above would become sums over
blocks; pplab keeps them one line and refuses a size that does not divide, naming it and the grid.
(w must also divide by d for the ring all-reduce to cut it into d equal chunks, as the formula
assumes; the values are right either way.)
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from ..runtime import comm
from .layers import copy_to_parallel
from .summa import Grid2D, SummaMatmul


class Grid2p5D:
    """The ranks of the world as d layers of a q x q grid (p = d·q²); rank k·q² + i·q + j sits in
    layer k, row i, column j. `grid2d` is this rank's layer (a Grid2D on its q² ranks), `depth_group`
    the d ranks at the same (i, j) in every layer. Every rank must create it, in the same order."""

    def __init__(self, depth: int):
        p = comm.world_size()
        if depth < 1 or p % depth or math.isqrt(p // depth) ** 2 != p // depth:
            raise ValueError(f"a 2.5D grid needs depth·q² ranks; {p} ranks with depth={depth} do not make "
                             f"square layers: use depth 1 with 1, 4, 9 ranks, or 2 with 2, 8, 18 ranks")
        self.d, self.q = depth, math.isqrt(p // depth)
        q2 = self.q * self.q
        self.k, rest = divmod(dist.get_rank(), q2)
        self.i, self.j = divmod(rest, self.q)
        layer = dist.new_group(list(range(self.k * q2, (self.k + 1) * q2)), use_local_synchronization=True)
        self.grid2d = Grid2D(layer)
        self.depth_group = dist.new_group([k * q2 + rest for k in range(depth)], use_local_synchronization=True)

    def __repr__(self):
        return f"Grid2p5D(depth={self.d}, q={self.q}: rank {dist.get_rank()} at layer {self.k}, row {self.i}, col {self.j})"


def _check(n, parts, what, grid):
    if n % parts:
        raise ValueError(f"{what} {n} does not split into {parts} equal blocks on a 2.5D grid of depth {grid.d} "
                         f"over {grid.q}x{grid.q}: use a multiple of {parts}")


def split_2p5d(x, grid: Grid2p5D):
    """Rank (k, i, j)'s block (k·q + i, j) of a [B, in] matrix held whole on every rank."""
    _check(x.shape[0], grid.d * grid.q, "a batch of", grid)
    _check(x.shape[1], grid.q, "a feature size of", grid)
    r, c = x.shape[0] // (grid.d * grid.q), x.shape[1] // grid.q
    row = grid.k * grid.q + grid.i
    return x[row * r:(row + 1) * r, grid.j * c:(grid.j + 1) * c].clone()   # its own storage, not a view of x


class Linear2p5D(nn.Module):
    """Y = X W (no bias) on a 2.5D grid: rank (k, i, j) holds W_ij ([in/q, out/q], the same in every
    layer k), takes its block of X ([B/(d·q), in/q]) and returns the same block of Y ([B/(d·q), out/q])."""

    def __init__(self, in_features, out_features, grid: Grid2p5D):
        super().__init__()
        _check(in_features, grid.q, "in_features", grid)
        _check(out_features, grid.q, "out_features", grid)
        self.grid, self.in_features, self.out_features = grid, in_features, out_features
        bound = 1 / math.sqrt(in_features)                          # nn.Linear's initialisation
        self.weight = nn.Parameter(torch.empty(in_features // grid.q, out_features // grid.q).uniform_(-bound, bound))

    @classmethod
    def from_dense(cls, dense: nn.Linear, grid: Grid2p5D):
        if dense.bias is not None:
            raise ValueError("Linear2p5D is Y = X W without a bias: pass nn.Linear(..., bias=False)")
        m = cls(dense.in_features, dense.out_features, grid).to(dense.weight.dtype)
        wt, q = dense.weight.T, grid.q                               # W = weight^T, [in, out]
        r, c = dense.in_features // q, dense.out_features // q
        with torch.no_grad():
            m.weight.copy_(wt[grid.i * r:(grid.i + 1) * r, grid.j * c:(grid.j + 1) * c])
        return m

    def forward(self, x):
        g = self.grid
        if x.dim() != 2 or x.shape[1] * g.q != self.in_features:
            raise ValueError(f"Linear2p5D takes this rank's block of X, [B/(d·q), in/q] = [B/{g.d * g.q}, "
                             f"{self.in_features}/{g.q}]; got shape {tuple(x.shape)} (use split_2p5d(x, grid))")
        w = copy_to_parallel(self.weight, g.depth_group)            # backward: dW summed over the layers
        return SummaMatmul.apply(x, w, g.grid2d)


def bytes_per_rank(B, c_in, c_out, q, d=1, element_size=8) -> dict:
    """What each rank of a 2.5D grid (d layers of q x q) sends for one Linear2p5D, forward and backward
    (the module docstring derives it). d = 1 is SUMMA (2D)."""
    x, w = B * c_in / (d * q * q), c_in * c_out / (q * q)
    fwd = (q - 1) * (x + w)
    bwd = 2 * (q - 1) * (x + w) + 2 * (d - 1) / d * w
    return {"forward": fwd * element_size, "backward": bwd * element_size}


def memory_per_rank(B, c_in, c_out, q, d=1, element_size=8) -> dict:
    """Bytes a rank holds for one Linear2p5D: its weight block, and the input block kept for backward."""
    return {"weight": c_in * c_out / (q * q) * element_size, "saved": B * c_in / (d * q * q) * element_size}
