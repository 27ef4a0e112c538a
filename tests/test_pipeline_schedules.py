"""Pipeline schedules: generators, validation, and the simulator's figures.

Durations are in units of t_f. Unless a test says otherwise t_f = 1, t_b = 2 (the
backward costs twice the forward, as the course's figures assume). A scalar duration
is one rank's whole share of the model, so with v chunks each chunk takes t/v.
Times are sums of small multiples of 1/2, exact in floating point, except where a
tolerance (1e-9) is given.
"""
import pytest

from pplab.pipeline import (Action, Schedule, ScheduleError, SimResult, bubble_fraction,
                            make_schedule, simulate, validate)
from pplab.trace import Timeline

A = Action
SINGLE = ["naive", "gpipe", "1f1b", "zb-h1"]          # one stage per rank, any m
PM = [(1, 1), (2, 1), (2, 3), (3, 2), (3, 7), (4, 4), (4, 6), (4, 9), (5, 8), (8, 3)]


def _inputs_end(sched, result, a, latency):
    """Latest time the inputs of `a` are available on its rank (independent re-derivation)."""
    where = {}
    for r, acts in enumerate(sched.actions):
        for k, b in enumerate(acts):
            where[(b.kind, b.stage, b.microbatch)] = (r, result.end[r][k])
    r_a = sched.stage_to_rank[a.stage]
    needs = []
    if a.kind == "F" and a.stage > 0:
        needs = [("F", a.stage - 1)]
    elif a.kind in "BI":
        needs = [("F", a.stage)] + ([("B", a.stage + 1), ("I", a.stage + 1)] if a.stage + 1 < sched.num_stages else [])
    elif a.kind == "W":
        needs = [("I", a.stage)]
    t = 0.0
    for kind, s in needs:
        if (kind, s, a.microbatch) in where:
            r, e = where[(kind, s, a.microbatch)]
            t = max(t, e + (latency if r != r_a else 0.0))
    return t


# ----------------------------------------------------------------------------------
# generators

@pytest.mark.parametrize("name", SINGLE + ["zb-v"])
@pytest.mark.parametrize("p,m", PM)
def test_generators_give_complete_valid_schedules(name, p, m):
    s = make_schedule(name, p, m)
    assert validate(s) is s
    split = name.startswith("zb")
    assert s.num_ranks == p and s.num_microbatches == m and s.num_stages == p * s.chunks
    for r, acts in enumerate(s.actions):
        assert len(acts) == (3 if split else 2) * m * s.chunks
        assert all(s.stage_to_rank[a.stage] == r for a in acts)
    assert s.split_backward == split


@pytest.mark.parametrize("p,m,v", [(1, 3, 2), (2, 2, 2), (2, 6, 3), (3, 3, 2), (4, 8, 2), (4, 12, 3), (4, 4, 4)])
def test_interleaved_validates_and_places_stage_chunk_times_p_plus_rank(p, m, v):
    s = make_schedule("interleaved-1f1b", p, m, chunks=v)
    validate(s)
    assert s.stage_to_rank == [stage % p for stage in range(p * v)]
    for r in range(p):
        assert s.stages_of(r) == [c * p + r for c in range(v)]
        assert all(a.stage == a.chunk * p + r for a in s.actions[r])


def test_v_shape_placement_and_neighbours():
    s = make_schedule("zb-v", 4, 8)
    assert s.stage_to_rank == [0, 1, 2, 3, 3, 2, 1, 0]
    for r in range(4):
        assert s.stages_of(r) == [r, 7 - r]
        assert all(a.stage == (r, 7 - r)[a.chunk] for a in s.actions[r])
    assert s.neighbour_ranks(0) == (None, 1)
    assert s.neighbour_ranks(3) == (2, 3)        # the turn of the V stays on rank 3
    assert s.neighbour_ranks(4) == (3, 2)
    assert s.neighbour_ranks(7) == (1, None)     # the loss stage is on rank 0 again
    with pytest.raises(ScheduleError, match="stage 8 does not exist"):
        s.neighbour_ranks(8)


