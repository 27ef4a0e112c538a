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
Then one package per chapter, `chNN_<chapter>/`, with one module per exercise named by its
id (`ch04_pipeline/gpipe_order.py` checks exercises/04_gpipe_order.ipynb), importing from
`core` and `sealed`; an exercise's rank-side jobs live in `<id>_rank.py`, which holds no
reference (a graded check's ranks import only `*_rank` modules and `sealed/`, so a job lives
apart from its checker's expected values), and what several of a chapter's checkers share
has a module named for what it holds. A chapter's face lists its exercises in ORDER, the
order its notebook links them (the course's order: `pplab grade`'s columns). Every checker is
imported when this package is: a new exercise adds its module and its id to ORDER.
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
        _imported = importlib.import_module(f"{__name__}.{_module.name}")
        for _exercise in getattr(_imported, "ORDER", ()) if _module.ispkg else ():   # a chapter: its checkers
            importlib.import_module(f"{_imported.__name__}.{_exercise}")
