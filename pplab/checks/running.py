"""Running a student's answer, and turning every way that can fail into a Fail.

`run_on_ranks` launches a checker's job on real ranks and hands what each rank observed to
the checker's `check`; `call_answer` and `inspect_answer` run the answer (or a probe of it)
in one child process when it is a SourceAnswer. A hang is told apart from a deadlock by
how busy each rank's CPU was (`_CpuWatch`); a raise is reported with the student's line.
Split from answers.py (the answer itself and the plain data that comes back from it);
core.py re-exports the names checkers use.
"""
from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile
import threading
import time

from ..runtime.launcher import LaunchError, launch
from .answers import SourceAnswer, _not_plain, _on_rank, answer_files, decode
from .core import Fail, Forbidden

# ----------------------------------------------------------------------------------
# Watching a launch from outside: which ranks burn CPU


class _CpuWatch:
    """Samples the state of each rank (pids from PROGRESS/pid.<rank>) twice a second, so that
    a hang can be told apart: a rank blocked in recv sleeps, a loop is always running."""

    def __init__(self, directory: str):
        self.directory, self.samples, self.stop = directory, {}, threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        import psutil

        procs = {}
        while not self.stop.wait(0.5):
            for name in os.listdir(self.directory):
                if name.startswith("pid.") and name not in procs:
                    with contextlib.suppress(Exception):
                        with open(os.path.join(self.directory, name)) as f:
                            procs[name] = (int(name[4:]), psutil.Process(int(f.read())))
            for rank, proc in procs.values():
                with contextlib.suppress(Exception):
                    running = proc.status() == psutil.STATUS_RUNNING     # runnable, even if waiting for a core
                    self.samples.setdefault(rank, []).append((time.monotonic(), running))
                    self.samples[rank] = self.samples[rank][-8:]

    def busy(self, rank: int) -> float | None:
        """How often this rank was seen running (or runnable) over its last few seconds: about
        1 for a loop, however loaded the machine, 0 for a rank blocked in recv. None if unknown."""
        self.stop.set()
        self.thread.join()
        s = self.samples.get(rank, [])
        if len(s) < 3:
            return None
        return sum(running for _, running in s) / len(s)


def _hang_message(running, timeout, cpu: _CpuWatch, name: str, label=None) -> str:
    """Why ranks were still running at the timeout, as far as their CPU use tells."""
    shares = {r: cpu.busy(r) for r in running}
    looping = [r for r, s in shares.items() if s is not None and s >= 0.7]
    idle = [r for r, s in shares.items() if s is not None and s <= 0.2]

    def who(rs):                                         # ("rank 0" / "ranks 0, 1", "was" / "were")
        if label is not None:
            return label, "was"
        return f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}", "were" if len(rs) > 1 else "was"
    if looping:
        (text, verb), waiting = who(looping), [r for r in running if r not in looping]
        also = " ({} {} waiting).".format(*who(waiting)) if waiting else "."
        return (f"{text} {verb} still running after {timeout:g} s, busy on the CPU all along: a loop that never "
                f"ends? Check what ends each loop in {name}{also}")
    text, verb = who(running)
    if len(idle) == len(running):
        if label is not None:
            return (f"{text} was still waiting after {timeout:g} s, using no CPU: what is it waiting for (a "
                    f"sleep, an input, a lock)?")
        return (f"{text} {verb} still waiting after {timeout:g} s: a deadlock? Every recv needs a matching send "
                f"from the rank it names, and a rank that waits to receive before it sends waits forever if its "
                f"sender is waiting too.")
    if label is not None:
        return f"{text} was still running after {timeout:g} s: a loop that never ends, or very slow work?"
    return f"{text} {verb} still running after {timeout:g} s: a deadlock (ranks waiting on each other) or a loop " \
           f"that never ends."


# ----------------------------------------------------------------------------------
# Running the answer, and turning every way it can fail into a Fail


def _last_exception(traceback_text: str) -> tuple[str, str]:
    """('ExceptionType', 'message') of the last exception in a formatted traceback."""
    block = traceback_text.rstrip().split("Traceback (most recent call last):")[-1]
    lines = block.splitlines()
    start = next((i for i in range(1, len(lines)) if lines[i] and not lines[i].startswith(" ")), len(lines) - 1)
    text = "\n".join(lines[start:]).strip()
    kind, _, message = text.partition(": ")
    return kind.rsplit(".", 1)[-1], message.strip()