def test_neighbour_ranks_interleaved():
    s = make_schedule("interleaved-1f1b", 3, 6, chunks=2)
    assert [s.neighbour_ranks(st) for st in range(6)] == \
        [(None, 1), (0, 2), (1, 0), (2, 1), (0, 2), (1, None)]


# ----------------------------------------------------------------------------------
# the course's figures

def test_naive_model_parallelism_uses_a_quarter_of_four_workers():
    r = simulate(make_schedule("naive", 4, 1), t_f=1, t_b=2)
    assert r.makespan == 12 and r.utilization == 0.25
    r = simulate(make_schedule("naive", 4, 3), t_f=1, t_b=2)     # m runs one after another
    assert r.makespan == 3 * 12 and r.utilization == 0.25
    assert r.peak_activations == [1, 1, 1, 1]


@pytest.mark.parametrize("m,busy,cells", [(4, 48, 84), (8, 96, 132)])
def test_gpipe_busy_cells(m, busy, cells):
    r = simulate(make_schedule("gpipe", 4, m), t_f=1, t_b=2)
    assert 4 * r.makespan == cells
    assert sum(r.makespan - b for b in r.bubble) == busy
    assert r.utilization == pytest.approx(busy / cells, abs=1e-12)


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p,m", PM)
@pytest.mark.parametrize("t_f,t_b", [(1, 2), (1.5, 2.5)])
def test_gpipe_and_1f1b_makespan(name, p, m, t_f, t_b):
    r = simulate(make_schedule(name, p, m), t_f=t_f, t_b=t_b)
    assert r.makespan == pytest.approx((m + p - 1) * (t_f + t_b), abs=1e-9)


@pytest.mark.parametrize("p,m", PM)
def test_peak_activations_gpipe_m_and_1f1b_p_minus_r(p, m):
    assert simulate(make_schedule("gpipe", p, m)).peak_activations == [m] * p
    assert simulate(make_schedule("1f1b", p, m)).peak_activations == [min(p - r, m) for r in range(p)]


@pytest.mark.parametrize("p,m,v", [(2, 2, 2), (4, 4, 2), (4, 8, 2), (4, 8, 4), (3, 9, 3), (8, 16, 2)])
def test_interleaving_divides_the_bubble_by_v(p, m, v):
    # bubble fraction = (makespan - m(t_f+t_b)) / (m(t_f+t_b)): idle time over the ideal
    # compute time of one rank, with t_f, t_b per rank (a chunk takes t_f/v, t_b/v).
    ideal = m * 3.0
    inter = simulate(make_schedule("interleaved-1f1b", p, m, chunks=v), t_f=1, t_b=2)
    plain = simulate(make_schedule("1f1b", p, m), t_f=1, t_b=2)
    assert (inter.makespan - ideal) / ideal == pytest.approx((p - 1) / (v * m), abs=1e-9)
    assert (plain.makespan - ideal) / ideal == pytest.approx((p - 1) / m, abs=1e-9)
    assert all(b == pytest.approx((p - 1) * 3.0 / v) for b in inter.bubble)


@pytest.mark.parametrize("p,m,v", [(2, 2, 2), (4, 4, 2), (4, 8, 2), (4, 8, 4), (3, 9, 3), (8, 16, 2)])
def test_interleaving_pays_with_memory(p, m, v):
    # Megatron's warm-up: rank r runs (v-1)p + 2(p-1-r) chunk-forwards before its first
    # backward, so it holds one more than that, each chunk 1/v of a micro-batch:
    # rank 0 of p=4, m=8, v=2 holds 5.5 micro-batches where 1F1B holds 4.
    r = simulate(make_schedule("interleaved-1f1b", p, m, chunks=v))
    expected = [min((v - 1) * p + 2 * (p - 1 - k) + 1, m * v) / v for k in range(p)]
    assert r.peak_activations == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize("p,m", [(2, 2), (3, 5), (4, 4), (4, 8), (5, 12)])
