"""How the grader reads submissions: one submission never stops the grading run, and students are
told apart (issue 34, items 1 and 4). Unit tests of the bounded reader (pplab/course/reading.py),
the prediction lines (pplab/checks/prediction_lines.py) and the students' identities
(pplab/course/students.py); the one grading run with hostile files is in test_grading_hostile.py.
"""
import csv
import json
import os
import random
import re
import socket
import stat
import subprocess
import sys
import unicodedata
import urllib.parse
from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

from pplab.course import grading, reading, students, submission

REPO = Path(__file__).resolve().parents[1]
ANSWERS = {"my_broadcast": ["00_broadcast"]}
SOLUTION = next(c.source for c in nbformat.read(REPO / "solutions" / "00_broadcast.ipynb", 4).cells
                if c.cell_type == "code" and "def my_broadcast" in c.source)


def _write(path, *sources, markdown=()):
    nbformat.write(new_notebook(cells=[new_markdown_cell(m) for m in markdown] +
                                [new_code_cell(s) for s in sources]), path)
    return path


# -- the prediction lines: linear, and the same as a plain reading line by line ----------

def _reference_predictions(source: str) -> dict:
    """Independent of the regular expression: each line split at its first '=', the value
    ending at the first '#' followed (after blanks) by the words 'your prediction'."""
    found = {}
    for line in source.split("\n"):
        name, equals, rest = line.partition("=")
        name = name.rstrip(" \t")
        if not equals or not re.fullmatch(r"[A-Za-z_]\w*", name):
            continue
        at = rest.find("#")
        while at >= 0:
            after = rest[at + 1:].lstrip(" \t")
            if after.startswith("your prediction") and not re.match(r"\w", after[len("your prediction"):]):
                found[name] = rest[:at].strip(" \t")
                break
            at = rest.find("#", at + 1)
    return found


HOSTILE_LINES = [
    "x =" + " " * 20_000,                                   # issue 34: days with the old pattern
    "x = 1" + " " * 20_000 + "2",
    "x = " + "# " * 20_000,
    "x = #" + " " * 20_000 + "y",
    "x = " + " \t" * 10_000 + "# your predictio",
    "y" * 20_000 + " =",
    ("x = 1 #" + " " * 50) * 2_000,
    "\n".join(["z = 1 " + " " * 30] * 5_000),
    "x = " + " " * 20_000 + "# your prediction",
]


def test_hostile_prediction_lines_are_read_in_a_moment():
    """In a child with a deadline: the old pattern never returns on these (a wall clock on
    the main path would be flaky; a hang is what this catches)."""
    code = ("import importlib.util, json, sys\n"            # the module alone: `import pplab` would load torch
            "spec = importlib.util.spec_from_file_location('lines', sys.argv[1])\n"
            "lines = importlib.util.module_from_spec(spec)\nspec.loader.exec_module(lines)\n"
            "print(json.dumps([lines.predictions_in(s) for s in json.load(sys.stdin)]))")
    run = subprocess.run([sys.executable, "-c", code, str(REPO / "pplab" / "checks" / "prediction_lines.py")],
                         input=json.dumps(HOSTILE_LINES), capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout) == [_reference_predictions(s) for s in HOSTILE_LINES]
    assert json.loads(run.stdout)[-1] == {"x": ""}


def test_prediction_lines_match_a_plain_reading_of_every_notebook_and_edge_case():
    from pplab.checks.predictions import predictions_in

    sources = ["".join(c["source"]) for folder in ("solutions", "exercises", "notebooks")
               for nb in sorted((REPO / folder).glob("*.ipynb")) for c in json.loads(nb.read_text())["cells"]
               if c["cell_type"] == "code"]
    sources += ["x = 3 # your prediction", "x=3#your prediction: y", 'x = "a#b"   #  your prediction',
                "x = 1 # your predictions", "x = 1 # your prediction # your prediction", "  x = 1 # your prediction",
                "x = # your prediction", "x = a  b \t # your prediction", "x == 3  # your prediction",
                "1x = 3  # your prediction", "x.y = 3  # your prediction", "x = 3  # your prediction_",
                "x = 3  # your prediction\ny = 'a # your prediction' # your prediction"]
    found = [predictions_in(s) for s in sources]
    assert found == [_reference_predictions(s) for s in sources]
    assert sum(map(len, found)) > 40                       # the course's prediction lines were among them


# -- only regular files are read ------------------------------------------------------

