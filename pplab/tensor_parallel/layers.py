"""Tensor parallelism (Megatron 1D): one layer's weights split over the ranks of a group.

    fc = ColumnParallelLinear.from_dense(dense_fc)      # rank r holds rows r of W: out/p outputs
    y = fc(x)                                            # x: [..., in] the same on every rank
    head = RowParallelLinear.from_dense(dense_head)     # rank r holds columns r of W: in/p inputs
    z = head(y)                                          # one all-reduce: z the same on every rank

Y = XW can be split two ways. Split W by output columns and every rank computes its own
slice of Y from the whole X (*column parallel*); split W by input rows and X by columns and
every rank computes a partial sum of the whole Y (*row parallel*). A column layer followed by
a row layer needs no communication between them: the column layer's output slice is exactly
the row layer's input slice. So an MLP (column -> GeLU -> row) or an attention layer (heads
split, q/k/v column, output row) costs one all-reduce forward and one backward.

The communication is four conjugate autograd operators (Megatron's f and g and friends):
each one's backward is another one's forward, because the gradient of "copy X to every rank"
is "sum the gradients from every rank", and vice versa. All go through `pplab.comm`, so their
bytes and time land in the trace.

Shapes. Linear layers act on the last dimension; attention and the blocks take [s, b, h]
(sequence, batch, hidden), as Megatron does. With `sequence_parallel=True` (Megatron SP, see
chapter 5) activations between blocks are split along the *sequence* dimension, dim 0:
ColumnParallelLinear takes x of [s/p, b, in] and all-gathers it to [s, b, in] (reduce-scatter
backward); RowParallelLinear reduce-scatters its [s, b, out] partial sums to [s/p, b, out]
instead of all-reducing them (all-gather backward). The sequence length must divide by p.
Sizes that do not divide (out_features, ffn, vocab) are split as torch.tensor_split does:
the first n % p ranks get one more.
Every layer takes `group=` (None = the whole world), so it can run on the TP sub-group of a mesh.
Built from these: `transformer.py` (MLP, attention, block, vocabulary-parallel
embedding and loss), `cnn.py` (convolutions) and `summa.py` (SUMMA), beside this file.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..runtime import comm
from ..split import split_sizes


def my_range(n: int, group=None) -> tuple[int, int]:
    """[start, end) of this rank's share of n rows."""
    sizes, r = split_sizes(n, comm.world_size(group)), comm.rank(group)
    return sum(sizes[:r]), sum(sizes[:r + 1])


def _split(x, dim, group):
    """This rank's slice of x along dim (no communication)."""
    start, end = my_range(x.shape[dim], group)
    return x.narrow(dim, start, end - start).contiguous()


def all_gather_along(x, dim, group, full=None):
    """Concatenate every rank's slice along dim. Uneven slices (given `full`) are padded to the
    largest, gathered in one collective, and the padding dropped."""
    p = comm.world_size(group)
    if p == 1:
        return x
    sizes = split_sizes(full, p) if full is not None else [x.shape[dim]] * p
    x = x.movedim(dim, 0)
    if x.shape[0] < sizes[0]:                                     # pad to the largest slice
        x = torch.cat([x, x.new_zeros(sizes[0] - x.shape[0], *x.shape[1:])])
    out = x.new_empty(p * sizes[0], *x.shape[1:])
    comm.all_gather_into_tensor(out, x.contiguous(), group=group)
    out = torch.cat([c[:n] for c, n in zip(out.chunk(p), sizes)]) if sizes[-1] < sizes[0] else out
    return out.movedim(0, dim)