@pytest.mark.parametrize("F,B,W", [(1, 1, 1), (1, 1.5, 0.5), (2, 1, 1), (1, 2, 1), (1.5, 1, 0.5)])
def test_zb_h1_makespan_from_the_zero_bubble_paper(p, m, F, B, W):
    # The paper's B is the input-gradient pass, our I: so t_b = B + W and t_w = W.
    # ZB-H1 takes m(F+B+W) + (p-1)(F+B-W) where 1F1B takes (m+p-1)(F+B+W). Exact for
    # m >= p and W <= min(F, B) (the paper's figures have F = B = W); a longer W no
    # longer fits the gaps it is deferred into.
    zb = simulate(make_schedule("zb-h1", p, m), t_f=F, t_b=B + W, t_w=W)
    plain = simulate(make_schedule("1f1b", p, m), t_f=F, t_b=B + W)
    assert zb.makespan == pytest.approx(m * (F + B + W) + (p - 1) * (F + B - W), abs=1e-9)
    assert plain.makespan == pytest.approx((m + p - 1) * (F + B + W), abs=1e-9)
    # same peak memory as 1F1B: no rank holds more micro-batches than 1F1B's rank 0 (p)
    assert zb.peak_activations == [p] * p
    assert max(zb.peak_activations) == max(plain.peak_activations)


@pytest.mark.parametrize("p,m", [(2, 3), (3, 5), (4, 7), (4, 12), (5, 10)])
def test_zb_v_has_no_gap_inside_any_rank(p, m):
    # F = I = W per chunk (t_f=1, t_b=2, t_w=1 per rank; each chunk takes half) and
    # m >= 2p-1: every rank computes without a pause from its first action to its last;
    # only the staggered start, (p-1) chunk forwards, remains. Peak: p micro-batches.
    r = simulate(make_schedule("zb-v", p, m), t_f=1, t_b=2, t_w=1)
    for rank in range(p):
        assert all(s == e for s, e in zip(r.start[rank][1:], r.end[rank][:-1]))
    assert r.makespan == pytest.approx(m * 3 + (p - 1) * 0.5)
    assert r.peak_activations == [p] * p


# ----------------------------------------------------------------------------------
# durations per stage, latency, and the simulator's own consistency

def test_a_slow_stage_stretches_gpipe_like_a_flow_shop():
    # Identical micro-batches through stages in series: the last one leaves after
    # sum(stage times) + (m-1) * slowest stage, once for the forwards, once for backwards.
    t_f, t_b, m = [1, 1, 2, 1], [2, 2, 4, 2], 4
    r = simulate(make_schedule("gpipe", 4, m), t_f=t_f, t_b=t_b)
    assert r.makespan == (sum(t_f) + (m - 1) * 2) + (sum(t_b) + (m - 1) * 4) == 33
    assert min(r.bubble) == r.bubble[2]                     # the slow rank idles least
    naive = simulate(make_schedule("naive", 4, 2), t_f=t_f, t_b=t_b)
    assert naive.makespan == 2 * (sum(t_f) + sum(t_b))


def test_p2p_latency_adds_two_trips_through_the_pipeline():
    p, m, L = 4, 5, 0.25
    for name, base in [("gpipe", (m + p - 1) * 3), ("naive", m * p * 3)]:
        hops = 2 * (p - 1) * (m if name == "naive" else 1)
        assert simulate(make_schedule(name, p, m), p2p_latency=L).makespan == base + hops * L
    # the turn of the V (stage p-1 to p, both on rank p-1) costs no latency
    s = make_schedule("zb-v", p, 8)
    r = simulate(s, p2p_latency=L)
    k_in, k_out = (s.actions[p - 1].index(A("F", 0, st, c)) for st, c in [(p - 1, 0), (p, 1)])
    k_prev = s.actions[p - 2].index(A("F", 0, p - 2, 0))
    assert r.start[p - 1][k_in] == r.end[p - 2][k_prev] + L
    assert r.start[p - 1][k_out] == r.end[p - 1][k_in]


