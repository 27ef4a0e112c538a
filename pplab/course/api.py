"""The one-call API: grade a notebook, or a folder as one student's submission, into a GradeResult.

    import pplab.course
    result = pplab.course.grade_notebook("alice.ipynb", exercises=["broadcast"], limits={"check_timeout": 20})
    result.points, result.max_points, [(r.exercise, r.status) for r in result.exercises]

`pplab grade` grades a class (grading.py); these grade one student, as Gradescope and PrairieLearn
do in a container per submission (gradescope.py, `pplab grade --format prairielearn`).
"""
from __future__ import annotations

from pathlib import Path

from .results import GradeResult, _known_exercises, combine

SANDBOX_LIMITS = ("memory", "processes", "disk")      # what a submission may take (sandbox.Limits)


def _grading_keywords(limits: dict | None) -> dict:
    """`limits` as keywords of grading.grade_notebook: the time limits as they are, and memory,
    processes, disk (e.g. {"memory": "1500M"}) as one sandbox.Limits."""
    from .sandbox import Limits

    keywords = dict(limits or {})
    wanted = {k: keywords.pop(k) for k in SANDBOX_LIMITS if k in keywords}
    if wanted:
        keywords["limits"] = Limits.parse(**{**dict(memory="2G", processes=256, disk="512M"), **wanted})
    return keywords


def grade_notebook(path, exercises=None, *, limits: dict | None = None, sandboxed: bool = True) -> GradeResult:
    """Grade one notebook: a GradeResult with one ExerciseResult per exercise (default: all of them).

    limits: the grader's limits for this notebook: timeout (seconds to run the notebook),
    cell_timeout, check_timeout (seconds per launch of ranks in a check), and what its sandboxes
    may take: memory, processes, disk (sandbox.Limits), e.g. {"timeout": 300, "memory": "1500M"}."""
    import time

    from . import grading
    ids = grading.chapter_order(_known_exercises(exercises))
    started = time.monotonic()
    grade = grading.grade_notebook(path, exercises=ids, sandboxed=sandboxed, **_grading_keywords(limits))
    result = combine(Path(path).stem, [(path, grade)], ids)
    result.seconds = round(time.monotonic() - started, 2)
    return result



def grade_submission(folder, exercises=None, *, student: str = "submission", limits: dict | None = None,
                     sandboxed: bool = True, on_result=None, on_notebook=None) -> GradeResult:
    """Grade every notebook under `folder` as ONE student's submission (Gradescope and PrairieLearn
    run the grader once per student, in a folder of whatever they handed in).

    on_result(ExerciseResult): as each check ends; on_notebook(path, NotebookGrade): as each
    notebook's grading ends (the Gradescope runner keeps both, in case its deadline comes)."""
    import time

    from . import grading
    from .check_process import pplab_sources

    ids = grading.chapter_order(_known_exercises(exercises))
    started = time.monotonic()
    refused: dict = {}
    found = grading.find_submissions(folder, refused)
    notebooks = sorted(nb for nbs in found.values() for nb in nbs)
    settings = dict(_grading_keywords(limits), sources=pplab_sources(), exercises=ids, sandboxed=sandboxed, on_result=on_result,
                    hidden=grading._hidden_from_students(folder, Path(folder) / "_", None))
    grades = []
    for nb in notebooks:
        grades.append((nb, grading._grade_safely(nb, settings)))
        if on_notebook:
            on_notebook(nb, grades[-1][1])
    result = combine(student, grades, ids, [n for notes in refused.values() for n in notes])
    if not notebooks and not refused:
        result.notes.append(f"no notebook (.ipynb) in the submission: hand in your notebooks themselves")
    result.seconds = round(time.monotonic() - started, 2)
    return result
