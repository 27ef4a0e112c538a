"""Exercise notebooks made from the solutions, and grading of submitted notebooks.

1. One source of truth. Every exercise is written once, in solutions/, with the
   answer between `### BEGIN SOLUTION` and `### END SOLUTION`. `pplab exercises`
   writes exercises/ from it: in code cells the marked lines become
   `raise NotImplementedError("write your solution here")`, in markdown cells
   "_Your answer here._", and outputs are cleared. `pplab exercises --check` names
   the exercise notebooks that are out of date (a test runs it).

2. Grading. `pplab grade SUBMISSIONS --out grades.csv` gives marks that nothing in a
   student's notebook can decide:
   - it runs each notebook top to bottom in a fresh kernel, in a scratch folder holding
     only a copy of it, with a time limit, only to note what went wrong (cells that
     raised, timed out or killed the kernel). Nothing the kernel prints or writes is read
     as a result;
   - it takes the answers from the notebook's *source* (`definitions`): for each exercise,
     the last top-level definition of its answer and, transitively, of every global name
     that code reads (def, class, import, assignment to a plain name). Nothing else at
     the top level is run; statements that look like tampering (assigning to a module's
     attributes, setattr, exec, writing files...) are named in the notes;
   - it checks each answer in a fresh process of its own (`python -I`, a clean folder,
     pplab imported from a copy of its source read before any notebook ran), where no
     student code runs: the student's definitions run only in the ranks and child
     processes that call them, and what comes back is decoded as plain data. The check
     process kills every process below it, then sends its verdict over a Unix socket on
     which the grader reads only the connection the kernel says (SO_PEERCRED) comes from
     the check process itself: a verdict forged by the answer, anywhere, is ignored.
   A notebook that crashes, hangs or deadlocks loses nothing: its definitions are graded.

   The grader does not sandbox: student code runs with the grader's rights, so a notebook
   can still damage the machine or (deliberately, through the operating system) other
   processes of the same user. Grade in a container or a throwaway account if that matters.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import copy
import csv
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import nbformat

from .runner import _become_subreaper, _kill_children, _kill_tree

BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"
CODE_STUB = 'raise NotImplementedError("write your solution here")'
MARKDOWN_STUB = "_Your answer here._"


# ----------------------------------------------------------------------------------
# 1. Exercises from solutions


def strip_solutions(source: str, stub: str, where: str = "cell") -> str:
    """Replace every BEGIN..END block (markers included) by `stub` at the marker's indent."""
    out, inside = [], False
    for number, line in enumerate(source.split("\n"), 1):
        marker = line.strip()
        if marker.startswith(BEGIN):
            if inside:
                raise ValueError(f"{where}, line {number}: {BEGIN} inside another solution block")
            inside = True
            out.append(line[: len(line) - len(line.lstrip())] + stub)
        elif marker.startswith(END):
            if not inside:
                raise ValueError(f"{where}, line {number}: {END} without a {BEGIN} before it")
            inside = False
        elif not inside:
            out.append(line)
    if inside:
        raise ValueError(f"{where}: {BEGIN} without an {END} after it")
    return "\n".join(out)


def exercise_notebook(solution: nbformat.NotebookNode, name: str = "notebook") -> nbformat.NotebookNode:
    """The student's version of a solution notebook: answers removed, outputs cleared."""
    nb = copy.deepcopy(solution)
    for i, cell in enumerate(nb.cells, 1):
        where = f"{name}, cell {i}"
        if cell.cell_type == "code":
            cell.source = strip_solutions(cell.source, CODE_STUB, where)
            cell.outputs = []
            cell.execution_count = None
        elif cell.cell_type == "markdown":
            cell.source = strip_solutions(cell.source, MARKDOWN_STUB, where)
        cell.metadata.pop("execution", None)            # run timings
    nb.metadata.pop("widgets", None)                    # saved widget state
    return nb


def notebook_text(nb: nbformat.NotebookNode) -> str:
    """The exact text nbformat.write would produce: the stale check compares it byte for byte."""
    text = nbformat.writes(nb)
    return text if text.endswith("\n") else text + "\n"


