"""The chapters' 'predict, then run' questions: asked for real, answered by the tests.

Each question is a markdown cell ending in a question, then a cell of prediction lines left
empty (`my_x = None  # your prediction: ...`), then a cell that measures and calls
compare_prediction or compare_choice with each of them. Nothing in the repository holds the
answer where the learner runs it: the worked answers live in tests/prediction_answers.py, and
the root conftest.py fills them in when nbval runs the notebooks (where they must match).
"""
import re
from pathlib import Path

import nbformat
import pytest

from pplab.checks.predictions import predictions_in
from prediction_answers import ANSWERS, fill_in

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
CHAPTERS = sorted(p.stem for p in NOTEBOOKS.glob("[0-9][0-9]*_*.ipynb"))   # 09b_... too


def questions(name):
    """[(cell index, {variable: value as written})] of the notebook's prediction cells."""
    cells = nbformat.read(NOTEBOOKS / f"{name}.ipynb", 4).cells
    return cells, [(k, predictions_in(c.source)) for k, c in enumerate(cells)
                   if c.cell_type == "code" and predictions_in(c.source)]


@pytest.mark.parametrize("name", CHAPTERS)
def test_each_chapter_asks_predictions_and_gives_none_away(name):
    cells, found = questions(name)
    assert len(found) >= 2 or name.startswith("00"), f"{name} asks {len(found)} predict-then-run question(s)"
    for k, predicted in found:
        for var, value in predicted.items():
            assert value == "None", f"{name} cell {k}: {var} is given ({value}); leave it None"
            assert var in ANSWERS.get(name, {}), f"{name}: no worked answer for {var} in tests/prediction_answers.py"
        above = cells[k - 1]
        assert above.cell_type == "markdown" and "?" in above.source, f"{name} cell {k}: no question above it"
        later = "\n".join(c.source for c in cells[k + 1:k + 3] if c.cell_type == "code")
        for var in predicted:
            assert re.search(rf"compare_(prediction|choice)\((?:[^()]|\([^()]*\))*\b{var}\b", later, re.S), \
                f"{name} cell {k}: nothing compares {var} with a measurement in the two cells after it"


def test_every_worked_answer_belongs_to_a_question():
    asked = {name: {v for _, predicted in questions(name)[1] for v in predicted} for name in CHAPTERS}
    for name, answers in ANSWERS.items():
        assert set(answers) <= asked.get(name, set()), f"{name}: worked answers for no question: {set(answers) - asked.get(name, set())}"


def test_fill_in_writes_the_worked_answer_and_only_into_empty_lines():
    src = "p = 4\nmy_bubble = None    # your prediction: the bubble\nmy_peak = 3  # your prediction: peak\n"
    filled = fill_in("04_pipeline", src)
    assert "my_bubble = (p - 1) / m    # your prediction: the bubble" in filled and "my_peak = 3  #" in filled
    with pytest.raises(KeyError, match="no worked answer for my_unknown"):
        fill_in("04_pipeline", "my_unknown = None  # your prediction")
