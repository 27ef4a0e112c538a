"""Plausible wrong answers to the exercises of chapter 5, each a mistake a student could make.

WRONG[exercise_id] lists (function, regular expressions the check's message must match,
timeout for the check or None for the default), as in wrong_solutions.py.
"""
import math

import torch
import torch.distributed as dist

from pplab import comm

# ----------------------------------------------------------------------------------
# 5a: the online-softmax merge


def merge_average(o1, lse1, o2, lse2):
    """Averages the two outputs: right only when both parts have the same denominator."""
    return (o1 + o2) / 2, torch.logaddexp(lse1, lse2)


def merge_exp_of_lse(o1, lse1, o2, lse2):
    """Right in exact arithmetic, but exp(lse) overflows for large scores."""
    e1, e2 = torch.exp(lse1), torch.exp(lse2)
    return (e1[..., None] * o1 + e2[..., None] * o2) / (e1 + e2)[..., None], torch.log(e1 + e2)


def merge_lse_is_max(o1, lse1, o2, lse2):
    """The output is right; the merged log-sum-exp is taken as the larger of the two."""
    lse = torch.logaddexp(lse1, lse2)
    ref = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    o = torch.exp(lse1 - ref)[..., None] * o1 + torch.exp(lse2 - ref)[..., None] * o2
    return o, torch.maximum(lse1, lse2)


def merge_nan_on_empty_rows(o1, lse1, o2, lse2):
    """The textbook formula: -inf - (-inf) = nan for rows that have seen no key yet."""
    lse = torch.logaddexp(lse1, lse2)
    return torch.exp(lse1 - lse)[..., None] * o1 + torch.exp(lse2 - lse)[..., None] * o2, lse


def merge_weights_swapped(o1, lse1, o2, lse2):
    lse = torch.logaddexp(lse1, lse2)
    ref = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    return torch.exp(lse2 - ref)[..., None] * o1 + torch.exp(lse1 - ref)[..., None] * o2, lse


# ----------------------------------------------------------------------------------
# 5b: Ulysses' all-to-all


def _exchange_all(pieces, received, rank, p):
    handles = []
    for s in range(1, p):
        to, frm = (rank + s) % p, (rank - s) % p
        handles += [comm.isend(pieces[to], to), comm.irecv(received[frm], frm)]
    for h in handles:
        h.wait()


def a2a_relative_places(x, scatter_dim, gather_dim):
    """Puts the piece from rank i at place (i - rank) % p: right on rank 0 only."""
    rank, p = comm.rank(), comm.world_size()
    pieces = [t.contiguous() for t in x.chunk(p, dim=scatter_dim)]
    received = [pieces[rank] if i == rank else torch.empty_like(pieces[rank]) for i in range(p)]
    _exchange_all(pieces, received, rank, p)
    return torch.cat([received[(rank + i) % p] for i in range(p)], dim=gather_dim)


def a2a_sends_everything(x, scatter_dim, gather_dim):
    """Sends the whole tensor to every rank, which cuts out its piece: right values, p times the bytes."""
    rank, p = comm.rank(), comm.world_size()
    x = x.contiguous()
    everyone = [x if i == rank else torch.empty_like(x) for i in range(p)]
    _exchange_all([x] * p, everyone, rank, p)
    return torch.cat([t.chunk(p, dim=scatter_dim)[rank] for t in everyone], dim=gather_dim)


def a2a_joins_along_scatter_dim(x, scatter_dim, gather_dim):
    """Cuts along scatter_dim and joins the pieces back along it too: the tensor keeps its shape."""
    rank, p = comm.rank(), comm.world_size()
    pieces = [t.contiguous() for t in x.chunk(p, dim=scatter_dim)]
    received = [pieces[rank] if i == rank else torch.empty_like(pieces[rank]) for i in range(p)]
    _exchange_all(pieces, received, rank, p)
    return torch.cat(received, dim=scatter_dim)