def _student_frame(traceback_text: str, filenames) -> str:
    """' (in f, line 9: `comm.send(x, 3)`)' for the deepest frame in the student's files."""
    filenames = {filenames} if isinstance(filenames, str) else set(filenames)
    frames = re.findall(r'File "(.*?)", line (\d+), in (\S+)\n(?: {4}(.*)\n)?', traceback_text + "\n")
    mine = [f for f in frames if f[0] in filenames]
    if not mine:
        return ""
    _, line, func, code = mine[-1]
    return f" (in {func}, line {line}" + (f": `{code.strip()}`)" if code else ")")


def _not_implemented(name: str) -> str:
    return (f"{name} is not implemented yet (it raises NotImplementedError): write your "
            f"solution in its cell, run that cell, then run the check again.")


def _launch_failure(err: LaunchError, answer, where, cpu, timeout, single=False) -> Fail:
    """The Fail that says what went wrong in a launch: a hang, a raise, a death.
    single: one child calling the answer (call_answer), named after the answer, not "rank 0"."""
    name = getattr(answer, "__name__", "your function")
    if err.running:                                      # a hang
        return Fail(where(err.running[0]) + _hang_message(err.running, timeout, cpu, name, name if single else None))
    if err.rank in err.tracebacks:                       # a rank raised
        text = err.tracebacks[err.rank]
        kind, message = _last_exception(text)
        if kind == "Forbidden":                          # the same whatever the trial
            return Forbidden(message)
        if kind == "Fail":                               # a check inside the rank failed
            return Fail(where(err.rank) + message)
        if kind == "NotImplementedError":
            return Fail(_not_implemented(name), seed_matters=False)
        who = name if single else f"rank {err.rank}"
        return Fail(f"{where(err.rank)}{who} raised {kind}: {message}"
                    f"{_student_frame(text, answer_files(answer))}.")
    first_line = str(err).split("\n")[0]                 # a rank died
    return Fail(where(err.rank if err.rank is not None else 0) + first_line)


def run_on_ranks(job, *args, world_size: int, timeout: float, answer=None, describe=None,
                 trials: int | None = None, check=None):
    """launch(job, *args, PROGRESS) on `world_size` ranks, turning every way it can fail into a Fail.

    A SourceAnswer among `args` reaches `job` as the function it defines (run in each
    rank). `job` gets a progress directory as its last argument; it writes the trial it
    is on with `progress(PROGRESS, trial)`, so a failure or a hang can say which trial it
    was (`describe(world_size, trial)` words it and starts every message), and records
    what it saw in each trial with `observe(PROGRESS, trial, data)`.

    check(world_size, trial, {rank: data}), called here, in the checker's process, for
    trials 0 .. trials-1 in order, compares what the ranks observed with the reference and
    raises Fail (its message gets the trial's description in front). If the launch failed,
    the trials that every rank (or some) finished are checked first, so a wrong value
    is reported before the hang or crash it led to. Returns each rank's return value of
    `job` (plain data).
    """
    directory = tempfile.mkdtemp(prefix="pplab-check-")
    cpu = _CpuWatch(directory)
    try:
        try:
            out = launch(_on_rank, job, args, directory, world_size=world_size, timeout=timeout, backend="gloo",
                         safe_results=True)
            failure = None
        except LaunchError as err:
            out, failure = None, err

        def trial_of(rank):
            with contextlib.suppress(OSError, ValueError):
                with open(os.path.join(directory, str(rank))) as f:
                    return int(f.read())
            return None

        def where(rank, trial=None):
            trial = trial_of(rank) if trial is None else trial
            if describe is None or trial is None:
                return f"world_size={world_size}: "
            return f"{describe(world_size, trial)}: "

        if check is not None:
            _check_observed(directory, world_size, trials, check, where, complete=failure is None)
        if failure is not None:
            raise _launch_failure(failure, answer, where, cpu, timeout) from None
        results = []
        for rank, data in enumerate(out):
            try:
                value = decode(data)
            except Exception as exc:  # noqa: BLE001 - whatever came back, it is refused
                raise Fail(f"world_size={world_size}: rank {rank} sent back something that is not plain data "
                           f"({type(exc).__name__}).") from None
            results.append(value)
        return results
    finally:
        cpu.stop.set()
        shutil.rmtree(directory, ignore_errors=True)