@pytest.mark.parametrize("name,chunks", [(n, None) for n in SINGLE + ["zb-v"]] + [("interleaved-1f1b", 3)])
def test_simulated_times_respect_every_dependency(name, chunks):
    s = make_schedule(name, 4, 8, chunks=chunks)
    t_f = [1 + 0.5 * (st % 3) for st in range(s.num_stages)]          # imbalanced stages
    r = simulate(s, t_f=t_f, t_b=[2 * x for x in t_f], p2p_latency=0.3)
    for rank, acts in enumerate(s.actions):
        for k, a in enumerate(acts):
            earliest = max(_inputs_end(s, r, a, 0.3), r.end[rank][k - 1] if k else 0.0)
            assert r.start[rank][k] == pytest.approx(earliest, abs=1e-9)   # as soon as possible
    busy = sum(e - st for rank in range(4) for st, e in zip(r.start[rank], r.end[rank]))
    assert r.utilization == pytest.approx(busy / (4 * r.makespan))


def test_default_split_is_half_and_half():
    s = make_schedule("zb-h1", 2, 2)
    r = simulate(s, t_f=1, t_b=3)
    durations = {a.kind: e - st for a, st, e in zip(s.actions[0], r.start[0], r.end[0])}
    assert durations == {"F": 1, "I": 1.5, "W": 1.5}


# ----------------------------------------------------------------------------------
# printing and the Timeline

def test_text_grid():
    assert str(make_schedule("1f1b", 2, 3)) == (
        "1f1b: 2 ranks, 3 micro-batches\n"
        "rank 0 | F0 F1 B0 F2 B1 B2\n"
        "rank 1 | F0 B0 F1 B1 F2 B2")
    assert str(make_schedule("zb-h1", 2, 2)) == (
        "zb-h1: 2 ranks, 2 micro-batches\n"
        "rank 0 | F0 F1 I0 W0 I1 W1\n"
        "rank 1 | F0 I0 F1 I1 W0 W1")
    assert str(make_schedule("interleaved-1f1b", 2, 2, chunks=2)) == (
        "interleaved-1f1b: 2 ranks, 2 micro-batches, 2 chunks per rank (4 stages)\n"
        "rank 0 | F0.0 F1.0 F0.1 F1.1 B0.1 B1.1 B0.0 B1.0\n"
        "rank 1 | F0.0 F1.0 F0.1 B0.1 F1.1 B1.1 B0.0 B1.0")
    assert make_schedule("gpipe", 2, 8).grid(max_columns=4).splitlines()[1] == "rank 0 | F0 F1 F2 F3 ... (+12)"


@pytest.mark.parametrize("name,p,m", [("1f1b", 4, 6), ("zb-v", 3, 5), ("interleaved-1f1b", 2, 4)])
def test_timeline_matches_the_simulation(name, p, m):
    s = make_schedule(name, p, m)
    r = simulate(s)
    tl = r.timeline()
    assert isinstance(tl, Timeline) and isinstance(r, SimResult)
    assert tl.source == "simulated" and tl.unit == "t_f" and tl.memory_unit == "micro-batches"
    n_actions = sum(map(len, s.actions))
    n_forwards = sum(a.kind == "F" for acts in s.actions for a in acts)
    assert len(tl.select(category="compute")) == n_actions
    assert len(tl.select(category="memory")) == 2 * n_forwards      # one up at F, one down at B/W
    assert tl.makespan == r.makespan
    assert tl.utilization() == pytest.approx(r.utilization, abs=1e-12)
    assert [tl.peak_memory(k) for k in range(p)] == r.peak_activations
    assert [tl.bubble(k) for k in range(p)] == pytest.approx(r.bubble)
    event = next(e for e in tl.select(rank=0, kind="F") if e.meta["microbatch"] == 1 and e.meta["chunk"] == 0)
    assert event.label == ("F1.0" if s.chunks > 1 else "F1") and event.meta["stage"] == 0
    assert {e.kind for e in tl.select(category="compute")} == ({"F", "I", "W"} if s.split_backward else {"F", "B"})


