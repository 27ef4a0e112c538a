"""Exercise checks: run a student's answer for real and say exactly what is wrong.

    result = pplab.check("broadcast", my_broadcast)
    ✔ broadcast: passed on world sizes 2, 3, 4 (18 trials with random data, ...)

From the bottom up: `sealed/`, the floor under every checker, is how a check runs the
student's code where it reaches no secret of the check (sealed ranks, their router, the
zygote they are forked from, a graded check's fresh interpreter; its face's docstring has the
plan, module by module); it imports nothing else of this package. Then `core`: the registry
(`@exercise`), `check`/`run_check` and the helpers every checker uses (core's docstring has
the contract); `predictions` compares a chapter's 'predict, then run' answers with what was
measured (`prediction_lines` finds them in a cell's source, in linear time, for the grader).
Each other module of this package holds one chapter's checkers and imports from `core` and
`sealed`; a checker's rank-side jobs live in `*_rank` modules, which hold no reference (a
graded check's ranks import only those and `sealed/`). Every module here is imported when
the package is, so a new chapter adds one file and touches nothing else.
"""
import importlib
import pkgutil

from .core import (EXERCISES, CheckResult, Exercise, Fail, Forbidden, Scored, SourceAnswer, check, check_number, exercise,
                   first_difference, get_exercise, run_check)
from .predictions import compare_choice, compare_prediction

__all__ = ["EXERCISES", "CheckResult", "compare_choice", "compare_prediction", "Exercise", "Fail", "Forbidden", "Scored", "SourceAnswer", "check", "check_number",
           "exercise", "first_difference", "get_exercise", "run_check"]

for _module in pkgutil.iter_modules(__path__):
    if _module.name not in ("core", "sealed", "predictions"):
        importlib.import_module(f"{__name__}.{_module.name}")
