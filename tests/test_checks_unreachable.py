"""Issue 34, item 2: graded, an answer runs where the implementation the exercise asks for does
not exist (pplab/checks/sealed/: fresh_zygote.py, library_view.py, denied.py).

Every route from a student's code to the library's own function (tests/wrong_solutions_unreachable.py)
earns 0 with the note "the library's X is not available while your answer is checked"; the same
submissions, run with a zygote forked from the checker (as before), do reach the library and
score, so the attacks are real. Correct answers keep full marks in
test_checks_sealed.py::test_every_solution_passes_as_the_grader_reads_it.
"""
import os

import pytest

from pplab import checks
from pplab.checks import SourceAnswer, core
from pplab.checks.sealed import fresh_zygote
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
    answer = SourceAnswer("my_broadcast", (("<cell 1>", 1, "from pplab.checks.ch00_start_here.broadcast import _broadcast_inputs\n"
                                            "def my_broadcast(tensor, src):\n    pass\n"),))
    message = _graded("broadcast", answer)
    assert f"pplab.checks.ch00_start_here.broadcast {NOTE}: it is the checker's own module" in message, message


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
    assert "pplab.checks.ch00_start_here.broadcast_rank" in checks_served and "pplab.checks.sealed.rank" in checks_served
    assert "pplab.checks.ch05_sequence_parallel.ring_attention_rank" in checks_served      # a chapter's jobs
    assert not [n for n in checks_served if n.rpartition(".")[2] in ("core", "broadcast", "ring_attention", "ring_checks",
                                                                      "moe_dispatch", "gpipe_order", "denied",
                                                                      "fresh_zygote", "template")]
    assert not [n for n in checks_served if n.startswith("pplab.checks.ch") and not n.endswith("_rank")
                and "import" in served[n][1]]                  # a chapter package's face: empty too
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


# ----------------------------------------------------------------------------------
# Every exercise: listed in DENIED (or EXEMPT, with why), and its denied modules unreachable

def test_every_exercise_is_denied_its_answer_or_says_why_not():
    from pplab.checks.sealed.denied import DENIED, EXEMPT
    assert not set(DENIED) & set(EXEMPT), "an exercise is either denied or exempt"
    missing = sorted(set(checks.EXERCISES) - set(DENIED) - set(EXEMPT))
    assert set(DENIED) | set(EXEMPT) == set(checks.EXERCISES), missing
    assert all(len(why) > 40 for why in EXEMPT.values())
    import importlib.util
    for exercise_id, modules in DENIED.items():          # a misspelt module would deny nothing
        assert modules and all(importlib.util.find_spec(m) is not None for m in modules), exercise_id


def test_no_checker_of_a_denied_exercise_keeps_a_rank_job_or_probe_in_its_own_module():
    """What the ranks run (jobs `_..._rank`, probes `_refuse...`) must come from a *_rank module: a
    graded check's ranks cannot import the checker's (fresh_zygote.py), so a job left there fails
    every correct answer, and a job that imported the checker would bring its references along."""
    import sys
    from pplab.checks.sealed.denied import DENIED
    for exercise_id in DENIED:
        module = sys.modules[checks.EXERCISES[exercise_id].checker.__module__]
        for name, obj in vars(module).items():
            job = name.endswith(("_rank", "_rank_job", "_rank_of_trials")) or name.startswith("_refuse")
            if callable(obj) and job:
                assert obj.__module__.endswith("_rank"), (exercise_id, name, obj.__module__)


_VIEW_EVERY_EXERCISE = r'''
import importlib, json, sys
from pplab.checks import EXERCISES
from pplab.checks.sealed import fresh_zygote, library_view
from pplab.checks.sealed.denied import CHECKS_NOTE, DENIED, note
plans = {e: (fresh_zygote.served(d), d, fresh_zygote.jobs_of(EXERCISES[e].checker)) for e, d in DENIED.items()}
found = {}
for exercise_id, (sources, denies, jobs) in plans.items():
    library_view.install(sources, {m: note(m) for m in denies}, CHECKS_NOTE)
    seen = found[exercise_id] = {}
    for module in denies + (EXERCISES[exercise_id].checker.__module__,):
        try:                              # a stand-in a library module already holds imports: its names refuse
            getattr(importlib.import_module(module), "anything")
        except ImportError as err:
            seen[module] = str(err)
        except AttributeError:
            seen[module] = "imported"
    for module in jobs + ["pplab.checks.sealed.rank", "pplab"]:    # what the ranks run still loads
        try:
            importlib.import_module(module)
            seen[module] = "imported"
        except Exception as err:
            seen[module] = f"{type(err).__name__}: {err}"
print(json.dumps(found))
'''


