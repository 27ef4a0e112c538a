"""pplab.overlap (chapter 11a): the hidden fraction on timelines made by hand; the collective matmul,
DualPipe's pair and the dispatch under the shared expert on real ranks, each against torch on one
process (tolerance 1e-5 relative: the same float32 products, summed in another order).

Launches are shared: one per world size runs every function of that size. The stand-in sleeps; only
what it cannot break is asserted (a sleep is never shorter than asked; a send waited for before any
compute has nothing under it), never how long a run took.
"""
import pytest
import torch
from torch import nn

import pplab
from pplab import comm, trace
from pplab.overlap import (Chunk, collective_matmul, dualpipe_step, gather_then_matmul, hidden_fraction, hidden_time,
                           moe_with_shared_expert, pair_hidden_fraction, stand_in_span)
from pplab.trace import Event, Timeline

pytestmark = pytest.mark.usefixtures("no_leftover_processes")


# ----------------------------------------------------------------------------------
# hidden_time / hidden_fraction: pure functions of a timeline, checked on events made by hand


def _timeline(events, world_size=2):
    return Timeline(events, world_size=world_size, t0=0.0)


def test_hidden_counts_comm_under_the_same_ranks_compute_once():
    events = [Event(0, "F", "compute", 1.0, 3.0), Event(0, "B", "compute", 4.0, 5.0),
              Event(0, "send", "comm", 0.0, 2.0, bytes_sent=8), Event(0, "recv", "comm", 1.5, 4.5, bytes_recv=8),
              Event(1, "F", "compute", 0.0, 10.0),                  # rank 1's compute hides nothing of rank 0's
              Event(0, "barrier", "comm", 6.0, 9.0)]                # barriers are not communication of data
    t = _timeline(events)
    # in flight 0-4.5 (two messages, overlapping, counted once); under compute 1-3 and 4-4.5
    assert hidden_time(t, 0) == pytest.approx((4.5, 2.5))
    assert hidden_fraction(t, 0) == pytest.approx(2.5 / 4.5)
    assert hidden_time(t, 0, kinds=("send",)) == pytest.approx((2.0, 1.0))
    assert hidden_time(t, 0, start=1.0) == pytest.approx((3.0, 2.0))    # only the recv started in [1, inf)
    assert hidden_time(t, 0, end=1.0) == pytest.approx((2.0, 1.0))      # only the send started before 1
    with pytest.raises(ValueError, match="rank 1 recorded no communication"):
        hidden_fraction(t, 1)


def test_hidden_fraction_all_or_nothing_and_bad_input():
    inside = _timeline([Event(0, "F", "compute", 0.0, 10.0), Event(0, "send", "comm", 2.0, 3.0),
                        Event(0, "send", "comm", 2.5, 7.0)], world_size=1)
    assert hidden_fraction(inside, 0) == 1.0
    after = _timeline([Event(0, "F", "compute", 0.0, 1.0), Event(0, "all_gather", "comm", 1.0, 3.0)], world_size=1)
    assert hidden_fraction(after, 0) == 0.0                 # touching at one instant hides nothing
    with pytest.raises(ValueError, match=r"rank=2 is not a rank of this timeline: use 0\.\.0"):
        hidden_fraction(after, 2)
    with pytest.raises(TypeError, match="takes a pplab.trace.Timeline"):
        hidden_fraction([Event(0, "F", "compute", 0.0, 1.0)], 0)


def test_stand_in_span_lasts_at_least_its_seconds_and_refuses_bad_times():
    trace.reset(0)
    with stand_in_span("F", 0.02, microbatch=1) as event:
        pass
    assert event.label == "F1" and event.end - event.start >= 0.02    # a floor: sleep is never shorter
    for bad in (-1, "0.1", True):
        with pytest.raises(ValueError, match="seconds must be a number >= 0"):
            with stand_in_span("F", bad):
                pass


def test_chunk_refuses_misuse():
    with pytest.raises(ValueError, match="role must be 'first' or 'last'"):
        Chunk(nn.Linear(2, 2), "middle")
    with pytest.raises(ValueError, match="give it targets"):
        Chunk(nn.Linear(2, 2), "last")
    first = Chunk(nn.Linear(2, 2), "first")
    with pytest.raises(ValueError, match="micro-batch 0 has not run forward"):
        first.backward(0, torch.ones(1, 2))
    first.forward(0, torch.ones(1, 2))
    with pytest.raises(ValueError, match="needs the gradient its output got"):
        first.backward(0)
    with pytest.raises(ValueError, match=r"gradient for micro-batch 0 is \[3\], its output \[1, 2\]"):
        first.backward(0, torch.ones(3))


# ----------------------------------------------------------------------------------
# On real ranks: one launch per world size runs the collective matmul and the MoE layer


ROWS = {2: [3, 5], 3: [2, 0, 5], 4: [3, 3, 3, 2]}      # uneven, and at p = 3 a rank with no rows


def _at_p(rows):
    p, me = comm.world_size(), comm.rank()
    torch.manual_seed(0)
    x, w = torch.randn(sum(rows), 6), torch.randn(3 * p, 6)
    start = sum(rows[:me])
    mine, w_mine = x[start:start + rows[me]], w[3 * me:3 * me + 3]
    out = {"ring": collective_matmul(mine, w_mine, rows, row_time=0.001), "plain": gather_then_matmul(mine, w_mine, rows)}
    gate, shared, experts = nn.Linear(6, p), nn.Linear(6, 6), [nn.Linear(6, 6) for _ in range(p)]
    tokens = torch.randn(p, 7, 6)
    with torch.no_grad():
        out["moe"] = moe_with_shared_expert(tokens[me], gate, experts[me], shared, shared_time=0.001)
        out["moe_plain"] = moe_with_shared_expert(tokens[me], gate, experts[me], shared, overlap=False)
    errors = []
    for call in (lambda: collective_matmul(mine, w_mine, rows[:-1]), lambda: collective_matmul(mine.T, w_mine, rows),
                 lambda: moe_with_shared_expert(tokens[me], nn.Linear(6, p + 1), experts[me], shared),
                 lambda: dualpipe_step(Chunk(nn.Linear(2, 2), "last", targets=[]), Chunk(nn.Linear(2, 2), "first"),
                                       [mine, mine])):
        try:
            call()
        except ValueError as e:
            errors.append(str(e))
    return out, errors


