"""Chimera, DualPipe, DualPipeV: orders against torch and the DualPipe repository, bubbles and memory
against the published formulas, and training on real ranks against one process.

References: torch.distributed.pipelining's ScheduleDualPipeV (its pipeline_order, rank by rank);
Chimera's bubble ratio (D-2)/(2N+D-2) and activation bounds (Li & Hoefler 2021, table 2); the
bubble and memory table of deepseek-ai/DualPipe's README. Real ranks: float64 MLP, gradients and
weights after one SGD step equal single-process training to rtol=1e-10, atol=1e-12 (two copies'
gradients are added, so the sums are in another order than one process's: ~1e-17 apart).
"""
import functools

import pytest

import torch
from torch import nn
from torch.distributed.pipelining.schedules import ScheduleDualPipeV, _ComputationType as C

import pplab
from pplab.pipeline import ScheduleError, make_schedule, run_pipeline, simulate
from pplab.pipeline.actions import Action, Schedule
from pplab.pipeline.bidirectional import chimera_bubble_ratio, dualpipe_table
from pplab.pipeline.validation import validate

import pipeline_models                # the MLP, its data, one process training it

F64 = torch.float64
RTOL, ATOL = 1e-10, 1e-12


# ----------------------------------------------------------------------------------
# DualPipeV's order is torch's

def torch_order(p, m):
    """torch's pipeline_order for DualPipeV, computed without building stages or a process group."""
    sched = object.__new__(ScheduleDualPipeV)
    sched.pp_group_size, sched._n_microbatches = p, m
    return [sched._calculate_single_rank_operations(r) for r in range(p)]


KIND = {C.FORWARD: "F", C.FULL_BACKWARD: "B", C.BACKWARD_INPUT: "I", C.BACKWARD_WEIGHT: "W"}


def flatten(actions):
    """torch's actions as (kind, micro-batch, stage, overlapped with the next)."""
    out = []
    for a in actions:
        if a.computation_type == C.OVERLAP_F_B:
            f, b = a.sub_actions
            out += [("F", f.microbatch_index, f.stage_index, True),
                    (KIND[b.computation_type], b.microbatch_index, b.stage_index, False)]
        else:
            out.append((KIND[a.computation_type], a.microbatch_index, a.stage_index, False))
    return out


@pytest.mark.parametrize("p,m", [(2, 4), (2, 7), (3, 6), (3, 8), (4, 8), (4, 11), (5, 10), (6, 13)])
def test_dualpipev_order_is_torchs(p, m):
    ours = make_schedule("dualpipev", p, m)
    for r, theirs in enumerate(torch_order(p, m)):
        assert [(a.kind, a.microbatch, a.stage, a.overlap) for a in ours.actions[r]] == flatten(theirs), f"rank {r}"


def test_dualpipe_rank_runs_dualpipev_order_of_its_mirror():
    """deepseek-ai/DualPipe's dualpipe.py: rank r runs the steps of rank min(r, p-1-r) of p/2 ranks;
    phase 0 is the direction where r is among the first p/2 stages. Rank 3 of p=4, m=8 worked by hand
    from that file's steps 1-8 (half rank 0 of 2, 4 micro-batches each way)."""
    s = make_schedule("dualpipe", 4, 8)
    got = " ".join(a.label() + ("&" if a.overlap else "") for a in s.actions[3])
    # rank 3 = half rank 0: up copy (micro-batches 4..7) is its phase 0, the down copy its phase 1
    assert got == "F4 F5 F6 F0 I0 W0 F1 F7& B1 F2& B4 B2 F3& B5 B3 I6 W6 I7 W7"
    assert all(a.stage == (4 if a.microbatch >= 4 else 3) for a in s.actions[3])
    assert {a.stage for a in s.actions[3]} == {3, 4}     # down copy's piece 3, up copy's piece 0
    assert s.stage_to_rank == [0, 1, 2, 3, 3, 2, 1, 0]


# ----------------------------------------------------------------------------------
# bubbles and memory against the published figures

@pytest.mark.parametrize("p", [2, 4, 6, 8, 10, 12])
def test_chimera_bubble_and_activations_are_the_papers(p):
    s = make_schedule("chimera", p, p)                  # one basic unit: N = D
    r = simulate(s, t_f=1, t_b=1)                            # the paper counts F and B as equal slots
    work = 2 * p                                             # per rank: p/2 micro-batches x 2 stages x (F + B)
    assert r.bubble == [p - 2] * p
    assert max(r.bubble) / r.makespan == pytest.approx(chimera_bubble_ratio(p, p))
    # activations between (D/2 + 1) and D micro-batches (the paper's [(D/2+1) Ma, D Ma])
    assert min(r.peak_activations) == p // 2 + 1 and max(r.peak_activations) == p
    assert r.makespan == work + p - 2