def test_bubble_fraction():
    assert bubble_fraction(4, 8) == 3 / 8 and bubble_fraction(4, 8, v=2) == 3 / 16
    assert bubble_fraction(4, 2, v=2) == (3 + 1 * 2) / 4          # m < p: (v-1)(p-m) more chunk-times
    with pytest.raises(ValueError, match="p, m, v >= 1"):
        bubble_fraction(4, 0)


@pytest.mark.parametrize("p,v,m", [(4, 2, 1), (4, 2, 3), (4, 2, 4), (4, 2, 6), (4, 3, 2), (4, 3, 4),
                                   (4, 3, 9), (5, 4, 3), (5, 4, 5), (5, 4, 7), (3, 2, 2), (6, 2, 12)])
def test_bubble_fraction_is_what_the_simulator_measures(p, v, m):
    """m < p, m = p and m > p: the formula against the interleaved schedule played out
    (idle / useful time), for two ratios of t_b to t_f."""
    for t_f, t_b in ((1.0, 2.0), (1.0, 1.0)):
        r = simulate(make_schedule("interleaved-1f1b", p, m, chunks=v), t_f=t_f, t_b=t_b)
        useful = m * (t_f + t_b)
        assert (r.makespan - useful) / useful == pytest.approx(bubble_fraction(p, m, v), abs=1e-9)
    for name in ("gpipe", "1f1b"):                                 # v = 1, m < p included
        r = simulate(make_schedule(name, p, m), t_f=1.0, t_b=2.0)
        assert (r.makespan - 3.0 * m) / (3.0 * m) == pytest.approx(bubble_fraction(p, m), abs=1e-9)


# ----------------------------------------------------------------------------------
# clear errors

@pytest.mark.parametrize("args,kwargs,message", [
    (("hanayo", 4, 8), {}, "unknown schedule 'hanayo'; known schedules: naive, gpipe, 1f1b, "
                           "interleaved-1f1b, zb-h1, zb-v"),
    (("1f1b", 10, 10**6), {}, "1f1b with p=10 ranks, m=1000000 micro-batches, v=1 chunks is 20,000,000 "
                              "actions: more than the 1,000,000 pplab builds"),
    (("zb-v", 1000, 1), {}, "zb-v builds each rank's order for at least 2p-1 = 1999 micro-batches"),
    (("interleaved-1f1b", 300, 1000), {"chunks": 2}, "is 1,200,000 actions"),
    (("interleaved-1f1b", 4, 8), {"chunks": 1}, "with one chunk per rank, use '1f1b'"),
    (("gpipe", 4, 8), {"chunks": 2}, "gpipe puts 1 chunk(s) on each rank, got chunks=2"),
    (("zb-v", 4, 8), {"chunks": 3}, "zb-v puts 2 chunk(s) on each rank, got chunks=3"),
    (("1f1b", 0, 8), {}, "num_stages (p, the number of pipeline ranks) must be a positive integer, got 0"),
    (("1f1b", 4, 2.5), {}, "num_microbatches (m) must be a positive integer, got 2.5"),
])
def test_make_schedule_errors(args, kwargs, message):
    with pytest.raises(ScheduleError) as err:
        make_schedule(*args, **kwargs)
    assert message in str(err.value)


def test_simulate_errors():
    s = make_schedule("zb-h1", 4, 4)
    with pytest.raises(ScheduleError, match="t_f has 3 values, but 'zb-h1' has 4 stages"):
        simulate(s, t_f=[1, 1, 1])
    with pytest.raises(ScheduleError, match="so it must be <= t_b: got t_w=3, t_b=2"):
        simulate(s, t_w=3)
    with pytest.raises(ScheduleError, match="p2p_latency must be a number >= 0, got -1"):
        simulate(s, p2p_latency=-1)
    with pytest.raises(ScheduleError, match="t_b must be non-negative numbers"):
        simulate(s, t_b=[1, -1, 1, 1])


