"""The course's machinery, on top of every chapter (no chapter imports it).

exercises.py      exercises/ written from solutions/ (the solution between BEGIN/END SOLUTION markers).
grading.py        `pplab grade`: each notebook run for its notes, its answers taken from its source.
submission.py     what the grader takes from a notebook's source: the definitions an answer needs.
check_process.py  one answer's check, in a fresh process where no student code runs.
sandbox.py        the sandbox (an allow list, limits) around every process that runs a student's code;
                  the Linux isolation itself is pplab/isolation.py, shared with the sealed ranks.
runner.py         runs a notebook in a kernel, for the notes; kills process trees.
cli.py            the `pplab` command.

The student-facing checks (`pplab.check`, pplab/checks/) belong to this layer too.
"""
