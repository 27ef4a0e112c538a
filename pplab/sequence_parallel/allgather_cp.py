"""Llama 3's context parallelism: all-gather K and V, then attend locally with any mask.

    q, k, v = (shard_sequence(t, layout="zigzag") for t in (Q, K, V))     # this rank's 2 chunks
    out = allgather_attention(q, k, v, documents=[700, 300, 24])          # its queries' rows

The Llama 3 paper (Llama Team 2024, section 3.3.2) cuts the sequence into 2·CP chunks, rank i
holding chunks i and 2·CP-1-i (chapter 5's zigzag), and then, "different from existing CP
implementations that overlap communication and computation in a ring-like structure", first
all-gathers K and V and computes attention for its local Q. The all-gather sits on the critical
path; they take it because (1) any mask, the document mask of packed sequences included, is
then an ordinary local mask, and (2) with grouped-query attention (405B: 128 query heads, 8
key/value heads) K and V are much smaller than Q, and attention's O(S²) work dwarfs the O(S)
all-gather.

Here: every rank pads its K/V shard to the longest shard (an all-gather moves equal pieces;
with S = 13 on 3 ranks the shards are 5, 4, 4 tokens and two ranks send one padding row), the
all-gather brings every rank's K/V, the padding rows are masked out with the other documents'
keys, and the attention is plain torch (autograd differentiates it). In backward the gradient
of the gathered K/V is reduce-scattered: each rank gets the sum, over every rank's queries, of
its own K/V's gradient. Grouped-query attention: k and v may have fewer heads than q (q's heads
a multiple of theirs); only those travel, and each is repeated for its group of query heads
after the gather.

Per rank, per layer (n = ⌈S/p⌉ tokens, b = bytes of one token's K and V together; exact for the
rank with the longest shard, `kv_bytes_per_rank` for any):
    sent      forward (p-1)·n·b (the all-gather), backward (p-1)·n·b (the reduce-scatter)
    held      (p+1)·n·b: every rank's K/V, and its own shard; ring attention holds 3·n·b
Ring attention sends the same K/V forward (2(S - n_right)·row per rank) but hides it under the
compute; it never holds more than its own block and two visitors.
"""
from __future__ import annotations

import math

import torch

from .. import trace
from ..runtime import comm
from .ring_attention import agree_on_call, document_starts, pieces


class _GatherKV(torch.autograd.Function):
    """All-gather of this rank's K/V (padded to `n_max` rows) forward; reduce-scatter of its gradient backward."""

    @staticmethod
    def forward(ctx, kv, group, n_max):
        p, me = comm.world_size(group), comm.rank(group)
        padded = torch.nn.functional.pad(kv, (0, 0, 0, n_max - kv.shape[-2]))     # rows n..n_max are padding
        full = kv.new_empty((p,) + padded.shape)
        comm.all_gather_into_tensor(full.flatten(0, 1), padded.contiguous(), group=group)   # gloo: ranks along dim 0
        trace.hold(full, "K/V")
        ctx.info = (group, me, kv.shape[-2], full.nbytes)
        return full

    @staticmethod
    def backward(ctx, grad):
        group, me, n, held = ctx.info
        mine = grad.new_empty(grad.shape[1:])
        comm.reduce_scatter_tensor(mine, grad.contiguous().flatten(0, 1), group=group)   # every rank's part, summed
        trace.release(held, "K/V")                                             # backward is past the gather
        return mine[..., :n, :], None, None


def positions(runs) -> torch.Tensor:
    """The global positions of a rank's tokens, in the order its shard holds them."""
    return torch.cat([torch.arange(a, b) for a, b in runs]) if runs else torch.zeros(0, dtype=torch.long)


