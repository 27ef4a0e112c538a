"""Ring attention: exact attention over a sequence sharded across ranks, K/V passed round a ring.

    q, k, v = (shard_sequence(t, layout="zigzag") for t in (Q, K, V))   # this rank's tokens
    out = ring_attention(q, k, v, causal=True, layout="zigzag")          # this rank's rows of
    out.sum().backward()                                                 # softmax(QKᵀ/√d)·V

Every rank keeps its own queries. Its keys and values travel: in step s, rank r computes
attention of its queries against the K/V block of rank r-s, while it already sends that
block on to rank r+1 and receives the next one from rank r-1 (`comm.isend`/`irecv`, so
the transfer runs under the compute). After p steps every query has met every key, but
no rank ever held more than its own block and two visitors: K/V memory per rank is
O(S/p) instead of the O(S) of gathering the whole sequence (`gathered_kv_attention`).

**The online-softmax merge.** Attention of a row over the keys of two blocks can be
computed block by block. Each block gives its output o_b = softmax(s_b)·v_b and its
log-sum-exp lse_b = log Σ exp(s_b). The two combine exactly (flash attention's rule):

    lse = log(exp(lse_1) + exp(lse_2))
    o   = exp(lse_1 - lse)·o_1 + exp(lse_2 - lse)·o_2                  (`merge`)

**Backward** (custom autograd) runs the ring again. With the final lse of each query row
saved, the softmax of any block is exp(s_b - lse), so each block's gradient needs no
merging: dV_b += Pᵀ·dO, dS = P∘(dO·Vᵀ - rowsum(dO∘O)), dQ += dS·K·scale, dK_b += dSᵀ·Q·scale.
dQ stays home; the partial dK/dV of a block travel round the ring with it, each rank
adding its part, and arrive complete at the block's owner after p hops.

**Causal masking and the zigzag layout.** With `causal=True`, query i sees keys j ≤ i.
Cut contiguously (rank r holds the r-th of p pieces), rank 0's queries see only its own
block, while rank p-1's see all of them: rank p-1 does p blocks of work while rank 0 idles.
The zigzag layout cuts the sequence into 2p chunks and gives rank r chunks r and 2p-1-r
(an early and a late one), so every rank does the same work: in each step, half a block.
Blocks or halves that the mask hides entirely are skipped, not computed and masked.

**Packed documents** (chapter 11c). `documents=[n_0, n_1, ...]` (lengths that sum to the
sequence) adds a document mask: a query sees only keys of its own document (and, causal,
not later ones). Each rank's runs are cut at the documents' starts, and only pieces of the
same document meet, so a pair of blocks from different documents is skipped like a hidden
one. `layout=` may also be explicit runs, one list of (start, stop) per rank, as a split
that knows the documents gives (pplab.sequence_parallel.packed).

Bytes per rank (N_kv = one rank's K block in bytes, equal shards): forward sends K and V
p-1 times: 2(p-1)·N_kv. Backward sends K and V p-1 times and dK, dV p times: (4p-2)·N_kv
(dK, dV travel in float32 when the inputs are half or bfloat16: they are sums).

The trace shows each block's compute as "F<j>" / "B<j>" (j: the rank whose K/V block it
is; meta "scores": the query-key scores it computed, "visible": those the masks let through)
and the K/V held by this rank as memory events labelled "K/V".
"""
from __future__ import annotations

import itertools
import math

import torch
import torch.distributed as dist

from ..runtime import comm
from .. import trace
from ..split import split_sizes

LAYOUTS = ("contiguous", "zigzag")


# ----------------------------------------------------------------------------------
# Layouts: which global positions each rank holds.