def test_crossed_orders_deadlock_with_a_clear_message():
    s = Schedule("crossed", 2, 2, 1, [
        [A("F", 0, 0), A("B", 0, 0), A("F", 1, 0), A("B", 1, 0)],
        [A("F", 1, 1), A("B", 1, 1), A("F", 0, 1), A("B", 0, 1)]], [0, 1])
    with pytest.raises(ScheduleError) as err:
        validate(s)
    text = str(err.value)
    assert text.startswith("deadlock in 'crossed': rank(s) [0, 1] can never go on")
    assert ("rank 0 is stuck at step 1 (B0 of stage 0), waiting for B0 (or I0) of stage 1, "
            "which rank 1 runs at step 3, behind its own stuck step 0") in text
    assert "rank 1 is stuck at step 0 (F1 of stage 1), waiting for F1 of stage 0, which rank 0 runs at step 2" in text
    with pytest.raises(ScheduleError, match="deadlock"):
        simulate(s)


def test_w_before_its_i_is_reported():
    s = make_schedule("zb-h1", 2, 2)
    acts = s.actions[0]
    i, w = acts.index(A("I", 0, 0)), acts.index(A("W", 0, 0))
    acts[i], acts[w] = acts[w], acts[i]
    with pytest.raises(ScheduleError, match=r"rank 0 is stuck at step 2 \(W0 of stage 0\), waiting for "
                                            r"B0 \(or I0\) of stage 0, which it runs itself later, at step 3"):
        validate(s)


def test_incomplete_or_misplaced_actions_are_reported():
    s = make_schedule("gpipe", 2, 2)
    s.actions[1].remove(A("B", 1, 1))
    with pytest.raises(ScheduleError, match="backward 1 of stage 1 appears as 0 B, 0 I, 0 W"):
        validate(s)
    s = make_schedule("gpipe", 2, 2)
    s.actions[1].append(A("F", 1, 1))
    with pytest.raises(ScheduleError, match="F1 of stage 1 appears 2 times, not once"):
        validate(s)
    s = make_schedule("1f1b", 2, 2)
    s.actions[1].append(A("I", 1, 1))
    with pytest.raises(ScheduleError, match="appears as 1 B, 1 I, 0 W: it needs one B, or one I and one W"):
        validate(s)
    s = make_schedule("gpipe", 2, 2)
    s.actions[1][0] = A("F", 0, 0)
    with pytest.raises(ScheduleError, match="rank 1, step 0: F0 of stage 0 is on rank 1, but stage 0 lives on rank 0"):
        validate(s)
    s = make_schedule("zb-v", 2, 3)
    s.actions[0][0] = A("F", 0, 0, chunk=1)
    with pytest.raises(ScheduleError, match="stage 0 is chunk 0 of rank 0, but the action says chunk 1"):
        validate(s)
    s = make_schedule("gpipe", 2, 2)
    s.actions[0][0] = A("X", 0, 0)
    with pytest.raises(ScheduleError, match="unknown action kind 'X'; kinds are F, B, I, W"):
        validate(s)
    with pytest.raises(ScheduleError, match=r"each of the 2 ranks exactly 1 stage\(s\), got \[0, 0\]"):
        validate(Schedule("bad", 2, 1, 1, [[], []], [0, 0]))


# ----------------------------------------------------------------------------------
# interleaved 1F1B with any m, and sizes


@pytest.mark.parametrize("v", [2, 3])
def test_interleaved_runs_any_number_of_microbatches(v):
    """m need not be a multiple of p (as torch's ScheduleInterleaved1F1B). Bubble, idle time
    over useful time: (p-1)/(v m) for m >= p; for m < p rank 0 also waits p-m chunk-times
    at each of the v-1 turns between chunks, forward and backward."""
    for p in range(1, 7):
        for m in range(1, 14):
            s = make_schedule("interleaved-1f1b", p, m, chunks=v)      # validated: complete, no deadlock
            r = simulate(s, t_f=1, t_b=2)
            ideal = 3.0 * m
            expected = ((p - 1) + (v - 1) * max(0, p - m)) / (v * m)
            assert (r.makespan - ideal) / ideal == pytest.approx(expected, abs=1e-9), (p, m, v)
            assert expected == pytest.approx(bubble_fraction(p, m, v))


