"""The course's machinery, on top of every chapter (no chapter imports it).

exercises.py      exercises/ written from solutions/ (the solution between BEGIN/END SOLUTION markers).
grading.py        `pplab grade`: each notebook run for its notes, its answers taken from its source.
results.py        the one result object (GradeResult, ExerciseResult) every output is written from.
api.py            grade_notebook / grade_submission: one notebook, or one student's folder, to a GradeResult.
formats.py        the outputs: CSV, JSON, JUnit XML, PrairieLearn's results.json.
deadline.py       one submission graded in a child with a deadline of its own: what finished is scored,
                  the rest timed out (Gradescope's run_autograder, `pplab grade --format prairielearn`).
gradescope.py     Gradescope's autograder zip, and its run_autograder.
submission.py     what the grader takes from a notebook's source: the definitions an answer needs.
reading.py        a submission's bytes read bounded: regular files only, parsed in a child with a deadline.
students.py       the submissions folder read as one identity per student; their answer files' names.
check_process.py  one answer's check, in a fresh process where no student code runs.
sandbox.py        the sandbox (an allow list, limits) around every process that runs a student's code;
                  the Linux isolation itself is pplab/isolation.py, shared with the sealed ranks.
runner.py         runs a notebook in a kernel, for the notes; kills process trees.
cli.py            the `pplab` command.

The student-facing checks (`pplab.check`, pplab/checks/) belong to this layer too.

    result = pplab.course.grade_notebook("alice.ipynb", exercises=["broadcast"])   # a GradeResult
"""
from .api import grade_notebook, grade_submission  # noqa: F401
from .results import ExerciseResult, GradeResult  # noqa: F401