def pieces(seq_len: int, p: int, layout="contiguous") -> list[list[tuple[int, int]]]:
    """For each of p ranks, the runs [start, stop) of global positions it holds, in order.

    layout: "contiguous", "zigzag", or the runs themselves (checked to cover 0..seq_len once)."""
    if not isinstance(layout, str):
        return _explicit(seq_len, p, layout)
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}: use one of {', '.join(map(repr, LAYOUTS))}")
    chunks = p if layout == "contiguous" else 2 * p
    bounds = [0]
    for n in split_sizes(seq_len, chunks):
        bounds.append(bounds[-1] + n)
    run = [(bounds[c], bounds[c + 1]) for c in range(chunks)]
    return [[run[r]] if layout == "contiguous" else [run[r], run[2 * p - 1 - r]] for r in range(p)]


def _explicit(seq_len, p, layout):
    """Explicit runs, checked: p lists of (start, stop) that cover 0..seq_len exactly once."""
    try:
        runs = [[(int(a), int(b)) for a, b in rank_runs] for rank_runs in layout]
    except (TypeError, ValueError):
        raise ValueError(f"layout must be 'contiguous', 'zigzag' or one list of (start, stop) runs per rank, "
                         f"got {layout!r}") from None
    flat = sorted(r for rank_runs in runs for r in rank_runs)
    if len(runs) != p or any(a >= b for a, b in flat) or \
            [a for a, _ in flat] != [0] + [b for _, b in flat[:-1]] or (flat[-1][1] if flat else 0) != seq_len:
        raise ValueError(f"layout {runs} must give each of the {p} ranks its runs [start, stop) (start < stop) "
                         f"so that together they cover positions 0..{seq_len} exactly once")
    return runs


def _layout_key(layout):
    """The layout as something every rank can compare (a name, or nested tuples of runs)."""
    if isinstance(layout, str):
        return layout
    try:
        return tuple(tuple((int(a), int(b)) for a, b in r) for r in layout)
    except (TypeError, ValueError):
        return repr(layout)


def document_starts(documents, seq_len: int, name: str = "attention") -> list[int]:
    """The first position of every document, checked: positive lengths that sum to the sequence."""
    docs = list(documents)
    if not docs or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in docs) \
            or sum(docs) != seq_len:
        raise ValueError(f"{name}: documents={docs} must be positive whole lengths that add up to the "
                         f"sequence's {seq_len} tokens (pad the last document, or add a document of padding)")
    return list(itertools.accumulate(docs[:-1], initial=0))


def _length(runs) -> int:
    """How many tokens a rank's runs hold."""
    return sum(b - a for a, b in runs)


def shard_sequence(x: torch.Tensor, group=None, layout: str = "contiguous", dim: int = -2) -> torch.Tensor:
    """This rank's tokens of a whole sequence `x` (sequence along `dim`) in the given layout."""
    runs = pieces(x.shape[dim], comm.world_size(group), layout)[comm.rank(group)]
    return torch.cat([x.narrow(dim, a, b - a) for a, b in runs], dim).contiguous()


def unshard_sequence(shards: list, layout: str = "contiguous", dim: int = -2) -> torch.Tensor:
    """The whole sequence back from every rank's shard (a list by rank): the inverse of shard_sequence."""
    seq_len = sum(s.shape[dim] for s in shards)
    placed = []
    for shard, runs in zip(shards, pieces(seq_len, len(shards), layout)):
        offset = 0
        for a, b in runs:
            placed.append((a, shard.narrow(dim, offset, b - a)))
            offset += b - a
    return torch.cat([t for _, t in sorted(placed, key=lambda x: x[0])], dim)