def _specials(folder: Path) -> dict:
    """A FIFO, a socket, a folder and a link, each named *.ipynb: {name: what the note says}."""
    os.mkfifo(folder / "fifo.ipynb")
    with socket.socket(socket.AF_UNIX) as s:
        try:
            s.bind(str(folder / "socket.ipynb"))
        except OSError:                                    # a path too long for a socket's address
            os.mknod(folder / "socket.ipynb", stat.S_IFSOCK | 0o600)
    (folder / "folder.ipynb").mkdir()
    (folder / "link.ipynb").symlink_to("/etc/passwd")
    return {"fifo": "a named pipe (FIFO)", "socket": "a socket", "folder": "a folder", "link": "a symbolic link"}


@pytest.mark.timeout(60)
def test_a_fifo_socket_folder_or_link_is_refused_by_name_without_waiting(tmp_path):
    kinds = _specials(tmp_path)
    for name, words in kinds.items():
        with pytest.raises(reading.Unreadable, match=re.escape(f"{name}.ipynb is {words}, not a notebook file")):
            reading.read_bytes(tmp_path / f"{name}.ipynb")
    nb = _write(tmp_path / "ok.ipynb", "x = 1")
    assert reading.read_bytes(nb) == nb.read_bytes()


@pytest.mark.timeout(60)
def test_a_fifo_swapped_in_after_the_check_is_opened_without_waiting_and_refused(tmp_path, monkeypatch):
    os.mkfifo(tmp_path / "late.ipynb")
    regular = os.stat(_write(tmp_path / "ok.ipynb", "x = 1"))
    monkeypatch.setattr(reading.os, "lstat", lambda path: regular)   # as if it were a file when looked at
    with pytest.raises(reading.Unreadable, match=r"late.ipynb is a named pipe \(FIFO\), not a notebook file"):
        reading.read_bytes(tmp_path / "late.ipynb")


def test_special_files_give_their_student_a_row_and_the_others_are_found(tmp_path):
    kinds = _specials(tmp_path)
    _write(tmp_path / "ada.ipynb", "x = 1")
    (tmp_path / "bea").mkdir()
    _write(tmp_path / "bea" / "part1.ipynb", "x = 1")
    os.mkfifo(tmp_path / "bea" / "part2.ipynb")
    (tmp_path / "bea" / "deep").mkdir()
    (tmp_path / "bea" / "deep" / "linked").symlink_to(tmp_path)
    refused = {}
    found = students.find_submissions(tmp_path, refused)
    assert {s: [p.relative_to(tmp_path).as_posix() for p in nbs] for s, nbs in found.items()} == \
        {"ada": ["ada.ipynb"], "bea": ["bea/part1.ipynb"]}
    assert sorted(refused) == ["bea", *sorted(kinds)]
    for name, words in kinds.items():
        assert refused[name][0].startswith(f"{name}.ipynb is {words}"), refused[name]
    assert refused["bea"] == [
        "bea/part2.ipynb is a named pipe (FIFO), not a notebook file: refused, hand in the .ipynb file Jupyter saves",
        f"bea/deep/linked is a symbolic link (to {tmp_path}): refused, hand in the notebook itself"]


def test_a_student_folder_is_searched_only_so_deep_and_for_so_many_notebooks(tmp_path, monkeypatch):
    monkeypatch.setattr(students, "MAX_DEPTH", 2)
    monkeypatch.setattr(students, "MAX_NOTEBOOKS", 3)
    deep = tmp_path / "cal" / "a" / "b" / "c"
    deep.mkdir(parents=True)
    for folder in (tmp_path / "cal", tmp_path / "cal" / "a", deep):
        _write(folder / "nb.ipynb", "x = 1")
    for k in range(3):
        _write(tmp_path / "cal" / "a" / f"more{k}.ipynb", "x = 1")
    refused = {}
    found = students.find_submissions(tmp_path, refused)
    assert [p.relative_to(tmp_path).as_posix() for p in found["cal"]] == \
        ["cal/a/more0.ipynb", "cal/a/more1.ipynb", "cal/nb.ipynb"]
    assert refused["cal"] == ["cal/a/more2.ipynb: more than 3 notebooks, the most the grader takes from one "
                              "student: skipped",
                              "cal/a/nb.ipynb: more than 3 notebooks, the most the grader takes from one student: "
                              "skipped",
                              "cal/a/b/c: more than 2 folders deep, not searched for notebooks"]


# -- what is done with the bytes: in a child, with a deadline and a memory limit ----------