@pytest.mark.parametrize("pp", [4, 6, 8])
@pytest.mark.parametrize("F,B,W,FB", [(1.0, 2.0, 1.0, 3.0), (1.0, 2.0, 1.0, 2.5), (2.0, 4.0, 2.0, 5.0),
                                      (2.0, 4.0, 2.0, 4.5), (1.0, 1.8, 0.8, 2.5)])
def test_dualpipe_readme_table(pp, F, B, W, FB):
    """Rows 1F1B, ZB1P, DualPipe of the README (DeepSeek-V3's Table 2), with B <= F&B <= F + B: B = 2F,
    W = F as the README draws them, and F, B, W, F&B all different. The DualPipe row holds when the
    input-gradient part B − W lasts F (as it does in each case here)."""
    m = 2 * pp + 4
    table = dualpipe_table(pp, F, B, W, FB)
    runs = {"1F1B": simulate(make_schedule("1f1b", pp, m), t_f=F, t_b=B),
            "ZB1P": simulate(make_schedule("zb-h1", pp, m), t_f=F, t_b=B, t_w=W),
            "DualPipe": simulate(make_schedule("dualpipe", pp, m), t_f=F, t_b=B, t_w=W, t_fb=FB)}
    for name, r in runs.items():
        bubble, params, activations = table[name]
        assert max(r.bubble) == pytest.approx(bubble), name
        held = len(r.schedule.stages_of(0)) * r.schedule.num_ranks // r.schedule.stages_per_replica
        assert held == params, name                      # stages of one pp-stage model per device
        assert max(r.peak_activations) == activations, name


