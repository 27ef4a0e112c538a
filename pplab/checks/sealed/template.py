"""The template of graded checks' zygotes: an interpreter that imported torch and nothing of
pplab, kept to fork a fresh zygote (fresh_zygote.py) for each graded check.

A fresh `python -I` pays about 1.5 s of CPU to import torch; a graded check's zygote used to
pay it every time. The template pays it once. It never receives a payload: for each check it
is sent two descriptors (SCM_RIGHTS), the zygote's control socket and the pipe its payload
comes through; it forks, and the child (`become_zygote`) reads the payload and serves the
check, as a fresh interpreter would. What the child inherits is the template's memory: torch,
the standard library and this file, never a module of pplab.

One template per checking process, started on first use, in one of two ways:
- the grader's check process (check_process.py) runs this file first and forks it
  (`fork_template`) before it reads its job, which holds the whole library's source;
- any other checker (a test, `pplab.check` with source) starts `python -I` running this file
  (`Template.start`).
Either way it dies with the process that started it (PR_SET_PDEATHSIG), and ends when its
socket does. The zygotes it forks die with it in turn.

This file runs before pplab can be imported: the standard library and torch only.
"""
import atexit
import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import threading

import torch  # noqa: F401 - what every zygote needs, imported once here

_PR_SET_PDEATHSIG, _PR_SET_DUMPABLE = 1, 4     # pplab/isolation.py's, repeated: this file runs before pplab exists


def _prctl(option: int, value: int) -> None:
    try:
        ctypes.CDLL(None).prctl(option, value, 0, 0, 0)
    except (OSError, AttributeError):                    # not Linux: no such safeguard there
        pass


# ----------------------------------------------------------------------------------
# In the template


def serve(requests: socket.socket, parent: int) -> None:
    """The template's life: for each request (two descriptors) fork a zygote and reply with its
    pid; exit when the socket ends or the parent is gone."""
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)            # never outlive the process that started it
    if os.getppid() != parent:                           # it died before that line: nobody to serve
        os._exit(0)
    _prctl(_PR_SET_DUMPABLE, 0)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)         # a check process's stdin holds its job: never read it
    signal.signal(signal.SIGCHLD, _reap)                 # each zygote is reaped as it exits
    while True:
        try:
            _, fds, _, _ = socket.recv_fds(requests, 16, 2)
        except OSError:
            fds = []
        if len(fds) != 2:
            os._exit(0)                                  # the checker closed the socket: it is done
        pid = os.fork()
        if pid == 0:
            requests.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)    # the zygote waits for its ranks itself
            become_zygote(*fds)
        for fd in fds:
            os.close(fd)
        try:
            requests.send(json.dumps({"pid": pid}).encode())
        except OSError:
            os._exit(0)


def _reap(*_) -> None:
    try:
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass
    except ChildProcessError:
        pass


def become_zygote(control: int, payload: int) -> None:
    """In a child of the template: read the payload (fresh_zygote.FreshZygote), install the
    library view it holds, and serve the check's launches as any zygote does."""
    import types
    try:
        with open(payload, "rb") as pipe:
            job = json.loads(pipe.read())
        view = types.ModuleType("pplab.checks.sealed.library_view")
        exec(compile(job["view"][1], job["view"][0], "exec"), view.__dict__)
        view.install(job.pop("sources"), job["denied"], job["checks_note"])
        sys.modules["pplab.checks.sealed.library_view"] = view
        from pplab.checks.sealed import rank, zygotes
        from pplab.checks.sealed.answers import SourceAnswer
        name, statements, params = job["answer"]
        answer = SourceAnswer(name, tuple(tuple(s) for s in statements),
                              None if params is None else tuple(map(tuple, params)))
        rank._STATE["hide"] = job["hide"]
        for module in job["preload"]:                    # once here, not compiled again in every rank
            try:
                __import__(module)
            except ImportError:
                pass
        del job, view
        zygotes._zygote_main(socket.socket(fileno=control), answer)
    finally:
        os._exit(0)                                      # no interpreter teardown: the check waits for this exit


# ----------------------------------------------------------------------------------
# In the checker

_DIES_WITH_ITS_PARENT = ("import ctypes, os, sys\n"
                         "ctypes.CDLL(None).prctl(1, 9, 0, 0, 0)\n"          # PR_SET_PDEATHSIG, SIGKILL
                         "if os.getppid() != int(sys.argv[2]):\n    os._exit(0)\n")


class Template:
    """The checker's handle on its template: `fork(control, payload)` -> the new zygote's pid."""

    running = None                                       # this process's template, once one is started

    def __init__(self, requests: socket.socket, pid: int, proc=None):
        self.requests, self.pid, self.proc, self.lock = requests, pid, proc, threading.Lock()

    @classmethod
    def start(cls) -> "Template":
        """Start `python -I` running this file as a template."""
        with open(__file__, encoding="utf-8") as f:
            text = f.read()
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        code = (_DIES_WITH_ITS_PARENT + text +          # the former before torch is imported (seconds)
                "\nserve(socket.socket(fileno=int(sys.argv[1])), int(sys.argv[2]))\n")
        proc = subprocess.Popen([sys.executable, "-I", "-c", code, str(theirs.fileno()), str(os.getpid())],
                                stdin=subprocess.DEVNULL, pass_fds=(theirs.fileno(),), close_fds=True)
        theirs.close()
        return cls(mine, proc.pid, proc)

    def fork(self, control: int, payload: int) -> int:
        """A zygote forked for one check, holding `control` and reading its payload from `payload`."""
        with self.lock:
            try:
                socket.send_fds(self.requests, [b"fork"], [control, payload])
                reply = self.requests.recv(256)
            except BaseException:                        # interrupted: a reply may be left unread
                self.requests.close()                    # so this template is done (fork_zygote starts another)
                raise
        if not reply:
            raise OSError("the template has ended")
        return json.loads(reply)["pid"]

    def close(self) -> None:
        self.requests.close()
        if self.proc is not None:                        # it holds nothing worth a goodbye
            self.proc.kill()
            self.proc.wait()
            return
        try:
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass


def fork_template() -> tuple:
    """Fork this process as its template (the grader's check process does, first thing, and
    hands the result to `Template` once pplab is imported): (its socket, its pid)."""
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:
        mine.close()
        try:
            serve(theirs, parent)
        finally:
            os._exit(0)
    theirs.close()
    return mine, pid


def fork_zygote(control: int, payload: int) -> int:
    """A zygote for one check from this process's template, started now if there is none yet
    (or started again if the one there has ended, with the thread that started it)."""
    for attempt in (1, 2):
        if Template.running is None:
            Template.running = Template.start()
            atexit.register(Template.running.close)     # reaped here (PR_SET_PDEATHSIG would end it anyway)
        try:
            return Template.running.fork(control, payload)
        except OSError:
            Template.running.close()
            Template.running = None
            if attempt == 2:
                raise
