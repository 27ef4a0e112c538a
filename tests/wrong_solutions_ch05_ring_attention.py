"""Plausible wrong answers to the capstone `ring_attention` (causal ring attention, forward and
backward, zigzag layout), each one mistake a student could make, one of them wrong on rank 1 only.

WRONG[exercise_id] lists (function, regular expressions the check's message must match, timeout
for the check or None for the default), as in wrong_solutions_ch00_broadcast.py. Every ring answer here is one
implementation, `_Ring` (masks by global positions, torch.distributed's isend/irecv), with one
switch turned; with none turned it is right (tests/test_checks_capstone_ring.py).
"""
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from pplab import comm
from pplab.sequence_parallel import ring_attention as library_ring_attention


def _positions(rank, p, n, layout):
    """The global positions of rank's n tokens: zigzag (chunks rank and 2p-1-rank) or contiguous."""
    c = n // 2
    if layout == "contiguous":
        return torch.arange(rank * n, (rank + 1) * n)
    if layout == "fitted on two ranks":                 # chunks rank and p + 1 - rank: 3 - rank when p = 2
        return torch.cat([torch.arange(rank * c, (rank + 1) * c), torch.arange((p + 1 - rank) * c, (p + 2 - rank) * c)])
    return torch.cat([torch.arange(rank * c, (rank + 1) * c), torch.arange((2 * p - 1 - rank) * c, (2 * p - rank) * c)])


def _finite(lse):
    return torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)


def _hop(tensors, p):
    """Post sends to the right neighbour and receives from the left: (handles, buffers)."""
    me = dist.get_rank()
    buffers = [torch.empty_like(t) for t in tensors]
    handles = [dist.isend(t.contiguous(), (me + 1) % p) for t in tensors]
    return handles + [dist.irecv(b, (me - 1) % p) for b in buffers], buffers


def _wait(handles):
    for h in handles:
        h.wait()


class _Ring(torch.autograd.Function):
    """Ring attention; opts: causal, layout, merge ("lse" or "plain"), dkv ("p-1 hops", "p hops",
    "dropped"), dq_scale_on_rank_0_only."""

    @staticmethod
    def forward(ctx, q, k, v, opts):
        p, me, n = dist.get_world_size(), dist.get_rank(), q.shape[-2]
        pos = [_positions(r, p, n, opts["layout"]) for r in range(p)]
        out, lse = torch.zeros_like(q), torch.full(q.shape[:-1], -math.inf, dtype=q.dtype)
        kv = (k.contiguous(), v.contiguous())
        for step in range(p):
            j = (me - step) % p
            if step < p - 1:
                handles, nxt = _hop(kv, p)
            s = (q @ kv[0].transpose(-1, -2)) / math.sqrt(q.shape[-1])
            if opts["causal"]:
                s = s.masked_fill(pos[j][None, :] > pos[me][:, None], -math.inf)
            lse_b = torch.logsumexp(s, -1)
            o_b = torch.exp(s - _finite(lse_b)[..., None]) @ kv[1]
            new = torch.logaddexp(lse, lse_b)
            if opts["merge"] == "plain":                    # forgot to rescale by the log-sum-exps
                out = out + o_b
            else:                                           # the weights sum to 1 (+ eps: a near miss)
                w_old, w_new = torch.exp(lse - _finite(new))[..., None], torch.exp(lse_b - _finite(new))[..., None]
                out = (w_old * out + w_new * o_b) / (w_old + w_new + opts.get("eps", 0.0))
            lse = new
            if step < p - 1:
                _wait(handles)
                kv = nxt
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.opts, ctx.pos = opts, pos
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        opts, pos = ctx.opts, ctx.pos
        p, me = dist.get_world_size(), dist.get_rank()
        scale = 1 / math.sqrt(q.shape[-1])
        delta = (dout * out).sum(-1, keepdim=True)
        dq, kv, mine, acc, acc_handles = torch.zeros_like(q), (k.contiguous(), v.contiguous()), None, None, []
        for step in range(p):
            j = (me - step) % p
            if step < p - 1:
                handles, nxt = _hop(kv, p)
            s = (q @ kv[0].transpose(-1, -2)) * scale
            if opts["causal"]:
                s = s.masked_fill(pos[j][None, :] > pos[me][:, None], -math.inf)
            prob = torch.exp(s - lse[..., None])
            ds = prob * (dout @ kv[1].transpose(-1, -2) - delta)
            dq += ds @ kv[0] * (scale if me == 0 or not opts["dq_scale_on_rank_0_only"] else 1.0)
            part = [ds.transpose(-1, -2) @ q * scale, prob.transpose(-1, -2) @ dout]
            if opts["dkv"] == "p hops":                     # the owner's part travels too: one hop more
                if step > 0:
                    _wait(acc_handles)
                    part = [a + b for a, b in zip(part, acc)]
                acc_handles, acc = _hop(part, p)
            elif step == 0:
                mine = part
            elif opts["dkv"] == "p-1 hops":
                if step >= 2:
                    _wait(acc_handles)
                    part = [a + b for a, b in zip(part, acc)]
                acc_handles, acc = _hop(part, p)
            if step < p - 1:
                _wait(handles)
                kv = nxt
        if opts["dkv"] == "p hops":
            _wait(acc_handles)
            mine = acc
        elif opts["dkv"] == "p-1 hops" and p > 1:
            _wait(acc_handles)
            mine = [a + b for a, b in zip(mine, acc)]
        return dq, mine[0], mine[1], None


