"""The exercises of chapter 5: registered, each solution notebook checks its own exercise, and
other correct answers pass too (the checks ask for a result, not one way to write it).
Every solution passing, every stub failing and every wrong answer of
wrong_solutions_ch05_sequence_parallel.py failing with its message: tests/test_checks.py runs those."""
import math

import pytest
import torch
import torch.distributed as dist

from pplab import checks, comm
from pplab.sequence_parallel.ring_attention import merge
from wrong_solutions_ch05_sequence_parallel import WRONG, blockwise_within_tolerance, ring_step_within_tolerance

pytestmark = pytest.mark.usefixtures("no_leftover_processes")

IDS = ["online_softmax_merge", "ring_attention_step", "ulysses_all_to_all"]


def test_the_chapter_registers_its_exercises():
    assert IDS == ["online_softmax_merge", "ring_attention_step", "ulysses_all_to_all"]
    assert set(WRONG) == set(IDS)
    # one wrong answer per rank exercise is right on rank 0 and wrong on another rank only
    assert any("rank 0 only" in fn.__doc__ for fn, _, _ in WRONG["ulysses_all_to_all"])
    assert any("rank 0 only" in fn.__doc__ for fn, _, _ in WRONG["ring_attention_step"])



# -- other correct answers pass -------------------------------------------------------

def blockwise_merging_partials_backwards(q, k, v, block, causal=False):
    """Each block's (o, lse) merged into the running result with the library's merge, the blocks
    visited last to first: a row with no visible key in a block gives o = 0, lse = -inf."""
    n, S = q.shape[-2], k.shape[-2]
    out = torch.zeros(q.shape[:-1] + v.shape[-1:], dtype=q.dtype)
    lse = torch.full(q.shape[:-1], -math.inf, dtype=q.dtype)
    for j in reversed(range(0, S, block)):
        s = q @ k[..., j:j + block, :].transpose(-1, -2) * q.shape[-1] ** -0.5
        if causal:
            s = s.masked_fill((j + torch.arange(s.shape[-1]))[None, :] > torch.arange(n)[:, None], -math.inf)
        lse_b = torch.logsumexp(s, -1)
        o_b = torch.exp(s - torch.where(torch.isinf(lse_b), 0.0, lse_b)[..., None]) @ v[..., j:j + block, :]
        out, lse = merge(out, lse, o_b, lse_b)
    return out, lse


def a2a_one_peer_at_a_time(x, scatter_dim, gather_dim):
    """torch.distributed's blocking send/recv, lower rank sends first, pieces via torch.split."""
    rank, p = dist.get_rank(), dist.get_world_size()
    size = x.shape[scatter_dim] // p
    pieces = [t.contiguous() for t in torch.split(x, size, dim=scatter_dim)]
    got = []
    for i in range(p):
        if i == rank:
            got.append(pieces[i])
            continue
        buf = torch.empty_like(pieces[i])
        if rank < i:
            dist.send(pieces[i], i)
            dist.recv(buf, i)
        else:
            dist.recv(buf, i)
            dist.send(pieces[i], i)
        got.append(buf)
    return torch.cat(got, dim=gather_dim)


def ring_step_with_library_merge(q, k, v, out, lse, step):
    """Global positions for the mask, the library's merge, comm.exchange after the compute."""
    rank, p = comm.rank(), comm.world_size()
    n = q.shape[-2]
    src = (rank - step) % p
    hidden = (rank * n + torch.arange(n))[:, None] < (src * n + torch.arange(n))[None, :]
    if not hidden.all():
        s = (q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5).masked_fill(hidden, -math.inf)
        out, lse = merge(out, lse, torch.softmax(s, -1) @ v, torch.logsumexp(s, -1))
    if step == p - 1:
        return out, lse, None, None
    kv, nxt = torch.cat([k, v], -1), torch.empty(k.shape[:-1] + (k.shape[-1] + v.shape[-1],), dtype=k.dtype)
    comm.exchange(kv, (rank + 1) % p, nxt, (rank - 1) % p)
    return out, lse, nxt[..., :k.shape[-1]], nxt[..., k.shape[-1]:]


@pytest.mark.parametrize("exercise_id, fn", [("online_softmax_merge", blockwise_merging_partials_backwards),
                                             ("ulysses_all_to_all", a2a_one_peer_at_a_time),
                                             ("ring_attention_step", ring_step_with_library_merge),
                                             # near misses inside the tolerance (1e-11, 1e-12) must pass
                                             ("online_softmax_merge", blockwise_within_tolerance),
                                             ("ring_attention_step", ring_step_within_tolerance)])
def test_other_correct_answers_pass(exercise_id, fn):
    result = checks.run_check(exercise_id, fn)
    assert result, result.message
