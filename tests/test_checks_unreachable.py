"""Issue 34, item 2: graded, an answer runs where the implementation the exercise asks for does
not exist (pplab/checks/fresh_zygote.py, library_view.py, denied.py).

Every route from a student's code to the library's own function (tests/wrong_solutions_unreachable.py)
earns 0 with the note "the library's X is not available while your answer is checked"; the same
submissions, run with a zygote forked from the checker (as before), do reach the library and
score, so the attacks are real. Correct answers keep full marks in
test_checks_sealed.py::test_every_solution_passes_as_a_function_and_as_source.
"""
import os

import pytest

from pplab import checks
from pplab.checks import SourceAnswer, core, fresh_zygote
from wrong_solutions_unreachable import ROUTES, TARGETS, every_route, submission

pytestmark = pytest.mark.usefixtures("no_leftover_processes")

NOTE = "is not available while your answer is checked"


def _graded(exercise_id, answer):
    result = checks.run_check(exercise_id, answer, timeout=20)
    assert not result.passed and result.score == 0, result.message
    return result.message


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_each_route_to_the_library_earns_nothing_on_broadcast(route):
    message = _graded("broadcast", submission("broadcast", route))
    if route == "gc.get_objects":                    # the memory holds no function of pplab.collectives at all
        assert "nothing of pplab.collectives in this process's memory" in message, message
    else:
        assert f"the library's pplab.collectives {NOTE}" in message, message


@pytest.mark.parametrize("exercise_id", ["moe_dispatch", "zero_bubble", "ring_attention", "sharded_optimizer", "fsdp"])
def test_every_route_at_once_earns_nothing(exercise_id):
    """One submission tries all nine routes and uses the first that works: none does."""
    module = TARGETS[exercise_id][2]
    message = _graded(exercise_id, every_route(exercise_id))
    assert f"the library's {module} {NOTE}" in message, message


def test_the_checkers_own_modules_are_not_there_either():
    answer = SourceAnswer("my_broadcast", (("<cell 1>", 1, "from pplab.checks.collectives import _broadcast_inputs\n"
                                            "def my_broadcast(tensor, src):\n    pass\n"),))
    message = _graded("broadcast", answer)
    assert f"pplab.checks.collectives {NOTE}: it is the checker's own module" in message, message


@pytest.mark.parametrize("exercise_id, route", [(e, "computed getattr") for e in sorted(TARGETS)
                                                 if e not in ("sharded_optimizer", "fsdp")] +   # capstones: seconds saved
                         [("broadcast", "gc.get_objects"), ("broadcast", "reading the file")])
def test_the_same_submission_scores_where_the_library_is_in_reach(exercise_id, route, monkeypatch):
    """Without the fresh zygote (ranks forked from the checker, as before), these routes reach the
    library and earn marks: what the tests above refuse are real attacks."""
    monkeypatch.setattr(core, "DENIED", {})
    result = checks.run_check(exercise_id, submission(exercise_id, route), timeout=20)
    assert result.score > 0, result.message


def test_what_the_ranks_are_served_holds_no_denied_module_and_no_checker():
    served = fresh_zygote.served(("pplab.collectives", "pplab.sequence_parallel.ring_attention"))
    assert "pplab.comm" not in served and "pplab.runtime.comm" in served and "pplab.split" in served
    assert "pplab.collectives" not in served and "pplab.sequence_parallel.ring_attention" not in served
    assert "pplab.sequence_parallel.ulysses" in served
    checks_served = sorted(n for n in served if n.startswith("pplab.checks."))
    assert "pplab.checks.collectives_rank" in checks_served and "pplab.checks.sealed_rank" in checks_served
    assert not [n for n in checks_served if n.rpartition(".")[2] in ("core", "collectives", "ring_attention_capstone",
                                                                      "expert_parallel", "pipeline", "denied")]
    assert not [n for n in served if n.startswith("pplab.course")]
    assert "import" not in served["pplab.checks"][1]         # the package's face, which imports every checker


def test_the_hidden_folders_keep_only_a_stub_that_says_why():
    import pplab
    hidden = fresh_zygote.hidden_paths(("pplab.collectives", "pplab.sequence_parallel.ring_attention"))
    folder = os.path.realpath(os.path.dirname(pplab.__file__))
    assert set(hidden[folder]) == {"collectives.py", os.path.join("sequence_parallel", "ring_attention.py")}
    assert hidden[folder]["collectives.py"].startswith("raise ImportError(\"the library's pplab.collectives " + NOTE)
    root = os.path.dirname(folder)
    if os.path.exists(os.path.join(root, "solutions")):
        assert hidden[os.path.join(root, "solutions")] == {}
