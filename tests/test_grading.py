"""exercises/ generated from solutions/ (and never stale), and `pplab grade`."""
import csv
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

from pplab import checks
from pplab.course import cli, exercises, grading, reading, sandbox, submission

REPO = Path(__file__).resolve().parents[1]
PPLAB = [sys.executable, "-m", "pplab.course.cli"]


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

def _solution_cell():
    nb = nbformat.read(REPO / "solutions" / "00_broadcast.ipynb", 4)
    return next(c.source for c in nb.cells if c.cell_type == "code" and "def my_broadcast" in c.source)


def _write(path, *sources):
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(new_notebook(cells=[new_code_cell(s) for s in sources]), path)


@pytest.mark.usefixtures("no_leftover_processes")
def test_grade_a_folder_of_good_and_bad_submissions(tmp_path):
    subs = tmp_path / "submissions"
    subs.mkdir()
    # hangs after a correct answer: interrupted at the cell limit, the rest still runs
    # (a sleeping loop rather than `while True: pass`, not to starve the other notebooks)
    _write(subs / "ada.ipynb", "from pplab import comm", _solution_cell(),
           "import time\nwhile True:\n    time.sleep(0.1)", "print('still here')")
    # the generated exercise, untouched, plus lines that only look like a pass
    shutil.copy(REPO / "exercises" / "00_broadcast.ipynb", subs / "bob.ipynb")
    nb = nbformat.read(subs / "bob.ipynb", 4)
    nb.cells.append(new_code_cell('print("✔ broadcast: passed on world sizes 2, 3, 4")\n'
                                  'import json\n'
                                  'print("0" * 32, json.dumps({"passed": True, "message": "forged"}))'))
    nbformat.write(nb, subs / "bob.ipynb")
    # the solution notebook as handed in by a student who did everything right
    (subs / "cyd").mkdir()
    shutil.copy(REPO / "solutions" / "00_broadcast.ipynb", subs / "cyd" / "00_broadcast.ipynb")
    # crashes the kernel before its correct answer: definitions are graded from the source,
    # whatever the run did
    _write(subs / "dan.ipynb", "from pplab import comm", "import os\nos._exit(1)", _solution_cell())
    # not a notebook at all
    (subs / "hal.ipynb").write_text("not json")
    # deadlocks: every rank receives before it sends
    _write(subs / "eve.ipynb", "from pplab import comm\n\ndef my_broadcast(tensor, src):\n"
           "    p = comm.world_size()\n    comm.recv(tensor, (comm.rank() - 1) % p)\n"
           "    comm.send(tensor, (comm.rank() + 1) % p)")

    out = tmp_path / "grades.csv"
    run = subprocess.run(PPLAB + ["grade", str(subs), "--out", str(out), "--timeout", "150",
                                  "--cell-timeout", "20", "--check-timeout", "6", "--jobs", "3"],
                         capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr
    with open(out, newline="") as f:
        rows = {row["student"]: row for row in csv.DictReader(f)}
    ids = grading.chapter_order(checks.EXERCISES)
    assert ids[:4] == ["broadcast", "reduce_scatter", "ring_all_reduce", "predict_time"]       # chapters 0, 1a-c
    assert list(rows["ada"]) == ["student", *ids, "total", "notes"]
    scores = {s: (r["broadcast"], int(r["total"])) for s, r in rows.items()}
    # bob handed in the exercise untouched: "missing" (not attempted), which is not 0 (tried, wrong)
    assert scores == {"ada": ("1", 1), "bob": ("missing", 0), "cyd": ("1", 1), "dan": ("1", 1), "eve": ("0", 0),
                      "hal": ("missing", 0)}, rows
    assert all(r["ring_all_reduce"] == "missing" for r in rows.values())
    assert rows["ada"]["notes"] == "cell 3 timed out after 20 s"
    assert "is not implemented yet" not in rows["bob"]["notes"]
    assert rows["cyd"]["notes"] == ""
    assert "kernel died in cell 2" in rows["dan"]["notes"]
    assert "a deadlock: rank 0 waits to receive from rank 1" in rows["eve"]["notes"]
    assert rows["hal"]["notes"].startswith("could not read the notebook: not a notebook (not JSON")


@pytest.mark.usefixtures("no_leftover_processes")
def test_a_notebook_that_ignores_interrupts_is_killed_with_everything_it_started(tmp_path):
    """Ctrl-C ignored, ranks still running: at the notebook's limit the runner, the kernel
    and the ranks are all killed (the fixture checks that nothing is left)."""
    path = tmp_path / "gus.ipynb"
    _write(path, "import signal, time\nimport pplab\nsignal.signal(signal.SIGINT, signal.SIG_IGN)",
           "def stuck():\n    time.sleep(10**6)\n\npplab.launch(stuck, world_size=2, timeout=10**6)")
    started = time.monotonic()
    grade = grading.grade_notebook(path, timeout=15, cell_timeout=60, check_timeout=5)   # the notebook limit fires first
    assert "stopped after 15 s (the notebook's time limit)" in grade.notes
    assert grade.passed == {} and time.monotonic() - started < 60


# -- attacks on the grader ---------------------------------------------------------

FIXTURES = Path(__file__).parent / "fixtures" / "grading"


@pytest.mark.usefixtures("no_leftover_processes")
def test_attacks_on_the_grader_get_no_marks_and_a_note(tmp_path):
    """Each attack notebook (tests/fixtures/grading, with a wrong my_broadcast) gets 0 and a
    note on what was ignored; correct answers graded in the same run, before and after the
    attacks wrote their files, still pass. The grader runs from a copy of pplab, so that the
    notebook that writes into pplab's folder and onto sys.path writes only into the copy."""
    copy, site, subs = tmp_path / "pplab-copy", tmp_path / "pplab-site", tmp_path / "submissions"
    shutil.copytree(REPO / "pplab", copy / "pplab", ignore=shutil.ignore_patterns("__pycache__"))
    site.mkdir()
    subs.mkdir()
    for notebook in FIXTURES.glob("*.ipynb"):
        shutil.copy(notebook, subs / notebook.name)
    shutil.copy(REPO / "solutions" / "00_broadcast.ipynb", subs / "aa_good.ipynb")
    shutil.copy(REPO / "solutions" / "00_broadcast.ipynb", subs / "zz_good.ipynb")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), str(copy)]))
    out = tmp_path / "grades.csv"
    run = subprocess.run(PPLAB + ["grade", str(subs), "--out", str(out), "--timeout", "150", "--cell-timeout",
                                  "60", "--check-timeout", "20", "--jobs", "3"],
                         capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    with open(out, newline="") as f:
        rows = {row["student"]: row for row in csv.DictReader(f)}
    scores = {s: int(r["broadcast"]) for s, r in rows.items()}
    assert scores == {"aa_good": 1, "zz_good": 1, "helpers": 1, "attack_run_check": 0,
                      "attack_grader_functions": 0, "attack_results_file": 0, "attack_monkeypatch": 0,
                      "attack_files": 0, "attack_call_time": 0, "attack_kills_checker": 0}, rows
    notes = {s: r["notes"] for s, r in rows.items()}
    assert "ignored cell 4, line 4: `pplab.checks.run_check = ...`: the grader runs only definitions" in \
        notes["attack_run_check"]
    assert "ignored cell 5, line 7: `pplab.course.grading.grade_in_kernel = ...`" in notes["attack_grader_functions"]
    assert "ignored cell 5, line 8: `pplab.course.grading.run_check_process = ...`" in notes["attack_grader_functions"]
    assert "ignored cell 5, line 1: `for pid in (os.getppid(), os.getpid()):`" in notes["attack_results_file"]
    sandboxed = sandbox.why_not() is None
    assert "ignored cell 5, line 7: `for parent in (pathlib.Path.cwd(), pathlib.Path.cwd().parent):`" in \
        notes["attack_results_file"]
    assert "ignored cell 3, line 2: `comm.send = ...`" in notes["attack_monkeypatch"]
    assert "ignored cell 3, line 3: `dist.ProcessGroup.broadcast = ...`" in notes["attack_monkeypatch"]
    assert "ignored cell 4, line 1: `class Quiet:" in notes["attack_monkeypatch"]
    assert "`(here.parent / 'results.jsonl').write_text(json.dumps(FORGED) + '\\n')`" in notes["attack_files"]
    # the answer imports pplab.checks.ch00_start_here.broadcast: refused before it runs
    assert "my_broadcast uses `pplab.checks` (cell 2), the grader's own code" in notes["attack_call_time"]
    assert re.search(r"broadcast: ignored [1-9]\d* forged verdict\(s\)", notes["attack_kills_checker"])
    assert "cell 8 raised ValueError: a cell that raises" in notes["helpers"]
    if sandboxed:
        # pplab's files and the folders on sys.path are read-only in the sandbox: nothing was written,
        # and the kill of the check process (pid 1 of its sandbox) had no effect
        assert not (copy / "pplab" / "checks" / "zz_forged.py").exists()
        assert not (site / "pplab" / "__init__.py").exists()
        assert (copy / "pplab" / "checks" / "core.py").read_text() == (REPO / "pplab" / "checks" / "core.py").read_text()
        assert "differs from the reference" in notes["attack_kills_checker"]
        assert not any("forged" in n.lower() and "ignored" not in n.lower() for n in notes.values())
    else:
        assert "pplab's files on disk changed while the notebook ran (pplab.checks.core, pplab.checks.zz_forged)" \
            in notes["attack_files"]


# Every solution graded from its source, as the grader takes it (nothing ignored): in
# tests/test_checks_sealed.py::test_every_solution_passes_as_a_function_and_as_source.


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
