"""DeepSpeed-Ulysses: q, k, v arrive sharded by sequence; one all-to-all re-cuts them by heads,
so that every rank holds the *whole* sequence for H/p of the heads and runs ordinary attention
on them; a second all-to-all cuts the output back by sequence. Heads are independent, so
nothing else needs to talk.

For p ranks, H heads, local tokens n_r (any split of the sequence: the pieces may differ in
size), tensor layout (..., heads, seq, head_dim):

    rank r holds (..., H, n_r, d)  --all-to-all-->  (..., H/p, S, d): heads r·H/p .. (r+1)·H/p - 1

Each rank sends (p-1)/p of its tensor per all-to-all (pairwise exchange built from traced
sends, `pplab.collectives`). Forward moves q, k, v in (one message per peer) and the
output back: 4·(p-1)/p·N bytes per rank, N = one rank's q in bytes. Backward the same.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import trace
from ..collectives import pairwise_all_to_all
from .ring_attention import agree_on_call

__all__ = ["ulysses_attention", "seq_to_heads", "heads_to_seq"]


def _seq_to_heads(x, lengths, ranks, me, group):
    """(..., H, n_me, d) -> (..., H/p, S, d): send heads block j to rank j, stack what comes back by position."""
    h = x.shape[-3] // len(ranks)
    ins = [x[..., j * h:(j + 1) * h, :, :].contiguous() for j in range(len(ranks))]
    outs = [x.new_empty(x.shape[:-3] + (h, n, x.shape[-1])) for n in lengths]
    pairwise_all_to_all(outs, ins, ranks, me, group)
    return torch.cat(outs, -2)


def _heads_to_seq(y, lengths, ranks, me, group):
    """(..., H/p, S, d) -> (..., H, n_me, d): the inverse: tokens of rank i go back to rank i."""
    ins = [t.contiguous() for t in y.split(lengths, -2)]
    outs = [y.new_empty(y.shape[:-2] + (lengths[me], y.shape[-1])) for _ in ranks]
    pairwise_all_to_all(outs, ins, ranks, me, group)
    return torch.cat(outs, -3)


class _SeqToHeads(torch.autograd.Function):
    """Forward: sequence-sharded -> head-sharded. Backward: the gradient takes the way back."""

    @staticmethod
    def forward(ctx, x, lengths, ranks, me, group):
        ctx.args = (lengths, ranks, me, group)
        return _seq_to_heads(x, *ctx.args)

    @staticmethod
    def backward(ctx, g):
        return _heads_to_seq(g, *ctx.args), None, None, None, None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, lengths, ranks, me, group):
        ctx.args = (lengths, ranks, me, group)
        return _heads_to_seq(y, *ctx.args)

    @staticmethod
    def backward(ctx, g):
        return _seq_to_heads(g, *ctx.args), None, None, None, None


def _ulysses_setup(name, group, q, k, v, causal=False):
    """Check the call (every rank raises the same error); return every rank's token count, ranks, my index."""
    ranks, me, runs = agree_on_call(name, group, q, k, v, "contiguous", causal)
    if q.dim() < 3 or v.shape != q.shape:
        raise ValueError(f"{name}: q, k, v must be (..., heads, seq, head_dim) and of one shape, "
                         f"got {list(q.shape)}, {list(k.shape)}, {list(v.shape)}")
    heads, p = q.shape[-3], len(ranks)
    if heads % p:
        raise ValueError(f"{name}: {heads} heads cannot be split over {p} ranks: Ulysses gives every rank "
                         f"the same number of whole heads. Use a group whose size divides {heads} "
                         f"({', '.join(str(d) for d in range(1, heads + 1) if heads % d == 0)}), "
                         f"or ring_attention, which has no such limit.")
    return [b - a for (a, b), in runs], ranks, me


def seq_to_heads(x, group=None):
    """Re-cut this rank's (..., H, n_r, d) sequence shard into (..., H/p, S, d): all heads' tokens, my heads."""
    return _SeqToHeads.apply(x, *_ulysses_setup("seq_to_heads", group, x, x, x), group)


def heads_to_seq(y, lengths, group=None):
    """The inverse of seq_to_heads; `lengths` = every rank's number of tokens n_r, in rank order."""
    ranks, me, _ = agree_on_call("heads_to_seq", group, y, y, y, "contiguous", False)
    return _HeadsToSeq.apply(y, list(lengths), ranks, me, group)


def ulysses_attention(q, k, v, group=None, causal: bool = False, scale=None):
    """DeepSpeed-Ulysses: exact attention over the whole sequence, sharded by sequence.

    q, k, v: this rank's tokens, (..., heads, n_r, head_dim), cut contiguously
    (`shard_sequence(x, group)`; n_r may differ by one). The number of heads must divide
    by the group size. Returns this rank's rows of softmax(q·kᵀ·scale)·v, differentiable.
    """
    lengths, ranks, me = _ulysses_setup("ulysses_attention", group, q, k, v, causal)
    qkv = _SeqToHeads.apply(torch.stack([q, k, v]), lengths, ranks, me, group)   # one exchange for all three
    with trace.span("F", label="attn", heads=q.shape[-3] // len(ranks)):
        out = F.scaled_dot_product_attention(*qkv.unbind(0), is_causal=causal, scale=scale)
    return _HeadsToSeq.apply(out, lengths, ranks, me, group)
