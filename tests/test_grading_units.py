"""Fast unit tests of the grader's parts (pplab/course), for what only the slow end-to-end grading
run (tests/test_grading_hostile.py, where there were three) used to catch (issue 38): the notes on
cells the parser refuses or that hide an answer in a block, a folder named *.ipynb, the order of
the columns, "missing" against 0 and the best of several notebooks, the written answers' file, and
the limits named in a note. No notebook runs here."""
import os
import re
import sys
from pathlib import Path

import pytest

from pplab import checks
from pplab.course import grading, results, sandbox, submission
from pplab.course.formats import csv_row
from pplab.course.grading import NotebookGrade
from pplab.course.results import ExerciseResult
from pplab.course.students import find_submissions

REPO = Path(__file__).resolve().parents[1]
GOOD = "from pplab import comm\n\ndef my_broadcast(tensor, src):\n    comm.broadcast(tensor, src)"


@pytest.mark.parametrize("limit", [None, 10_000], ids=["default limit", "raised limit"])
def test_cells_the_parser_refuses_are_named_and_the_others_still_read(limit):
    """The same note whatever recursion limit the grader's process runs under (CI once ran this
    after a test that had raised it, and the deep cell parsed)."""
    huge = "x = (" + " + ".join(["1"] * 5_000) + ")"            # too deep for Python's parser
    before = sys.getrecursionlimit()
    sys.setrecursionlimit(limit or before)
    try:
        found = submission.definitions([(2, huge), (3, GOOD), (4, "my_x =" + " " * 200)], {"my_broadcast"})
    finally:
        sys.setrecursionlimit(before)
    assert "cell 2 could not be read by Python's parser (RecursionError): it was not graded" in found.notes
    assert "cell 4 has a syntax error (line 1): it was not graded" in found.notes
    assert [f for f, *_ in found.answers["my_broadcast"].statements] == ["<cell 3>", "<cell 3>"]


def test_an_answer_inside_a_block_is_not_taken_and_the_note_says_where():
    block = "if True:\n" + "\n".join("    " + line for line in GOOD.splitlines())
    found = submission.definitions([(1, "import torch"), (2, block)], {"my_broadcast"})
    assert "my_broadcast" not in found.answers
    assert any(n.startswith("my_broadcast is defined inside an `if` block (cell 2, line 4)") and
               n.endswith("Move it out of the block.") for n in found.notes), found.notes


def test_a_folder_named_like_a_notebook_is_refused_and_a_students_folder_is_read(tmp_path):
    (tmp_path / "folder.ipynb").mkdir()
    (tmp_path / "folder.ipynb" / "inside.ipynb").write_text("{}")
    (tmp_path / "cyd").mkdir()
    (tmp_path / "cyd" / "00_broadcast.ipynb").write_text("{}")
    (tmp_path / "ada.ipynb").write_text("{}")
    os.symlink(tmp_path / "ada.ipynb", tmp_path / "linked.ipynb")
    refused = {}
    found = find_submissions(tmp_path, refused)
    assert found == {"ada": [tmp_path / "ada.ipynb"], "cyd": [tmp_path / "cyd" / "00_broadcast.ipynb"]}
    assert any("folder.ipynb is a folder, not a notebook file" in n for n in refused["folder"]), refused
    assert any("linked.ipynb is a symbolic link" in n for n in refused["linked"]), refused


def test_columns_follow_the_chapters():
    """Chapter by chapter (the notebooks' prefixes on disk), then as the chapter registers them
    (tests/test_exercise_names.py checks that against the links in the chapter notebooks)."""
    ids = grading.chapter_order(reversed(list(checks.EXERCISES)))
    prefixes = [checks.EXERCISES[ex].notebook.split("_")[0] for ex in ids]
    assert prefixes == sorted(prefixes) and sorted(ids) == sorted(checks.EXERCISES)
    assert all((REPO / "solutions" / f"{checks.EXERCISES[ex].notebook}.ipynb").exists() for ex in ids)
    assert ids[:4] == ["broadcast", "reduce_scatter", "ring_all_reduce", "predict_time"]


def test_missing_is_not_zero_and_the_best_notebook_counts():
    ids = ["broadcast", "reduce_scatter", "pp_dp_train_step"]
    first = NotebookGrade(results={"broadcast": ExerciseResult.of("broadcast", results.FAILED, 0, "wrong on rank 2"),
                                   "pp_dp_train_step": ExerciseResult.of("pp_dp_train_step", results.FAILED, 3,
                                                                         "1F1B memory ✘")},
                          notes=["cell 3 timed out after 20 s"])
    second = NotebookGrade(results={"broadcast": ExerciseResult.of("broadcast", results.PASSED, 1)})
    row = csv_row(results.combine("ada", [(Path("a.ipynb"), first), (Path("b.ipynb"), second)], ids))
    assert row == {"student": "ada", "broadcast": 1, "reduce_scatter": "missing", "pp_dp_train_step": 3,
                   "total": 4, "notes": row["notes"]}
    assert row["notes"].startswith("a.ipynb: cell 3 timed out after 20 s")      # several notebooks: named
    assert "pp_dp_train_step: 1F1B memory ✘" in row["notes"] and "wrong on rank 2" not in row["notes"]
    alone = csv_row(results.combine("eve", [(Path("e.ipynb"), first)], ids))
    assert (alone["broadcast"], alone["reduce_scatter"], alone["total"]) == (0, "missing", 3)
    assert alone["notes"].startswith("cell 3 timed out")                          # one notebook: no prefix


def test_written_answers_go_to_one_file_per_student_once(tmp_path):
    grading._write_answers({"zz_good": [("zz_good.ipynb", 3, "My written answer: ceil(log2 p) rounds.\n")],
                            "bob": []}, tmp_path / "answers")
    files = sorted(p.name for p in (tmp_path / "answers").iterdir())
    assert files == ["zz_good.md"]
    text = (tmp_path / "answers" / "zz_good.md").read_text()
    assert text.count("ceil(log2 p)") == 1 and text.startswith("# zz_good: written answers")
    assert "## zz_good.ipynb, cell 3" in text


def test_a_note_at_a_limit_names_the_option_that_changes_it():
    limits = sandbox.Limits.parse(memory="1500M", processes=200, disk="128M")
    assert limits.describe() == "memory 1.46G, 200 processes, disk 128M"
    note = grading._name_the_limit("cell 3 raised MemoryError", limits)
    assert note == "cell 3 raised MemoryError (the submission's memory limit: pplab grade --memory 1.46G)"
    assert re.search(r"--disk 128M\)$", grading._name_the_limit("cell 2 raised OSError: No space left on device",
                                                                 limits))
    assert grading._name_the_limit("cell 2 raised ValueError: no", limits) == "cell 2 raised ValueError: no"