def a2a_library(x, scatter_dim, gather_dim):
    """torch's own all-to-all on the pieces laid out along dim 0."""
    p = comm.world_size()
    inp = torch.stack(x.chunk(p, dim=scatter_dim)).contiguous()
    out = torch.empty_like(inp)
    dist.all_to_all_single(out, inp)
    return torch.cat(list(out), dim=gather_dim)


# ----------------------------------------------------------------------------------
# 5c: one step of causal ring attention


def _post(k, v, step):
    rank, p = comm.rank(), comm.world_size()
    if step == p - 1:
        return [], None, None
    k_next, v_next = torch.empty_like(k), torch.empty_like(v)
    right, left = (rank + 1) % p, (rank - 1) % p
    return ([comm.isend(k, right), comm.isend(v, right), comm.irecv(k_next, left), comm.irecv(v_next, left)],
            k_next, v_next)


def _merge(out, lse, s, v):
    block_lse = torch.logsumexp(s, -1)
    block_out = torch.exp(s - block_lse[..., None]) @ v
    new = torch.logaddexp(lse, block_lse)
    return torch.exp(lse - new)[..., None] * out + torch.exp(block_lse - new)[..., None] * block_out, new


def _finish(handles, out, lse, k_next, v_next):
    for h in handles:
        h.wait()
    return out, lse, k_next, v_next


def ring_step_queries_from_zero(q, k, v, out, lse, step):
    """Masks by global positions, but takes its own queries to start at position 0: right on rank 0 only."""
    rank, p = comm.rank(), comm.world_size()
    n = q.shape[-2]
    handles, k_next, v_next = _post(k, v, step)
    src = (rank - step) % p
    q_pos, k_pos = torch.arange(n), src * n + torch.arange(n)
    hidden = q_pos[:, None] < k_pos[None, :]
    if not hidden.all():
        s = (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).masked_fill(hidden, -math.inf)
        out, lse = _merge(out, lse, s, v)
    return _finish(handles, out, lse, k_next, v_next)


def ring_step_no_mask(q, k, v, out, lse, step):
    """Forgets the causal mask: every query sees every key."""
    handles, k_next, v_next = _post(k, v, step)
    out, lse = _merge(out, lse, q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]), v)
    return _finish(handles, out, lse, k_next, v_next)


def ring_step_local_triangle(q, k, v, out, lse, step):
    """Masks the upper triangle of every block, as if each block were the rank's own."""
    n = q.shape[-2]
    handles, k_next, v_next = _post(k, v, step)
    s = (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).masked_fill(
        torch.ones(n, n, dtype=torch.bool).triu(1), -math.inf)
    out, lse = _merge(out, lse, s, v)
    return _finish(handles, out, lse, k_next, v_next)


def ring_step_nan_on_hidden_blocks(q, k, v, out, lse, step):
    """Masks correctly but merges blocks that are hidden entirely: -inf - (-inf) = nan."""
    rank, p = comm.rank(), comm.world_size()
    n = q.shape[-2]
    handles, k_next, v_next = _post(k, v, step)
    src = (rank - step) % p
    hidden = (rank * n + torch.arange(n))[:, None] < (src * n + torch.arange(n))[None, :]
    s = (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).masked_fill(hidden, -math.inf)
    out, lse = _merge(out, lse, s, v)
    return _finish(handles, out, lse, k_next, v_next)


def ring_step_gathers_everything(q, k, v, out, lse, step):
    """At step 0 sends its block to every rank and computes everything at once: no ring."""
    rank, p = comm.rank(), comm.world_size()
    n = q.shape[-2]
    if step > 0:
        return out, lse, None if step == p - 1 else k, None if step == p - 1 else v
    ks = [k if i == rank else torch.empty_like(k) for i in range(p)]
    vs = [v if i == rank else torch.empty_like(v) for i in range(p)]
    handles = []
    for s in range(1, p):
        to, frm = (rank + s) % p, (rank - s) % p
        handles += [comm.isend(k, to), comm.isend(v, to), comm.irecv(ks[frm], frm), comm.irecv(vs[frm], frm)]
    for h in handles:
        h.wait()
    K, V = torch.cat(ks, -2), torch.cat(vs, -2)
    hidden = (rank * n + torch.arange(n))[:, None] < torch.arange(p * n)[None, :]
    s = (q @ K.transpose(-1, -2) / math.sqrt(q.shape[-1])).masked_fill(hidden, -math.inf)
    return torch.softmax(s, -1) @ V, torch.logsumexp(s, -1), k, v


