"""pplab.check: the stub and every plausible wrong answer fail with
a message that says what was wrong."""
import importlib
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import pplab
from pplab import checks, comm
from notebook_answers import solution_notebook, stub


def _wrong_answers() -> dict:
    """Every tests/wrong_solutions*.py's WRONG, gathered per exercise: a new file of wrong answers is
    collected by being there, and two files listing the same exercise add up (neither replaces the other).
    (A file without WRONG holds attacks on the checker, used by its own tests.)"""
    wrong = {}
    for path in sorted(Path(__file__).parent.glob("wrong_solutions*.py")):
        for exercise_id, cases in getattr(importlib.import_module(path.stem), "WRONG", {}).items():
            wrong.setdefault(exercise_id, []).extend(cases)
    return wrong


WRONG_ANSWERS = _wrong_answers()

pytestmark = pytest.mark.usefixtures("no_leftover_processes")


# Every solution passes: each solution notebook (solutions/, run under nbval by `make test`) asserts
# its own pplab.check, and tests/test_checks_sealed.py checks it again as the grader reads it.


@pytest.mark.parametrize("exercise_id", sorted(checks.EXERCISES))
def test_stub_fails_as_not_implemented(exercise_id, capsys):
    result = checks.check(exercise_id, stub(exercise_id))
    assert not result
    assert "is not implemented yet" in result.message
    assert "seed=" not in result.message                 # no input would change that
    assert capsys.readouterr().out.startswith(f"✘ {exercise_id}: ")


CASES = [(ex, fn, patterns, timeout) for ex, cases in WRONG_ANSWERS.items() for fn, patterns, timeout in cases]


@pytest.mark.parametrize("exercise_id, fn, patterns, timeout", CASES,
                         ids=[f"{c[0]}-{c[1].__name__}" for c in CASES])   # pytest -k <exercise id> selects them
def test_wrong_answer_fails_with_a_clear_message(exercise_id, fn, patterns, timeout):
    result = checks.run_check(exercise_id, fn, timeout=timeout or 30.0)
    assert not result
    for pattern in patterns:
        assert re.search(pattern, result.message), f"{pattern!r} not in: {result.message}"


def test_every_exercise_has_wrong_answers():
    assert set(WRONG_ANSWERS) == set(checks.EXERCISES)


# -- other correct answers pass: the check asks for a result, not for one algorithm --

def linear_with_torch_distributed(tensor, src):
    if dist.get_rank() == src:
        for r in range(dist.get_world_size()):
            if r != src:
                dist.send(tensor, r)
    else:
        dist.recv(tensor, src)


def tree_with_nonblocking_sends(tensor, src):
    rank, p = comm.rank(), comm.world_size()
    me, mask = (rank - src) % p, 1
    while mask < p:                       # receive in my round, then post all my sends at once
        if mask <= me < 2 * mask:
            comm.irecv(tensor, (me - mask + src) % p).wait()
        mask *= 2
    handles = []
    while mask > 1:
        mask //= 2
        if me < mask and me + mask < p:
            handles.append(comm.isend(tensor, (me + mask + src) % p))
    for h in handles:
        h.wait()


@pytest.mark.parametrize("fn", [linear_with_torch_distributed, tree_with_nonblocking_sends])
def test_other_correct_broadcasts_pass(fn):
    result = checks.run_check("broadcast", fn)
    assert result, result.message


# -- library collectives are refused ------------------------------------------------

def test_course_collectives_are_refused_too():
    from pplab import collectives
    bc = collectives.broadcast

    def through_module(tensor, src):
        collectives.broadcast(tensor, src)

    def imported_by_name(tensor, src):
        bc(tensor, src)

    result = checks.run_check("broadcast", through_module)
    assert "you called pplab.collectives.broadcast, the library collective it replaces" in result.message
    result = checks.run_check("broadcast", imported_by_name)
    assert "you use pplab.collectives.broadcast" in result.message


# -- the check itself -------------------------------------------------------------

def test_the_seed_reproduces_a_failure():
    from wrong_solutions_ch00_broadcast import broadcast_to_next_only

    first = checks.run_check("broadcast", broadcast_to_next_only, seed=12345)
    again = checks.run_check("broadcast", broadcast_to_next_only, seed=12345)
    assert first.message == again.message and first.seed == 12345
    assert "Re-run with seed=12345 to reproduce." in first.message
    # without a seed, the inputs come from os.urandom: a fresh seed every time
    assert len({checks.run_check("broadcast", broadcast_to_next_only).seed for _ in range(2)}) == 2


def test_trials_cover_every_src_dtype_and_shape():
    from pplab.checks.ch00_start_here import broadcast
    for p in (2, 3, 4):
        trials = broadcast._broadcast_trials(7, p)
        assert {t.src for t in trials} == set(range(p))
        assert {(t.dtype, t.shape) for t in trials} == set(broadcast._BROADCAST_CASES)
        assert any(t.shape == (1,) for t in trials) and any(t.src != 0 for t in trials)
    assert broadcast._broadcast_trials(1, 4) != broadcast._broadcast_trials(2, 4)


