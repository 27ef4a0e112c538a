"""exercises/ generated from solutions/ (and never stale), and `pplab grade`."""
import csv
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

from pplab import checks, cli, grading

REPO = Path(__file__).resolve().parents[1]
PPLAB = [sys.executable, "-m", "pplab.cli"]


# -- exercises from solutions --------------------------------------------------------

def test_exercises_are_up_to_date():
    stale = grading.sync_exercises(REPO / "solutions", REPO / "exercises", check=True)
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
    assert any(grading.MARKDOWN_STUB in c.source for c in nb.cells if c.cell_type == "markdown")


def test_strip_solutions_keeps_the_indent_and_the_rest():
    source = "def f(x):\n    y = 1\n    ### BEGIN SOLUTION\n    return x + y\n    ### END SOLUTION\n\nprint(f)"
    assert grading.strip_solutions(source, grading.CODE_STUB) == \
        f"def f(x):\n    y = 1\n    {grading.CODE_STUB}\n\nprint(f)"
    with pytest.raises(ValueError, match="line 2: ### BEGIN SOLUTION inside another"):
        grading.strip_solutions("### BEGIN SOLUTION\n### BEGIN SOLUTION", "x", "cell")
    with pytest.raises(ValueError, match="without an ### END SOLUTION"):
        grading.strip_solutions("a\n### BEGIN SOLUTION\nb", "x", "cell")
    with pytest.raises(ValueError, match="line 1: ### END SOLUTION without"):
        grading.strip_solutions("### END SOLUTION", "x", "cell")


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
    assert grading.sync_exercises(tmp_path / "solutions", tmp_path / "exercises", check=True) == \
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


def test_the_grader_cell_prints_one_tagged_result(capsys):
    grading.grade_in_kernel("broadcast", {"my_broadcast": None}, "my_broadcast", "n0nce", 5.0)
    grading.grade_in_kernel("broadcast", {}, "my_broadcast", "n0nce", 5.0)
    lines = capsys.readouterr().out.splitlines()
    results = [json.loads(line.removeprefix("n0nce ")) for line in lines if line.startswith("n0nce ")]
    assert [r["passed"] for r in results] == [False, False]
    assert results[0]["message"] == "my_broadcast has no answer yet."
    assert results[1]["message"] == "my_broadcast was not defined (its cell raised an error?)"


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
    # crashes the kernel after a correct answer; the later wrong answer never runs
    _write(subs / "dan.ipynb", "from pplab import comm", _solution_cell(), "import os\nos._exit(1)",
           "def my_broadcast(tensor, src):\n    pass")
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
    ids = list(checks.EXERCISES)
    assert list(rows["ada"]) == ["student", *ids, "total", "notes"]
    scores = {s: (int(r["broadcast"]), int(r["total"])) for s, r in rows.items()}
    assert scores == {"ada": (1, 1), "bob": (0, 0), "cyd": (1, 1), "dan": (1, 1), "eve": (0, 0),
                      "hal": (0, 0)}, rows
    assert rows["ada"]["notes"] == "cell 3 timed out after 20 s"
    assert "is not implemented yet" in rows["bob"]["notes"]
    assert rows["cyd"]["notes"] == ""
    assert "kernel died in cell 3" in rows["dan"]["notes"]
    assert "still waiting after 6 s: a deadlock?" in rows["eve"]["notes"]
    assert rows["hal"]["notes"].startswith("could not run the notebook: NotJSONError")


@pytest.mark.usefixtures("no_leftover_processes")
def test_a_notebook_that_ignores_interrupts_is_killed_with_everything_it_started(tmp_path):
    """Ctrl-C ignored, ranks still running: at the notebook's limit the runner, the kernel
    and the ranks are all killed (the fixture checks that nothing is left)."""
    path = tmp_path / "gus.ipynb"
    _write(path, "import signal, time\nimport pplab\nsignal.signal(signal.SIGINT, signal.SIG_IGN)",
           "def stuck():\n    time.sleep(10**6)\n\npplab.launch(stuck, world_size=2, timeout=10**6)")
    started = time.monotonic()
    grade = grading.grade_notebook(path, timeout=15, cell_timeout=10, check_timeout=5)
    assert grade.notes[-1] == "stopped after 15 s (the notebook's time limit)"
    assert grade.passed == {} and time.monotonic() - started < 60