def test_interleaved_groups_follow_torchs_rounds():
    from pplab.pipeline.schedules import interleaved_groups
    assert interleaved_groups(4, 8) == [4, 4]           # Megatron: groups of p
    assert interleaved_groups(4, 10) == [5, 5]          # torch: m // p rounds of m / rounds
    assert interleaved_groups(4, 9) == [5, 4]           # uneven: as even as can be
    assert interleaved_groups(4, 3) == [3]
    for p in range(1, 9):
        for m in range(1, 40):
            g = interleaved_groups(p, m)
            assert sum(g) == m and (m < p or min(g) >= p)


def test_large_schedules_are_built_in_time_linear_in_actions():
    """p = 100,000 ranks, one micro-batch each: 200,000 actions (once quadratic in p)."""
    import signal

    def too_slow(signum, frame):
        raise AssertionError("make_schedule took minutes: not linear in the number of actions")

    old = signal.signal(signal.SIGALRM, too_slow)
    signal.alarm(120)                                    # a hang detector, not a timing
    try:
        s = make_schedule("1f1b", 100_000, 1)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    assert sum(map(len, s.actions)) == 200_000 and s.stages_of(99_999) == [99_999]


def test_explorer_title_quotes_the_formula_that_holds():
    from pplab.pipeline.explorer import pipeline_timeline
    for m, formula in ((2, "((p-1)+(v-1)(p-m))/(v·m)"), (4, "(p-1)/(v·m)"), (8, "(p-1)/(v·m)")):
        title = pipeline_timeline("interleaved-1f1b", 4, m, 2, 1.0, 2.0, 0.0).title
        value = bubble_fraction(4, m, 2)
        assert f"bubble {value:.1%} of useful time, {formula} = {value:.1%}" in title, title
        assert "does not hold" not in title


# ----------------------------------------------------------------------------------
# The order itself, pinned: to torch.distributed.pipelining's where torch has the schedule,
# to lists written by hand otherwise. (Makespans and peaks cannot see, e.g., GPipe's backwards
# run in reverse: the same cells, the same totals.)


