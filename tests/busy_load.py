"""Load a machine the way a shared one is loaded, for as long as a `with` block runs.

    with busy(spinners=4, copiers=0):     # two pure-Python spin loops per core of a 2-core machine
        ...                               # run what must hold on a busy machine

Spinners are `while True: pass` (the CPU taken, memory left alone), copiers copy 64 MiB arrays
back and forth (memory bandwidth taken too). Each is its own process, at the niceness of the tests
(0 in CI), in its own process group, so that leaving the block (normally, on an exception or on Ctrl-C) kills every
one of them and waits for it: nothing is left running.
"""
import contextlib
import os
import signal
import subprocess
import sys

SPIN = "while True: pass"
COPY = "a = bytearray(64 << 20)\nwhile True: b = bytes(a); a = bytearray(b)"


def start(code):
    """One load process running `code`, leading its own process group. It keeps the niceness of
    whoever starts it (0 in CI), so that it competes with the tests as an equal, not more or less."""
    return subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)


def stop(procs):
    """Kill every process (its whole group) and reap it."""
    for p in procs:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
    for p in procs:
        p.wait()


@contextlib.contextmanager
def busy(spinners=None, copiers=0):
    """`spinners` spin loops (default two per core this process may use) and `copiers` memory copiers."""
    if spinners is None:
        spinners = 2 * len(os.sched_getaffinity(0))
    procs = []
    try:
        for code in [SPIN] * spinners + [COPY] * copiers:
            procs.append(start(code))
        yield procs
    finally:
        stop(procs)