@pytest.fixture(scope="module")
def runs():
    return {p: pplab.launch(_at_p, ROWS[p], world_size=p) for p in (2, 3, 4)}


@pytest.mark.parametrize("p", [2, 3, 4])
def test_collective_matmul_equals_torch_and_sends_every_chunk_but_one(runs, p):
    rows, r = ROWS[p], runs[p]
    torch.manual_seed(0)
    x, w = torch.randn(sum(rows), 6), torch.randn(3 * p, 6)
    for me, (out, _) in enumerate(r):
        want = x @ w[3 * me:3 * me + 3].T                       # torch, on one process
        torch.testing.assert_close(out["ring"], want, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(out["plain"], want, rtol=1e-5, atol=1e-6)
        # the ring hands on every chunk but the one of rank me + 1 (which holds it already)
        gathered = r.timeline.select(me, "comm", "all_gather")[0].start      # gather_then_matmul ran after the ring
        ring = sum(e.bytes_sent for e in r.timeline.select(me, "comm", "send") if e.start < gathered)
        assert ring == (sum(rows) - rows[(me + 1) % p]) * 6 * 4


@pytest.mark.parametrize("p", [2, 3, 4])
def test_moe_with_shared_expert_equals_one_process_with_and_without_overlap(runs, p):
    torch.manual_seed(0)
    torch.randn(sum(ROWS[p]), 6), torch.randn(3 * p, 6)             # the same draws as the ranks made
    gate, shared, experts = nn.Linear(6, p), nn.Linear(6, 6), [nn.Linear(6, 6) for _ in range(p)]
    tokens = torch.randn(p, 7, 6)
    with torch.no_grad():
        for me, (out, _) in enumerate(runs[p]):
            probs = torch.softmax(gate(tokens[me]), dim=-1)
            want = torch.stack([shared(t) + probs[i].max() * experts[int(probs[i].argmax())](t)
                                for i, t in enumerate(tokens[me])])
            torch.testing.assert_close(out["moe"], want, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(out["moe_plain"], want, rtol=1e-5, atol=1e-6)


def test_bad_input_says_what_to_change(runs):
    for p in (2, 3):
        for _, errors in runs[p]:
            assert f"rows must list how many sequence rows each of the {p} ranks holds" in errors[0]
            assert "x_shard is [6, " in errors[1] and "must be [rows[" in errors[1]
            assert f"of the {p} experts (one per rank), [7, {p}]" in errors[2]
            assert ("dualpipe_step runs on 2 ranks" if p == 3 else "pass the first-stage chunk, then the last") in errors[3]


# ----------------------------------------------------------------------------------
# DualPipe's pair on two ranks: gradients against torch on one process, and the pair's hidden fraction


def _pair(overlap):
    torch.manual_seed(1)
    s0, s1 = nn.Sequential(nn.Linear(4, 4), nn.Tanh()), nn.Linear(4, 4)
    x, y = torch.randn(2, 2, 3, 4), torch.randn(2, 2, 3, 4)
    me = comm.rank()
    dualpipe_step(Chunk(s0, "first", t_f=0.02), Chunk(s1, "last", t_f=0.02, targets=list(y[1 - me]), scale=12.0),
                  list(x[me]), overlap=overlap)
    return [p.grad for p in s0.parameters()], [p.grad for p in s1.parameters()], trace.events()


def test_dualpipe_pair_gradients_equal_one_process_and_the_pair_hides_the_gradient():
    torch.manual_seed(1)
    s0, s1 = nn.Sequential(nn.Linear(4, 4), nn.Tanh()), nn.Linear(4, 4)
    x, y = torch.randn(2, 2, 3, 4), torch.randn(2, 2, 3, 4)
    want = {}
    for start in (0, 1):                       # the two micro-batches that start on rank `start`
        s0.zero_grad(), s1.zero_grad()
        (sum(((s1(s0(x[start, m])) - y[start, m]) ** 2).sum() for m in range(2)) / 12).backward()
        want[start] = ([p.grad.clone() for p in s0.parameters()], [p.grad.clone() for p in s1.parameters()])
    fractions = {}
    for overlap in (True, False):
        r = pplab.launch(_pair, overlap, world_size=2)
        for me in (0, 1):
            for got, ref in zip(r[me][0], want[me][0]):           # first chunk: this rank's micro-batches
                torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
            for got, ref in zip(r[me][1], want[1 - me][1]):       # last chunk: the other rank's
                torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
        merged = [pair_hidden_fraction(r.timeline, k) for k in (0, 1)]               # ends when received
        fractions[overlap] = [pair_hidden_fraction(Timeline(r[k][2]), k) for k in (0, 1)]   # ends at the wait
        if not overlap:
            assert merged == [0.0, 0.0]            # ended before F1 began, whichever end is read
    assert fractions[False] == [0.0, 0.0]          # waited for before F1: nothing under it, whatever the load
    assert all(f > 0 for f in fractions[True])     # posted before F1 and waited after: F1 lies under it
