"""3D tensor parallelism: a Linear layer Y = XW on a q x q x q cube of ranks (p = q³).

    cube = Grid3D()                              # 8 ranks = 2 x 2 x 2
    layer = Linear3D.from_dense(dense, cube)     # dense: nn.Linear(in, out, bias=False)
    y = layer(split_3d_input(x, cube))           # x: [B, in] -> [B/q², in/q] on each rank
    y                                            # this rank's piece of Y = X W, [B/q², out/q]

Agarwal, Balle, Gustavson, Joshi and Palkar (*A three-dimensional approach to parallel matrix
multiplication*, 1995) place the q³ block products X_il·W_lj of Y_ij = sum_l X_il W_lj on the
q³ points (i, j, l) of a cube; Bian, Xu, Wang and You (*Maximizing parallelism in distributed
training for huge neural networks*, 2021; Colossal-AI's "3D") cut each block once more so that
every rank stores 1/p of X, of W and of Y, and run it with all-gathers and reduce-scatters.
Rank i·q² + j·q + l sits at (i, j, l). With X, W, Y cut into q x q blocks:

- rank (i, j, l) holds X_il's j-th row piece [B/q², in/q] and W_lj's i-th row piece [in/q², out/q];
- forward: all-gather X_il along j (the q ranks (i, *, l)), all-gather W_lj along i (ranks
  (*, j, l)), multiply: X_il W_lj is rank (i, j, l)'s term of Y_ij; reduce-scatter the terms along
  l (ranks (i, j, *)): rank (i, j, l) ends with Y_ij's l-th row piece [B/q², out/q].
  The output is laid out like the input with j and l swapped (Colossal-AI alternates the roles of
  the axes from one layer to the next, so the next layer takes it as it is);
- backward, the same three steps transposed: all-gather dY_ij along l; dX_il = sum_j dY_ij W_lj^T,
  reduce-scattered along j; dW_lj = sum_i X_il^T dY_ij, reduce-scattered along i. The gathered
  X_il and W_lj are kept from the forward for this (Colossal-AI does the same).

Bytes on the wire per rank (ring all-gather and reduce-scatter, as `traced_collectives()` runs
them: for q pieces of s elements each rank sends (q-1)·s):

    forward   (q-1)·(B·in + in·out + B·out) / q³     gather X, gather W, reduce-scatter Y
    backward  (q-1)·(B·out + B·in + in·out) / q³     gather dY, reduce-scatter dX and dW

so both shrink like p^(-2/3), against 1D's constant and 2D's p^(-1/2).
Memory per rank: the weight piece in·out/q³, and for backward the gathered X_il (B·in/q²) and
W_lj (in·out/q²).

Every size must divide: B and in by q² (two cuts), out by q. Here the algorithm itself needs it:
an all-gather or reduce-scatter cuts one tensor into q pieces of one shape. A size that does not
divide gets an error naming it and the cube.
"""
from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist
from torch import nn

from .. import collectives
from ..runtime import comm
from .summa import traced_collectives as _summa_traced
from .tp25d import bytes_per_rank as tp25d_bytes


class Grid3D:
    """The world's q³ ranks as a q x q x q cube; rank i·q² + j·q + l sits at (i, j, l). Each rank makes
    its three lines of q ranks: `group_i` (varying i), `group_j` (varying j), `group_l` (varying l).
    Every rank must create it, in the same order."""

    def __init__(self):
        p = comm.world_size()
        q = round(p ** (1 / 3))
        if q ** 3 != p:
            lo = int(p ** (1 / 3))
            raise ValueError(f"a 3D grid needs a cube number of ranks, and {p} is not one: "
                             f"use {lo ** 3} or {(lo + 1) ** 3} ranks")
        self.q = q
        self.i, rest = divmod(dist.get_rank(), q * q)
        self.j, self.l = divmod(rest, q)
        at = self.at
        self.group_i = dist.new_group([at(a, self.j, self.l) for a in range(q)], use_local_synchronization=True)
        self.group_j = dist.new_group([at(self.i, a, self.l) for a in range(q)], use_local_synchronization=True)
        self.group_l = dist.new_group([at(self.i, self.j, a) for a in range(q)], use_local_synchronization=True)

    def at(self, i, j, l) -> int:
        """The global rank at (i, j, l)."""
        return (i * self.q + j) * self.q + l

    def __repr__(self):
        return f"Grid3D(q={self.q}: rank {dist.get_rank()} at i={self.i}, j={self.j}, l={self.l})"


