"""The capstone of chapter 7, `pp_dp_train_step`: registered, its helpers against hand values and
pplab.pipeline's own schedules, another correct answer passing (the check asks for values, traffic
and memory, not for one way of writing it), and the traffic mistakes named. The solution passing,
the stub failing and every wrong answer of wrong_solutions_ch07_pp_dp_train_step.py failing with its
message are run from tests/test_checks.py."""
import re

import pytest
import torch
import torch.distributed as dist

from pplab import checks
from pplab.checks.ch07_hybrid.pp_dp_train_step import _dp_problem, _traffic_problem, peak_held
from pplab.checks.ch07_hybrid.pp_dp_train_step_rank import layout
from pplab.mesh import groups
from pplab.pipeline import make_schedule
from wrong_solutions_ch07_pp_dp_train_step import WRONG

pytestmark = pytest.mark.usefixtures("no_leftover_processes")


def test_the_capstone_registers_with_its_wrong_answers():
    ids = [i for i, ex in checks.EXERCISES.items() if ex.checker.__module__ == "pplab.checks.ch07_hybrid.pp_dp_train_step"]
    assert ids == ["pp_dp_train_step"] and set(WRONG) == set(ids)
    ex = checks.get_exercise("pp_dp_train_step")
    assert ex.notebook == "07_pp_dp_train_step" and ex.points == 5
    assert any("rank 0 only" in (fn.__doc__ or "") for fn, _, _ in WRONG["pp_dp_train_step"])


def test_layout_by_hand():
    # rank = stage·dp + replica: with 3 stages × 2 replicas, replica 1's pipeline is ranks 1, 3, 5
    assert layout(2, 2) == {"pp": [[0, 2], [1, 3]], "dp": [[0, 1], [2, 3]]}
    assert layout(3, 2) == {"pp": [[0, 2, 4], [1, 3, 5]], "dp": [[0, 1], [2, 3], [4, 5]]}
    for pp, dp in ((2, 2), (3, 2), (2, 3)):                 # the layout of pplab.mesh, which the notebook uses
        assert layout(pp, dp) == {"pp": groups("pp", pp=pp, dp=dp), "dp": groups("dp", pp=pp, dp=dp)}


def test_peak_held_by_hand_and_on_pplab_schedules():
    assert peak_held("FFBFBB") == 2 and peak_held("FBFBFB") == 1 and peak_held("") == 0
    for p, m in ((2, 4), (3, 5), (4, 7)):
        one_f_one_b, gpipe = make_schedule("1f1b", p, m), make_schedule("gpipe", p, m)
        assert [peak_held([a.kind for a in one_f_one_b.actions[s]]) for s in range(p)] == list(range(p, 0, -1))
        assert [peak_held([a.kind for a in gpipe.actions[s]]) for s in range(p)] == [m] * p


# -- another correct answer passes -------------------------------------------------------

def step_with_schedule_and_torch_distributed(stage, inputs, targets, loss_fn, m, pp_group, dp_group):
    """pplab.pipeline's 1F1B actions, torch.distributed's isend/recv, one all-reduce per
    parameter, and the loss returned as a tensor."""
    ranks = dist.get_process_group_ranks(pp_group)
    s, pp = ranks.index(dist.get_rank()), len(ranks)
    prev, nxt = (ranks[s - 1] if s else None), (ranks[s + 1] if s + 1 < pp else None)
    pairs = list(zip(inputs.chunk(m), targets.chunk(m)))
    saved, pending, total = {}, [], torch.zeros((), dtype=inputs.dtype)
    for action in make_schedule("1f1b", pp, m).actions[s]:
        i = action.microbatch
        x, y = pairs[i]
        if action.kind == "F":
            if prev is not None:
                x = torch.empty_like(x)
                dist.recv(x, prev)
                x.requires_grad_()
            out = stage(x)
            if nxt is None:
                out = loss_fn(out, y) / m
                total += out.detach()
            else:
                pending.append(dist.isend(out.detach(), nxt))
            saved[i] = x, out
        else:
            x, out = saved.pop(i)
            grad = None
            if nxt is not None:
                grad = torch.empty_like(out)
                dist.recv(grad, nxt)
            out.backward(grad)
            if prev is not None:
                pending.append(dist.isend(x.grad, prev))
    for work in pending:
        work.wait()
    for q in stage.parameters():
        dist.all_reduce(q.grad, group=dp_group)
        q.grad /= dist.get_world_size(dp_group)
    return total if nxt is None else None


def test_another_correct_answer_passes_with_every_part():
    result = checks.run_check("pp_dp_train_step", step_with_schedule_and_torch_distributed)
    assert result, result.message
    assert "Parts: gradients ✔ · loss ✔ · pipeline traffic ✔ · dp all-reduce ✔ · 1F1B memory ✔ (5 of 5)" in \
        result.message


# -- each traffic mistake gets its own words (the record made by hand: no ranks needed) ----------