def test_unknown_exercise_lists_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown exercise 'brodcast': the exercises are .*broadcast"):
        checks.check("brodcast", print)


def test_wrong_signature_and_missing_answer():
    result = checks.run_check("broadcast", lambda tensor: None)
    assert "must take (tensor, src); yours takes (tensor)" in result.message
    assert "pass your function itself" in checks.run_check("broadcast", 42).message
    assert "has no answer yet" in checks.run_check("broadcast", None).message


def test_result_prints_once_and_is_truthy_only_on_pass(capsys):
    from wrong_solutions_ch00_broadcast import broadcast_with_library

    result = pplab.checks.check("broadcast", broadcast_with_library)
    out = capsys.readouterr().out
    assert out.count("✘ broadcast: exercise 'broadcast' asks you to build broadcast") == 1
    assert not result and bool(checks.CheckResult("x", True, "passed", 0))
    assert repr(result) == "<CheckResult broadcast: failed>"


def test_first_difference():
    a = torch.arange(12.0).reshape(3, 4)
    b = a.clone()
    assert checks.first_difference(a, b) is None
    b[1, 2] = 99.0
    assert checks.first_difference(a, b) == ((1, 2), 6.0, 99.0)
    assert checks.first_difference(a[0], b[0] + 1e-7, atol=1e-6) is None
    assert checks.first_difference(torch.tensor([5, 6]), torch.tensor([5, 7])) == (1, 6, 7)



def test_known_mistake_names_the_first_near_miss_that_matches():
    from pplab.checks.compare import known_mistake
    want = torch.tensor([1.0, -2.0, 3.0])
    mistakes = [(None, "skipped: no such mistake here"), (2 * want, "twice"), (2 * want, "also twice"),
                (torch.zeros(2), "another shape")]
    assert known_mistake(2 * want, mistakes) == " twice"                          # the first that matches
    assert known_mistake(2 * want + 1e-7, mistakes, atol=1e-6) == " twice"        # within the tolerance
    assert known_mistake(2 * want + 1e-5, mistakes, atol=1e-6) == ""              # just outside it
    assert known_mistake(torch.zeros(2), mistakes[:3]) == ""                      # a shape no mistake has
    assert known_mistake(want, []) == ""
    """Later chapters register numeric answers (a bubble fraction): a plain function."""
    @checks.exercise("test_bubble", "GPipe bubble fraction, p=4 stages, m=8 micro-batches", answer="bubble")
    def check_bubble(answer, seed, timeout):
        return checks.check_number(answer, (4 - 1) / (8 + 4 - 1), what="the bubble fraction", rel_tol=1e-3)

    try:
        assert checks.run_check("test_bubble", 3 / 11)
        wrong = checks.run_check("test_bubble", 3 / 12)
        assert not wrong and "the bubble fraction is 0.25, expected 0.272727" in wrong.message
        assert "should be a number, got str" in checks.run_check("test_bubble", "3/11").message
    finally:
        del checks.EXERCISES["test_bubble"]


@pytest.mark.parametrize("exercise_id", sorted(set(checks.EXERCISES) - {"broadcast"}))
def test_solution_notebook_checks_its_own_exercise(exercise_id):
    """Every chapter's solution notebook defines its answer between the markers and checks it."""
    ex = checks.get_exercise(exercise_id)
    sources = [c.source for c in solution_notebook(exercise_id).cells if c.cell_type == "code"]
    assert any(f'pplab.check("{exercise_id}", {ex.answer})' in s for s in sources)
    assert any("### BEGIN SOLUTION" in s and re.search(rf"^(def|class) {ex.answer}\b", s, re.M) for s in sources)


def test_compare_prediction_says_how_far_off(capsys, monkeypatch):
    monkeypatch.delenv("PPLAB_PREDICTIONS_MUST_MATCH")     # a learner's miss only prints
    assert checks.compare_prediction("bytes", 100, 104, rel_tol=0.05)
    assert "3.8% off" in capsys.readouterr().out
    result = checks.compare_prediction("bytes", 100, 150)
    assert not result and "33.3% off" in result.message and "more than 10%" in result.message
    empty = checks.compare_prediction("bytes", None, 12345.0)
    assert not empty and "replace None" in empty.message and "12345" not in capsys.readouterr().out
    assert "is a number" in checks.compare_prediction("bytes", "many", 1.0).message


