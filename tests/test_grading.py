"""exercises/ generated from solutions/ (and never stale), and `pplab grade`."""
import os
import shutil
import sys
import time
from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

from pplab import checks
from pplab.course import check_process, cli, exercises, grading, reading, sandbox, submission

REPO = Path(__file__).resolve().parents[1]


# -- exercises from solutions --------------------------------------------------------

def test_exercises_are_up_to_date():
    stale = exercises.sync_exercises(REPO / "solutions", REPO / "exercises", check=True)
    assert not stale, f"exercises/ is out of date ({', '.join(stale)}): run `pplab exercises`"


def test_every_exercise_has_a_solution_notebook_defining_its_answer():
    for ex in checks.EXERCISES.values():
        nb = nbformat.read(REPO / "solutions" / f"{ex.notebook}.ipynb", 4)
        assert any(ex.answer in grading.defined_names(c.source) for c in nb.cells if c.cell_type == "code")


def test_generated_exercise_has_no_solution_and_no_output():
    text = (REPO / "exercises" / "00_broadcast.ipynb").read_text()
    assert "BEGIN SOLUTION" not in text and "mask *= 2" not in text and "999" not in text
    nb = nbformat.reads(text, 4)
    assert all(c.outputs == [] and c.execution_count is None for c in nb.cells if c.cell_type == "code")
    assert any(exercises.MARKDOWN_STUB in c.source for c in nb.cells if c.cell_type == "markdown")


def test_strip_solutions_keeps_the_indent_and_the_rest():
    source = "def f(x):\n    y = 1\n    ### BEGIN SOLUTION\n    return x + y\n    ### END SOLUTION\n\nprint(f)"
    assert exercises.strip_solutions(source, exercises.CODE_STUB) == \
        f"def f(x):\n    y = 1\n    {exercises.CODE_STUB}\n\nprint(f)"
    with pytest.raises(ValueError, match="line 2: ### BEGIN SOLUTION inside another"):
        exercises.strip_solutions("### BEGIN SOLUTION\n### BEGIN SOLUTION", "x", "cell")
    with pytest.raises(ValueError, match="without an ### END SOLUTION"):
        exercises.strip_solutions("a\n### BEGIN SOLUTION\nb", "x", "cell")
    with pytest.raises(ValueError, match="line 1: ### END SOLUTION without"):
        exercises.strip_solutions("### END SOLUTION", "x", "cell")


def test_a_modified_solution_makes_exercises_stale(tmp_path, capsys):
    shutil.copytree(REPO / "solutions", tmp_path / "solutions")
    shutil.copytree(REPO / "exercises", tmp_path / "exercises")
    args = ["exercises", "--solutions", str(tmp_path / "solutions"), "--exercises", str(tmp_path / "exercises")]
    assert cli.main(args + ["--check"]) == 0

    path = tmp_path / "solutions" / "00_broadcast.ipynb"
    nb = nbformat.read(path, 4)
    nb.cells.insert(1, new_markdown_cell("A new paragraph the exercise does not have yet."))
    nbformat.write(nb, path)
    (tmp_path / "exercises" / "99_orphan.ipynb").write_text(nbformat.writes(new_notebook()))
    capsys.readouterr()
    assert cli.main(args + ["--check"]) == 1
    err = capsys.readouterr().err
    assert "00_broadcast.ipynb (stale)" in err and "99_orphan.ipynb (no solution)" in err

    assert cli.main(args) == 0                                         # regenerate
    assert exercises.sync_exercises(tmp_path / "solutions", tmp_path / "exercises", check=True) == \
        ["99_orphan.ipynb (no solution)"]
    assert "A new paragraph" in (tmp_path / "exercises" / "00_broadcast.ipynb").read_text()


# -- finding answers and submissions -------------------------------------------------

def test_defined_names():
    assert grading.defined_names("import os\ndef my_broadcast(t, s):\n    pass\nx = y = 3\nz: int = 1") == \
        ["my_broadcast", "x", "y", "z"]
    assert grading.defined_names("%time x = 1\ndef f():\n    def inner(): pass") == ["f"]
    assert grading.defined_names("def broken(:") == []


