"""'Predict, then run': the learner writes a guess before a cell measures the real thing.

A prediction cell in a chapter holds one line per question, left empty in the course:

    my_bubble = None    # your prediction: the bubble fraction of GPipe at p = 4, m = 8

and the cell after it measures and compares:

    compare_prediction("GPipe bubble", my_bubble, measured, explain="(p - 1)/m counts ...")

Until the learner writes a number, the comparison says what to fill in and does not give the
measurement away. Once they have, it says how far off they were and, when they missed, why
(`explain`). `compare_choice` does the same for questions whose answer is one of a few things
("which rank idles most?").

The course's tests fill every prediction in with a worked answer (tests/prediction_answers.py)
and set PPLAB_PREDICTIONS_MUST_MATCH=1, so a worked answer that stops matching what the
notebook measures fails the test run (a `timed` measurement excepted: clocks are noisy); a
learner's miss only prints. The grader reads the
predictions a student wrote (`predictions_in`, prediction_lines.py) without running anything.
"""
from __future__ import annotations

import os

from .core import CheckResult
from .prediction_lines import PREDICTION_LINE, predictions_in  # noqa: F401 - found in linear time, on its own

NO_PREDICTION = "no prediction yet"


def _must_match() -> bool:
    return os.environ.get("PPLAB_PREDICTIONS_MUST_MATCH") == "1"


def _report(result: CheckResult, explain: str, timed: bool = False) -> CheckResult:
    print(result, flush=True)
    if not result.passed and explain and not result.message.startswith(NO_PREDICTION):
        print(f"  why: {explain}", flush=True)
    if _must_match() and not result.passed and not (timed and result.message.startswith("you predicted")):
        raise AssertionError(f"the worked prediction does not match: {result}")
    return result


def _unanswered(what: str, predicted) -> CheckResult | None:
    if predicted is None or predicted is Ellipsis:
        return CheckResult(what, False, f"{NO_PREDICTION}: write your answer in the cell above "
                                        "(replace None), run it, then run this cell again", 0)
    return None


def compare_prediction(what: str, predicted, measured: float, *, rel_tol: float = 0.1, unit: str = "",
                       explain: str = "", timed: bool = False) -> CheckResult:
    """Compare a predicted number with the measured one.

        compare_prediction("bytes rank 1 sends", my_bytes, measured, unit="B")
        ✔ bytes rank 1 sends: you predicted 3.146e+06 B, measured 3.146e+06 B (0.0% off; within 10%)

    Prints ✔ or ✘ (and `explain` when off) and returns a CheckResult, truthy if within rel_tol.
    timed: the measurement comes from a clock, so on a loaded machine even the worked answer
    may miss; the tests then hold it to being filled in, not to matching.
    """
    result = _unanswered(what, predicted)
    if result is None and (isinstance(predicted, bool) or not isinstance(predicted, (int, float))):
        result = CheckResult(what, False, f"a prediction is a number, got {type(predicted).__name__} {predicted!r}", 0)
    if result is None:
        unit = f" {unit}" if unit else ""
        off = abs(predicted - measured) / abs(measured) if measured else abs(predicted)
        ok = off <= rel_tol
        result = CheckResult(what, ok, f"you predicted {predicted:.4g}{unit}, measured {measured:.4g}{unit} "
                                       f"({off:.1%} off; {'within' if ok else 'more than'} {rel_tol:.0%})", 0)
    return _report(result, explain, timed)


def compare_choice(what: str, predicted, actual, *, choices=None, explain: str = "", timed: bool = False) -> CheckResult:
    """Compare a predicted choice ("which rank idles most?", "which layout wins?") with what happened.

        compare_choice("the rank that idles most", my_idlest_rank, idlest, choices=range(4))
        ✔ the rank that idles most: you predicted 3, and it is 3

    timed: as compare_prediction's (what happened was decided by a clock).
    """
    result = _unanswered(what, predicted)
    if result is None and choices is not None and predicted not in list(choices):
        result = CheckResult(what, False, f"the answer is one of {list(choices)}, got {predicted!r}", 0)
    if result is None:
        ok = predicted == actual
        result = CheckResult(what, ok, f"you predicted {predicted!r}, and it is {actual!r}" if ok
                             else f"you predicted {predicted!r}, but it is {actual!r}", 0)
    return _report(result, explain, timed)
