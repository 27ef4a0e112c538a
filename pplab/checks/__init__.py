"""Exercise checks: run a student's answer for real and say exactly what is wrong.

    result = pplab.check("broadcast", my_broadcast)
    ✔ broadcast: passed on world sizes 2, 3, 4 (18 trials with random data, ...)

`core` holds the registry (`@exercise`), `check`/`run_check` and the helpers every checker
uses, `answers` the student's answer and what may come back from it, `running` where it
runs (real ranks, or one child) and how each failure is worded, `forbidden` what it may not
call (all described in core's docstring, and all imported from `core` by the checkers);
each other module of this package holds one chapter's checkers and imports only
from `core`. Every module here is imported when the package is, so a new chapter adds one
file and touches nothing else.
"""
import importlib
import pkgutil

from .core import (EXERCISES, CheckResult, compare_prediction, Exercise, Fail, Forbidden, SourceAnswer, check, check_number, exercise,
                   first_difference, get_exercise, run_check)

__all__ = ["EXERCISES", "CheckResult", "compare_prediction", "Exercise", "Fail", "Forbidden", "SourceAnswer", "check", "check_number",
           "exercise", "first_difference", "get_exercise", "run_check"]

for _module in pkgutil.iter_modules(__path__):
    if _module.name not in ("core", "answers", "running", "forbidden"):
        importlib.import_module(f"{__name__}.{_module.name}")