def agree_on_call(name, group, q, k, v, layout, causal, documents=None):
    """Check the call on every rank; return (global ranks, my index, every rank's runs).

    Every rank hands the others a description of its call (untraced bookkeeping: it is not
    part of the algorithm), so all of them raise the same clear error instead of some
    waiting forever for a message that never comes.
    """
    ranks = list(comm.group_ranks(group))
    if comm.rank() not in ranks:
        raise ValueError(f"{name}: rank {comm.rank()} is not in the group {ranks}")
    problems = []
    if not (q.dim() >= 2 and q.dim() == k.dim() == v.dim()):
        problems.append(f"q, k, v must have the same number (>= 2) of dimensions (..., seq, head_dim), "
                        f"got {list(q.shape)}, {list(k.shape)}, {list(v.shape)}")
    elif not (q.shape[:-1] == k.shape[:-1] == v.shape[:-1] and q.shape[-1] == k.shape[-1]):
        problems.append(f"q, k, v must agree in every dimension but v's last (self-attention over the "
                        f"same tokens), got {list(q.shape)}, {list(k.shape)}, {list(v.shape)}")
    if isinstance(layout, str) and layout not in LAYOUTS:
        problems.append(f"unknown layout {layout!r}: use one of {', '.join(map(repr, LAYOUTS))}, or explicit runs")
    docs = None if documents is None else tuple(documents)
    mine = {"problems": problems, "n": q.shape[-2] if q.dim() >= 2 else 0,
            "call": (name, bool(causal), _layout_key(layout), str(q.dtype), tuple(q.shape[:-2]), q.shape[-1],
                     v.shape[-1], docs)}
    everyone = [mine]
    if len(ranks) > 1:
        everyone = [None] * len(ranks)
        with trace.paused():
            dist.all_gather_object(everyone, mine, group=group)
    found = [f"rank {r}: {m}" for r, d in zip(ranks, everyone) for m in d["problems"]]
    if found:
        raise ValueError(f"{name}: " + "; ".join(found))
    if any(d["call"] != mine["call"] for d in everyone):
        listing = "; ".join(f"rank {r}: {d['call'][1:]}" for r, d in zip(ranks, everyone))
        raise ValueError(f"{name}: the ranks disagree on (causal, layout, dtype, batch/head dims, "
                         f"head_dim, v's head_dim, documents): {listing}; every rank must pass the same")
    lengths = [d["n"] for d in everyone]
    if documents is not None:
        document_starts(documents, sum(lengths), name)
    runs = pieces(sum(lengths), len(ranks), layout)
    expected = [_length(r) for r in runs]
    if lengths != expected:
        raise ValueError(
            f"{name}: the ranks hold {lengths} tokens, but a {layout} layout of {sum(lengths)} tokens "
            f"over {len(ranks)} ranks gives them {expected}. Cut the sequence with "
            f"pplab.sequence_parallel.ring_attention.shard_sequence(x, group, layout={layout!r}).")
    return ranks, ranks.index(comm.rank()), runs


# ----------------------------------------------------------------------------------
# Attention of one block, and the merge.


def merge(o1, lse1, o2, lse2):
    """Combine two partial attention results over disjoint key sets into one (online softmax).

    o: (..., n, d) outputs, each normalised over its own keys; lse: (..., n) log-sum-exp of
    the scores over those keys (-inf where a row saw no key). Exact, in any order.
    """
    lse = torch.logaddexp(lse1, lse2)
    ref = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)     # rows that saw nothing stay 0
    return torch.exp(lse1 - ref)[..., None] * o1 + torch.exp(lse2 - ref)[..., None] * o2, lse


def _cut(runs, starts):
    """Runs cut at document starts: (start, stop, document, offset in the rank's rows) for each piece."""
    out, offset = [], 0
    for a, b in runs:
        cuts = [a] + [s for s in starts if a < s < b] + [b]
        for x, y in zip(cuts, cuts[1:]):
            if y > x:
                out.append((x, y, sum(s <= x for s in starts), offset))
                offset += y - x
    return out


def _pairs(q_runs, k_runs, causal, starts=(0,)):
    """Which (query rows, key rows) of a block to compute, and which need the causal mask.

    Runs are disjoint ranges of global positions, so under `causal` a pair of runs is either
    all visible (keys before queries), all hidden (skipped), or the same run (mask a triangle).
    With documents (their first positions in `starts`), runs are cut where a document starts
    and only pieces of the same document are paired.
    """
    if not causal and len(starts) <= 1:
        nq, nk = _length(q_runs), _length(k_runs)
        return [(slice(0, nq), slice(0, nk), False)] if nq and nk else []
    out = []
    for qa, qb, qdoc, qo in _cut(q_runs, starts):
        for ka, kb, kdoc, ko in _cut(k_runs, starts):
            if qdoc == kdoc and (not causal or ka < qb):    # not hidden: same document, a key at or before a query
                out.append((slice(qo, qo + qb - qa), slice(ko, ko + kb - ka), causal and kb > qa))
    return out