def _torch_order(name, p, m):
    """torch's per-rank order [(kind, microbatch, stage)], idle slots (None) and its gradient
    reductions dropped. torch's schedule classes compute `pipeline_order` in __init__ from a
    few numbers, but need real pipeline stages (a process group) to be built; here the object
    is made without __init__ and given those numbers, then the same torch methods fill it in."""
    from torch.distributed.pipelining import schedules as S
    if name in ("gpipe", "1f1b"):
        s = object.__new__(S.ScheduleGPipe if name == "gpipe" else S.Schedule1F1B)
        s._num_stages, s._n_microbatches = p, m
        order = s._get_pipeline_order()
    else:
        s = object.__new__({"interleaved-1f1b": S.ScheduleInterleaved1F1B,
                            "zb-h1": S.ScheduleInterleavedZeroBubble,     # ZB-H1 is its one-chunk case
                            "zb-v": S.ScheduleZBVZeroBubble}[name])
        s.pp_group_size, s._n_microbatches = p, m
        s.n_local_stages = 1 if name == "zb-h1" else 2
        s.number_of_rounds = max(1, m // p)                                # as in their __init__
        s.microbatches_per_round = m // s.number_of_rounds
        s.num_stages = s._num_stages = p * s.n_local_stages
        s.pipeline_order = {r: s._calculate_single_rank_operations(r) for r in range(p)}
        if name == "zb-h1":
            s.pipeline_order = s._add_bubbles_to_actions(p)
        order = s.pipeline_order
    kind = {"FORWARD": "F", "FULL_BACKWARD": "B", "BACKWARD_INPUT": "I", "BACKWARD_WEIGHT": "W"}
    return [[(kind[a.computation_type.name], a.microbatch_index, a.stage_index) for a in order[r]
             if a is not None and a.computation_type.name in kind] for r in range(p)]


def _ours(name, p, m):
    return [[(a.kind, a.microbatch, a.stage) for a in acts] for acts in make_schedule(name, p, m).actions]


# torch's ScheduleInterleaved1F1B and ScheduleInterleavedZeroBubble refuse m that is not a
# multiple of max(1, m // p) rounds (pplab runs those with uneven groups): only m they accept.
TORCH_PM = [(2, 2), (2, 3), (2, 4), (3, 4), (3, 5), (3, 6), (4, 3), (4, 4), (4, 6), (4, 8), (4, 10)]


@pytest.mark.parametrize("name", ["gpipe", "interleaved-1f1b", "zb-h1", "zb-v"])
@pytest.mark.parametrize("p, m", TORCH_PM)
def test_order_of_every_rank_equals_torchs(name, p, m):
    assert _ours(name, p, m) == _torch_order(name, p, m)


@pytest.mark.parametrize("p, m", TORCH_PM)
def test_1f1b_order_equals_torchs_but_on_the_last_rank(p, m):
    """torch's Schedule1F1B.pipeline_order (its printable order; its step() runs another code path)
    starts the last rank, which has no warm-up forward, at micro-batch 1 and ends it at micro-batch
    m, which does not exist: ranks 0..p-2 are compared with torch, the last one with the hand
    lists of test_order_by_hand and here with F i, B i alternating, as 1F1B defines it."""
    ours, theirs = _ours("1f1b", p, m), _torch_order("1f1b", p, m)
    assert ours[:-1] == theirs[:-1]
    assert theirs[-1][0] == ("F", 1, p - 1)                  # torch's slip, so that this note stays true
    assert ours[-1] == [(k, i, p - 1) for i in range(m) for k in "FB"]


def _hand(rows, stages=None):
    """'F0 F1 B0' per rank -> [(kind, microbatch, stage)]; stage = rank unless given."""
    return [[(c[0], int(c[1:]), r if stages is None else stages[r]) for c in row.split()] for r, row in enumerate(rows)]


BY_HAND = {
    ("naive", 2, 3): ["F0 B0 F1 B1 F2 B2",
                      "F0 B0 F1 B1 F2 B2"],
    ("naive", 3, 4): ["F0 B0 F1 B1 F2 B2 F3 B3"] * 3,
    ("gpipe", 2, 3): ["F0 F1 F2 B0 B1 B2"] * 2,                         # backwards in micro-batch order
    ("gpipe", 3, 4): ["F0 F1 F2 F3 B0 B1 B2 B3"] * 3,
    ("1f1b", 2, 3): ["F0 F1 B0 F2 B1 B2",                                # 1 warm-up forward
                     "F0 B0 F1 B1 F2 B2"],
    ("1f1b", 3, 4): ["F0 F1 F2 B0 F3 B1 B2 B3",                          # p-1-r warm-up forwards
                     "F0 F1 B0 F2 B1 F3 B2 B3",
                     "F0 B0 F1 B1 F2 B2 F3 B3"],
    ("zb-h1", 2, 3): ["F0 F1 I0 W0 F2 I1 W1 I2 W2",                      # rank r defers r W's
                      "F0 I0 F1 I1 W0 F2 I2 W1 W2"],
    ("zb-h1", 3, 4): ["F0 F1 F2 I0 W0 F3 I1 W1 I2 W2 I3 W3",
                      "F0 F1 I0 F2 I1 W0 F3 I2 W1 I3 W2 W3",
                      "F0 I0 F1 I1 F2 I2 W0 F3 I3 W1 W2 W3"],
}


@pytest.mark.parametrize("name, p, m", list(BY_HAND), ids=[f"{n}-p{p}-m{m}" for n, p, m in BY_HAND])
def test_order_by_hand(name, p, m):
    assert _ours(name, p, m) == _hand(BY_HAND[name, p, m])