def _ring(**change):
    opts = {"causal": True, "layout": "zigzag", "merge": "lse", "dkv": "p-1 hops", "dq_scale_on_rank_0_only": False}
    opts.update(change)

    def ring_attention(q, k, v, group=None):
        return _Ring.apply(q, k, v, opts)
    return ring_attention


def ring_by_positions(q, k, v, group=None):
    """Right: masks by global positions, torch.distributed's isend/irecv (another correct answer)."""
    return _ring()(q, k, v, group)


def ring_without_causal_mask(q, k, v, group=None):
    """Attends to every key, the future included."""
    return _ring(causal=False)(q, k, v, group)


def ring_masks_as_if_contiguous(q, k, v, group=None):
    """Takes rank r's tokens for positions r·2c .. (r+1)·2c-1: the contiguous layout's mask."""
    return _ring(layout="contiguous")(q, k, v, group)


def ring_adds_partial_outputs(q, k, v, group=None):
    """Merges the blocks' outputs by adding them, without rescaling by their log-sum-exps."""
    return _ring(merge="plain")(q, k, v, group)


def ring_keeps_dkv_of_visitors(q, k, v, group=None):
    """Computes dK/dV for each visiting block but never sends them back to its owner."""
    return _ring(dkv="dropped")(q, k, v, group)


def ring_sends_dkv_p_times(q, k, v, group=None):
    """The owner's own part of dK/dV goes round the ring too: p hops, one too many."""
    return _ring(dkv="p hops")(q, k, v, group)


def ring_zigzag_fitted_on_two_ranks(q, k, v, group=None):
    """The zigzag's second chunk taken as p + 1 - rank, a formula fitted on two ranks (3 - rank): right
    at p = 2; at p = 3 every rank masks with the wrong positions."""
    return _ring(layout="fitted on two ranks")(q, k, v, group)


def ring_merge_with_an_epsilon(q, k, v, group=None):
    """The merge normalised by (w_old + w_new + 1e-8), an epsilon "for safety": each step shrinks the
    output by 1e-8, ten times the tolerance, far inside 1e-7."""
    return _ring(eps=1e-8)(q, k, v, group)


def ring_dq_unscaled_off_rank_0(q, k, v, group=None):
    """dQ misses the 1/√d scale on every rank but 0 (rank 0 only right)."""
    return _ring(dq_scale_on_rank_0_only=True)(q, k, v, group)