def test_compare_prediction_explains_a_miss_only(capsys, monkeypatch):
    monkeypatch.delenv("PPLAB_PREDICTIONS_MUST_MATCH")
    checks.compare_prediction("bytes", 100, 101, explain="because of the ring")
    assert "why:" not in capsys.readouterr().out
    checks.compare_prediction("bytes", 100, 150, explain="because of the ring")
    assert "why: because of the ring" in capsys.readouterr().out
    checks.compare_prediction("bytes", None, 150, explain="because of the ring")
    assert "why:" not in capsys.readouterr().out          # nothing to explain before a guess


def test_compare_choice(capsys, monkeypatch):
    monkeypatch.delenv("PPLAB_PREDICTIONS_MUST_MATCH")
    assert checks.compare_choice("idlest rank", 3, 3, choices=range(4))
    wrong = checks.compare_choice("idlest rank", 0, 3, choices=range(4))
    assert not wrong and "but it is 3" in wrong.message
    assert "one of [0, 1, 2, 3]" in checks.compare_choice("idlest rank", 7, 3, choices=range(4)).message
    assert "replace None" in checks.compare_choice("idlest rank", None, 3).message


def test_worked_predictions_must_match_under_the_tests(monkeypatch):
    monkeypatch.setenv("PPLAB_PREDICTIONS_MUST_MATCH", "1")
    assert checks.compare_prediction("bytes", 100, 100)
    with pytest.raises(AssertionError, match="does not match"):
        checks.compare_prediction("bytes", 100, 150)
    with pytest.raises(AssertionError, match="replace None"):
        checks.compare_prediction("bytes", None, 150)
    with pytest.raises(AssertionError, match="but it is"):
        checks.compare_choice("rank", 1, 2)
    assert not checks.compare_prediction("wait", 1.0, 2.0, timed=True)     # a clock's miss: printed only
    with pytest.raises(AssertionError, match="replace None"):
        checks.compare_prediction("wait", None, 2.0, timed=True)
    assert not checks.compare_choice("faster", "inside", "across", timed=True)   # a clock decided: printed only
    with pytest.raises(AssertionError, match="replace None"):
        checks.compare_choice("faster", None, "across", timed=True)
    with pytest.raises(AssertionError, match="one of"):
        checks.compare_choice("faster", "both", "across", choices=("inside", "across"), timed=True)


def test_predictions_in_reads_only_prediction_lines():
    from pplab.checks.predictions import predictions_in
    src = ("p = 4\nmy_bubble = None   # your prediction: the bubble\n"
           "my_peak = (p - 1) * 2  # your prediction\nother = 3  # a comment\n")
    assert predictions_in(src) == {"my_bubble": "None", "my_peak": "(p - 1) * 2"}


@pytest.fixture
def scored_exercises():
    """Two throwaway exercises worth 4 points: one checked in parts, one scored on quality."""
    @checks.exercise("_parts", "parts", answer="f", points=4)
    def _parts(answer, seed, timeout):
        right = answer()
        if right < 4:
            raise checks.Fail(f"{right} of 4 parts right", earned=right)
        return "all parts"

    @checks.exercise("_quality", "quality", answer="f", points=3)
    def _quality(answer, seed, timeout):
        return checks.Scored("bubble against the target", earned=answer())
    yield
    del checks.EXERCISES["_parts"], checks.EXERCISES["_quality"]


def test_a_capstone_right_in_some_parts_earns_those_points(scored_exercises):
    part = checks.run_check("_parts", lambda: 3, seed=1)
    assert not part and part.score == 3 and part.points == 4 and "[3 of 4 points]" in part.message
    whole = checks.run_check("_parts", lambda: 4, seed=1)
    assert whole and whole.score == 4
    assert checks.run_check("_parts", lambda: 9, seed=1).score == 4          # a pass: all, never more


def test_an_answer_scored_on_quality_earns_what_it_is_worth(scored_exercises):
    some = checks.run_check("_quality", lambda: 2, seed=1)
    assert not some and some.score == 2 and "scored bubble against the target [2 of 3 points]" in some.message
    assert checks.run_check("_quality", lambda: 3, seed=1)
    assert checks.run_check("_quality", lambda: 7, seed=1).score == 3      # clamped to the exercise's points
    assert checks.run_check("_quality", lambda: -1, seed=1).score == 0


def test_a_one_point_exercise_reads_as_before():
    result = checks.run_check("one_f_one_b_order", 0.5, seed=1)
    assert result.points == 1 and result.score in (0, 1) and "points]" not in result.message


def test_other_correct_chapter_10_answers_pass():
    """Chapter 10's checks pass right answers written apart from the solutions: a gather by direct
    sends (wrong_solutions_ch10_quantised_gather), the bytes counted group by group (wrong_solutions_ch10_place_layout)."""
    from wrong_solutions_ch10_place_layout import _place
    from wrong_solutions_ch10_quantised_gather import quantised_gather
    for exercise_id, fn in (("quantised_gather", quantised_gather), ("place_layout", _place)):
        result = checks.run_check(exercise_id, fn)
        assert result, result.message