def test_find_submissions(tmp_path):
    for path in ["alice.ipynb", "bob/part1.ipynb", "bob/sub/part2.ipynb",
                 "bob/.ipynb_checkpoints/part1-checkpoint.ipynb", "notes.txt", "empty/readme.md"]:
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text("{}")
    found = grading.find_submissions(tmp_path)
    assert {s: [p.relative_to(tmp_path).as_posix() for p in nbs] for s, nbs in found.items()} == \
        {"alice": ["alice.ipynb"], "bob": ["bob/part1.ipynb", "bob/sub/part2.ipynb"]}


def test_timeouts_must_leave_room_for_a_check(tmp_path):
    with pytest.raises(ValueError, match="cell_timeout .* must be longer than check_timeout"):
        grading.grade(tmp_path, tmp_path / "g.csv", cell_timeout=10, check_timeout=30)


def test_definitions_keep_what_the_answer_needs_and_name_what_was_ignored():
    cells = [(2, "import torch\nimport pplab\nfrom pplab import comm as c\nSCALE = 2\nUNUSED = 3"),
             (3, "def helper(t):\n    return t * SCALE\n\nclass Box:\n    size = SCALE"),
             (4, "pplab.checks.run_check = lambda *a, **k: None\nprint('hi')\nfor i in range(3):\n    LOOP = i"),
             (5, "@torch.no_grad()\ndef my_answer(tensor, src=0, *rest, key=None, **more):\n"
                 "    return helper(tensor) + Box.size + LOOP + c.rank()"),
             (6, "def helper(t):\n    return t * 3        # the last definition counts"),
             (7, "x = setattr(pplab, 'grading', None)\nmy_other = x")]
    found = submission.definitions(cells, {"my_answer", "my_other", "missing"})
    answer = found.answers["my_answer"]
    assert [(f, line) for f, line, _ in answer.statements] == \
        [("<cell 2>", 1), ("<cell 2>", 3), ("<cell 2>", 4), ("<cell 3>", 4), ("<cell 5>", 1), ("<cell 6>", 1)]
    assert answer.statements[-2][2].startswith("@torch.no_grad()\ndef my_answer")
    assert answer.params is None                         # decorated: its signature is the decorator's
    assert set(found.answers) == {"my_answer", "my_other"}
    assert found.answers["my_other"].statements == (("<cell 7>", 2, "my_other = x"),)    # x = setattr(...): left out
    assert "ignored cell 4, line 1: `pplab.checks.run_check = ...`: the grader runs only definitions" in found.notes
    assert "ignored cell 7, line 1: `x = ...`: the grader runs only definitions" in found.notes
    assert any("my_answer uses `LOOP`, which no definition at the top level binds" in n for n in found.notes)
    plain = submission.definitions([(1, "def f(a, b=1, *c, d, e=2, **g):\n    pass")], {"f"}).answers["f"]
    assert str(__import__("inspect").signature(plain)) == "(a, b=Ellipsis, *c, d, e=Ellipsis, **g)"


def test_a_source_answer_runs_only_in_a_child():
    answer = checks.SourceAnswer("f", (("<cell 1>", 1, "import os\nPID = os.getpid()\ndef f():\n    return PID"),))
    with pytest.raises(TypeError, match="runs only in a child process"):
        answer()
    import os
    pid = checks.core.call_answer(answer)
    assert isinstance(pid, int) and pid != os.getpid()
    assert "f" not in globals() and "submission" not in sys.modules


def test_a_source_answer_that_loops_or_raises_is_named_not_called_a_deadlock():
    spin = checks.SourceAnswer("measure_bubble", (("<cell 3>", 1, "def measure_bubble(timeline):\n"
                                                                  "    while True:\n        pass"),))
    message = checks.run_check("bubble_fraction", spin, timeout=2).message
    assert "measure_bubble was still running after 2 s, busy on the CPU all along: a loop that never ends?" in message
    assert "deadlock" not in message
    bad = checks.SourceAnswer("measure_bubble", (("<cell 3>", 1, "def measure_bubble(timeline):\n    return 1 / 0"),))
    assert "measure_bubble raised ZeroDivisionError: division by zero (in measure_bubble, line 2: `return 1 / 0`)" \
        in checks.run_check("bubble_fraction", bad).message