def test_every_denied_module_of_every_exercise_is_unavailable_through_the_library_view():
    """Launch-free, all exercises in one interpreter: with the view a graded check installs,
    each denied module (and the checker's own) refuses with its note, and the exercise's
    *_rank jobs still load."""
    import json
    import subprocess
    import sys
    from pplab.checks.sealed.denied import DENIED
    root = os.path.dirname(os.path.dirname(os.path.abspath(checks.__file__)))
    out = subprocess.run([sys.executable, "-c", _VIEW_EVERY_EXERCISE], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": os.path.dirname(root)}, check=True).stdout
    found = json.loads(out)
    assert set(found) == set(DENIED)
    for exercise_id, seen in found.items():
        for module in DENIED[exercise_id]:
            assert seen[module].startswith(f"the library's {module} {NOTE}"), (exercise_id, module, seen[module])
        checker = checks.EXERCISES[exercise_id].checker.__module__
        assert seen[checker] == f"{checker} {NOTE}: it is the checker's own module (its references and expected " \
                                "values stay in the checker's process)", (exercise_id, seen[checker])
        assert all(v == "imported" for m, v in seen.items() if m not in DENIED[exercise_id] and m != checker), \
            (exercise_id, seen)


# one exercise of each chapter whose denial came after the first eight (those: the tests above)
_SAMPLE = {"predict_time": "n_bytes, world_size", "ddp_from_scratch": "model, cap_bytes", "f_g": "x",
           "gpipe_order": "num_ranks, num_microbatches, chunks", "megatron_sp_block": "x",
           "zero_bytes": "params", "pp_dp_train_step": "stage", "checkpointed_block": "block",
           "find_layout": "problem"}
_SAMPLE["fp8_blocks"] = "x"                  # chapter 11b


def _imports_every_denied_module(exercise_id):
    """An answer that reaches for each of the exercise's denied modules by three routes and
    raises what each route met: "REACHED" where one got the module's contents. (A route may
    return the empty stand-in a library module already holds: then any name looked up on it
    raises the note.)"""
    from pplab.checks.sealed.denied import DENIED
    answer = checks.EXERCISES[exercise_id].answer
    text = (f"import importlib\nMODULES = {DENIED[exercise_id]!r}\n"
            f"def {answer}(*args, **kwargs):\n"
            "    met, box = [], {}\n"
            "    for m in MODULES:\n"
            "        for route in (lambda: importlib.import_module(m), lambda: __import__(m, fromlist=['_']),\n"
            "                      lambda: [exec('import ' + m + ' as found', box), box['found']][1]):\n"
            "            try:\n"
            "                module = route()\n"
            "                if not [k for k in vars(module) if not k.startswith('__')]:\n"
            "                    getattr(module, 'anything')       # a stand-in: every lookup raises the note\n"
            "                met.append('REACHED ' + m)\n"
            "            except ImportError as err:\n"
            "                met.append(str(err).split(':')[0])\n"
            "    raise RuntimeError(' | '.join(met))\n")
    return SourceAnswer(answer, (("<cell 1>", 1, text),))


@pytest.mark.parametrize("exercise_id", sorted(_SAMPLE))
def test_an_answer_that_imports_its_denied_modules_earns_nothing(exercise_id):
    from pplab.checks.sealed.denied import DENIED
    message = _graded(exercise_id, _imports_every_denied_module(exercise_id))
    assert "REACHED" not in message, message
    for module in DENIED[exercise_id]:
        assert f"the library's {module} is not available while your answer is checked" in message, message


def test_the_same_imports_reach_the_library_without_the_fresh_zygote(monkeypatch):
    """The control: forked from the checker (as before), the routes above do reach the modules."""
    monkeypatch.setattr(core, "DENIED", {})
    result = checks.run_check("gpipe_order", _imports_every_denied_module("gpipe_order"), timeout=20)
    assert "REACHED pplab.pipeline.schedules" in result.message and result.score == 0, result.message