def _check(n, parts, what, q):
    if n % parts:
        raise ValueError(f"{what} {n} does not split into {parts} equal pieces on a {q}x{q}x{q} cube: "
                         f"use a multiple of {parts}")


def _piece(t, row_parts, row, col_parts, col):
    r, c = t.shape[0] // row_parts, t.shape[1] // col_parts
    return t[row * r:(row + 1) * r, col * c:(col + 1) * c].clone()     # its own storage, not a view of t


def split_3d_input(x, cube: Grid3D):
    """Rank (i, j, l)'s piece of a [B, in] matrix held whole on every rank: rows i·q + j of q², columns l of q."""
    q = cube.q
    _check(x.shape[0], q * q, "a batch of", q)
    _check(x.shape[1], q, "a feature size of", q)
    return _piece(x, q * q, cube.i * q + cube.j, q, cube.l)


def split_3d_output(y, cube: Grid3D):
    """Rank (i, j, l)'s piece of Y [B, out] as Linear3D returns it: rows i·q + l of q², columns j of q."""
    q = cube.q
    _check(y.shape[0], q * q, "a batch of", q)
    _check(y.shape[1], q, "a feature size of", q)
    return _piece(y, q * q, cube.i * q + cube.l, q, cube.j)


def split_3d_weight(w, cube: Grid3D):
    """Rank (i, j, l)'s piece of W [in, out]: rows l·q + i of q², columns j of q."""
    q = cube.q
    _check(w.shape[0], q * q, "in_features", q)
    _check(w.shape[1], q, "out_features", q)
    return _piece(w, q * q, cube.l * q + cube.i, q, cube.j)


def _all_gather_rows(piece, group, q):
    """The q pieces of the line, stacked in the line's order (rows)."""
    out = piece.new_empty(q * piece.shape[0], *piece.shape[1:])
    comm.all_gather_into_tensor(out, piece.contiguous(), group=group)
    return out


