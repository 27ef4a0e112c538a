"""The grader's check of one answer, in a fresh process where no student code runs.

    verdict = run_check_process("broadcast", answer, sources, check_timeout=30)
    verdict.passed, verdict.message, verdict.score, verdict.status    # status: results.STATUSES

`answer` is a SourceAnswer: the student's definitions as source text (submission.py). The
check process is `python -I` (no current folder, no PYTHONPATH, no user site) serving pplab
from `sources`, a copy of pplab's files the grader read before any notebook ran, so nothing
a notebook wrote to disk changes it. It runs in the sandbox (sandbox.py) where the machine
allows it: read-only files, a private /tmp, its own process ids and network, so nothing the
student's ranks start outlives the check or reaches another student's.

The student's definitions run only in the ranks and children the check launches. Their
verdict reaches the grader over a Unix socket which the check process connects to after it
has killed every process below it; the grader believes only the connection whose peer the
kernel reports (SO_PEERCRED) as the check process itself. The check process is not dumpable,
so its ranks (the same user, without privileges in the sandbox) cannot trace or read it.
"""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import NamedTuple

from . import sandbox
from ..checks.sealed import template
from .runner import become_subreaper, kill_children, kill_tree, not_dumpable

OUTPUT_LINES, LINE_CHARS = 100, 500          # what the grader keeps of a check's output


class Verdict(NamedTuple):
    """What the grader learns from one check: results.py turns it into an ExerciseResult."""

    passed: bool
    message: str                      # the check's message, without the hint
    score: float                      # points earned
    status: str = "failed"            # results.STATUSES: passed, partial, failed, missing, timed out, error
    hint: str = ""                    # how to reproduce a failure (the seed)
    seconds: float = 0.0              # how long the check took


def pplab_sources(root: str | Path | None = None) -> dict:
    """{module name: [file, source, is a package]} of the pplab package (at `root`, default
    this one), read now. The check processes import pplab from this copy, so a notebook that
    rewrites (or adds to) pplab's files, or leaves a module named like one anywhere, changes
    nothing in them."""
    root = Path(root or Path(__file__).resolve().parents[1])   # the pplab package
    found = {}
    for file in sorted(root.rglob("*.py")):
        parts = list(file.relative_to(root.parent).with_suffix("").parts)
        package = parts[-1] == "__init__"
        name = ".".join(parts[:-1] if package else parts)
        found[name] = [str(file), file.read_text(), package]
    return found


def copy_pplab(sources: dict, folder: str | Path) -> dict:
    """Write `sources` as a package under FOLDER/pplab (read-only files) and return the sources
    of that copy: a sandbox sees this copy, never the course's checkout."""
    package = Path(folder) / "pplab"
    package.mkdir(parents=True, exist_ok=True)
    Path(folder).chmod(0o755)                   # readable by a sandbox's own uid (where the grader is root)
    import importlib.util
    import shutil

    for name, (original, text, is_package) in sources.items():
        parts = name.split(".")[1:]
        file = package.joinpath(*parts, "__init__.py") if is_package else package.joinpath(*parts[:-1], parts[-1] + ".py")
        file.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
        file.write_text(text)
        file.chmod(0o444)
        # The copy is read-only: Python cannot cache its bytecode there. Where the original's
        # cached bytecode is for these very bytes, it goes along (with the original's time, which
        # Python checks with the size): imports in a sandbox need not compile pplab again.
        with contextlib.suppress(OSError, ValueError, NotImplementedError):
            stat, cached = os.stat(original), importlib.util.cache_from_source(original)
            if stat.st_size == len(text.encode()) and os.path.exists(cached):
                os.utime(file, ns=(stat.st_atime_ns, stat.st_mtime_ns))
                target = Path(importlib.util.cache_from_source(str(file)))
                target.parent.mkdir(mode=0o755, exist_ok=True)
                shutil.copyfile(cached, target)
    return pplab_sources(package)


