"""Where a student's answer runs, and what may come back from it.

A checker never runs the student's code in its own process. It hands the answer to
`run_on_ranks(job, answer, ...)` (real ranks) or `call_answer(answer, ...)`, and reads
back plain data: numbers, strings, None, lists, tuples, dicts and tensors, decoded with
`torch.load(weights_only=True)` (never plain pickle), so nothing a rank sends can run
code in the checker's process. See core.py's docstring for the whole contract.

The answer is either the function itself (`pplab.check("broadcast", my_broadcast)` in
a notebook: forked ranks inherit it) or, when grading, a `SourceAnswer`: the student's
definitions as source text, run (`resolve()`) only in the child processes that call
the answer, in a fresh module, in a fresh working directory.
"""
from __future__ import annotations

import contextlib
import inspect
import io
import linecache
import os
import re
import shutil
import sys
import tempfile
import threading
import time
import types
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .. import trace
from ..launcher import LaunchError, launch
from .core import Fail, Forbidden

# ----------------------------------------------------------------------------------
# The answer as source (the grader's form)

_KINDS = {"positional_only": inspect.Parameter.POSITIONAL_ONLY,
          "positional_or_keyword": inspect.Parameter.POSITIONAL_OR_KEYWORD,
          "var_positional": inspect.Parameter.VAR_POSITIONAL,
          "keyword_only": inspect.Parameter.KEYWORD_ONLY, "var_keyword": inspect.Parameter.VAR_KEYWORD}


@dataclass(frozen=True)
class SourceAnswer:
    """A student's answer as source: the definitions it needs, run only where it is called.

    name: the name the answer is bound to; statements: ((filename, first line, source),
    ...) in notebook order, e.g. ("<cell 5>", 1, "def my_broadcast(tensor, src): ...");
    params: for an answer that is a plain `def`, its parameters as (name, kind, has a
    default) read from the source without running it, so that a checker can look at its
    signature here (inspect.signature works on it); None otherwise.
    """

    name: str
    statements: tuple = ()
    params: tuple | None = None

    @property
    def __name__(self) -> str:              # messages say "my_broadcast raised ...", as for a function
        return self.name

    @property
    def __signature__(self):
        if self.params is None:
            return None
        return inspect.Signature([inspect.Parameter(name, _KINDS[kind], default=... if default else
                                                    inspect.Parameter.empty) for name, kind, default in self.params])

    def __call__(self, *args, **kwargs):
        raise TypeError(f"{self.name} is source code: it runs only in a child process. Call it with "
                        f"call_answer({self.name}, ...) or run_on_ranks(job, {self.name}, ...).")

    @property
    def filenames(self) -> set:
        return {filename for filename, _, _ in self.statements}

    def resolve(self, workdir: str | None = None):
        """In the child that calls the answer: run the definitions in a fresh module (in
        `workdir`, or a fresh temporary folder), return what `name` is bound to."""
        os.chdir(workdir or tempfile.mkdtemp(prefix="pplab-answer-"))
        module = types.ModuleType("submission")
        module.__file__ = "<submission>"
        sys.modules["submission"] = module
        texts: dict[str, list[str]] = {}
        for filename, line, source in self.statements:
            lines = texts.setdefault(filename, [])
            lines += ["\n"] * (line - 1 - len(lines))
            lines += [s + "\n" for s in source.split("\n")]
        for filename, lines in texts.items():      # tracebacks show the student's lines
            linecache.cache[filename] = (sum(map(len, lines)), None, lines, filename)
        for filename, line, source in self.statements:
            exec(compile("\n" * (line - 1) + source, filename, "exec"), module.__dict__)
        if self.name not in module.__dict__:
            raise NameError(f"{self.name} is not defined by the definitions taken from the notebook")
        return module.__dict__[self.name]


def answer_files(answer) -> set:
    """The file names the answer's own frames have in a traceback."""
    if isinstance(answer, SourceAnswer):
        return answer.filenames
    filename = getattr(getattr(answer, "__code__", None), "co_filename", None)
    return {filename} if filename else set()


# ----------------------------------------------------------------------------------
# Plain data across a process boundary

_SAFE_TYPES: list = []


def allow_type(cls) -> None:
    """Let instances of a small dataclass of pplab's (e.g. pipeline.Action) come back
    from a child. Its fields must be plain data; it must run no code when built."""
    if cls not in _SAFE_TYPES:
        _SAFE_TYPES.append(cls)


def _plain(x):
    """numpy numbers and arrays as Python numbers and tensors (what a student may return)."""
    if type(x).__module__ == "numpy":
        return torch.from_numpy(x.copy()) if hasattr(x, "shape") and x.shape else x.item()
    if type(x) in (list, tuple):
        return type(x)(_plain(v) for v in x)
    if type(x) is dict:
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, torch.Tensor):
        return x.detach().cpu()
    return x


def encode(value) -> bytes:
    """In a child: `value` as bytes the checker's process can decode safely. Something that
    is not plain data becomes a NotPlainData marker naming its type."""
    buffer = io.BytesIO()
    try:
        torch.save(_plain(value), buffer)
        decode(buffer.getvalue())
    except Exception:  # noqa: BLE001 - anything that does not come back as plain data
        buffer = io.BytesIO()
        torch.save(("__pplab_not_plain_data__", type(value).__name__), buffer)
    return buffer.getvalue()


def decode(data: bytes):
    """In the checker's process: the plain data `encode` made (raises if it is not that)."""
    if not isinstance(data, bytes):
        raise TypeError(f"expected bytes, got {type(data).__name__}")
    with torch.serialization.safe_globals(list(_SAFE_TYPES)):
        return torch.load(io.BytesIO(data), weights_only=True)


def _not_plain(value) -> str | None:
    if isinstance(value, tuple) and len(value) == 2 and value[0] == "__pplab_not_plain_data__":
        return str(value[1])
    return None


# ----------------------------------------------------------------------------------
# Inside a rank: what the checker's job records


def progress(directory: str, trial: int) -> None:
    """Inside a rank: note the trial this rank is on (see run_on_ranks)."""
    with open(os.path.join(directory, str(dist.get_rank())), "w") as f:
        f.write(str(trial))


def observe(directory: str, trial: int, data) -> None:
    """Inside a rank: record what the student's code produced and this rank observed in
    trial `trial` (plain data: tensors, numbers, strings, lists, tuples, dicts). The
    checker's `check` reads it in the checker's process."""
    path = os.path.join(directory, f"observed.{dist.get_rank()}.{trial}")
    with open(path + ".part", "wb") as f:
        f.write(encode(data))
    os.replace(path + ".part", path)


def _on_rank(job, args, directory):
    """What each rank runs: resolve a SourceAnswer here, run the checker's job, send back
    its result as bytes of plain data."""
    rank = dist.get_rank()
    with open(os.path.join(directory, f"pid.{rank}"), "w") as f:
        f.write(str(os.getpid()))
    workdir = os.path.join(directory, f"cwd.{rank}")
    os.makedirs(workdir, exist_ok=True)
    args = tuple(a.resolve(workdir) if isinstance(a, SourceAnswer) else a for a in args)
    result = job(*args, directory)
    trace.reset(rank)                     # the checker needs no trace; what comes back stays plain
    return encode(result)


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