def ring_step_all_gather(q, k, v, out, lse, step):
    p = comm.world_size()
    ks = [torch.empty_like(k) for _ in range(p)]
    dist.all_gather(ks, k)
    return out, lse, k, v


def ring_step_sends_left(q, k, v, out, lse, step):
    """Passes the blocks the other way round: every block is still seen, but the ring runs backwards."""
    rank, p = comm.rank(), comm.world_size()
    n = q.shape[-2]
    handles, k_next, v_next = [], None, None
    if step < p - 1:
        k_next, v_next = torch.empty_like(k), torch.empty_like(v)
        right, left = (rank + 1) % p, (rank - 1) % p
        handles = [comm.isend(k, left), comm.isend(v, left), comm.irecv(k_next, right), comm.irecv(v_next, right)]
    src = (rank + step) % p
    if src <= rank:
        s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        if src == rank:
            s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), -math.inf)
        out, lse = _merge(out, lse, s, v)
    return _finish(handles, out, lse, k_next, v_next)


STEP = r"^world_size=\d, \d tokens per rank, q/k/v of .*: rank \d, step \d: "
A2A = r"^world_size=\d, x of \d x \d+ heads x \d tokens per rank x \d: rank \d's "
WRONG = {
    "online_softmax_merge": [
        (merge_average, [r"^trial 0 \(random scores", r"o differs at index", r"plain average of o1 and o2"], None),
        (merge_exp_of_lse, [r"^trial 1 \(large scores", r"contains nan|differs", r"exp\(lse\) overflows"], None),
        (merge_lse_is_max, [r"lse differs at index", r"It is max\(lse1, lse2\)", r"torch\.logaddexp"], None),
        (merge_nan_on_empty_rows, [r"^trial 3 \(rows that saw no key in either part", r"contains nan",
                                   r"-inf - \(-inf\) = nan"], None),
        (merge_weights_swapped, [r"^trial 0 .*o differs at index"], None),
    ],
    "ulysses_all_to_all": [
        (a2a_relative_places, [A2A.replace(r"rank \d's", r"rank [1-3]'s"), r"differs at index .*got head \d+, token",
                               r"goes at place i"], None),
        (a2a_sends_everything, [A2A, r"sent \{.*\} \(bytes per destination rank\)", r"never the whole tensor"],
         None),
        (a2a_joins_along_scatter_dim, [A2A, r"result of ulysses_all_to_all\(x, 1, 2\) is \(.*\), expected shape",
                                       r"for all \d+ tokens"], None),
        (a2a_library, [r"^exercise 'ulysses_all_to_all' asks you to build all_to_all from point-to-point",
                       r"torch\.distributed\.all_to_all_single"], None),
    ],
    "ring_attention_step": [
        (ring_step_queries_from_zero, [STEP.replace(r"rank \d", r"rank [1-3]"), r"(out|lse) (differs|contains nan)",
                                       r"this rank's queries \(tokens \d+\.\.\d+\)"], None),
        (ring_step_no_mask, [STEP, r"out differs", r"a query at position i sees keys at positions <= i"], None),
        (ring_step_local_triangle, [STEP.replace(r"step \d", r"step [1-3]"), r"out differs"], None),
        (ring_step_nan_on_hidden_blocks, [STEP, r"contains nan", r"entirely in this rank's future"], None),
        (ring_step_gathers_everything, [STEP, r"sent to ranks? [\d, ]+: in a ring each rank passes K and V only "
                                              r"to its right neighbour|out differs|k_next is not the block"], None),
        (ring_step_all_gather, [r"^exercise 'ring_attention_step' asks you to build",
                                r"torch\.distributed\.all_gather"], None),
        (ring_step_sends_left, [STEP, r"sent to rank|differs|not the block of rank"], None),
    ],
}
