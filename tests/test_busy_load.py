"""tests/busy_load.py, which make test-busy runs beside the notebooks: its load really runs, and
nothing of it is left behind however the block ends."""
import os
import time

import pytest
from busy_load import busy
from conftest import alive


def cpu_seconds(pid):
    with open(f"/proc/{pid}/stat") as f:
        utime, stime = f.read().rsplit(")", 1)[1].split()[11:13]
    return (int(utime) + int(stime)) / os.sysconf("SC_CLK_TCK")


def test_the_load_runs_each_in_its_own_group_and_is_killed_whatever_ends_the_block():
    with pytest.raises(RuntimeError, match="a failing test"):
        with busy(spinners=2, copiers=1) as procs:
            assert len(procs) == 3 and all(os.getpgid(p.pid) == p.pid for p in procs)
            deadline = time.monotonic() + 20
            while not all(cpu_seconds(p.pid) > 0.05 for p in procs) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert all(cpu_seconds(p.pid) > 0.05 for p in procs), "every load process uses the CPU"
            raise RuntimeError("a failing test")
    assert not any(alive(p.pid) for p in procs) and all(p.returncode is not None for p in procs)


def test_by_default_two_spinners_per_core():
    with busy() as procs:
        assert len(procs) == 2 * len(os.sched_getaffinity(0))
    assert not any(alive(p.pid) for p in procs)



def test_the_busy_option_runs_the_load_from_session_start_to_finish(no_leftover_processes):
    """The root conftest's hooks, as `pytest --busy` (make test-busy) calls them: two spin loops per
    core from the session's start, none after its finish; not in an xdist worker (the controller's
    load serves all), nor without --busy."""
    import importlib.util
    from pathlib import Path
    from types import SimpleNamespace

    spec = importlib.util.spec_from_file_location("root_conftest", Path(__file__).resolve().parent.parent / "conftest.py")
    root = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(root)
    session = SimpleNamespace(config=SimpleNamespace(getoption=lambda name: name == "--busy"))
    root.pytest_sessionstart(session)
    procs = list(root._load)
    try:
        assert len(procs) == 2 * len(os.sched_getaffinity(0)) and all(alive(p.pid) for p in procs)
    finally:
        root.pytest_sessionfinish(session)
    assert not any(alive(p.pid) for p in procs) and root._load == []
    worker = SimpleNamespace(config=SimpleNamespace(getoption=lambda name: True, workerinput={}))
    quiet = SimpleNamespace(config=SimpleNamespace(getoption=lambda name: False))
    for s in (worker, quiet):
        root.pytest_sessionstart(s)
        assert root._load == []