TRIAL = {"m": 3, "b": 2, "d": 4}                       # one message: 2 × 4 float64, 64 bytes
NEXT, PREV = [(5, 64)] * 3, [(1, 64)] * 3               # stage 1 of replica 1, whose pipeline is ranks 1, 3, 5


@pytest.mark.parametrize("sends, words", [
    (NEXT + PREV, None),
    (PREV + NEXT, None),                                # the order of the messages is 1F1B's business, not traffic's
    (NEXT, r"^it sent 0 messages to rank 1 \(previous stage\); 1F1B sends one gradient per micro-batch, "
                  r"m = 3\.$"),
    (NEXT + PREV + PREV, r"^it sent 6 messages to rank 1 \(previous stage\)"),
    (NEXT + PREV + [(2, 64)], r"^it sent to rank 2, which is not a neighbouring stage of its replica \(the "
                              r"replica's stages are ranks \[1, 3, 5\]\)"),
    (NEXT[:2] + PREV, r"^it sent 2 messages to rank 5 \(next stage\); 1F1B sends one activation per micro-batch"),
    ([(5, 192)] + PREV, r"^it sent 1 messages to rank 5 \(next stage\)"),
    ([(5, 64), (5, 64), (5, 32)] + PREV, r"^it sent a message of 32 bytes to rank 5; one micro-batch's activation is "
                                         r"b × d = 2 × 4 float64, 64 bytes"),
])
def test_pipeline_traffic_mistakes_are_named(sends, words):
    problem = _traffic_problem({"sends_in": {"step": sends}}, TRIAL, 1, [1, 3, 5])
    assert (problem is None) if words is None else re.search(words, problem), problem


def _all_reduce(group, nbytes, kind="all_reduce"):
    return {"kind": kind, "bytes": nbytes, "group": group, "phase": "step"}


@pytest.mark.parametrize("calls, words", [
    ([_all_reduce([2, 3], 160)], None),                  # one bucket of the stage's 20 float64 gradients
    ([_all_reduce([2, 3], 128), _all_reduce([2, 3], 32)], None),       # one call per parameter: as good
    ([], r"^it made no collective: .* all-reduce them over dp_group \(ranks \[2, 3\], the copies of stage 1\)"),
    ([_all_reduce([1, 3, 5], 160)], r"^it all-reduced over ranks \[1, 3, 5\], its replica's pipeline \(pp_group\)"),
    ([_all_reduce([0, 1, 2, 3, 4, 5], 160)], r"^it all-reduced over ranks \[0, 1, 2, 3, 4, 5\], not the copies of its "
                                             r"stage; the copies of stage 1 are dp_group, ranks \[2, 3\]"),
    ([_all_reduce([2, 3], 160)] * 2, r"^it all-reduced 320 bytes over dp_group; the stage's gradients are 160 bytes"),
    ([_all_reduce([2, 3], 160, "broadcast")], r"^it made a broadcast"),
])
def test_dp_all_reduce_mistakes_are_named(calls, words):
    problem = _dp_problem({"collectives": calls}, TRIAL, 1, [2, 3], [1, 3, 5], 160)
    assert (problem is None) if words is None else re.search(words, problem), problem


# -- 1F1B memory: pp - s micro-batches at the peak, no more (GPipe, a warm-up too long) and no fewer
#    (a warm-up too short idles): the events made by hand, no ranks needed -----------------------

def _one_f_one_b(m, warmup):
    return ["F"] * warmup + ["F", "B"] * (m - warmup) + ["B"] * warmup


@pytest.mark.parametrize("s, events, words", [
    (0, _one_f_one_b(5, 2), None),
    (1, _one_f_one_b(5, 1), None),
    (2, _one_f_one_b(5, 0), None),
    (1, _one_f_one_b(5, 2), r"^it held up to 3 micro-batches' activations at once \(forwards whose backward had not "
                            r"run\); 1F1B holds at most pp - s = 2 at stage 1\. Run pp - s - 1 = 1 warm-up forwards"),
    (0, ["F"] * 5 + ["B"] * 5, r"held up to 5 .* All 5 forwards ran before the first backward: that is GPipe's order"),
    (0, _one_f_one_b(5, 1), r"^it held at most 2 micro-batches' activations at once; 1F1B holds pp - s = 3 at stage 0: "
                            r"its warm-up is too short, .* Run pp - s - 1 = 2 warm-up forwards \(pp is the size of "
                            r"pp_group\)"),
    (1, _one_f_one_b(5, 0), r"^it held at most 1 micro-batch's activations at once; 1F1B holds pp - s = 2 at stage 1"),
    (0, _one_f_one_b(4, 2), r"^it ran 4 forwards and 4 backwards of its stage; the step has m = 5"),
])
def test_1f1b_memory_wants_pp_minus_s_at_the_peak(s, events, words):
    from pplab.checks.ch07_hybrid.pp_dp_train_step import _memory_problem
    problem = _memory_problem({"events": events}, {"m": 5, "pp": 3}, s)
    assert problem is None if words is None else re.search(words, problem), problem