@pytest.mark.parametrize("pp", [4, 6, 8])
def test_dualpipe_bubble_when_the_input_gradient_is_not_f(pp):
    """When B − W differs from F the table's (PP/2−1)(F&B+B−3W) no longer holds: the simulated
    bubble is (PP/2−1)(F&B+F−2W), the same where B − W = F."""
    other = simulate(make_schedule("dualpipe", pp, 2 * pp + 4), t_f=1.0, t_b=1.7, t_w=0.6, t_fb=2.3)
    assert max(other.bubble) == pytest.approx((pp // 2 - 1) * (2.3 + 1.0 - 2 * 0.6))


@pytest.mark.parametrize("p", [2, 3, 4])
def test_dualpipev_is_dualpipe_on_half_the_devices(p):
    """README row DualPipeV: PP = 2p stages on p devices, bubble (PP/2-1)(F&B+B-3W), 2x parameters,
    PP+1 activations (one stage's each); a chunk is one stage, so t_f = 2F for a rank's two."""
    F, B, W, FB = 1.0, 2.0, 1.0, 2.5
    r = simulate(make_schedule("dualpipev", p, 2 * p + 1), t_f=2 * F, t_b=2 * B, t_w=2 * W, t_fb=2 * FB)
    assert max(r.bubble) == pytest.approx((p - 1) * (FB + B - 3 * W))
    assert [2 * a for a in r.peak_activations] == [2 * p + 1] * p


def test_overlapped_pair_takes_t_fb():
    """An F&B block lasts t_fb, so a rank's busy time falls by (F + B - F&B) per pair. Counted by
    hand from the steps on p=2, m=4: rank 0 pairs once in step 4 (twice) and once in step 5; rank 1
    (the turn of the V) runs its first F and B apart, then pairs 3 times in step 4."""
    s = make_schedule("dualpipev", 2, 4)
    pairs = [sum(a.overlap for a in acts) for acts in s.actions]
    assert pairs == [3, 3]
    assert [(a.kind, a.overlap) for a in s.actions[1][4:6]] == [("F", False), ("B", False)]
    slow = simulate(s, t_f=2, t_b=4, t_w=2)                  # pairs take F + B = 3 per chunk
    fast = simulate(s, t_f=2, t_b=4, t_w=2, t_fb=4)          # 2 per chunk
    busy = lambda r, k: sum(e - b for b, e in zip(r.start[k], r.end[k]))   # noqa: E731
    assert [busy(slow, k) - busy(fast, k) for k in range(2)] == [3.0, 3.0]


# ----------------------------------------------------------------------------------
# errors

@pytest.mark.parametrize("name,p,m,says", [
    ("chimera", 3, 6, "even number of ranks"), ("dualpipe", 5, 20, "even number of ranks"),
    ("chimera", 4, 6, "multiple of 4"), ("dualpipe", 4, 6, ">= 2p = 8"), ("dualpipe", 4, 9, "even"),
    ("dualpipev", 3, 5, "2p = 6"), ("hanayo", 2, 2, "known schedules: .*chimera"), ("dualpipe", 0, 4, "positive"),
])
def test_bad_sizes_say_what_to_change(name, p, m, says):
    with pytest.raises(ScheduleError, match=says):
        make_schedule(name, p, m)


def test_validator_catches_wrong_replica_and_bad_overlap():
    s = make_schedule("chimera", 2, 2)
    acts = [list(a) for a in s.actions]
    k = next(j for j, a in enumerate(acts[0]) if a.stage == 0)
    acts[0][k] = Action(acts[0][k].kind, 1, 0, 0)          # micro-batch 1 belongs to the up copy
    with pytest.raises(ScheduleError, match="belongs to the other replica"):
        validate(Schedule("x", 2, 2, 2, acts, s.stage_to_rank, replicas=2))
    acts = [list(a) for a in s.actions]
    acts[0][0] = Action("F", acts[0][0].microbatch, acts[0][0].stage, acts[0][0].chunk, overlap=True)
    with pytest.raises(ScheduleError, match="overlap=True"):
        validate(Schedule("x", 2, 2, 2, acts, s.stage_to_rank, replicas=2))
    with pytest.raises(ScheduleError, match="replicas must be 1, or 2"):
        validate(Schedule("x", 2, 3, 2, s.actions, s.stage_to_rank, replicas=2))


# ----------------------------------------------------------------------------------
# real ranks

mlp = functools.partial(pipeline_models.mlp, width=8)
data = functools.partial(pipeline_models.data, width=8)
reference = functools.partial(pipeline_models.reference, width=8)


def train_all(cases, n, lr):
    out = {}
    for name, p, m in cases:
        layers = mlp()
        optimizer = torch.optim.SGD(nn.Sequential(*layers).parameters(), lr=lr)
        x, y = data(n)
        out[name] = run_pipeline(make_schedule(name, p, m), layers, x, y, nn.MSELoss(), optimizer=optimizer)
    return out


@pytest.mark.parametrize("p,cases,n", [
    (2, [("chimera", 2, 4), ("dualpipe", 2, 4), ("dualpipev", 2, 5)], 11),
    (3, [("dualpipev", 3, 7)], 13),
    (4, [("chimera", 4, 4), ("dualpipe", 4, 8), ("dualpipev", 4, 8)], 13),
])
def test_gradients_and_step_equal_single_process(p, cases, n):
    lr = 0.1
    results = pplab.launch(train_all, cases, n, lr, world_size=p, timeout=60)
    ref_loss, ref_grads, ref_params = reference(n, lr)
    for name, _, m in cases:
        s = make_schedule(name, p, m)
        seen = {k: 0 for k in ref_grads}
        losses = 0.0
        for r, res in enumerate(results):
            assert sorted(res[name]["stages"]) == s.stages_of(r)
            for k, g in res[name]["grads"].items():          # every copy holds the full batch's gradient
                torch.testing.assert_close(g, ref_grads[k], rtol=RTOL, atol=ATOL, msg=f"{name} rank {r} grad {k}")
                torch.testing.assert_close(res[name]["params"][k], ref_params[k], rtol=RTOL, atol=ATOL,
                                           msg=f"{name} rank {r} {k} after SGD")
                seen[k] += 1
            losses += res[name]["loss"] or 0.0
        assert set(seen.values()) == {s.replicas}, f"{name}: each parameter on {s.replicas} rank(s)"
        assert losses == pytest.approx(ref_loss, rel=1e-12), name    # the two directions' halves add up
        assert [res[name]["peak_activations"] for res in results] == pytest.approx(simulate(s).peak_activations)


# ----------------------------------------------------------------------------------
# drawn and in the explorer

@pytest.mark.parametrize("name,p,m", [("chimera", 4, 4), ("dualpipe", 4, 8), ("dualpipev", 3, 7)])
def test_explorer_lists_draws_and_checks_the_formula(name, p, m):
    from pplab.pipeline.explorer import pipeline_timeline
    t_b = 1.0 if name == "chimera" else 2.0                  # where each formula holds (see the tests above)
    tl = pipeline_timeline(name, p, m, t_f=1.0, t_b=t_b)
    assert "does not hold" not in tl.title and name in tl.title
    assert len(tl.select(category="compute")) == sum(map(len, make_schedule(name, p, m).actions))
    pplab.swimlane.draw(tl, memory=True)


def timed_dualpipe():
    x, y = data(8)
    return run_pipeline(make_schedule("dualpipe", 2, 4), mlp(), x, y, nn.MSELoss(),
                        compute_time={"F": 0.005, "B": 0.01, "W": 0.005})


def test_measured_dualpipe_follows_its_schedule():
    """The traced run: one span per action in the schedule's order on each rank; messages: each
    micro-batch crosses its copy's one rank boundary forward and back, plus each rank's swap of
    its two stages' gradients with the other copy."""
    results = pplab.launch(timed_dualpipe, world_size=2, timeout=60)
    s, tl = make_schedule("dualpipe", 2, 4), results.timeline
    for r in range(2):
        spans = tl.select(rank=r, category="compute")
        assert [e.label for e in spans] == [a.label(True) for a in s.actions[r]]
        # each stage is a whole 1/p of the model, so its forward pads to all of compute_time's F (as simulate)
        assert all(e.duration >= 0.005 - 1e-6 for e in spans if e.kind == "F")
    pairs = tl.messages()
    crossings = sum(s.stage_to_rank[t] != s.stage_to_rank[t + 1] for t in range(s.num_stages)
                    if (t + 1) % s.stages_per_replica)
    assert len(pairs) == 2 * (s.num_microbatches // 2) * crossings + 2 * 2   # + each rank's swap of 2 stages
    pplab.swimlane.draw(tl)


@pytest.mark.parametrize("p,m", [(2, 4), (3, 7), (4, 9)])
def test_torchs_validator_and_simulator_accept_our_dualpipev(p, m):
    """pplab's order, written in torch's format, through torch's own checks: _validate_schedule
    (pairs as OVERLAP_F_B: every F before its B or I, every I before its W, each stage on one rank)
    and, with pairs run one after the other as pplab's executor runs them (torch's simulator does
    not take OVERLAP_F_B), _add_send_recv then _simulate_comms_compute, which raises on a deadlock.
    Chimera and DualPipe keep two copies of the model, which torch's format (one stage index per
    piece of the model) cannot say."""
    from torch.distributed.pipelining.schedules import (_Action, _add_send_recv, _simulate_comms_compute,
                                                        _validate_schedule)
    kind = {"F": C.FORWARD, "B": C.FULL_BACKWARD, "I": C.BACKWARD_INPUT, "W": C.BACKWARD_WEIGHT}
    s = make_schedule("dualpipev", p, m)
    paired, flat = {}, {}
    for r, acts in enumerate(s.actions):
        flat[r] = [_Action(a.stage, kind[a.kind], a.microbatch) for a in acts]
        out, k = [], 0
        while k < len(acts):
            if acts[k].overlap:
                out.append(_Action(-1, C.OVERLAP_F_B, None, tuple(flat[r][k:k + 2])))
                k += 2
            else:
                out.append(flat[r][k])
                k += 1
        paired[r] = out
    assert _validate_schedule(paired, p, 2 * p, m) == dict(enumerate(s.stage_to_rank))
    lowered = _add_send_recv(flat, stage_to_rank=lambda st: s.stage_to_rank[st], num_stages=2 * p)
    played = _simulate_comms_compute(lowered, stage_to_rank=lambda st: s.stage_to_rank[st], num_stages=2 * p)
    for r in range(p):                                  # every action, compute and comms, got played
        assert [a for a in played[r] if a is not None] == lowered[r]


# ----------------------------------------------------------------------------------
# Chimera with several basic units (m = 2p, 3p): the paper's direct concatenation

@pytest.mark.parametrize("p,k", [(2, 2), (4, 2), (4, 3), (6, 2)])
def test_chimera_with_several_units_concatenates_the_basic_unit(p, k):
    """m = k·p: each rank runs unit 0's order k times; in unit u the down copy (stages 0..p-1) takes
    micro-batches u·p/2 .. u·p/2 + p/2 - 1 and the up copy m/2 plus those, so that micro-batches
    0..m/2-1 go down and m/2..m-1 go up. Derived here from the one-unit schedule (m = p), which
    the test above pins to the paper; a micro-batch stride of p instead of p/2, or halves taken
    from the unit rather than the batch, breaks it only when m > p."""
    m, half = k * p, p // 2
    unit = make_schedule("chimera", p, p)
    s = make_schedule("chimera", p, m)                      # validated: every F and B once, no deadlock
    for r in range(p):
        want = []
        for u in range(k):
            for a in unit.actions[r]:
                up, j = divmod(a.microbatch, half)           # in the unit: 0..p/2-1 down, p/2..p-1 up
                assert up == (a.stage >= p)
                want.append((a.kind, up * (m // 2) + u * half + j, a.stage, a.chunk))
        assert [(a.kind, a.microbatch, a.stage, a.chunk) for a in s.actions[r]] == want, f"rank {r}"
    assert {a.microbatch for acts in s.actions for a in acts if a.stage < p} == set(range(m // 2))
    r1, rk = simulate(unit, t_f=1, t_b=1), simulate(s, t_f=1, t_b=1)
    assert rk.peak_activations == r1.peak_activations       # a unit drains before the next one fills its rank
    for r in range(p):                                       # k times the work, in at most k units' time
        assert rk.makespan - rk.bubble[r] == k * (r1.makespan - r1.bubble[r])
    assert rk.makespan <= k * r1.makespan