def _count(pairs):
    """How many query-key scores a block computes (the work in its trace span)."""
    return sum((qs.stop - qs.start) * (ks.stop - ks.start) for qs, ks, _ in pairs)


def _visible(pairs):
    """How many of them the mask lets through: a masked diagonal piece of n rows keeps n(n+1)/2."""
    return sum((qs.stop - qs.start) * (qs.stop - qs.start + 1) // 2 if diagonal
               else (qs.stop - qs.start) * (ks.stop - ks.start) for qs, ks, diagonal in pairs)


def _scores(q, k, scale, diagonal):
    s = (q @ k.transpose(-1, -2)) * scale
    if diagonal:                                            # same run of positions: key j sees query i >= j
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), -math.inf)
    return s


def _rows(t, sl):
    return t[..., sl, :]


def _acc_dtype(dtype):
    return torch.promote_types(dtype, torch.float32)        # half/bfloat16 accumulate in float32


# ----------------------------------------------------------------------------------
# The ring.


def _post(sends, recvs, right, left, group):
    """Start sending `sends` to the right and receiving `recvs` from the left (empty ones skipped)."""
    return [comm.isend(t, right, group) for t in sends if t.numel()] + \
           [comm.irecv(t, left, group) for t in recvs if t.numel()]


def _wait(handles):
    for h in handles:
        h.wait()


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, causal, layout, scale, documents):
        ranks, me, runs = agree_on_call("ring_attention", group, q, k, v, layout, causal, documents)
        starts = (0,) if documents is None else tuple(document_starts(documents, sum(map(_length, runs))))
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        p, acc = len(ranks), _acc_dtype(q.dtype)
        right, left = ranks[(me + 1) % p], ranks[(me - 1) % p]
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        qa = q.to(acc)
        out = torch.zeros(q.shape[:-1] + v.shape[-1:], dtype=acc, device=q.device)
        lse = torch.full(q.shape[:-1], -math.inf, dtype=acc, device=q.device)
        k_cur, v_cur = k, v
        trace.hold([k, v], "K/V")
        for s in range(p):
            j = (me - s) % p                                # whose K/V block we hold now
            handles, nxt = [], None
            if s < p - 1:                                   # pass it on while we compute with it
                n_next = _length(runs[(j - 1) % p])
                nxt = (k.new_empty(k.shape[:-2] + (n_next, k.shape[-1])),
                       v.new_empty(v.shape[:-2] + (n_next, v.shape[-1])))
                trace.hold(list(nxt), "K/V")
                handles = _post([k_cur, v_cur], nxt, right, left, group)
            todo = _pairs(runs[me], runs[j], causal, starts)
            if todo:
                with trace.span("F", microbatch=j, block=j, scores=_count(todo), visible=_visible(todo)):
                    for qs, ks, diagonal in todo:
                        sc = _scores(_rows(qa, qs), _rows(k_cur, ks).to(acc), scale, diagonal)
                        part_lse = torch.logsumexp(sc, -1)
                        part = torch.exp(sc - part_lse[..., None]) @ _rows(v_cur, ks).to(acc)
                        out[..., qs, :], lse[..., qs] = merge(out[..., qs, :], lse[..., qs], part, part_lse)
            _wait(handles)
            if s > 0:
                trace.release([k_cur, v_cur], "K/V")
            if nxt is not None:
                k_cur, v_cur = nxt
        del k_cur, v_cur, nxt, handles                      # the last visitor, before the output is made
        trace.release([k, v], "K/V")
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.info = (group, ranks, me, runs, causal, scale, starts)
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        group, ranks, me, runs, causal, scale, starts = ctx.info
        p, acc = len(ranks), out.dtype
        right, left = ranks[(me + 1) % p], ranks[(me - 1) % p]
        qa, do = q.to(acc), dout.to(acc)
        delta = (do * out).sum(-1)                          # rowsum(dO ∘ O) = Σ_j P_ij dP_ij
        dq = torch.zeros_like(qa)
        k_cur, v_cur = k, v
        arriving, dkv_handles = None, []                    # partial dK/dV of the block, from the left
        for s in range(p):
            j = (me - s) % p
            handles, nxt = [], None
            if s < p - 1:
                n_next = _length(runs[(j - 1) % p])
                nxt = (k.new_empty(k.shape[:-2] + (n_next, k.shape[-1])),
                       v.new_empty(v.shape[:-2] + (n_next, v.shape[-1])))
                handles = _post([k_cur, v_cur], nxt, right, left, group)
            dk = torch.zeros(k_cur.shape, dtype=acc, device=k.device)
            dv = torch.zeros(v_cur.shape, dtype=acc, device=v.device)
            todo = _pairs(runs[me], runs[j], causal, starts)
            if todo:
                with trace.span("B", microbatch=j, block=j, scores=_count(todo), visible=_visible(todo)):
                    for qs, ks, diagonal in todo:
                        kb, vb = _rows(k_cur, ks).to(acc), _rows(v_cur, ks).to(acc)
                        qb, dob = _rows(qa, qs), _rows(do, qs)
                        prob = torch.exp(_scores(qb, kb, scale, diagonal) - lse[..., qs, None])
                        dv[..., ks, :] += prob.transpose(-1, -2) @ dob
                        ds = prob * (dob @ vb.transpose(-1, -2) - delta[..., qs, None])
                        dq[..., qs, :] += (ds @ kb) * scale
                        dk[..., ks, :] += (ds.transpose(-1, -2) @ qb) * scale
            _wait(dkv_handles)                              # the partial sums for block j are here
            dkv_handles = []                                # (and the ones we sent have left: free them)
            if arriving is not None:
                dk += arriving[0]
                dv += arriving[1]
                arriving = None
            _wait(handles)                                  # block j computed with and sent on: free it
            handles, k_cur, v_cur = [], None, None          # before the buffers below are made
            if nxt is not None:
                k_cur, v_cur = nxt
                nxt = None
            if p > 1:                                       # on to the right; take block j-1's from the left
                n_in = _length(runs[(j - 1) % p])
                arriving = (torch.empty(k.shape[:-2] + (n_in, k.shape[-1]), dtype=acc, device=k.device),
                            torch.empty(v.shape[:-2] + (n_in, v.shape[-1]), dtype=acc, device=v.device))
                dkv_handles = _post([dk, dv], arriving, right, left, group)
            else:
                arriving = (dk, dv)
            dk = dv = None
        _wait(dkv_handles)                                  # after p hops: our own block's dK, dV
        dk, dv = arriving
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None


