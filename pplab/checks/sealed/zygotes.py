"""The zygote of a check: the process its sealed ranks are forked from.

`run_check` enters `zygote(answer)` before it draws the seed. That forks this process
once: the fork keeps the answer (a function object, inherited; or a SourceAnswer, whose
source each rank resolves) and nothing the check computes later: no seed, no input, no
reference. For each launch the checker creates one socketpair and two pipes per rank and
passes the ranks' ends to the zygote (`socket.send_fds`); the zygote forks the ranks,
each with only its own ends, and kills and reaps them when the launch ends. The zygote
dies with the checker (PR_SET_PDEATHSIG), and both are non-dumpable: a rank cannot read
their memory.
"""
from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import socket
import sys
import warnings

from . import rank
from ...isolation import PR_SET_DUMPABLE, PR_SET_PDEATHSIG
from .isolate import prctl

_ZYGOTES: list = []                     # the zygote of the check running now (run_check enters one)


class Zygote:
    """The checker's handle on its zygote: `launch` ranks, `end` them, `close` it."""

    def __init__(self, answer):
        self.control, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*fork.*", category=DeprecationWarning)
            self.pid = os.fork()
        if self.pid == 0:
            try:
                self.control.close()
                _zygote_main(theirs, answer)
            finally:
                os._exit(0)
        theirs.close()

    def launch(self, world_size: int):
        """Ask for `world_size` ranks: ([channel], [stdout pipe], [stderr pipe], [pid]) on this side."""
        mine, fds = [], []
        for _ in range(world_size):
            chan, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            out_r, out_w = os.pipe()
            err_r, err_w = os.pipe()
            mine.append((chan, out_r, err_r))
            fds += [theirs.detach(), out_w, err_w]
        try:
            socket.send_fds(self.control, [json.dumps({"launch": world_size}).encode()], fds)
            reply = self.control.recv(1 << 16)
            if not reply:
                raise RuntimeError("the zygote of this check has died: run the check again")
            pids = json.loads(reply)["pids"]
        finally:
            for fd in fds:
                os.close(fd)
        return [m[0] for m in mine], [m[1] for m in mine], [m[2] for m in mine], pids

    def end(self) -> dict:
        """Kill what is left of the launch's ranks; {pid: exit status} of each."""
        try:
            self.control.send(json.dumps({"end": True}).encode())
            return {int(k): v for k, v in json.loads(self.control.recv(1 << 16))["ended"].items()}
        except (OSError, ValueError, KeyError):
            return {}                                    # the zygote is gone, and its ranks with it

    def close(self) -> None:
        self.control.close()                             # the zygote kills its ranks and exits
        with contextlib.suppress(ChildProcessError):
            os.waitpid(self.pid, 0)


def _zygote_main(control: socket.socket, answer) -> None:
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)             # never outlive the checker
    prctl(PR_SET_DUMPABLE, 0)
    keep = control.fileno()
    os.closerange(3, keep)
    os.closerange(keep + 1, 1 << 16)
    _forget_the_seed()
    rank._STATE["answer"] = answer
    rank.preload()                                # once here, not in every rank
    me, ranks = os.getpid(), []
    while True:
        try:
            data, fds, _, _ = socket.recv_fds(control, 1 << 16, 1024)
        except OSError:
            data = b""
        if not data:
            break
        request = json.loads(data)
        if "launch" in request:
            for r in range(request["launch"]):
                pid = os.fork()
                if pid == 0:
                    control.close()
                    chan, out, err = fds[3 * r:3 * r + 3]
                    rank.rank_main(me, chan, out, err)
                ranks.append(pid)
            for fd in fds:
                os.close(fd)
            control.send(json.dumps({"pids": ranks}).encode())
        elif "end" in request:
            control.send(json.dumps({"ended": _reap(ranks)}).encode())
            ranks = []
    _reap(ranks)


def _reap(pids) -> dict:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    statuses = {}
    for pid in pids:
        with contextlib.suppress(ChildProcessError):
            statuses[pid] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    return statuses


def _forget_the_seed() -> None:
    """A seed passed to run_check(seed=...) sits in its frame, which the ranks inherit."""
    frame = sys._getframe()
    while frame is not None:
        if "seed" in frame.f_locals:
            frame.f_locals["seed"] = None
            with contextlib.suppress(Exception):
                ctypes.pythonapi.PyFrame_LocalsToFast(ctypes.py_object(frame), ctypes.c_int(0))
        frame = frame.f_back


def zygote(answer):
    """Around a check (run_check): the zygote its sealed launches fork their ranks from.
    Enter it before the seed is drawn. The checker is non-dumpable meanwhile."""
    return serving(lambda: Zygote(answer))


@contextlib.contextmanager
def serving(make):
    """The zygote `make()` starts (a Zygote, or fresh_zygote.py's FreshZygote), known to the
    launches of this check while the block runs, with the checker non-dumpable meanwhile."""
    dumpable = _dumpable()
    prctl(PR_SET_DUMPABLE, 0)
    z = make()
    _ZYGOTES.append(z)
    try:
        yield z
    finally:
        _ZYGOTES.remove(z)
        z.close()
        prctl(PR_SET_DUMPABLE, dumpable)


def _dumpable() -> int:
    with contextlib.suppress(Exception):
        return int(ctypes.CDLL(None).prctl(3, 0, 0, 0, 0))         # PR_GET_DUMPABLE
    return 1