def allgather_attention(q, k, v, group=None, causal: bool = True, layout="zigzag", scale=None, documents=None):
    """softmax(q·kᵀ·scale)·v for this rank's queries, over the whole sequence's keys (same result as
    ring_attention); q: (..., Hq, n, d), k and v: (..., Hkv, n, d) with Hq a multiple of Hkv.

    layout: 'zigzag' (Llama 3's), 'contiguous' or explicit runs; documents: the lengths of the
    packed documents (a query sees its own document only). Any sequence length: the shards are
    padded to the longest for the all-gather, and the padding is masked.
    """
    if q.dim() >= 3 and q.dim() == k.dim() == v.dim() and k.shape[-3] != q.shape[-3]:
        if k.shape[-3] == 0 or q.shape[-3] % k.shape[-3] or k.shape[:-1] != v.shape[:-1]:
            raise ValueError(f"allgather_attention: q has {q.shape[-3]} heads, k and v {k.shape[-3]} and "
                             f"{v.shape[-3]}: grouped-query attention needs k and v alike, and q's heads a "
                             f"multiple of theirs (q {list(q.shape)}, k {list(k.shape)}, v {list(v.shape)})")
        group_size = q.shape[-3] // k.shape[-3]
        ranks, me, runs = agree_on_call("allgather_attention", group, q, k.repeat_interleave(group_size, -3),
                                        v.repeat_interleave(group_size, -3), layout, causal, documents)
    else:
        group_size = 1
        ranks, me, runs = agree_on_call("allgather_attention", group, q, k, v, layout, causal, documents)
    lengths = [sum(b - a for a, b in r) for r in runs]
    seq, n_max = sum(lengths), max(lengths)
    trace.hold([k, v], "K/V")
    kv = torch.stack([k, v]) if k.shape[-1] == v.shape[-1] else None
    if kv is None:                                          # v's head_dim differs: two gathers
        k_all, v_all = (_GatherKV.apply(t, group, n_max) for t in (k, v))
    else:                                                   # one all-gather for K and V together
        full = _GatherKV.apply(kv, group, n_max)            # (p, 2, ..., n_max, d)
        k_all, v_all = full[:, 0], full[:, 1]
    # (p, ..., Hkv, n_max, d) -> (..., Hq, p·n_max, d): ranks' rows side by side, heads repeated per group
    k_all, v_all = (torch.cat(t.unbind(0), -2).repeat_interleave(group_size, -3) for t in (k_all, v_all))
    key_pos = torch.cat([torch.cat([positions(r), torch.full((n_max - len_r,), -1)])
                         for r, len_r in zip(runs, lengths)])              # -1: a padding row
    visible = _mask(positions(runs[me]), key_pos, causal, documents, seq)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    with trace.span("F", "attention", visible=int(visible.sum())):   # one local attention, after the gather
        scores = (q @ k_all.transpose(-1, -2)) * scale
        out = torch.softmax(scores.masked_fill(~visible, -math.inf), -1) @ v_all
    trace.release([k, v], "K/V")
    if not (torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))):
        trace.release(len(ranks) * n_max * (k[..., :1, :].nbytes + v[..., :1, :].nbytes), "K/V")   # none kept
    return out


def _mask(q_pos, key_pos, causal, documents, seq):
    """(n_q, p·n_max) bool: query at q_pos may see key at key_pos (not padding, same document, not later)."""
    visible = (key_pos >= 0)[None, :].expand(len(q_pos), -1)
    if causal:
        visible = visible & (key_pos[None, :] <= q_pos[:, None])
    if documents is not None:
        starts = torch.tensor(document_starts(documents, seq, "allgather_attention"))
        doc = lambda pos: torch.bucketize(pos, starts, right=True)       # noqa: E731 - document index of each position
        visible = visible & (doc(key_pos)[None, :] == doc(q_pos)[:, None])
    return visible


def kv_bytes_per_rank(seq_len: int, p: int, token_bytes: int, method: str = "allgather", rank: int = 0,
                      layout="contiguous") -> dict:
    """What `rank` sends and holds of K/V for one attention layer, by formula: the sequence of seq_len
    tokens cut over p ranks by `layout` (rank i holds n_i tokens), b = token_bytes, the bytes of one
    token's K and V together.

    allgather: sends (p-1)·max(n)·b forward (shards padded to the longest) and as much backward;
               holds (n_rank + p·max(n))·b: every rank's padded shard, and its own.
    ring:      sends (S - n_right)·b forward (every block but its right neighbour's, the last it
               receives) and (2S - n_right)·b backward (K/V again, then dK/dV of all p blocks, in the
               inputs' dtype); holds at most min(3, p)·max(n)·b (its own block and two visitors).
    """
    if method not in ("allgather", "ring"):
        raise ValueError(f"method must be 'allgather' or 'ring', got {method!r}")
    if min(seq_len, p, token_bytes) < 1 or seq_len < p or not 0 <= rank < p:
        raise ValueError(f"need seq_len >= p >= 1, token_bytes >= 1 and 0 <= rank < p, got seq_len={seq_len}, "
                         f"p={p}, token_bytes={token_bytes}, rank={rank}")
    n = [sum(b - a for a, b in runs) for runs in pieces(seq_len, p, layout)]
    if method == "allgather":
        return {"forward": (p - 1) * max(n) * token_bytes, "backward": (p - 1) * max(n) * token_bytes,
                "held": (n[rank] + p * max(n)) * token_bytes}
    right = n[(rank + 1) % p]
    return {"forward": (seq_len - right) * token_bytes, "backward": (2 * seq_len - right) * token_bytes,
            "held": min(3, p) * max(n) * token_bytes}