def ring_attention(q, k, v, group=None, causal: bool = False, layout="contiguous", scale=None, documents=None):
    """softmax(q·kᵀ·scale)·v over the whole sequence, for this rank's queries; q, k, v: (..., n, d).

    Each rank passes its own tokens (`shard_sequence(x, group, layout)`): any sequence
    length, the first ranks get one token more when it does not divide. Returns this
    rank's rows of the output, in the same layout; differentiable with respect to q, k, v.
    scale defaults to 1/√d, as in torch's scaled_dot_product_attention. documents: the
    lengths of the documents packed in the sequence (a query then sees its own document only).
    """
    return _RingAttention.apply(q, k, v, group, causal, layout, scale,
                                None if documents is None else tuple(documents))


# ----------------------------------------------------------------------------------
# The naive baseline: gather every rank's K/V, then attend locally.


class _GatheredKV(torch.autograd.Function):
    """The same arithmetic as one ring step, but over every rank's K/V at once (half or bfloat16
    inputs computed in float32, as the ring does)."""

    @staticmethod
    def forward(ctx, q, k, v, group, causal, layout, scale, will_backward):
        ranks, me, runs = agree_on_call("gathered_kv_attention", group, q, k, v, layout, causal)
        p = len(ranks)
        if len({_length(r) for r in runs}) > 1:
            raise ValueError(f"gathered_kv_attention: all-gather needs equal shards; the ranks hold "
                             f"{[_length(r) for r in runs]} tokens. Use a sequence length "
                             f"divisible by {p if layout == 'contiguous' else 2 * p}, or ring_attention.")
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        full = k.new_empty((p, 2) + k.shape)               # (rank, K or V, ...): one all-gather for both
        full[me, 0], full[me, 1] = k, v                     # my slot, sent from where it lies: no extra copy
        trace.hold([k, v, full], "K/V")
        comm.all_gather_into_tensor(full.flatten(0, 1), full[me], group=group)
        pos = [torch.cat([torch.arange(a, b, dtype=torch.long) for a, b in r]) for r in runs]
        mask = (pos[me][:, None] < torch.cat(pos)[None, :]).to(q.device) if causal else None   # hidden keys
        qa = q.to(_acc_dtype(q.dtype))
        prob, lse = _gathered_softmax(qa, full, mask, scale)
        out = sum(prob[..., i, :, :] @ full[i, 1].to(qa.dtype) for i in range(p))
        held = sum(t.nbytes for t in (k, v, full))
        if will_backward:                                   # the gathered K/V stay until backward
            ctx.save_for_backward(q, full, out, lse)
            ctx.info = (group, mask, scale, held)
        else:
            trace.release(held, "K/V")
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, full, out, lse = ctx.saved_tensors
        group, mask, scale, held = ctx.info
        acc = out.dtype
        qa, do = q.to(acc), dout.to(acc)
        prob, _ = _gathered_softmax(qa, full, mask, scale, lse)
        delta = (do * out).sum(-1, keepdim=True)
        dq, dfull = torch.zeros_like(qa), torch.empty(full.shape, dtype=acc, device=full.device)
        for i in range(full.shape[0]):                      # the same rules as ring attention's backward
            k_i, v_i, p_i = full[i, 0].to(acc), full[i, 1].to(acc), prob[..., i, :, :]
            dfull[i, 1] = p_i.transpose(-1, -2) @ do
            ds = p_i * (do @ v_i.transpose(-1, -2) - delta)
            dq += (ds @ k_i) * scale
            dfull[i, 0] = (ds.transpose(-1, -2) @ qa) * scale
        # each rank's dK/dV is the sum over every rank's queries: reduce-scatter
        mine = dfull.new_empty(dfull.shape[1:])
        comm.reduce_scatter_tensor(mine, dfull.flatten(0, 1), group=group)
        trace.release(held, "K/V")                          # k, v and full: the holdings of forward
        return dq.to(q.dtype), mine[0].to(q.dtype), mine[1].to(q.dtype), None, None, None, None, None


def _gathered_softmax(q, full, mask, scale, lse=None):
    """Softmax over all S keys as (..., p, n_q, n_k) probabilities (block i = rank i's keys), and lse;
    in q's dtype."""
    s = torch.stack([q @ full[i, 0].to(q.dtype).transpose(-1, -2) for i in range(full.shape[0])], -3) * scale
    if mask is not None:
        s = s.masked_fill(mask.view(mask.shape[0], full.shape[0], -1).transpose(0, 1), -math.inf)
    if lse is None:
        lse = torch.logsumexp(s, (-3, -1))
    return torch.exp(s - lse[..., None, :, None]), lse


def gathered_kv_attention(q, k, v, group=None, causal: bool = False, layout: str = "contiguous", scale=None):
    """The same result as ring_attention, the naive way: all-gather K and V (S tokens on every
    rank), attend, reduce-scatter dK/dV in backward. Needs equal shards."""
    will_backward = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    return _GatheredKV.apply(q, k, v, group, causal, layout, scale, will_backward)
