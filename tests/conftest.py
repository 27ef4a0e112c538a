import contextlib
import os
import signal
import sys

import matplotlib
import pytest

matplotlib.use("Agg")

# A launch in a test that names no timeout= gives up after 30 s instead of the launcher's
# default (120 s): a rank waiting for the wrong peer then fails the test in half a minute,
# naming the ranks still running. The heaviest healthy launch here takes about 7 s on a
# loaded 2-core machine (tests/test_hybrid.py, 8 ranks training). Notebooks collected in the
# same run (make test) do heavier work and keep 60 s. A value the caller set wins in both.
# (pyproject's `timeout = 300` is the per-test limit of pytest-timeout, for whatever hangs
# outside a launch.)
_CALLER_LAUNCH_TIMEOUT = os.environ.get("PPLAB_LAUNCH_TIMEOUT")
os.environ.setdefault("PPLAB_LAUNCH_TIMEOUT", "60")


@pytest.fixture(autouse=True)
def _launch_timeout_for_tests(monkeypatch):
    if _CALLER_LAUNCH_TIMEOUT is None:
        monkeypatch.setenv("PPLAB_LAUNCH_TIMEOUT", "30")


# A check called without seed= draws a fresh one from os.urandom. Here each test draws from its own
# generator instead, seeded by the test's id: a run of the suite is repeatable, so a wrong answer whose
# message depends on its inputs cannot fail one CI run in twenty. To explore other inputs, set
# PPLAB_TEST_SEED (any whole number): `make seed-sweep` runs the checks' tests under several.
_TEST_SEED = int(os.environ.get("PPLAB_TEST_SEED", "0"))


@pytest.fixture(autouse=True)
def _check_seeds_fixed_per_test(request, monkeypatch):
    import random
    import zlib

    from pplab.checks import core
    draws = random.Random(zlib.crc32(request.node.nodeid.encode()) ^ _TEST_SEED)
    monkeypatch.setattr(core, "fresh_seed", lambda: draws.getrandbits(32))


def descendants(pid=None):
    """Pids of every live process below `pid` (default: this test process), from /proc; but not the
    template of graded checks' zygotes (pplab/checks/sealed/template.py): it is kept for the next check, and
    tests/test_checks_template.py checks that it ends with this process. Every zygote it forked is
    counted."""
    pid = pid or os.getpid()
    parent = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[0] != "Z":                      # zombies are dead, just not reaped
                parent[int(entry)] = int(fields[1])
    found, frontier = set(), {pid}
    while frontier:
        frontier = {c for c, p in parent.items() if p in frontier} - found
        found |= frontier
    template = sys.modules.get("pplab.checks.sealed.template")          # imported only where a check ran
    running = template and template.Template.running
    return found - ({running.pid} if running else set())


def alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.fixture
def no_leftover_processes():
    """Fail the test if it leaves any child process running (but the checks' template, see descendants)."""
    before = descendants()
    yield
    leftover = descendants() - before
    assert not leftover, f"processes left behind: {sorted(leftover)}"


# A notebook's kernel that dies before its first reply is started again (up to three tries). Two test
# processes start kernels at once: jupyter_client picks free ports, then the kernel binds them, and a
# kernel started in between can take one first (the kernel dies with "Address already in use"; nbval
# sends its stderr to /dev/null). CI lost a whole solution notebook to this once in four runs. A
# kernel that does not answer in time is not retried: that is a real failure.
def _start_kernel_again_if_it_died(start, tries=3):
    def start_new_kernel(*args, **kwargs):
        for attempt in range(1, tries + 1):
            try:
                return start(*args, **kwargs)
            except RuntimeError as err:
                if "died before replying" not in str(err) or attempt == tries:
                    raise
    return start_new_kernel


try:
    import nbval.kernel as _nbval_kernel
except ImportError:                 # nbval is in the test extras; without it no notebook is collected
    pass
else:
    _nbval_kernel.start_new_kernel = _start_kernel_again_if_it_died(_nbval_kernel.start_new_kernel)


# Notebooks under fixtures/ are inputs of the grading tests (attacks among them), not
# notebooks to run under nbval.
collect_ignore = ["fixtures"]


@contextlib.contextmanager
def interrupt_after(seconds):
    """Raise KeyboardInterrupt in this process after `seconds`, as Ctrl-C (or Jupyter's stop) would."""
    def raise_interrupt(signum, frame):
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGALRM, raise_interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, seconds)
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
