"""Worked answers to the chapters' 'predict, then run' questions.

The notebooks hold `my_x = None  # your prediction: ...`: a learner running them top to bottom
predicts for real. Under the tests (nbval), tests/conftest.py writes these answers into those
lines before the cell runs and sets PPLAB_PREDICTIONS_MUST_MATCH=1, so each answer must match
what the notebook measures (within the tolerance its compare_* call states) or the run fails.
Each answer is an expression in the notebook's own names, as a learner would write it.
"""
import re

from pplab.checks.predictions import PREDICTION_LINE

ANSWERS = {
}


def fill_in(notebook: str, source: str) -> str:
    """`source` with every empty prediction line of `notebook` given its worked answer."""
    def answer(m):
        if m["value"] != "None":
            return m[0]
        try:
            worked = ANSWERS[notebook][m["name"]]
        except KeyError:
            raise KeyError(f"{notebook}: no worked answer for {m['name']} in tests/prediction_answers.py") from None
        return re.sub(r"=\s*None", f"= {worked}", m[0], count=1)
    return PREDICTION_LINE.sub(answer, source)