# Runs first in a check process (python -I: no current folder, no PYTHONPATH, no user site
# on sys.path): fork the template of graded checks' zygotes (checks/sealed/template.py: torch, no
# pplab) before the job is read, serve pplab from the copy sent on stdin, then run one check.
_BOOT = Path(template.__file__).read_text() + r'''
_TEMPLATE = fork_template()
import importlib.abc, importlib.machinery, importlib.util, json, sys
job = json.loads(sys.stdin.buffer.read())
sources, MARK = job.pop("sources"), "<pplab copy>/"

class Copy(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, path=None):
        if path is not None and not path.startswith(MARK):
            raise ImportError(path)
        self.package = path[len(MARK):] if path else None
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] != "pplab":
            return None
        if name not in sources:
            raise ModuleNotFoundError(f"no module named {name!r} in pplab")
        file, _, package = sources[name]
        spec = importlib.util.spec_from_loader(name, self, origin=file, is_package=package)
        if package:
            spec.submodule_search_locations = [MARK + name]
        return spec
    def iter_modules(self, prefix=""):
        for name, (_, _, package) in sorted(sources.items()):
            head, _, tail = name.rpartition(".")
            if head == self.package:
                yield prefix + tail, package
    def create_module(self, spec):
        return None
    def get_source(self, name):              # the copy's text: what a graded check's fresh zygote serves
        return sources[name][1]
    def exec_module(self, module):
        file, text, _ = sources[module.__name__]
        module.__file__ = file
        exec(compile(text, file, "exec"), module.__dict__)

sys.meta_path.insert(0, Copy())
sys.path_hooks.insert(0, Copy)
sys.path_importer_cache.clear()
from pplab.course.check_process import _check_main
_check_main(job, _TEMPLATE)
'''


class _Tail:
    """The last OUTPUT_LINES lines of a stream, each cut to LINE_CHARS: a process that prints
    without pause costs the reader a little CPU, never memory."""

    def __init__(self, stream):
        self.lines: list[str] = []
        self.thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self.thread.start()

    def _read(self, stream):
        partial = b""
        while chunk := stream.read1(1 << 16) if hasattr(stream, "read1") else stream.read(1 << 16):
            *whole, partial = (partial + chunk).split(b"\n")
            partial = partial[-LINE_CHARS:]
            self.lines = (self.lines + [w[:LINE_CHARS].decode(errors="replace") for w in whole])[-OUTPUT_LINES:]
        if partial:
            self.lines = (self.lines + [partial.decode(errors="replace")])[-OUTPUT_LINES:]