def test_the_child_reads_what_the_grader_would_read_in_its_own_process(tmp_path):
    path = _write(tmp_path / "nb.ipynb", "from pplab import comm", SOLUTION,
                  "my_bubble = 3 / 8   # your prediction: the bubble",
                  "x =" + " " * 20_000 + "\nmy_peak = 2" + " " * 20_000 + "# your prediction",
                  markdown=["I think the tree needs ceil(log2 p) rounds."])
    got = reading.read_submission(path, ANSWERS)
    cells, notes = reading.read_cells(path)
    expected = submission.definitions([(n, src) for n, kind, src in cells if kind == "code"], set(ANSWERS))
    assert got.notes == notes == []
    assert got.found.answers == expected.answers and got.found.notes == expected.notes
    assert got.found.answers["my_broadcast"].params == (("tensor", "positional_or_keyword", False),
                                                        ("src", "positional_or_keyword", False))
    assert got.written == [(1, "I think the tree needs ceil(log2 p) rounds."),
                           (4, "predictions: `my_bubble = 3 / 8`"), (5, "predictions: `my_peak = 2`")]


def test_the_child_runs_pplab_as_the_grader_read_it_not_the_files_on_disk(tmp_path):
    """A notebook run without the sandbox could rewrite submission.py: the reader runs the
    sources the grader read before grading began (here, one changed to say so)."""
    from pplab.course.check_process import pplab_sources

    sources = pplab_sources()
    file, text, package = sources["pplab.course.submission"]
    sources["pplab.course.submission"] = [file, text + (
        "\n_read = definitions\n\ndef definitions(cells, answers):\n    found = _read(cells, answers)\n"
        "    found.notes.append('read from the snapshot')\n    return found\n"), package]
    got = reading.read_submission(_write(tmp_path / "nb.ipynb", SOLUTION), ANSWERS, sources=sources)
    assert got.found.notes == ["read from the snapshot"] and "my_broadcast" in got.found.answers


@pytest.mark.timeout(120)
@pytest.mark.parametrize("data, note", [
    (b"{ not json", "not a notebook (not JSON: JSONDecodeError)"),
    (b"[" * 1_000_000 + b"]" * 1_000_000, "not a notebook (not JSON: RecursionError)"),
    (json.dumps({"worksheets": [], "nbformat": 3}).encode(), "nbformat 3: open and save it in Jupyter"),
    (b"\xff\xfe" + random.Random(0).randbytes(2048), "not a notebook (not JSON"),   # the same in every xdist process
])
def test_what_is_not_a_notebook_is_refused_with_a_note(tmp_path, data, note):
    (tmp_path / "x.ipynb").write_bytes(data)
    with pytest.raises(reading.Unreadable, match=re.escape(note)):
        reading.read_submission(tmp_path / "x.ipynb", ANSWERS)


@pytest.mark.timeout(120)
def test_a_million_cells_cost_a_moment_and_a_note(tmp_path):
    cells = [new_code_cell(SOLUTION)] + [{}] * 1_000_000
    (tmp_path / "x.ipynb").write_text(json.dumps({"cells": cells, "nbformat": 4}))
    got = reading.read_submission(tmp_path / "x.ipynb", ANSWERS, seconds=60)
    assert "my_broadcast" in got.found.answers
    assert got.notes[0] == (f"the notebook has 1,000,001 cells, more than the grader reads ({reading.MAX_CELLS:,}): "
                            f"cells after {reading.MAX_CELLS:,} were skipped")
    assert got.notes[1] == "cell 2 is not a well-formed cell (no cell_type or source): skipped"
    assert got.notes[10:] == [f"and {reading.MAX_CELLS - 1 - 9:,} more cells skipped for these reasons"]


@pytest.mark.timeout(120)
def test_a_parse_that_never_ends_is_killed_with_a_note(tmp_path, monkeypatch):
    pid_file = tmp_path / "pid"
    monkeypatch.setattr(reading, "BOOT", f"import os, time\nopen({str(pid_file)!r}, 'w').write(str(os.getpid()))\n"
                                         f"time.sleep(600)")
    path = _write(tmp_path / "nb.ipynb", SOLUTION)
    with pytest.raises(reading.Unreadable, match=r"reading it \(JSON, cells, Python's parser\) took more than 2 s, "
                                                 r"the grader's limit for one notebook"):
        reading.read_submission(path, ANSWERS, seconds=2)
    if pid_file.exists():                                  # it started before the deadline: it is gone now
        assert not Path(f"/proc/{pid_file.read_text()}").exists()


@pytest.mark.timeout(120)
def test_a_parse_that_needs_too_much_memory_is_stopped_with_a_note(tmp_path):
    (tmp_path / "x.ipynb").write_bytes(b'{"cells": [' + b"[]," * 1_500_000 + b'[]], "nbformat": 4}')
    with pytest.raises(reading.Unreadable, match=r"reading it needed more than 0.0625 GiB, the grader's limit"):
        reading.read_submission(tmp_path / "x.ipynb", ANSWERS, memory=64 << 20)


def test_a_reader_that_crashes_gives_a_note_not_a_grader_crash(tmp_path, monkeypatch):
    monkeypatch.setattr(reading, "BOOT", "import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)")
    with pytest.raises(reading.Unreadable, match=r"the grader's reader stopped on it \(signal 11"):
        reading.read_submission(_write(tmp_path / "nb.ipynb", SOLUTION), ANSWERS)


