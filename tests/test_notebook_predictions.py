"""The 'predict, then run' questions of chapters 0 and 3 to 6: each notebook asks at least two,
each as a prediction cell the learner fills in (committed with a worked value, so the notebook
runs top to bottom) followed by a cell that measures and calls compare_prediction with it."""
import ast
import re
from pathlib import Path

import nbformat
import pytest

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
MARK = "# your prediction: replace this with your own number before running the next cell"


def _assigned(source):
    return {t.id for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Assign)
            for t in node.targets if isinstance(t, ast.Name)}


@pytest.mark.parametrize("name", ["00_start_here", "03_tensor_parallel", "04_pipeline",
                                  "05_sequence_parallel", "06_zero"])
def test_each_notebook_asks_predict_then_run_questions(name):
    cells = nbformat.read(NOTEBOOKS / f"{name}.ipynb", 4).cells
    questions = 0
    for k, cell in enumerate(cells):
        if cell.cell_type != "code" or MARK not in cell.source:
            continue
        predicted = {line.split("=")[0].strip() for line in cell.source.splitlines() if MARK in line}
        assert predicted <= _assigned(cell.source), cell.source
        assert cells[k - 1].cell_type == "markdown" and "?" in cells[k - 1].source, f"cell {k}: no question above it"
        # the measurement comes after, and compares each prediction with what it measured
        later = "\n".join(c.source for c in cells[k + 1:k + 3] if c.cell_type == "code")
        for var in predicted:
            assert re.search(rf"compare_prediction\([^)]*\b{var}\b", later, re.S), (name, var)
        questions += 1
    assert questions >= 2, f"{name} asks {questions} predict-then-run question(s)"
