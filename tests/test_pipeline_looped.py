"""Looped BFS and interleaved zero bubble (pipeline/looped.py), and the CSV torch reads (pipeline/torch_csv.py).

References: torch.distributed.pipelining's own ScheduleLoopedBFS and ScheduleInterleavedZeroBubble
(their per-rank orders), its validator, lowering pass and simulator, its loader and dumper, its
runtime (gradients), orders and makespans worked out by hand, and single-process training.
Gradients on real ranks are compared with rtol=1e-10, atol=1e-12 (float64; observed: equal).
"""
from types import SimpleNamespace

import functools

import pytest

import torch
from torch import nn
from torch.distributed.pipelining import schedules as S

import pplab
from pplab.pipeline import ScheduleError, bubble_fraction, make_schedule, run_pipeline, simulate
from pplab.pipeline.torch_csv import (from_torch_rows, read_torch_csv, run_with_torch, torch_rows,
                                      write_torch_csv)

import pipeline_models                # the MLP, its data, one process training it

F64 = torch.float64
RTOL, ATOL = 1e-10, 1e-12
KIND = {"FORWARD": "F", "FULL_BACKWARD": "B", "BACKWARD_INPUT": "I", "BACKWARD_WEIGHT": "W"}


def _torch_order(name, p, m, v):
    """torch's pipeline_order for p ranks with v stages each, idle slots kept (None). Its classes
    build the order in __init__, which needs real stages; the object is made without __init__ and
    given the numbers __init__ would set, and torch's own methods fill the order in."""
    if name == "looped-bfs":
        s = object.__new__(S.ScheduleLoopedBFS)
        s.pp_group_size, s._n_microbatches, s._stages = p, m, [None] * v
        return {r: s._calculate_single_rank_operations(r) for r in range(p)}
    s = object.__new__(S.ScheduleInterleavedZeroBubble)
    s.pp_group_size, s._n_microbatches, s.n_local_stages = p, m, v
    s.number_of_rounds = max(1, m // p)
    s.microbatches_per_round = m // s.number_of_rounds
    s.pipeline_order = {r: s._calculate_single_rank_operations(r) for r in range(p)}
    return s._add_bubbles_to_actions(p * v)


def _triples(order):
    return [[(KIND[a.computation_type.name], a.microbatch_index, a.stage_index) for a in order[r] if a is not None]
            for r in sorted(order)]


def _ours(schedule):
    return [[(a.kind, a.microbatch, a.stage) for a in acts] for acts in schedule.actions]


# (p, m, v): non-powers of two, m < p, m not a multiple of p, three chunks; only m that torch's
# interleaved zero bubble accepts (a multiple of max(1, m // p) rounds)
PMV = [(2, 2, 2), (2, 4, 3), (3, 2, 2), (3, 4, 2), (3, 6, 3), (4, 4, 2), (4, 6, 2), (4, 8, 2), (5, 7, 2), (4, 10, 3)]


@pytest.mark.parametrize("name", ["looped-bfs", "interleaved-zb"])
@pytest.mark.parametrize("p, m, v", PMV)
def test_order_of_every_rank_equals_torchs(name, p, m, v):
    assert _ours(make_schedule(name, p, m, v)) == _triples(_torch_order(name, p, m, v))


def test_orders_by_hand():
    bfs = make_schedule("looped-bfs", 2, 2, 2)                 # stages 0, 2 on rank 0; 1, 3 on rank 1
    assert [[a.label(True) for a in acts] for acts in bfs.actions] == [
        "F0.0 F1.0 F0.1 F1.1 B1.1 B0.1 B1.0 B0.0".split()] * 2
    assert bfs.stage_to_rank == [0, 1, 0, 1]
    zb = make_schedule("interleaved-zb", 2, 2, 2)              # warm-up (v-1)g + (p-1-r) = 3 and 2
    assert [[a.label(True) for a in acts] for acts in zb.actions] == [
        "F0.0 F1.0 F0.1 F1.1 I0.1 W0.1 I1.1 W1.1 I0.0 W0.0 I1.0 W1.0".split(),
        "F0.0 F1.0 F0.1 I0.1 F1.1 I1.1 W0.1 I0.0 W1.1 I1.0 W0.0 W1.0".split()]


def test_interleaved_zero_bubble_with_one_chunk_is_zb_h1():
    for p, m in [(2, 3), (3, 5), (4, 4)]:
        assert _ours(make_schedule("interleaved-zb", p, m, 1)) == _ours(make_schedule("zb-h1", p, m))


def test_interleaved_zero_bubble_refuses_uneven_rounds():
    with pytest.raises(ScheduleError, match=r"m = 9 must be a multiple of 2.*try m = 8 or 10"):
        make_schedule("interleaved-zb", 4, 9, 2)


@pytest.mark.parametrize("p, m, v", [(2, 2, 2), (4, 8, 2), (3, 7, 3), (4, 3, 2), (4, 2, 3)])
def test_looped_bfs_bubble_is_interleaveds(p, m, v):
    """GPipe looped v times: (vm + p - 1) chunk-steps of t/v for m >= p; at each turn from a chunk to
    the next, m < p micro-batches leave rank 0 idle p - m chunk-steps more (bubble_fraction)."""
    r = simulate(make_schedule("looped-bfs", p, m, v), t_f=1, t_b=2)
    if m >= p:
        assert r.makespan == pytest.approx((v * m + p - 1) * 3 / v)
    assert (r.makespan - 3 * m) / (3 * m) == pytest.approx(bubble_fraction(p, m, v))
    assert max(r.peak_activations) == m                        # like GPipe: every micro-batch, every chunk


@pytest.mark.parametrize("p, m, v", [(2, 4, 2), (4, 8, 2), (3, 6, 3), (5, 7, 2)])
@pytest.mark.parametrize("t_f, t_b, t_w", [(1, 2, 1), (1, 3, 1), (2, 3, 1), (1, 2, 0.5)])
def test_interleaved_zero_bubble_makespan_is_the_papers(p, m, v, t_f, t_b, t_w):
    """ZB-H1's m(F+I+W) + (p-1)(F+I-W) (Qi et al. 2024) with chunk times t/v: for m >= p, W <= F."""
    r = simulate(make_schedule("interleaved-zb", p, m, v), t_f=t_f, t_b=t_b, t_w=t_w)
    assert r.makespan == pytest.approx(m * (t_f + t_b) + (p - 1) * (t_f + t_b - 2 * t_w) / v)


def test_interleaved_zero_bubble_formula_fails_below_p_microbatches():
    r = simulate(make_schedule("interleaved-zb", 4, 2, 2), t_f=1, t_b=2, t_w=1)
    assert r.makespan == pytest.approx(9.5)                    # 6 of work + 3.5 idle, not the formula's 1.5


# ----------------------------------------------------------------------------------
# torch's own checks, and the CSV both ways


def _torch_runtime(p, v, m):
    """torch's _PipelineScheduleRuntime without stages (no process group): what _load_csv reads into."""
    rt = object.__new__(S._PipelineScheduleRuntime)
    rt.pp_group_size, rt._num_stages, rt._n_microbatches = p, p * v, m
    rt._stages, rt.pipeline_order, rt._defer_pp_recv = [], {}, False
    return rt


@pytest.mark.parametrize("name, p, m, v", [("looped-bfs", 3, 4, 2), ("interleaved-zb", 3, 6, 2),
                                           ("interleaved-1f1b", 4, 6, 2), ("zb-v", 3, 5, 2), ("1f1b", 3, 4, 1)])
def test_round_trip_through_torchs_loader_and_dumper(tmp_path, name, p, m, v):
    ours = make_schedule(name, p, m, v)
    write_torch_csv(ours, tmp_path / "ours.csv")
    rt = _torch_runtime(p, v, m)
    rt._load_csv(str(tmp_path / "ours.csv"))       # torch validates, maps stages to ranks, adds SEND/RECV
    assert [rt.stage_index_to_group_rank[s] for s in range(p * v)] == ours.stage_to_rank
    assert any("SEND_F" in str(a) for a in rt.pipeline_order_with_comms[0]) == (p > 1)
    # torch's simulator plays out the order with messages (it knows no UNSHARD: lowered here without it)
    comms = S._add_send_recv({r: list(rt.pipeline_order[r]) for r in range(p)},
                             lambda s: rt.stage_index_to_group_rank[s], p * v)
    played = S._simulate_comms_compute(comms, lambda s: rt.stage_index_to_group_rank[s], p * v)
    assert _triples({r: [a for a in played[r] if a is not None and a.computation_type.name in KIND]
                     for r in played}) == _ours(ours)
    for fmt in ("compute_only", "compute_comms"):
        rt._dump_csv(str(tmp_path / f"{fmt}.csv"), format=fmt)
        back = read_torch_csv(tmp_path / f"{fmt}.csv", name=name)
        assert (back.actions, back.stage_to_rank, back.chunks, back.num_microbatches) == \
            (ours.actions, ours.stage_to_rank, ours.chunks, ours.num_microbatches)


def test_torchs_own_order_with_idle_slots_imports_as_ours():
    rows = [["" if a is None else str(a) for a in acts] for acts in _torch_order("interleaved-zb", 4, 8, 2).values()]
    assert "" in rows[1]                                       # torch's padding is there, and dropped
    assert from_torch_rows(rows).actions == make_schedule("interleaved-zb", 4, 8, 2).actions
    assert torch_rows(make_schedule("looped-bfs", 2, 1, 2)) == [["0F0", "2F0", "2B0", "0B0"], ["1F0", "3F0", "3B0", "1B0"]]


@pytest.mark.parametrize("p, m", [(2, 5), (3, 6)])
def test_torchs_dualpipev_order_imports_with_its_overlapped_pairs(p, m):
    """torch writes DualPipeV's F&B pairs as one cell, '(0F1;3B0)OVERLAP_F_B': imported, each is an
    F with overlap=True and the B (or I) after it, so the schedule is pplab's DualPipeV, pairs included
    (simulate times a pair as t_fb only if it knows it is one)."""
    sched = object.__new__(S.ScheduleDualPipeV)
    sched.pp_group_size, sched._n_microbatches = p, m
    rows = [["" if a is None else str(a) for a in sched._calculate_single_rank_operations(r)] for r in range(p)]
    assert any(cell.endswith(")OVERLAP_F_B") for cell in rows[0])
    ours = make_schedule("dualpipev", p, m)
    back = from_torch_rows(rows, "dualpipev")
    assert (back.actions, back.stage_to_rank, back.chunks) == (ours.actions, ours.stage_to_rank, ours.chunks)
    assert simulate(back, t_fb=2).makespan == simulate(ours, t_fb=2).makespan < simulate(ours).makespan


@pytest.mark.parametrize("rows, message", [
    ([["(0B0;1F1)OVERLAP_F_B"]], r"overlaps \['B', 'F'\]; expected a forward then a backward"),
    ([["0F0", "0X0"]], r"'0X0' is not an action torch writes"),
    ([["0F0", "1F0"], ["1B0"]], r"stage 1 is run by ranks 0 and 1"),
    ([["0F0", "2F0"], ["1F0"]], r"different numbers of stages"),
    ([["0F0", "2F0", "2B0", "0B0"], ["3F0"]], r"no rank runs stage\(s\) \[1\]"),
    ([["", "0RECV_F0"]], r"no computation"),
    ([["0F0", "0B0"], ["1B0", "1F0"]], r"deadlock"),
])
def test_bad_csv_is_explained(rows, message):
    with pytest.raises(ScheduleError, match=message):
        from_torch_rows(rows)


# ----------------------------------------------------------------------------------
# real ranks


mlp = functools.partial(pipeline_models.mlp, width=8, depth=6)
data = functools.partial(pipeline_models.data, width=8)


def reference_grads(n):
    return pipeline_models.reference(n, 0.0, width=8, depth=6)[1]


def _gathered(results, key="grads"):
    out = {}
    for res in results:
        assert not set(out) & set(res[key])
        out.update(res[key])
    return out


def _pplab_run(name, p, m, v, n):
    x, y = data(n)
    return run_pipeline(make_schedule(name, p, m, v), mlp(), x, y, nn.MSELoss())


@pytest.mark.parametrize("name, p, m, v, n", [("looped-bfs", 3, 4, 2, 11), ("interleaved-zb", 3, 6, 2, 13),
                                              ("interleaved-zb", 2, 4, 3, 9)])
def test_executor_gradients_equal_single_process(name, p, m, v, n):
    results = pplab.launch(_pplab_run, name, p, m, v, n, world_size=p, timeout=60)
    ours, ref = _gathered(results), reference_grads(n)
    assert set(ours) == set(ref)
    for k in ref:
        torch.testing.assert_close(ours[k], ref[k], rtol=RTOL, atol=ATOL, msg=f"grad of {k}")


def _both_runtimes(cases, n):
    x, y = data(n)
    out = []
    for name, m, v in cases:
        s = make_schedule(name, 2, m, v)
        out.append((run_with_torch(s, mlp(), x, y, nn.MSELoss())["grads"],
                    run_pipeline(s, mlp(), x, y, nn.MSELoss())["grads"]))
    return out


def test_torchs_runtime_runs_pplab_schedules_to_the_same_gradients():
    """Looped BFS, interleaved ZB, and interleaved 1F1B with m = 5 on 2 ranks, which torch's own
    ScheduleInterleaved1F1B refuses (5 is not a multiple of its 2 rounds), run by torch from the CSV;
    and DualPipeV, its overlapped pairs run as torch's OVERLAP_F_B actions."""
    cases = [("looped-bfs", 4, 2), ("interleaved-zb", 4, 2), ("interleaved-1f1b", 5, 2), ("dualpipev", 4, 2)]
    stage = SimpleNamespace(group_size=2, num_stages=4, group_rank=0)     # all its check reads
    with pytest.raises(ValueError, match="multiple of the number of rounds"):
        S.ScheduleInterleaved1F1B([stage, stage], 5)
    results = pplab.launch(_both_runtimes, cases, 20, world_size=2, timeout=60)
    ref = reference_grads(20)
    for c, case in enumerate(cases):
        theirs = _gathered([{"grads": res[c][0]} for res in results])
        ours = _gathered([{"grads": res[c][1]} for res in results])
        assert set(theirs) == set(ours) == set(ref), case
        for k in ref:
            torch.testing.assert_close(theirs[k], ours[k], rtol=RTOL, atol=ATOL, msg=f"{case}: grad of {k}")
            torch.testing.assert_close(theirs[k], ref[k], rtol=RTOL, atol=ATOL, msg=f"{case}: grad of {k}")


# ----------------------------------------------------------------------------------
# the explorer


def test_explorer_offers_both_with_their_bubble_formulas():
    from pplab.pipeline import explore, pipeline_timeline
    assert pipeline_timeline("looped-bfs", 4, 8, 2).title == (           # peak: all 8; 3/16
        "looped-bfs: p=4, m=8, v=2  |  peak activations 8\nbubble 18.8% of useful time, (p-1)/(v·m) = 18.8%")
    assert pipeline_timeline("interleaved-zb", 4, 8, 2, 1.0, 3.0, 1.0).title == (   # 3 (1+2-1) / 2 / 32
        "interleaved-zb: p=4, m=8, v=2, t_f=1, t_I=2, t_W=1  |  peak activations 4\n"
        "bubble 9.4% of useful time, (p-1)(t_f+t_I-t_W)/(v·m·(t_f+t_b)) = 9.4%")
    assert "does not hold" in pipeline_timeline("interleaved-zb", 4, 2, 2, 1.0, 2.0, 1.0).title   # m < p
    box = explore(schedule="interleaved-zb", p=4, m=8, v=3)             # one figure drawn
    assert box.error is None and box.timeline.title.startswith("interleaved-zb: p=4, m=8, v=3")
    assert {"looped-bfs", "interleaved-zb"} <= set(box.controls["schedule"].options)
    assert box.controls["v"].layout.display is None                    # v is a choice here, shown
    box.controls["m"].value = 9                                          # 2 rounds cannot share 9
    assert "multiple of 2" in str(box.error)