# -- one identity per student ---------------------------------------------------------

NFC, NFD = unicodedata.normalize("NFC", "zoë"), unicodedata.normalize("NFD", "zoë")


def test_names_that_read_as_one_student_are_each_refused_with_a_note(tmp_path):
    _write(tmp_path / f"{NFC}.ipynb", "x = 1")
    (tmp_path / NFD).mkdir()
    _write(tmp_path / NFD / "a.ipynb", "x = 1")
    _write(tmp_path / "Bob.ipynb", "x = 1")
    _write(tmp_path / "bob.ipynb", "x = 1")
    _write(tmp_path / "bob smith.ipynb", "x = 1")
    _write(tmp_path / "bob_smith.ipynb", "x = 1")
    _write(tmp_path / "eve.ipynb", "x = 1")                 # a file and a folder of one name: one student
    (tmp_path / "eve").mkdir()
    _write(tmp_path / "eve" / "b.ipynb", "x = 1")
    _write(tmp_path / f"{unicodedata.normalize('NFD', 'renée')}.ipynb", "x = 1")
    (tmp_path / "EVE" / "notes").mkdir(parents=True)       # no notebook in it: nobody, and no collision with eve
    refused = {}
    found = students.find_submissions(tmp_path, refused)
    assert sorted(found) == ["bob smith", "bob_smith", "eve", unicodedata.normalize("NFC", "renée")]
    assert len(found["eve"]) == 2
    assert sorted(refused) == ["Bob", "bob", "zo\\xeb", "zoe\\u0308"]
    assert refused["zo\\xeb"] == ["refused: the name 'zo\\xeb' is the same student as 'zoe\\u0308' once case and "
                                  "Unicode form are ignored, so the grader cannot tell them apart: neither was "
                                  "graded; rename one and grade again"]
    assert "the name 'Bob' is the same student as 'bob'" in refused["Bob"][0]


def test_every_student_gets_a_file_of_their_own_for_written_answers(tmp_path):
    names = ["bob smith", "bob_smith", "bob%20smith", "bob.smith", NFC, "zo%C3%AB", "a/b", "..", "~x", "%7Ex",
             "x" * 300, "x" * 300 + "y", "=1+1", "\ufffd", "日本"]
    files = [students.answers_file_name(n) for n in names]
    assert len(set(files)) == len(names)
    for name, file in zip(names, files):
        assert re.fullmatch(r"[A-Za-z0-9_%~-]+\.md", file) and len(file.encode()) <= 255, file
        if "~" not in file:                                # reversible unless shortened with a hash
            assert urllib.parse.unquote(file[:-3], errors="strict") == name
    assert files[:2] == ["bob%20smith.md", "bob_smith.md"]
    grading._write_answers({"bob smith": [("a.ipynb", 2, "I am Bob Smith.")],
                            "bob_smith": [("b.ipynb", 3, "I am bob_smith.")]}, tmp_path / "answers")
    assert (tmp_path / "answers" / "bob%20smith.md").read_text() == \
        "# bob smith: written answers\n\n## a.ipynb, cell 2\n\nI am Bob Smith.\n\n"
    assert "I am bob_smith." in (tmp_path / "answers" / "bob_smith.md").read_text()


def test_a_run_with_only_refused_students_writes_a_row_for_each(tmp_path):
    subs = tmp_path / "subs"
    subs.mkdir()
    _write(subs / f"{NFC}.ipynb", SOLUTION)
    _write(subs / f"{NFD}.ipynb", SOLUTION)
    os.mkfifo(subs / "pipe.ipynb")
    rows = grading.grade(subs, tmp_path / "g.csv", exercises=["broadcast"])
    with open(tmp_path / "g.csv", newline="") as f:
        assert list(csv.DictReader(f)) == [{k: str(v) for k, v in row.items()} for row in rows]
    assert [(r["student"], r["broadcast"], r["total"]) for r in rows] == \
        [("pipe", "missing", 0), ("zo\\xeb", "missing", 0), ("zoe\\u0308", "missing", 0)]
    assert "pipe.ipynb is a named pipe (FIFO)" in rows[0]["notes"]
    assert all("cannot tell them apart" in r["notes"] for r in rows[1:])


def test_csv_cells_starting_with_a_tab_or_a_carriage_return_are_quoted():
    assert [grading._csv_safe(v) for v in ["\t=1+1", "\rcmd", "\tbob", " =1", "bob\t", 2.5]] == \
        ["'\t=1+1", "'\rcmd", "'\tbob", " =1", "bob\t", 2.5]
