"""The template of graded checks' zygotes (pplab/checks/sealed/template.py): one per checking process,
kept across checks, replaced if it died, ended with the process that started it.

That a zygote forked from it holds nothing of the library is tested where the attacks are
(tests/test_checks_unreachable.py: the gc.get_objects route finds nothing of pplab.collectives).
"""
import os
import signal
import subprocess
import sys
import time

import pytest

from pplab import checks
from pplab.checks.sealed.template import Template
from conftest import alive, descendants

pytestmark = pytest.mark.usefixtures("no_leftover_processes")

_RIGHT = checks.SourceAnswer("b", (("<cell 1>", 1, "from pplab import comm\n\ndef b(tensor, src):\n"
                                    "    if comm.rank() == src:\n"
                                    "        for r in range(comm.world_size()):\n"
                                    "            if r != src:\n"
                                    "                comm.send(tensor, r)\n"
                                    "    else:\n"
                                    "        comm.recv(tensor, src)\n"),))


def test_graded_checks_share_one_template_and_a_dead_one_is_replaced():
    assert checks.run_check("broadcast", _RIGHT, timeout=20)
    first = Template.running.pid
    zygotes = descendants(first)
    assert checks.run_check("broadcast", _RIGHT, timeout=20)
    assert Template.running.pid == first and descendants(first) == zygotes == set()   # each zygote ended with its check
    os.kill(first, signal.SIGKILL)
    assert checks.run_check("broadcast", _RIGHT, timeout=20)          # started again
    assert Template.running.pid != first and not alive(first)


_STARTS_ONE = ("import sys, time\nfrom pplab.checks.sealed.template import Template\n"
               "print(Template.start().pid, flush=True)\ntime.sleep(600)\n")


def test_the_template_ends_with_the_process_that_started_it():
    """A checker killed outright (no atexit, no close) takes its template with it."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(checks.__file__)))
    checker = subprocess.Popen([sys.executable, "-c", _STARTS_ONE], stdout=subprocess.PIPE, text=True,
                               env={**os.environ, "PYTHONPATH": root})
    try:
        pid = int(checker.stdout.readline())
        assert alive(pid)
    finally:
        checker.kill()
        checker.wait()
    for _ in range(300):                            # at once; a loaded machine may take seconds
        if not alive(pid):
            break
        time.sleep(0.1)
    assert not alive(pid)
