"""Plausible wrong answers to the exercises of chapter 5, each a mistake a student could make.

WRONG[exercise_id] lists (function, regular expressions the check's message must match,
timeout for the check or None for the default), as in wrong_solutions_ch00_broadcast.py.
"""
import math

import torch
import torch.distributed as dist

from pplab import comm

# ----------------------------------------------------------------------------------
# 5a: blockwise (flash) attention


def _scores(q, kb, j, causal):
    s = q @ kb.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        s = s.masked_fill(torch.arange(j, j + kb.shape[-2]) > torch.arange(q.shape[-2])[:, None], -math.inf)
    return s


def _online(q, k, v, block, causal, blocks=None, rescale=True, lse_of=None, eps=0.0, scale=1.0):
    """The right loop, with the knobs the mistakes below turn."""
    m = torch.full(q.shape[:-1], -math.inf, dtype=q.dtype)
    total = torch.zeros(q.shape[:-1], dtype=q.dtype)
    acc = torch.zeros(q.shape[:-1] + v.shape[-1:], dtype=q.dtype)
    for j in blocks if blocks is not None else range(0, k.shape[-2], block):
        s = _scores(q, k[..., j:j + block, :], j, causal)
        m_new = torch.maximum(m, s.amax(-1))
        shrink = torch.exp(m - m_new) if rescale else torch.ones_like(m)
        e = torch.exp(s - m_new[..., None])
        total, m = shrink * total + e.sum(-1), m_new
        acc = shrink[..., None] * acc + e @ v[..., j:j + block, :]
    out = acc / (total[..., None] + eps) * scale
    return out, (lse_of or (lambda m, total: m + torch.log(total)))(m, total)


def attention_all_at_once(q, k, v, block, causal=False):
    """Right values, but the whole n x S score matrix at once: no blocks at all."""
    s = _scores(q, k, 0, causal)
    return torch.softmax(s, -1) @ v, torch.logsumexp(s, -1)