def sync_exercises(solutions: str | Path, exercises: str | Path, check: bool = False) -> list[str]:
    """Write exercises/X.ipynb for every solutions/X.ipynb; return what was (or, with
    check=True, would be) out of date: "X.ipynb (stale)", "(missing)" or "(no solution)"."""
    solutions, exercises = Path(solutions), Path(exercises)
    if not solutions.is_dir():
        raise FileNotFoundError(f"no solutions folder at {solutions}: run from the course repository "
                                f"or pass --solutions DIR")
    wanted = {}
    for path in sorted(solutions.glob("*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        wanted[path.name] = notebook_text(exercise_notebook(nb, path.name))
    problems = []
    for name, text in wanted.items():
        target = exercises / name
        if not target.exists():
            problems.append(f"{name} (missing)")
        elif target.read_bytes() != text.encode():
            problems.append(f"{name} (stale)")
        else:
            continue
        if not check:
            exercises.mkdir(parents=True, exist_ok=True)
            target.write_bytes(text.encode())
    problems += [f"{p.name} (no solution)" for p in sorted(exercises.glob("*.ipynb")) if p.name not in wanted]
    return problems


# ----------------------------------------------------------------------------------
# 2. Grading: run each notebook for its notes, then check its definitions elsewhere


@dataclass
class NotebookGrade:
    passed: dict = field(default_factory=dict)      # exercise id -> True/False
    messages: dict = field(default_factory=dict)    # exercise id -> the check's message
    notes: list = field(default_factory=list)       # "cell 4 raised ValueError: ...", "ignored cell 2, line 1: ..."


def find_submissions(directory: str | Path) -> dict[str, list[Path]]:
    """{student: notebooks}: DIR/<student>.ipynb, or every notebook under DIR/<student>/."""
    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"no submissions folder at {directory}")
    found: dict[str, list[Path]] = {}
    for entry in sorted(directory.iterdir()):
        if entry.is_file() and entry.suffix == ".ipynb":
            found.setdefault(entry.stem, []).append(entry)
        elif entry.is_dir() and not entry.name.startswith("."):
            notebooks = [p for p in sorted(entry.rglob("*.ipynb")) if ".ipynb_checkpoints" not in p.parts]
            if notebooks:
                found.setdefault(entry.name, []).extend(notebooks)
    return found


def grade(submissions: str | Path, out: str | Path, *, timeout: float = 600.0, cell_timeout: float = 120.0,
          check_timeout: float = 30.0, jobs: int = 1, log=None) -> list[dict]:
    """Grade every submission and write one CSV row per student; return the rows.

    timeout: seconds for running each notebook, after which it and everything it started
      are killed; cell_timeout: seconds for each cell, after which the kernel is
      interrupted and the next cell runs; check_timeout: seconds per launch of ranks (and
      per call of an answer) in the grader's checks; jobs: notebooks graded at the same time.

    Columns: student, one per exercise of the registry (1 passed, 0 not), total, notes.
    An exercise found in several notebooks of a student counts if any passed. Notes
    number cells from 1, markdown included.
    """
    from .checks import EXERCISES

    if not cell_timeout > check_timeout:
        raise ValueError(f"cell_timeout ({cell_timeout:g} s) must be longer than check_timeout "
                         f"({check_timeout:g} s), or a hung check would look like a hung cell")
    sources = pplab_sources()                 # before any notebook runs: what the checks will import
    students = find_submissions(submissions)
    tasks = [(student, nb) for student, notebooks in students.items() for nb in notebooks]
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        futures = {task: pool.submit(grade_notebook, task[1], timeout=timeout, cell_timeout=cell_timeout,
                                     check_timeout=check_timeout, sources=sources) for task in tasks}
        grades = {task: future.result() for task, future in futures.items()}
    ids = list(EXERCISES)
    rows = []
    for student, notebooks in students.items():
        row, notes = {"student": student}, []
        for ex in ids:
            row[ex] = int(any(grades[(student, nb)].passed.get(ex, False) for nb in notebooks))
        for nb in notebooks:
            g = grades[(student, nb)]
            prefix = f"{nb.name}: " if len(notebooks) > 1 else ""
            notes += [prefix + n for n in g.notes]
            notes += [f"{prefix}{ex}: {_short(g.messages[ex])}" for ex, ok in g.passed.items()
                      if not ok and not row[ex] and g.messages[ex]]
        row["total"] = sum(row[ex] for ex in ids)
        row["notes"] = "; ".join(notes)
        rows.append(row)
        if log:
            log(f"{student}: {row['total']}/{len(ids)}" + (f" ({row['notes']})" if row["notes"] else ""))
    with open(out, "w", newline="") as f:
        writer = csv.DictWriter(f, ["student", *ids, "total", "notes"])
        writer.writeheader()
        writer.writerows(rows)
    return rows


def _short(message: str, limit: int = 200) -> str:
    message = message.split(" Re-run with seed=")[0]
    return message if len(message) <= limit else message[: limit - 1] + "…"


def grade_notebook(path: str | Path, *, timeout: float = 600.0, cell_timeout: float = 120.0,
                   check_timeout: float = 30.0, sources: dict | None = None) -> NotebookGrade:
    """Run one notebook for its notes (which cells raised, timed out, killed the kernel),
    then check the answers it defines (its source, whatever the run did), each in a fresh
    process of the grader's."""
    from .checks import EXERCISES
    from .submission import definitions

    sources = sources or pplab_sources()
    path = Path(path).resolve()
    grade = NotebookGrade()
    try:
        nb = nbformat.read(path, as_version=4)
    except Exception as exc:  # noqa: BLE001 - not a notebook
        grade.notes.append(f"could not run the notebook: {type(exc).__name__}: {str(exc)[:200]}")
        return grade
    before = pplab_sources()
    run_notebook(path, grade.notes, timeout=timeout, cell_timeout=cell_timeout)
    after = pplab_sources()
    changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    if changed:
        grade.notes.append(f"pplab's files on disk changed while the notebook ran ({', '.join(changed)[:200]}): "
                           f"the checks use the copy the grader read before grading began")
    cells = [(n, c.source) for n, c in enumerate(nb.cells, 1) if c.cell_type == "code"]
    found = definitions(cells, {ex.answer for ex in EXERCISES.values()})          # pplab/submission.py
    grade.notes += found.notes
    for ex in EXERCISES.values():
        if ex.answer in found.answers:
            grade.passed[ex.id], grade.messages[ex.id] = run_check_process(
                ex.id, found.answers[ex.answer], sources, check_timeout, grade.notes)
    return grade


# -- running the notebook, for its notes only ----------------------------------------

def run_notebook(path: Path, notes: list, *, timeout: float, cell_timeout: float) -> None:
    """Run the notebook top to bottom in a fresh kernel, in a scratch folder holding only a
    copy of it, in a process of its own with a time limit, and append what went wrong to
    `notes`. Nothing it prints or writes decides a mark: marks come from run_check_process."""
    with tempfile.TemporaryDirectory(prefix="pplab-grade-") as tmp:
        scratch = Path(tmp, "scratch")
        scratch.mkdir()
        shutil.copy(path, scratch / path.name)
        records, log = Path(tmp, "runner.jsonl"), Path(tmp, "runner.log")
        records.touch()
        # The runner loads pplab/runner.py on its own, without the pplab package (and torch):
        # it only drives a kernel.
        code = "import runpy, sys; runpy.run_path(sys.argv[1])['main'](sys.argv[2:])"
        argv = [sys.executable, "-c", code, str(Path(__file__).with_name("runner.py")), str(scratch / path.name),
                str(records), str(cell_timeout)]
        with open(log, "wb") as log_file:
            runner = subprocess.Popen(argv, cwd=scratch, stdin=subprocess.DEVNULL, stdout=log_file,
                                      stderr=subprocess.STDOUT, start_new_session=True)
            try:
                runner.wait(timeout)
                stopped = False
            except subprocess.TimeoutExpired:
                stopped = True
            _kill_tree(runner.pid)                      # the kernel, and anything it left running
            runner.wait()
        told, foreign = [], 0
        for line in records.read_text(errors="replace").splitlines():
            try:
                record = json.loads(line)
                if set(record) == {"note"}:
                    told.append(str(record["note"]))
                else:
                    foreign += 1
            except (ValueError, TypeError, AttributeError):
                foreign += 1                            # a line cut short by the kill, or not ours
        notes += told
        if foreign > 1 or (foreign and not stopped):
            notes.append(f"ignored {foreign} line(s) in the grader's notes file that the grader did not write "
                         f"(written by the notebook?): marks never come from there")
        if stopped:
            notes.append(f"stopped after {timeout:g} s (the notebook's time limit)")
        elif runner.returncode != 0 and not told:
            tail = log.read_text(errors="replace").strip().splitlines()[-1:] or ["no output"]
            notes.append(f"grader error (exit code {runner.returncode}): {tail[0]}")


def defined_names(source: str) -> list[str]:
    """Names a cell defines at top level (def, class, assignment), in order."""
    from .submission import defined_names
    return defined_names(source)


# ----------------------------------------------------------------------------------
# 3. The check, in a fresh process of the grader's where no student code runs

def pplab_sources() -> dict:
    """{module name: [file, source, is a package]} of the pplab package, read now. The check
    processes import pplab from this copy, so a notebook that rewrites (or adds to) pplab's
    files, or leaves a module named like one anywhere, changes nothing in them."""
    root = Path(__file__).resolve().parent
    found = {}
    for file in sorted(root.rglob("*.py")):
        parts = list(file.relative_to(root.parent).with_suffix("").parts)
        package = parts[-1] == "__init__"
        name = ".".join(parts[:-1] if package else parts)
        found[name] = [str(file), file.read_text(), package]
    return found


# Runs first in a check process (python -I: no current folder, no PYTHONPATH, no user site
# on sys.path): serve pplab from the copy sent on stdin, then run one check.
_BOOT = r'''
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
    def exec_module(self, module):
        file, text, _ = sources[module.__name__]
        module.__file__ = file
        exec(compile(text, file, "exec"), module.__dict__)

sys.meta_path.insert(0, Copy())
sys.path_hooks.insert(0, Copy)
sys.path_importer_cache.clear()
from pplab.grading import _check_main
_check_main(job)
'''


def run_check_process(exercise_id: str, answer, sources: dict, check_timeout: float,
                      notes: list | None = None) -> tuple[bool, str]:
    """(passed, message) of one exercise's check of `answer` (a SourceAnswer), run in a fresh
    process where no student code runs.

    The verdict comes back over a Unix socket that the check process connects to once
    every process below it has been killed, and the grader reads only the connection whose
    peer the kernel reports (SO_PEERCRED) as the check process itself: whatever a rank
    writes, to any file descriptor or to the socket, cannot stand in for it. Forged
    verdicts seen on the way are named in `notes`."""
    import socket
    import struct
    import threading

    notes = [] if notes is None else notes
    limit = 4 * check_timeout + 120                         # a few launches, each bounded by check_timeout
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    with tempfile.TemporaryDirectory(prefix="pplab-check-") as cwd, \
            socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
        address = f"\0pplab-verdict-{os.getpid()}-{os.urandom(8).hex()}"      # abstract: no file to find
        server.bind(address)
        server.listen(16)
        server.settimeout(0.2)
        job = {"sources": sources, "exercise": exercise_id, "timeout": check_timeout, "name": answer.name,
               "statements": [list(s) for s in answer.statements], "verdict": address,
               "params": None if answer.params is None else [list(p) for p in answer.params]}
        proc = subprocess.Popen([sys.executable, "-I", "-c", _BOOT], cwd=cwd, env=env, stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        lines: list[bytes] = []
        reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
        reader.start()
        try:
            proc.stdin.write(json.dumps(job).encode())
            proc.stdin.close()
        except OSError:
            pass
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
                    while chunk := conn.recv(65536):
                        data += chunk
            if pid == proc.pid:
                verdicts.append(data)
            else:
                forged += 1
        timed_out = proc.poll() is None
        _kill_tree(proc.pid)
        proc.wait()
        reader.join(5)
    text = [line.decode(errors="replace").strip() for line in lines if line.strip()]
    forged += sum(1 for line in text if '"passed"' in line)
    if forged:
        notes.append(f"{exercise_id}: ignored {forged} forged verdict(s) (from processes other than the check "
                     f"itself)")
    if timed_out and not verdicts:
        return False, f"the check did not finish within {limit:g} s (the grader's limit for one check)"
    try:
        verdict = json.loads(verdicts[0])
        return verdict["passed"] is True, str(verdict["message"])
    except (IndexError, ValueError, KeyError, TypeError):
        tail = text[-1][:200] if text else "no output"
        return False, f"the check process gave no verdict (exit code {proc.returncode}): {tail}"


def _check_main(job: dict) -> None:
    """In the check process: check the answer, kill every process below this one, then
    send the verdict to the grader's socket."""
    import socket

    _become_subreaper()
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    started = time.monotonic()
    try:
        from .checks import SourceAnswer, run_check

        answer = SourceAnswer(job["name"], tuple(tuple(s) for s in job["statements"]),
                              None if job["params"] is None else tuple(tuple(p) for p in job["params"]))
        result = run_check(job["exercise"], answer, timeout=float(job["timeout"]))
        verdict = {"passed": result.passed, "message": result.message}
    except BaseException as exc:  # noqa: BLE001 - a bug of ours must still give a verdict
        verdict = {"passed": False, "message": f"the check raised {type(exc).__name__}: {exc}"}
    verdict["seconds"] = round(time.monotonic() - started, 2)
    _kill_children()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as channel:
        channel.connect(job["verdict"])
        channel.sendall(json.dumps(verdict).encode())
    os._exit(0)
