"""Exercise checks: run a student's answer for real and say exactly what is wrong.

    result = pplab.check("broadcast", my_broadcast)
    ✔ broadcast: passed on world sizes 2, 3, 4 (18 trials with random data, ...)

From the bottom up, each module importing only those above it: `failures` (Fail, and how
a failure is worded), `answers` (the student's answer and the plain data that may come
back from it), `forbidden` (what an answer may not call), `router` and `isolation`, then
`sealed_rank` (a rank's life), `zygote` (what ranks are forked from) and `sealed` (a
launch, seen from the checker); `denied` (what each graded exercise's answer runs without),
`library_view`, `template` and `fresh_zygote` (a graded check's ranks come from an interpreter,
forked from one that imported torch and nothing of pplab, where those modules and the
checkers do not exist; a checker's rank-side jobs live in `*_rank`
modules, which hold no reference), and `core`: the registry (`@exercise`), `check`/
`run_check` and the helpers every checker uses (core's docstring has the contract);
`predictions` compares a chapter's 'predict, then run' answers with what was measured
(`prediction_lines` finds them in a cell's source, in linear time, for the grader). Each
other module of this package holds one chapter's checkers and imports from `core` and
`sealed`. Every module here is imported when the package is, so a new chapter adds one
file and touches nothing else.
"""
import importlib
import pkgutil

from .core import (EXERCISES, CheckResult, Exercise, Fail, Forbidden, Scored, SourceAnswer, check, check_number, exercise,
                   first_difference, get_exercise, run_check)
from .predictions import compare_choice, compare_prediction

__all__ = ["EXERCISES", "CheckResult", "compare_choice", "compare_prediction", "Exercise", "Fail", "Forbidden", "Scored", "SourceAnswer", "check", "check_number",
           "exercise", "first_difference", "get_exercise", "run_check"]

for _module in pkgutil.iter_modules(__path__):
    if _module.name not in ("core", "answers", "failures", "forbidden", "predictions"):
        importlib.import_module(f"{__name__}.{_module.name}")