def blockwise_drops_the_last_block(q, k, v, block, causal=False):
    """range(S // block) blocks: the keys of a last, shorter block are never seen."""
    return _online(q, k, v, block, causal, blocks=range(0, k.shape[-2] // block * block, block))


def blockwise_without_running_max(q, k, v, block, causal=False):
    """exp(s) summed directly: right in exact arithmetic, overflows for large scores."""
    total = torch.zeros(q.shape[:-1], dtype=q.dtype)
    acc = torch.zeros(q.shape[:-1] + v.shape[-1:], dtype=q.dtype)
    for j in range(0, k.shape[-2], block):
        e = torch.exp(_scores(q, k[..., j:j + block, :], j, causal))
        total, acc = total + e.sum(-1), acc + e @ v[..., j:j + block, :]
    return acc / total[..., None], torch.log(total)


def blockwise_softmax_per_block(q, k, v, block, causal=False):
    """Each block's softmax and lse, merged: a block entirely in a causal row's future is nan."""
    out = torch.zeros(q.shape[:-1] + v.shape[-1:], dtype=q.dtype)
    lse = torch.full(q.shape[:-1], -math.inf, dtype=q.dtype)
    for j in range(0, k.shape[-2], block):
        s = _scores(q, k[..., j:j + block, :], j, causal)
        o_b, lse_b = torch.softmax(s, -1) @ v[..., j:j + block, :], torch.logsumexp(s, -1)
        new = torch.logaddexp(lse, lse_b)
        out = torch.exp(lse - new)[..., None] * out + torch.exp(lse_b - new)[..., None] * o_b
        lse = new
    return out, lse


def blockwise_without_mask(q, k, v, block, causal=False):
    """Forgets the causal mask: every query sees every key."""
    return _online(q, k, v, block, False)


def blockwise_forgets_the_rescale(q, k, v, block, causal=False):
    """Keeps the running max, but never rescales what it accumulated when the max grows."""
    return _online(q, k, v, block, causal, rescale=False)


def blockwise_lse_is_the_max(q, k, v, block, causal=False):
    """The output is right; the log-sum-exp returned is the running max alone."""
    return _online(q, k, v, block, causal, lse_of=lambda m, total: m)


def blockwise_divides_with_an_epsilon(q, k, v, block, causal=False):
    """out = acc / (sum + 1e-7), an epsilon "against a division by zero": the sum is at least 1 (the
    running max's own exp), so out is off by up to 1e-7 relative, just outside the tolerance 1e-9 x (1 + |out|)."""
    return _online(q, k, v, block, causal, eps=1e-7)


def blockwise_within_tolerance(q, k, v, block, causal=False):
    """Right, out scaled by 1 + 1e-11: inside the tolerance, must pass (test_checks_sequence_parallel.py)."""
    return _online(q, k, v, block, causal, scale=1 + 1e-11)


def blockwise_with_torch(q, k, v, block, causal=False):
    """torch's own attention for the output."""
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return out, _online(q, k, v, block, causal)[1]


# ----------------------------------------------------------------------------------
# 5b: Ulysses' all-to-all


def _exchange_all(pieces, received, rank, p):
    handles = []
    for s in range(1, p):
        to, frm = (rank + s) % p, (rank - s) % p
        handles += [comm.isend(pieces[to], to), comm.irecv(received[frm], frm)]
    for h in handles:
        h.wait()


def a2a_xor_partners(x, scatter_dim, gather_dim):
    """Pairwise exchanges with partner rank ^ s (the hypercube's pattern), a partner >= p skipped:
    right on 2 and 4 ranks, on 3 ranks ranks 1 and 2 never meet (their pieces stay zero)."""
    rank, p = comm.rank(), comm.world_size()
    pieces = [t.contiguous() for t in x.chunk(p, dim=scatter_dim)]
    received = [pieces[rank] if i == rank else torch.zeros_like(pieces[rank]) for i in range(p)]
    handles = []
    for s in range(1, p):
        peer = rank ^ s
        if peer < p:
            handles += [comm.isend(pieces[peer], peer), comm.irecv(received[peer], peer)]
    for h in handles:
        h.wait()
    return torch.cat(received, dim=gather_dim)


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


def _merge(out, lse, s, v, eps=0.0):
    block_lse = torch.logsumexp(s, -1)
    block_out = torch.exp(s - block_lse[..., None]) @ v
    new = torch.logaddexp(lse, block_lse)
    w_old, w_new = torch.exp(lse - new)[..., None], torch.exp(block_lse - new)[..., None]
    return (w_old * out + w_new * block_out) / (w_old + w_new + eps), new


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


def _step(q, k, v, out, lse, step, src_of=lambda rank, step, p: (rank - step) % p, eps=0.0):
    """A right step (masks by global positions, skips blocks hidden entirely), with two knobs."""
    rank, p = comm.rank(), comm.world_size()
    n = q.shape[-2]
    handles, k_next, v_next = _post(k, v, step)
    src = src_of(rank, step, p)
    hidden = (rank * n + torch.arange(n))[:, None] < (src * n + torch.arange(n))[None, :]
    if not hidden.all():
        s = (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).masked_fill(hidden, -math.inf)
        out, lse = _merge(out, lse, s, v, eps)
    return _finish(handles, out, lse, k_next, v_next)


def ring_step_block_from_the_right(q, k, v, out, lse, step):
    """Takes the visiting block to be rank (rank + step) % p's, though K and V travel to the right:
    on 2 ranks the left and right neighbour are one rank, so right; from 3 ranks on, a past block is
    taken for a future one and skipped."""
    return _step(q, k, v, out, lse, step, src_of=lambda rank, step, p: (rank + step) % p)


def ring_step_merge_with_an_epsilon(q, k, v, out, lse, step):
    """Normalises the merge by (w_old + w_new + 1e-8), an epsilon "for safety": out off by 1e-8
    relative, ten times the tolerance."""
    return _step(q, k, v, out, lse, step, eps=1e-8)


def ring_step_within_tolerance(q, k, v, out, lse, step):
    """Right, with an epsilon of 1e-12 in the merge: inside the tolerance, must pass."""
    return _step(q, k, v, out, lse, step, eps=1e-12)


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
        (attention_all_at_once, [r"^trial 3 \(memory; .*\), the call held [\d,]+ bytes",
                                 r"one block of scores at a time", r"memory ✘ \(2 of 3\)"], None),
        (blockwise_drops_the_last_block, [r"^trial 0 .*\), out differs at index", r"the last, shorter block of \d keys",
                                          r"output ✘ · log-sum-exp ✘ · memory ✔ \(1 of 3\)"], None),
        (blockwise_without_running_max, [r"^trial 1 \(large scores", r"exp of scores this large overflows",
                                         r"\(1 of 3\)"], None),
        (blockwise_softmax_per_block, [r"^trial 2 \(causal", r"got nan", r"its own max is -inf"], None),
        (blockwise_without_mask, [r"^trial 2 \(causal", r"It is attention without the mask"], None),
        (blockwise_forgets_the_rescale, [r"^trial [0-3] .*out differs", r"exp\(m_old - m_new\)"], None),
        (blockwise_lse_is_the_max, [r"^trial 0 .*lse differs", r"It is the row's max score",
                                    r"output ✔ · log-sum-exp ✘ · memory ✔ \(2 of 3\)"], None),
        (blockwise_divides_with_an_epsilon, [r"^trial [0-2] .*out differs at index", r"output ✘ · log-sum-exp ✔"], None),
        (blockwise_with_torch, [r"you use torch\.nn\.functional\.scaled_dot_product_attention"], None),
    ],
    "ulysses_all_to_all": [
        (a2a_relative_places, [A2A.replace(r"rank \d's", r"rank [1-3]'s"), r"differs at index .*got head \d+, token",
                               r"goes at place i"], None),
        (a2a_xor_partners, [r"^world_size=3, x of .*: rank [12]'s result of ulysses_all_to_all\(x, 1, 2\) differs at "
                             r"index .*got head 0, token 0", r"goes at place i"], None),
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
        (ring_step_block_from_the_right, [r"^world_size=[34], .*: rank [1-3], step [1-3]: out differs",
                                          r"over the K/V blocks of ranks"], None),
        (ring_step_merge_with_an_epsilon, [STEP, r"out differs at index"], None),
        (ring_step_all_gather, [r"^exercise 'ring_attention_step' asks you to build",
                                r"torch\.distributed\.all_gather"], None),
        (ring_step_sends_left, [STEP, r"sent to rank|differs|not the block of rank"], None),
    ],
}
