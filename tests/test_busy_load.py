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