def reduce_scatter_along(x, dim, group):
    """Sum over ranks, and keep this rank's 1/p slice along dim."""
    p = comm.world_size(group)
    if p == 1:
        return x
    if x.shape[dim] % p:
        raise ValueError(f"a sequence (dim {dim}) of length {x.shape[dim]} cannot be split over {p} "
                         f"ranks for sequence parallelism: use a length that is a multiple of {p}")
    x = x.movedim(dim, 0).contiguous()
    out = x.new_empty(x.shape[0] // p, *x.shape[1:])
    comm.reduce_scatter_tensor(out, x, group=group)
    return out.movedim(0, dim)


def _all_reduce(x, group):
    if comm.world_size(group) > 1:
        x = x.contiguous()          # all-reduce works in place: never on autograd's own buffers
        comm.all_reduce(x, group=group)
    return x


# ----------------------------------------------------------------------------------
# The conjugate operators. Each backward is the forward of its partner.


class CopyToParallel(torch.autograd.Function):
    """"f": identity forward, all-reduce backward. Every rank uses the same X, so dL/dX is the
    sum of every rank's contribution."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad.clone(), ctx.group), None


class ReduceFromParallel(torch.autograd.Function):
    """"g": all-reduce forward, identity backward. The sum of partial results is used whole on
    every rank, so each partial result gets the whole gradient."""

    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x.clone(), group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class SplitToParallel(torch.autograd.Function):
    """Keep this rank's slice along `dim` forward; all-gather the slices' gradients backward."""

    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group, ctx.full = dim, group, x.shape[dim]
        return _split(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_along(grad, ctx.dim, ctx.group, ctx.full), None, None


class GatherFromParallel(torch.autograd.Function):
    """All-gather the slices along `dim` forward (`full` = the whole length, for uneven slices);
    keep this rank's slice of the gradient backward."""

    @staticmethod
    def forward(ctx, x, dim, group, full=None):
        ctx.dim, ctx.group = dim, group
        return all_gather_along(x, dim, group, full)

    @staticmethod
    def backward(ctx, grad):
        return _split(grad, ctx.dim, ctx.group), None, None, None


class GatherFromSequenceParallel(torch.autograd.Function):
    """Megatron SP, entering a TP region: all-gather the sequence slices forward; backward,
    reduce-scatter, since every rank's partial gradient of the whole sequence must be summed.
    Every rank's slice must have the same length (as the reduce-scatter below makes them): a
    rank cannot see the others' lengths without one more collective, and gloo aborts on a mismatch."""

    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return all_gather_along(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter_along(grad, ctx.dim, ctx.group), None, None


class ReduceScatterToSequenceParallel(torch.autograd.Function):
    """Megatron SP, leaving a TP region: sum the partial results and keep this rank's sequence
    slice forward (half an all-reduce); all-gather the slices' gradients backward."""

    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return reduce_scatter_along(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_along(grad, ctx.dim, ctx.group), None, None


def copy_to_parallel(x, group=None):
    return CopyToParallel.apply(x, group)


def reduce_from_parallel(x, group=None):
    return ReduceFromParallel.apply(x, group)


def split_to_parallel(x, dim=-1, group=None):
    return SplitToParallel.apply(x, dim % x.dim(), group)


def gather_from_parallel(x, dim=-1, group=None, full=None):
    return GatherFromParallel.apply(x, dim % x.dim(), group, full)


def gather_from_sequence_parallel(x, dim=0, group=None):
    return GatherFromSequenceParallel.apply(x, dim % x.dim(), group)


def reduce_scatter_to_sequence_parallel(x, dim=0, group=None):
    return ReduceScatterToSequenceParallel.apply(x, dim % x.dim(), group)


# ----------------------------------------------------------------------------------
# The two linear layers


def _init(rows, cols, fan_in, bias):
    """nn.Linear's initialisation, U(-1/sqrt(fan_in), 1/sqrt(fan_in)), for this rank's shard
    only: a layer too big for one rank is never built whole."""
    bound = 1 / math.sqrt(fan_in)
    w = nn.Parameter(torch.empty(rows, cols).uniform_(-bound, bound))
    return w, nn.Parameter(torch.empty(rows).uniform_(-bound, bound)) if bias else None


class ColumnParallelLinear(nn.Module):
    """Y = XW^T + b with W's rows (output features) split: this rank computes Y[..., my slice].

    x: [..., in] the same on every rank (or [s/p, b, in] with sequence_parallel: this rank's
    sequence slice, gathered along dim 0). Returns [..., out_r], this rank's out_r of the
    `out` features, or [..., out] on every rank with gather_output=True.
    """

    def __init__(self, in_features, out_features, bias=True, gather_output=False,
                 sequence_parallel=False, group=None):
        super().__init__()
        p = comm.world_size(group)
        if gather_output and sequence_parallel:
            raise ValueError("gather_output=True and sequence_parallel=True do not go together: "
                             "sequence parallelism keeps the output split until a RowParallelLinear")
        if out_features < p:
            raise ValueError(f"{out_features} output features cannot be split over {p} ranks: "
                             f"each rank needs at least one")
        self.in_features, self.out_features, self.group = in_features, out_features, group
        self.gather_output, self.sequence_parallel = gather_output, sequence_parallel
        start, end = my_range(out_features, group)
        self.weight, self.bias = _init(end - start, in_features, in_features, bias)

    @classmethod
    def from_dense(cls, dense: nn.Linear, gather_output=False, sequence_parallel=False, group=None):
        """This rank's rows of `dense` (the same layer on every rank): equal to it, split."""
        layer = cls(dense.in_features, dense.out_features, dense.bias is not None, gather_output,
                    sequence_parallel, group).to(dense.weight.dtype)
        start, end = my_range(dense.out_features, group)
        with torch.no_grad():
            layer.weight.copy_(dense.weight[start:end])
            if dense.bias is not None:
                layer.bias.copy_(dense.bias[start:end])
        return layer

    def forward(self, x):
        if self.sequence_parallel:
            x = gather_from_sequence_parallel(x, 0, self.group)
        else:
            x = copy_to_parallel(x, self.group)
        y = F.linear(x, self.weight, self.bias)
        return gather_from_parallel(y, -1, self.group, self.out_features) if self.gather_output else y


class RowParallelLinear(nn.Module):
    """Y = XW^T + b with W's columns (input features) split: this rank adds its partial sum.

    x: [..., in_r], this rank's slice of the input features (input_is_parallel=True, the output
    of a ColumnParallelLinear), or [..., in] to be split here. Returns [..., out] on every rank,
    or [s/p, b, out] (this rank's sequence slice) with sequence_parallel. The bias is added once,
    after the sum.
    """

    def __init__(self, in_features, out_features, bias=True, input_is_parallel=True,
                 sequence_parallel=False, group=None):
        super().__init__()
        p = comm.world_size(group)
        if in_features < p:
            raise ValueError(f"{in_features} input features cannot be split over {p} ranks: "
                             f"each rank needs at least one")
        if sequence_parallel and not input_is_parallel:
            raise ValueError("sequence_parallel=True needs input_is_parallel=True (Megatron SP)")
        self.in_features, self.out_features, self.group = in_features, out_features, group
        self.input_is_parallel, self.sequence_parallel = input_is_parallel, sequence_parallel
        start, end = my_range(in_features, group)
        self.weight, self.bias = _init(out_features, end - start, in_features, bias)

    @classmethod
    def from_dense(cls, dense: nn.Linear, input_is_parallel=True, sequence_parallel=False, group=None):
        layer = cls(dense.in_features, dense.out_features, dense.bias is not None, input_is_parallel,
                    sequence_parallel, group).to(dense.weight.dtype)
        start, end = my_range(dense.in_features, group)
        with torch.no_grad():
            layer.weight.copy_(dense.weight[:, start:end])
            if dense.bias is not None:
                layer.bias.copy_(dense.bias)
        return layer

    def forward(self, x):
        if not self.input_is_parallel:
            x = split_to_parallel(x, -1, self.group)
        partial = F.linear(x, self.weight)
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence_parallel(partial, 0, self.group)
            # each rank adds b to its own slice only: f sums the bias gradient over the ranks
            bias = copy_to_parallel(self.bias, self.group) if self.bias is not None else None
        else:
            y, bias = reduce_from_parallel(partial, self.group), self.bias
        return y + bias if bias is not None else y
