"""What every test run needs, wherever it starts (tests/, notebooks/ or solutions/).

The chapters' 'predict, then run' cells are empty in the course (`my_x = None  # your
prediction: ...`). Under the tests, each gets its worked answer (tests/prediction_answers.py)
before nbval runs the cell, and PPLAB_PREDICTIONS_MUST_MATCH=1 (inherited by the kernels nbval
starts) makes pplab.checks.compare_prediction fail when a worked answer does not match what the
notebook measured.

Every test and notebook cell is marked with its chapter (tests/chapters.py), so that
`make test CH=04` (pytest -m ch04) runs one chapter's library tests, notebooks and exercises.
"""
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "tests"))
os.environ["PPLAB_PREDICTIONS_MUST_MATCH"] = "1"


def pytest_configure(config):
    from chapters import CHAPTERS
    for chapter in CHAPTERS:
        config.addinivalue_line("markers", f"ch{chapter}: chapter {chapter}'s tests and notebooks (make test CH={chapter})")


@pytest.hookimpl(tryfirst=True)          # before -m picks the items by their markers
def pytest_collection_modifyitems(config, items):
    from chapters import chapters_of, exercises_named
    from prediction_answers import fill_in
    for item in items:
        params = item.callspec.params if hasattr(item, "callspec") else None
        for chapter in chapters_of(Path(str(item.path)), params):
            item.add_marker(getattr(pytest.mark, f"ch{chapter}"))
        if item.path.name.startswith("test_checks"):     # pytest -k <exercise id> selects its checker's tests
            item.extra_keyword_matches.update(exercises_named(getattr(item, "function", None), item.path, params))
        if type(item).__name__ == "IPyNbCell" and item.cell.cell_type == "code":
            item.cell.source = fill_in(item.path.stem, item.cell.source)
    if hasattr(config, "workerinput"):                  # an xdist process: in the order make test wants
        _slow_first(items)


# make test hands whole modules and notebooks to its two processes (xdist --dist loadscope), one at
# a time, in the order collected (--no-loadscope-reorder). xdist's own order, most tests first, put
# the modules that hold few tests but take minutes (a whole grading run, a fresh environment's
# install) near the end, where one process ran them alone while the other had nothing left. They
# go first; everything else keeps xdist's order. The order of the tests inside a module or a
# notebook is never changed.
SLOW_FIRST = ["tests/test_grading_hostile.py", "tests/test_grading_formats.py", "tests/test_lone_notebook.py",
              "tests/test_launch_hostile.py", "tests/test_launch.py", "notebooks/01_collectives.ipynb",
              "notebooks/07_hybrid.ipynb"]


def _slow_first(items):
    modules = {}
    for item in items:
        modules.setdefault(item.nodeid.split("::", 1)[0], []).append(item)
    order = sorted(modules, key=lambda m: (SLOW_FIRST.index(m) if m in SLOW_FIRST else len(SLOW_FIRST),
                                            -len(modules[m])))
    items[:] = [item for m in order for item in modules[m]]


# make test-busy: every notebook under nbval with two pure-Python spin loops per core running
# beside it (tests/busy_load.py), as on a shared machine. The load runs from the start of the
# session to its end (the controller's, under xdist: its workers' notebooks share one load) and is
# killed whatever ends the session: a failure, Ctrl-C, or the interpreter exiting.
def pytest_addoption(parser):
    parser.addoption("--busy", action="store_true",
                     help="run beside two busy processes per core (what every notebook's claims must survive)")


_load = []


def pytest_sessionstart(session):
    if session.config.getoption("--busy") and not hasattr(session.config, "workerinput"):
        import atexit

        import busy_load
        _load.extend(busy_load.start(busy_load.SPIN) for _ in range(2 * len(os.sched_getaffinity(0))))
        atexit.register(busy_load.stop, _load)
        print(f"\n--busy: {len(_load)} spin loops running beside the tests (pids {[p.pid for p in _load]})")


def pytest_sessionfinish(session):
    if _load:
        import busy_load
        busy_load.stop(_load)
        _load.clear()