def test_results_from_a_rank_are_decoded_as_plain_data_only(tmp_path):
    """Whatever a rank sends back cannot run code in the caller: no pickle of an object."""
    import pplab

    marker = tmp_path / "ran"

    class Evil:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    def job():
        return Evil()

    with pytest.raises(pplab.LaunchError, match="not plain data"):
        pplab.launch(job, world_size=1, safe_results=True)
    assert not marker.exists()
    assert pplab.launch(lambda: {"a": (1, 2.5, "s", None, b"x")}, world_size=1, safe_results=True) == \
        [{"a": (1, 2.5, "s", None, b"x")}]
    with pytest.raises(Exception):
        checks.core.decode(__import__("pickle").dumps(Evil()))
    assert not marker.exists()


# -- grading a folder of submissions -------------------------------------------------

def _write(path, *sources):
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(new_notebook(cells=[new_code_cell(s) for s in sources]), path)


@pytest.mark.usefixtures("no_leftover_processes")
def test_a_notebook_that_ignores_interrupts_is_killed_with_everything_it_started(tmp_path):
    """Ctrl-C ignored, ranks still running: at the notebook's limit the runner, the kernel
    and the ranks are all killed (the fixture checks that nothing is left)."""
    path = tmp_path / "gus.ipynb"
    _write(path, "import signal, time\nimport pplab\nsignal.signal(signal.SIGINT, signal.SIG_IGN)",
           "def stuck():\n    time.sleep(10**6)\n\npplab.launch(stuck, world_size=2, timeout=10**6)")
    started = time.monotonic()
    grade = grading.grade_notebook(path, timeout=10, cell_timeout=60, check_timeout=5)   # the notebook limit fires first
    assert "stopped after 10 s (the notebook's time limit)" in grade.notes
    assert grade.passed == {} and time.monotonic() - started < 60


# The end-to-end runs of `pplab grade` over a folder of good, broken and attacking notebooks
# are one run, in tests/test_grading_hostile.py.


# Every solution graded from its source, as the grader takes it (nothing ignored): in
# tests/test_checks_sealed.py::test_every_solution_passes_as_the_grader_reads_it.


def test_the_predictions_a_student_filled_in_go_with_the_written_answers():
    cells = [(1, "code", "my_bubble = 3 / 8   # your prediction: the bubble\nmy_peak = None  # your prediction: peak"),
             (2, "code", "x = 1   # not a prediction"),
             (3, "markdown", "I think the last rank idles most.")]
    assert reading.written_answers(cells, set()) == [
        (1, "predictions: `my_bubble = 3 / 8`"), (3, "I think the last rank idles most.")]


def test_solution_lines_count_the_code_between_the_markers():
    nb = new_notebook(cells=[
        new_code_cell("import torch\n### BEGIN SOLUTION\nx = 1\n\n# a comment\ny = 2  # trailing\n### END SOLUTION\nz = 3"),
        new_markdown_cell("### BEGIN SOLUTION\nprose is not code\n### END SOLUTION"),
        new_code_cell("def f():\n    ### BEGIN SOLUTION\n    return 1\n    ### END SOLUTION")])
    assert exercises.solution_lines(nb) == 3
    table = exercises.exercises_table({"02_ddp_from_scratch.ipynb": nb, "09z_unknown.ipynb": nb})
    assert "| `02_ddp_from_scratch` | 2 | DDP from scratch" in table and "| 3 | 1 |" in table
    assert "| `09z_unknown` | 9z | (no check) | 3 | - |" in table and "6 lines of solution code" in table


# -- the grader's own check process, in its sandbox -------------------------------------

@pytest.mark.skipif(sandbox.why_not() is not None, reason="no namespace sandbox on this machine")
@pytest.mark.parametrize("exercise_id", ["ddp_from_scratch", "sharded_optimizer", "fsdp"])
def test_solutions_pass_in_the_graders_check_process(exercise_id):
    """Checked as `pplab grade` checks them: in a check process, in the grader's sandbox (as root
    here, under a uid of its own), with ranks forked from a non-dumpable fresh zygote. These three
    once lost every point there: a rank could not lock its mounts, then looked for its working
    folder under the /tmp its own tmpfs covered ("FileNotFoundError: .../pplab-answer-...")."""
    from notebook_answers import solution_definitions

    name, found = solution_definitions(exercise_id)
    answer = found.answers[name]
    verdict = check_process.run_check_process(exercise_id, answer, check_process.pplab_sources(), 60)
    assert verdict.passed and verdict.score == checks.get_exercise(exercise_id).points, verdict.message
