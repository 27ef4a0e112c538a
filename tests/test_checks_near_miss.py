"""Answers that are right but not the solution's arithmetic pass: a different rounding, well inside a
checker's tolerance, must not be taken for a near miss (issue 38). Each tests/wrong_solutions*.py may
list such answers in CLOSE_BUT_RIGHT = {exercise_id: [answer, ...]}, next to the near misses just
outside the tolerance that its WRONG lists (tests/test_checks.py runs those)."""
import importlib
from pathlib import Path

import pytest

from pplab import checks

pytestmark = pytest.mark.usefixtures("no_leftover_processes")


def _close_but_right() -> list:
    found = []
    for path in sorted(Path(__file__).parent.glob("wrong_solutions*.py")):
        for exercise_id, answers in getattr(importlib.import_module(path.stem), "CLOSE_BUT_RIGHT", {}).items():
            found += [(exercise_id, fn) for fn in answers]
    return found


CASES = _close_but_right()


@pytest.mark.parametrize("exercise_id, fn", CASES, ids=[f"{ex}-{fn.__name__}" for ex, fn in CASES])
def test_a_right_answer_rounded_differently_passes(exercise_id, fn):
    assert exercise_id in checks.EXERCISES
    result = checks.run_check(exercise_id, fn)
    assert result, result.message
