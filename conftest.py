"""What every test run needs, wherever it starts (tests/, notebooks/ or solutions/).

The chapters' 'predict, then run' cells are empty in the course (`my_x = None  # your
prediction: ...`). Under the tests, each gets its worked answer (tests/prediction_answers.py)
before nbval runs the cell, and PPLAB_PREDICTIONS_MUST_MATCH=1 (inherited by the kernels nbval
starts) makes pplab.checks.compare_prediction fail when a worked answer does not match what the
notebook measured.
"""
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "tests"))
os.environ["PPLAB_PREDICTIONS_MUST_MATCH"] = "1"


def pytest_collection_modifyitems(items):
    from prediction_answers import fill_in
    for item in items:
        if type(item).__name__ == "IPyNbCell" and item.cell.cell_type == "code":
            item.cell.source = fill_in(item.path.stem, item.cell.source)