def _check_observed(directory, world_size, trials, check, where, complete: bool) -> None:
    for trial in range(trials or 0):
        observed = {}
        for rank in range(world_size):
            path = os.path.join(directory, f"observed.{rank}.{trial}")
            if not os.path.exists(path):
                continue
            try:
                with open(path, "rb") as f:
                    observed[rank] = decode(f.read())
            except Exception as exc:  # noqa: BLE001 - not plain data: refused, and a fail
                raise Fail(f"{where(rank, trial)}rank {rank} recorded something that is not plain data "
                           f"({type(exc).__name__}).") from None
        if not observed:
            if complete:
                raise Fail(f"{where(0, trial)}no rank recorded a result for this trial.")
            return
        missing = [r for r in range(world_size) if r not in observed]
        if missing and complete:
            raise Fail(f"{where(missing[0], trial)}rank {missing[0]} recorded no result for this trial.")
        for rank, data in observed.items():
            kind = _not_plain(data)
            if kind:
                raise Fail(f"{where(rank, trial)}rank {rank}: the answer gave a {kind}, which cannot come back "
                           f"from the process it ran in: return numbers, strings, lists, tuples, dicts or tensors.")
        try:
            check(world_size, trial, observed)
        except Fail as failure:
            if isinstance(failure, Forbidden):
                raise
            raise Fail(f"{where(0, trial)}{failure}", failure.seed_matters) from None
        except Exception as exc:  # noqa: BLE001 - data shaped unlike what the job records: refused
            raise Fail(f"{where(0, trial)}the results recorded by the ranks could not be read "
                       f"({type(exc).__name__}: {exc}).") from None
        if missing:         # the launch failed in this trial: what ranks recorded after it is out of step
            return


_SETTINGS = {"timeout": 30.0}


def _call_job(fn, args, directory):
    return fn(*args)


def call_answer(fn, *args, where: str = "", timeout: float | None = None):
    """Call the student's `fn(*args)` and return what it returned; anything it raises (or a
    hang) becomes a Fail that says what and where ("where" starts the message).

    A function object (pplab.check in a notebook) is called in this process. A
    SourceAnswer (grading) is called in a child process, within `timeout` seconds (default:
    the check's timeout), and what it returned comes back as plain data.
    """
    name = getattr(fn, "__name__", "your function")
    if not isinstance(fn, SourceAnswer):
        try:
            return fn(*args)
        except NotImplementedError:
            raise Fail(_not_implemented(name), seed_matters=False) from None
        except Exception as exc:  # noqa: BLE001 - the student's code may raise anything
            import traceback
            frame = _student_frame(traceback.format_exc(), answer_files(fn))
            raise Fail(f"{where}{name} raised {type(exc).__name__}: {exc}{frame}.") from None
    return _in_child(_call_job, fn, args, where=where, timeout=timeout)


def _in_child(job, fn: SourceAnswer, args, where="", timeout=None):
    """job(resolved fn, args, directory) in one child process (a launch of one rank)."""
    timeout = timeout or _SETTINGS["timeout"]
    directory = tempfile.mkdtemp(prefix="pplab-call-")
    cpu = _CpuWatch(directory)
    name = fn.__name__
    try:
        try:
            out = launch(_on_rank, job, (fn, args), directory, world_size=1, timeout=timeout, backend="gloo",
                         safe_results=True)
        except LaunchError as err:
            raise _launch_failure(err, fn, lambda rank: where, cpu, timeout, single=True) from None
        try:
            value = decode(out[0])
        except Exception as exc:  # noqa: BLE001
            raise Fail(f"{where}{name} sent back something that is not plain data ({type(exc).__name__}).") from None
        kind = _not_plain(value)
        if kind:
            raise Fail(f"{where}{name} returned a {kind}, which cannot come back from the process it ran in: "
                       f"return numbers, strings, lists, tuples, dicts or tensors.")
        return value
    finally:
        cpu.stop.set()
        shutil.rmtree(directory, ignore_errors=True)


def inspect_answer(fn, probe, *args, timeout: float | None = None):
    """probe(the answer's function, *args) -> plain data: run where the answer can be
    looked at (here for a function object, in a child for a SourceAnswer), e.g. to look
    for a library call in its code."""
    if not isinstance(fn, SourceAnswer):
        return probe(fn, *args)
    return _in_child(lambda f, a, d: probe(f, *a), fn, args, timeout=timeout)