class _GatherKV(torch.autograd.Function):
    """All-gather K/V forward (every rank holds the whole sequence's), reduce-scatter dK/dV backward."""

    @staticmethod
    def forward(ctx, x):
        p = comm.world_size()
        out = x.new_empty((p,) + x.shape)
        comm.all_gather_into_tensor(out, x.contiguous())
        return out

    @staticmethod
    def backward(ctx, grad):
        out = grad.new_empty(grad.shape[1:])
        comm.reduce_scatter_tensor(out, grad.contiguous())
        return out


def ring_that_all_gathers(q, k, v, group=None):
    """Right values, no ring: all-gathers K and V and attends locally (p blocks held on every rank)."""
    p, me, n = comm.world_size(), comm.rank(), q.shape[-2]
    pos = torch.cat([_positions(r, p, n, "zigzag") for r in range(p)])
    K, V = (torch.cat(list(_GatherKV.apply(t)), -2) for t in (k, v))
    hidden = pos[None, :] > _positions(me, p, n, "zigzag")[:, None]
    return F.scaled_dot_product_attention(q, K, V, attn_mask=~hidden)


def ring_from_library(q, k, v, group=None):
    """The library's own ring attention."""
    return library_ring_attention(q, k, v, group, causal=True, layout="zigzag")


WHERE = r"^p=2, S=\d+ tokens in 4 chunks of \d, b=\d, \d heads, d=\d, rank 0"
WRONG = {
    "ring_attention": [
        (ring_zigzag_fitted_on_two_ranks,
         [r"^p=3, S=\d+ tokens in 6 chunks of \d, .*, rank \d: the output differs from the single-process value",
          r"Parts: forward ✘"], None),
        (ring_merge_with_an_epsilon,
         [WHERE + r": the output differs from the single-process value", r"Parts: forward ✘"], None),
        (ring_without_causal_mask,
         [WHERE + r": the output differs from the single-process value", r"It is attention without the causal mask",
          r"Parts: forward ✘ · backward dQ ✘ · backward dK/dV ✘ · traffic ✔ \(1 of 4\)"], None),
        (ring_masks_as_if_contiguous,
         [WHERE + r": the output differs", r"It is what a contiguous layout would give",
          r"rank r holds chunks r and 2p-1-r: tokens 0\.\.\d and \d+\.\.\d+ here", r"traffic ✔ \(1 of 4\)"], None),
        (ring_adds_partial_outputs,
         [WHERE + r": the output differs", r"the rows that see keys of several blocks are not: the merge of partial "
                                           r"results is wrong", r"rescale both by their log-sum-exp",
          r"Parts: forward ✘"], None),
        (ring_keeps_dkv_of_visitors,
         [WHERE + r": dK \(k\.grad\) differs", r"It is the gradient from this rank's own queries only",
          r"never came back",
          r"Parts: forward ✔ · backward dQ ✔ · backward dK/dV ✘ · traffic ✘ \(2 of 4\)"], None),
        (ring_sends_dkv_p_times,
         [WHERE + r": in backward this rank sent [\d,]+ bytes, 6 blocks of [\d,]+ bytes .*; a ring sends 4",
          r"one dK/dV hop too many",
          r"Parts: forward ✔ · backward dQ ✔ · backward dK/dV ✔ · traffic ✘ \(3 of 4\)"], None),
        (ring_dq_unscaled_off_rank_0,
         [r"^p=2, .*, rank 1: dQ \(q\.grad\) differs from the single-process value",
          r"It is √d times too large",
          r"Parts: forward ✔ · backward dQ ✘ · backward dK/dV ✔ · traffic ✔ \(3 of 4\)"], None),
        (ring_that_all_gathers,
         [WHERE + r": forward made a collective call, all_gather", r"holds the whole sequence's keys and values on "
                                                                   r"every rank",
          r"Parts: forward ✔ · backward dQ ✔ · backward dK/dV ✔ · traffic ✘ \(3 of 4\)"], None),
        (ring_from_library,
         [r"^exercise 'ring_attention' asks you to work out ring attention's forward and backward yourself; you use "
          r"pplab\.sequence_parallel's own ring attention"], None),
    ],
}