def run_check_process(exercise_id: str, answer, sources: dict, check_timeout: float,
                      notes: list | None = None, *, hidden=(), sandboxed: bool = True,
                      limits: sandbox.Limits = sandbox.Limits()) -> Verdict:
    """The Verdict (passed, message, points earned, status, ...) of one exercise's check of `answer` (a SourceAnswer), run in a fresh
    process where no student code runs (in the sandbox if `sandboxed` and the machine has
    one, which sees the folder `sources` were read from (a copy: copy_pplab), read-only;
    `hidden`: folders it must never see; `limits`: the submission's).

    Forged verdicts seen on the way (connections from any other process, or lines that look
    like one in its output) are named in `notes`."""
    import socket
    import struct

    import psutil

    notes = [] if notes is None else notes
    limit = 4 * check_timeout + 120                         # a few launches, each bounded by check_timeout
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    with tempfile.TemporaryDirectory(prefix="pplab-check-") as tmp, \
            socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
        cwd, verdict_dir = Path(tmp, "work"), Path(tmp, "verdict")
        cwd.mkdir()
        verdict_dir.mkdir()
        address = str(verdict_dir / "socket")              # a path: it reaches into the sandbox's network
        server.bind(address)
        os.chmod(address, 0o777)           # where the grader is root, the check runs as a uid of its own
        server.listen(16)
        server.settimeout(0.2)
        job = {"sources": sources, "exercise": exercise_id, "timeout": check_timeout, "name": answer.name,
               "statements": [list(s) for s in answer.statements], "verdict": address,
               "params": None if answer.params is None else [list(p) for p in answer.params]}
        argv = [sys.executable, "-I", "-c", _BOOT]
        env.update(HOME=str(cwd), TMPDIR=str(cwd), MPLCONFIGDIR=str(cwd),
                   PPLAB_RANK_TMPFS=str(max(limits.disk // 8, 16 << 20)))      # each rank's /tmp and /dev/shm
        sandboxed = sandboxed and sandbox.why_not() is None
        if sandboxed:
            library = os.path.dirname(os.path.dirname(sources["pplab"][0]))       # above the copy's pplab/
            if library in sandbox._course():                 # never the checkout itself: a copy of its pplab
                sources = copy_pplab(sources, Path(tmp, "library"))
                library = str(Path(tmp, "library"))
            argv = sandbox.wrap(argv, workdir=str(cwd), read_only=[verdict_dir, library], denied=hidden, env=env,
                                limits=limits)
            job["sources"] = sources
        proc = subprocess.Popen(argv, cwd=cwd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, start_new_session=True)
        output = _Tail(proc.stdout)
        with contextlib.suppress(OSError):
            proc.stdin.write(json.dumps(job).encode())
            proc.stdin.close()
        verdicts, forged, deadline = [], 0, time.monotonic() + limit
        while time.monotonic() < deadline and (proc.poll() is None or not verdicts):
            try:
                conn, _ = server.accept()
            except (socket.timeout, OSError):
                if proc.poll() is not None:
                    break
                continue
            with conn:
                pid, _, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                                struct.calcsize("3i")))
                conn.settimeout(5)
                data = b""
                with contextlib.suppress(OSError):
                    while len(data) < 1 << 20 and (chunk := conn.recv(65536)):
                        data += chunk
            if _is_the_check(pid, proc.pid, sandboxed, psutil):
                verdicts.append(data)
            else:
                forged += 1
        timed_out = proc.poll() is None
        kill_tree(proc.pid)
        proc.wait()
        output.thread.join(5)
    text = [line.strip() for line in output.lines if line.strip()]
    forged += sum(1 for line in text if '"passed"' in line)
    if forged:
        notes.append(f"{exercise_id}: ignored {forged} forged verdict(s) (from processes other than the check "
                     f"itself)")
    if timed_out and not verdicts:
        return Verdict(False, f"the check did not finish within {limit:g} s (the grader's limit for one check)", 0.0,
                       "timed out", seconds=limit)
    stopped = sandbox.stopped_by(proc.returncode, text) if sandboxed else None
    if stopped and not verdicts:
        return Verdict(False, f"the check was stopped: {stopped}", 0.0, "error")
    try:
        verdict = json.loads(verdicts[0])
        score = float(verdict["score"])
        score = score if score == score else 0.0                                           # NaN: 0
        passed, hint = verdict["passed"] is True, str(verdict["hint"])
        status = "missing" if verdict["missing"] is True else "passed" if passed else "partial" if score > 0 \
            else "error" if verdict["error"] is True else "failed"
        return Verdict(passed, str(verdict["message"]).replace(" " + hint, "") if hint else str(verdict["message"]),
                       score, status, hint, float(verdict["seconds"]))
    except (IndexError, ValueError, KeyError, TypeError):
        if proc.returncode == sandbox.SETUP_FAILED:
            return Verdict(False, f"grader error: the sandbox could not be set up ({text[-1][:200] if text else ''})",
                           0.0, "error")
        tail = text[-1][:200] if text else "no output"
        return Verdict(False, f"the check process gave no verdict (exit code {proc.returncode}): {tail}", 0.0, "error")


def _is_the_check(pid: int, started: int, sandboxed: bool, psutil) -> bool:
    """The check process is the one the grader started or, in the sandbox, the command its pid 1
    started: its first child, pid 2 there (every other process there descends from it)."""
    if pid == started or not sandboxed:
        return pid == started
    try:
        parent = psutil.Process(pid).parent()
        with open(f"/proc/{pid}/status") as f:
            inner = next(line.split()[-1] for line in f if line.startswith("NSpid:"))
        return parent is not None and parent.ppid() == started and inner == "2"
    except (psutil.Error, OSError, StopIteration):
        return False


def _check_main(job: dict, forked_template: tuple) -> None:
    """In the check process: check the answer (a graded check's zygote forked from
    `forked_template`: its socket and pid), kill every process below this one, then send the
    verdict to the grader's socket."""
    import socket

    from ..checks.sealed.template import Template

    Template.running = Template(*forked_template)
    not_dumpable()
    become_subreaper()
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    started = time.monotonic()
    try:
        from ..checks import SourceAnswer, run_check

        answer = SourceAnswer(job["name"], tuple(tuple(s) for s in job["statements"]),
                              None if job["params"] is None else tuple(tuple(p) for p in job["params"]))
        result = run_check(job["exercise"], answer, timeout=float(job["timeout"]))
        verdict = {"passed": result.passed, "message": result.message, "score": result.score, "hint": result.hint,
                   "missing": result.missing, "error": False}
    except BaseException as exc:  # noqa: BLE001 - a bug of ours must still give a verdict
        verdict = {"passed": False, "message": f"the check raised {type(exc).__name__}: {exc}", "score": 0.0,
                   "hint": "", "missing": False, "error": True}
    verdict["seconds"] = round(time.monotonic() - started, 2)
    kill_children()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as channel:
        channel.connect(job["verdict"])
        channel.sendall(json.dumps(verdict).encode())
    os._exit(0)