def _reduce_scatter_rows(whole, group, q):
    """The sum over the line of `whole`, and this rank's row piece of it."""
    out = whole.new_empty(whole.shape[0] // q, *whole.shape[1:])
    comm.reduce_scatter_tensor(out, whole.contiguous(), group=group)
    return out


class _Matmul3D(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, cube):
        q = cube.q
        x_il = _all_gather_rows(x, cube.group_j, q)       # [B/q, in/q]
        w_lj = _all_gather_rows(w, cube.group_i, q)       # [in/q, out/q]
        ctx.save_for_backward(x_il, w_lj)
        ctx.cube = cube
        return _reduce_scatter_rows(x_il @ w_lj, cube.group_l, q)     # Y_ij's piece l, [B/q², out/q]

    @staticmethod
    def backward(ctx, dy):
        x_il, w_lj = ctx.saved_tensors
        c = ctx.cube
        dy_ij = _all_gather_rows(dy, c.group_l, c.q)                   # [B/q, out/q]
        dx = _reduce_scatter_rows(dy_ij @ w_lj.T, c.group_j, c.q)      # sum over j: dX_il, my piece
        dw = _reduce_scatter_rows(x_il.T @ dy_ij, c.group_i, c.q)      # sum over i: dW_lj, my piece
        return dx, dw, None


class Linear3D(nn.Module):
    """Y = X W (no bias) on a q x q x q cube: rank (i, j, l) holds W's piece [in/q², out/q]
    (split_3d_weight), takes X's piece [B/q², in/q] (split_3d_input) and returns Y's piece
    [B/q², out/q] (split_3d_output)."""

    def __init__(self, in_features, out_features, cube: Grid3D):
        super().__init__()
        q = cube.q
        _check(in_features, q * q, "in_features", q)
        _check(out_features, q, "out_features", q)
        self.cube, self.in_features, self.out_features = cube, in_features, out_features
        bound = 1 / math.sqrt(in_features)                          # nn.Linear's initialisation
        self.weight = nn.Parameter(torch.empty(in_features // (q * q), out_features // q).uniform_(-bound, bound))

    @classmethod
    def from_dense(cls, dense: nn.Linear, cube: Grid3D):
        if dense.bias is not None:
            raise ValueError("Linear3D is Y = X W without a bias: pass nn.Linear(..., bias=False)")
        m = cls(dense.in_features, dense.out_features, cube).to(dense.weight.dtype)
        with torch.no_grad():
            m.weight.copy_(split_3d_weight(dense.weight.T, cube))
        return m

    def forward(self, x):
        q = self.cube.q
        if x.dim() != 2 or x.shape[1] * q != self.in_features:
            raise ValueError(f"Linear3D takes this rank's piece of X, [B/q², in/q] = [B/{q * q}, "
                             f"{self.in_features}/{q}]; got shape {tuple(x.shape)} (use split_3d_input(x, cube))")
        return _Matmul3D.apply(x, self.weight, self.cube)


@contextlib.contextmanager
def traced_collectives():
    """summa.traced_collectives() (trees for broadcast and reduce, a ring for all-reduce), and the
    all-gather and reduce-scatter as chapter 1's rings of traced sends: the trace's `bytes_sent`
    is then what each rank put on the wire, for every layer of this chapter."""
    saved = {"all_gather_into_tensor": comm.all_gather_into_tensor, "reduce_scatter_tensor": comm.reduce_scatter_tensor}

    def all_gather_into_tensor(output, input, group=None, async_op=False):
        if async_op:
            raise ValueError("inside traced_collectives() all_gather runs as blocking sends: call it with async_op=False")
        collectives.all_gather_into_tensor(output, input, group=group)

    def reduce_scatter_tensor(output, input, op="sum", group=None, async_op=False):
        if async_op:
            raise ValueError("inside traced_collectives() reduce_scatter runs as blocking sends: call it with "
                             "async_op=False")
        collectives.reduce_scatter_tensor(output, input, op, group=group)

    with _summa_traced():
        comm.all_gather_into_tensor, comm.reduce_scatter_tensor = all_gather_into_tensor, reduce_scatter_tensor
        try:
            yield
        finally:
            for name, fn in saved.items():
                setattr(comm, name, fn)


def bytes_per_rank(B, c_in, c_out, q, element_size=8) -> dict:
    """What each rank of a q x q x q cube sends for one Linear3D, forward and backward (derived in the
    module docstring)."""
    each = (q - 1) * (B * c_in + c_in * c_out + B * c_out) / q ** 3 * element_size
    return {"forward": each, "backward": each}


def memory_per_rank(B, c_in, c_out, q, element_size=8) -> dict:
    """Bytes a rank holds for one Linear3D: its weight piece, and the gathered X_il and W_lj kept for backward."""
    return {"weight": c_in * c_out / q ** 3 * element_size,
            "saved": (B * c_in + c_in * c_out) / q ** 2 * element_size}


# ----------------------------------------------------------------------------------
# The four methods side by side: bytes per rank, forward + backward, for one layer


def one_d_bytes_per_rank(B, c_in, c_out, p, element_size=8) -> dict:
    """Megatron's ColumnParallelLinear (no bias, output left split): nothing forward, and backward the
    ring all-reduce of dX [B, in], 2·(p-1)/p·B·in elements per rank (B·in divisible by p)."""
    return {"forward": 0.0, "backward": 2 * (p - 1) / p * B * c_in * element_size}


def total_bytes_per_rank(method, p, B, c_in, c_out, depth=2, element_size=8) -> float:
    """Forward + backward bytes per rank of one Y = XW layer on p ranks, by formula, p taken as a real
    number (q = p^(1/2), (p/depth)^(1/2) or p^(1/3)) so that the curves can cross between grid sizes.
    method: "1D", "2D", "2.5D" (with `depth`) or "3D"."""
    if method == "1D":
        b = one_d_bytes_per_rank(B, c_in, c_out, p, element_size)
    elif method == "2D":
        b = tp25d_bytes(B, c_in, c_out, math.sqrt(p), 1, element_size)
    elif method == "2.5D":
        b = tp25d_bytes(B, c_in, c_out, math.sqrt(p / depth), depth, element_size)
    elif method == "3D":
        b = bytes_per_rank(B, c_in, c_out, p ** (1 / 3), element_size)
    else:
        raise ValueError(f"method must be '1D', '2D', '2.5D' or '3D', got {method!r}")
    return b["forward"] + b["backward"]


def crossovers(a, b, B, c_in, c_out, lo, hi, depth=2) -> list:
    """Every p in [lo, hi] where methods a and b send the same bytes per rank: the curves are sampled at
    2000 points spaced evenly in log p, and each change of sign of their difference is bisected."""
    def diff(p):
        return total_bytes_per_rank(a, p, B, c_in, c_out, depth) - total_bytes_per_rank(b, p, B, c_in, c_out, depth)
    ps = [lo * (hi / lo) ** (k / 1999) for k in range(2000)]
    found = []
    for left, right in zip(ps, ps[1:]):
        if diff(left) == 0:
            found.append(left)
        elif diff(left) * diff(right) < 0:
            for _ in range(100):
                mid = (left + right) / 2
                left, right = (mid, right) if diff(left) * diff(mid) > 0 else (left, mid)
            found.append((left + right) / 2)
    return found
