"""Grading of submitted notebooks (exercises/ are written from solutions/ by exercises.py).

1. Grading. `pplab grade SUBMISSIONS --out grades.csv` gives marks that nothing in a
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
   - it checks each answer in a fresh process of its own (check_process.py), where no
     student code runs: the student's definitions run only in the ranks and child
     processes that call them, and what comes back is decoded as plain data;
   - every process that runs a student's code (the notebook's kernel, the ranks of a
     check) runs in a sandbox (sandbox.py) that sees only the system, the Python
     environment and a copy of pplab (read-only) and its own folder: no course checkout,
     solutions, .git or other submission; when it ends every process it started ends
     with it. Where the machine has no namespaces (not Linux, or turned off) the grader
     says so once, in its summary: student code then runs with the grader's rights, so
     grade in a container;
   - each sandbox has the submission's limits (`limits`: memory, processes, disk, printed
     in the summary); one that reaches a limit is stopped with a note naming it.
   A notebook that crashes, hangs or deadlocks loses nothing: its definitions are graded.
   Whatever one submission holds (not a notebook, a symbolic link, huge or deeply nested
   code, output without end), it gets its own row with a note and the others are graded.

2. The CSV: one row per student, one column per exercise in chapter order (the points
   earned: 1 passed, 0 tried and failed for most; part of a capstone's points for the parts
   that were right, "missing" where no notebook of the student defines the answer or
   it is still the exercise's stub), the total, and the notes. Values a spreadsheet
   would read as a formula (=, +, -, @ first) are quoted with a leading '. Written
   answers (markdown cells the student added or changed, and the predictions they filled in)
   go to ANSWERS/<student>.md.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
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


from . import sandbox
from .exercises import MARKDOWN_STUB
from .check_process import copy_pplab, pplab_sources, run_check_process
from .runner import _kill_tree



# ----------------------------------------------------------------------------------
# 2. Grading: run each notebook for its notes, then check its definitions elsewhere

MAX_NOTEBOOK_BYTES = 20 << 20       # a notebook larger than this is not read (clear its outputs)
MAX_CELL_CHARS = 200_000            # a code cell longer than this is not parsed
MISSING = "missing"                 # the CSV's mark for an answer nobody wrote


@dataclass
class NotebookGrade:
    passed: dict = field(default_factory=dict)      # exercise id -> True/False, for answers it defines
    scores: dict = field(default_factory=dict)      # exercise id -> points earned (all of them when passed)
    messages: dict = field(default_factory=dict)    # exercise id -> the check's message
    notes: list = field(default_factory=list)       # "cell 4 raised ValueError: ...", "ignored cell 2, line 1: ..."
    written: list = field(default_factory=list)     # markdown the student wrote: (cell number, text)
    status: str = "graded"                          # "graded", "refused" (not read) or "failed to run"


def find_submissions(directory: str | Path, refused: dict | None = None) -> dict[str, list[Path]]:
    """{student: notebooks}: DIR/<student>.ipynb, or every notebook under DIR/<student>/.

    A symbolic link (to another student's notebook, to the solutions...) is never followed:
    it goes into `refused` as {student: [why]}, and that student gets a row with the note."""
    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"no submissions folder at {directory}")
    refused = {} if refused is None else refused
    found: dict[str, list[Path]] = {}

    def link(path: Path, student: str) -> bool:
        if path.is_symlink():
            refused.setdefault(student, []).append(
                f"{path.relative_to(directory)} is a symbolic link (to {os.readlink(path)}): refused, hand in the "
                f"notebook itself")
            return True
        return False

    for entry in sorted(directory.iterdir()):
        if entry.name.startswith("."):
            continue
        if entry.suffix == ".ipynb" and (entry.is_file() or entry.is_symlink()):
            if not link(entry, entry.stem):
                found.setdefault(entry.stem, []).append(entry)
        elif entry.is_dir() or entry.is_symlink():
            if link(entry, entry.name):
                continue
            notebooks = []
            for root, dirs, files in os.walk(entry):                       # never into a linked folder
                dirs[:] = sorted(d for d in dirs if d != ".ipynb_checkpoints" and not link(Path(root, d), entry.name))
                notebooks += [Path(root, f) for f in sorted(files) if f.endswith(".ipynb")
                              and not link(Path(root, f), entry.name)]
            if notebooks:
                found.setdefault(entry.name, []).extend(sorted(notebooks))
    return found


def chapter_order(exercise_ids) -> list[str]:
    """Exercise ids in the order of the course: by their notebook's name (00_, 01a_, ...)."""
    from ..checks import EXERCISES

    return sorted(exercise_ids, key=lambda ex: (EXERCISES[ex].notebook or "~", ex))


def grade(submissions: str | Path, out: str | Path, *, timeout: float = 600.0, cell_timeout: float = 120.0,
          check_timeout: float = 30.0, jobs: int = 1, exercises=None, answers: str | Path | None = None,
          sandboxed: bool = True, limits: sandbox.Limits = sandbox.Limits(), log=None) -> list[dict]:
    """Grade every submission and write one CSV row per student; return the rows.

    timeout: seconds for running each notebook, after which it and everything it started
      are killed; cell_timeout: seconds for each cell, after which the kernel is
      interrupted and the next cell runs; check_timeout: seconds per launch of ranks (and
      per call of an answer) in the grader's checks; jobs: notebooks graded at the same
      time; exercises: the ids to grade (default: all); answers: folder for each student's
      written answers (default: next to `out`, named after it); sandboxed: run student code
      in the sandbox where the machine has one (sandbox.py); limits: what each sandbox
      may take (sandbox.Limits: memory, processes, disk).

    Columns: student, one per exercise in chapter order (the points earned: 1 passed, 0
    failed for a one-point exercise; part of its points for a capstone right in some parts or
    an answer scored on how good it is; "missing"), total, notes. An exercise found in several
    notebooks of a student counts its best. Notes number cells from 1, markdown included. `log` gets one line per student
    and a summary at the end.
    """
    from ..checks import EXERCISES

    started = time.monotonic()
    if not cell_timeout > check_timeout:
        raise ValueError(f"cell_timeout ({cell_timeout:g} s) must be longer than check_timeout "
                         f"({check_timeout:g} s), or a hung check would look like a hung cell")
    ids = list(EXERCISES if exercises is None else exercises)
    unknown = [ex for ex in ids if ex not in EXERCISES]
    ids = chapter_order(ex for ex in ids if ex in EXERCISES)
    if unknown or not ids:
        raise ValueError(f"unknown exercise(s) {', '.join(unknown) or '(none given)'}: the exercises are "
                         f"{', '.join(chapter_order(EXERCISES))}")
    library = tempfile.TemporaryDirectory(prefix="pplab-library-")
    # before any notebook runs: what the checks import, and the copy every sandbox sees
    sources = copy_pplab(pplab_sources(), library.name)
    refused: dict[str, list[str]] = {}
    students = find_submissions(submissions, refused)
    no_sandbox = None if not sandboxed else sandbox.why_not()
    settings = dict(timeout=timeout, cell_timeout=cell_timeout, check_timeout=check_timeout, sources=sources,
                    exercises=ids, hidden=_hidden_from_students(submissions, out, answers), sandboxed=sandboxed,
                    limits=limits)
    tasks = [(student, nb) for student, notebooks in students.items() for nb in notebooks]
    with library, concurrent.futures.ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        futures = {task: pool.submit(_grade_safely, task[1], settings) for task in tasks}
        grades = {task: future.result() for task, future in futures.items()}
    rows, written = [], {}
    for student in sorted(set(students) | set(refused)):
        notebooks = students.get(student, [])
        row, notes = {"student": student}, list(refused.get(student, []))
        for ex in ids:
            tried = [grades[(student, nb)].scores[ex] for nb in notebooks if ex in grades[(student, nb)].scores]
            row[ex] = MISSING if not tried else _points(max(tried))
        for nb in notebooks:
            g = grades[(student, nb)]
            prefix = f"{nb.name}: " if len(notebooks) > 1 else ""
            notes += [prefix + n for n in g.notes]
            notes += [f"{prefix}{ex}: {_short(g.messages[ex])}" for ex, ok in g.passed.items()
                      if ex in ids and not ok and row[ex] != EXERCISES[ex].points and g.messages[ex]]
            written[student] = written.get(student, []) + [(nb.name, n, text) for n, text in g.written]
        row["total"] = _points(sum(row[ex] for ex in ids if row[ex] != MISSING))
        row["notes"] = "; ".join(notes)
        rows.append(row)
        if log:
            log(f"{student}: {row['total']}/{_points(sum(EXERCISES[ex].points for ex in ids))}" + (f" ({row['notes'][:300]})" if row["notes"] else ""))
    with open(out, "w", newline="") as f:
        writer = csv.DictWriter(f, ["student", *ids, "total", "notes"])
        writer.writeheader()
        writer.writerows({k: _csv_safe(v) for k, v in row.items()} for row in rows)
    _write_answers(written, Path(answers) if answers else Path(out).with_name(Path(out).stem + "_answers"))
    if log:
        statuses = [g.status for g in grades.values()]
        log(f"summary: {len(rows)} student(s), {len(tasks)} notebook(s): {statuses.count('graded')} graded, "
            f"{statuses.count('failed to run')} failed to run, {statuses.count('refused')} refused, "
            f"{sum(len(r) for r in refused.values())} link(s) refused; {time.monotonic() - started:.0f} s" +
            (f". NOT SANDBOXED ({no_sandbox}): student code ran with the grader's rights" if no_sandbox else
             f"; limits per submission: {limits.describe()} (--memory, --processes, --disk)" if sandboxed else ""))
    return rows


def _hidden_from_students(submissions, out, answers) -> list[str]:
    """Folders no student code may see: the submissions, the grades, the solutions."""
    hidden = [Path(submissions).resolve(), Path(out).resolve().parent]
    if answers:
        hidden.append(Path(answers).resolve())
    course = Path(__file__).resolve().parents[2]
    hidden += [course / "solutions"]
    return [str(p) for p in hidden if p.is_dir() and p != Path("/") and p != course]


def _points(x: float):
    """1 and 0 stay whole numbers in the CSV; a part of a point keeps two decimals."""
    return int(x) if float(x).is_integer() else round(x, 2)


def _csv_safe(value):
    """A cell a spreadsheet would run as a formula (=, +, -, @ first) gets a leading '."""
    if isinstance(value, str) and value[:1] in ("=", "+", "-", "@", "\t", "\r"):
        return "'" + value
    return value


def _write_answers(written: dict, folder: Path) -> None:
    """Each student's written answers (markdown they wrote) into FOLDER/<student>.md."""
    if not any(written.values()):
        return
    folder.mkdir(parents=True, exist_ok=True)
    for student, items in written.items():
        if items:
            text = "".join(f"## {name}, cell {n}\n\n{body.strip()}\n\n" for name, n, body in items)
            (folder / f"{_file_safe(student)}.md").write_text(f"# {student}: written answers\n\n{text}")


def _file_safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name).lstrip(".") or "_"


def _short(message: str, limit: int = 200) -> str:
    message = message.split(" Re-run with seed=")[0]
    return message if len(message) <= limit else message[: limit - 1] + "…"


def _grade_safely(path: Path, settings: dict) -> NotebookGrade:
    """grade_notebook, but whatever goes wrong stays with this notebook: a note, not a crash."""
    try:
        return grade_notebook(path, **settings)
    except Exception as exc:  # noqa: BLE001 - one submission must never stop the others
        return NotebookGrade(notes=[f"grader error on this notebook ({type(exc).__name__}: {str(exc)[:200]}): "
                                    f"it was not graded; please report it"], status="failed to run")


def read_cells(path: Path) -> tuple[list[tuple[int, str, str]], list[str]]:
    """[(cell number, cell type, source)] of a notebook, read without trusting its shape,
    and notes on what could not be read. Raises ValueError if it is not a notebook at all."""
    size = path.stat().st_size
    if size > MAX_NOTEBOOK_BYTES:
        raise ValueError(f"the notebook is {size / 2**20:.0f} MB, more than the grader reads "
                         f"({MAX_NOTEBOOK_BYTES >> 20} MB): clear its outputs and hand it in again")
    with open(path, "rb") as f:
        data = f.read(MAX_NOTEBOOK_BYTES + 1)
    try:
        nb = json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise ValueError(f"not a notebook (not JSON: {type(exc).__name__})") from None
    if not isinstance(nb, dict) or not isinstance(nb.get("cells"), list):
        old = isinstance(nb, dict) and "worksheets" in nb
        raise ValueError("not a notebook in nbformat 4" + (" (nbformat 3: open and save it in Jupyter)" if old
                                                           else " (no list of cells)"))
    cells, notes = [], []
    for number, cell in enumerate(nb["cells"], 1):
        kind = cell.get("cell_type") if isinstance(cell, dict) else None
        source = cell.get("source", None) if isinstance(cell, dict) else None
        if isinstance(source, list) and all(isinstance(s, str) for s in source):
            source = "".join(source)
        if kind not in ("code", "markdown", "raw") or not isinstance(source, str):
            notes.append(f"cell {number} is not a well-formed cell (no cell_type or source): skipped")
            continue
        if kind == "code" and len(source) > MAX_CELL_CHARS:
            notes.append(f"cell {number} holds {len(source):,} characters, more than the grader reads "
                         f"({MAX_CELL_CHARS:,}): skipped")
            continue
        cells.append((number, kind, source))
    return cells, notes


def grade_notebook(path: str | Path, *, timeout: float = 600.0, cell_timeout: float = 120.0,
                   check_timeout: float = 30.0, sources: dict | None = None, exercises=None, hidden=(),
                   sandboxed: bool = True, limits: sandbox.Limits = sandbox.Limits()) -> NotebookGrade:
    """Run one notebook for its notes (which cells raised, timed out, killed the kernel),
    then check the answers it defines (its source, whatever the run did), each in a fresh
    process of the grader's."""
    from ..checks import EXERCISES
    from .submission import definitions

    sources = sources or pplab_sources()
    path = Path(path)
    grade = NotebookGrade()
    if path.is_symlink():
        grade.notes.append(f"{path.name} is a symbolic link: refused, hand in the notebook itself")
        grade.status = "refused"
        return grade
    try:
        cells, unreadable = read_cells(path)
        grade.notes += unreadable
    except (ValueError, OSError) as exc:
        grade.notes.append(f"could not read the notebook: {exc}")
        grade.status = "refused"
        return grade
    wanted = [EXERCISES[ex] for ex in (exercises or EXERCISES)]
    found = definitions([(n, src) for n, kind, src in cells if kind == "code"], {ex.answer for ex in wanted})
    grade.written = _written_answers(cells, {ex.notebook for ex in wanted if ex.answer in found.answers})
    before = pplab_sources()
    if not run_notebook(path, grade.notes, timeout=timeout, cell_timeout=cell_timeout, hidden=hidden,
                        sandboxed=sandboxed, limits=limits, sources=sources):
        grade.status = "failed to run"
    after = pplab_sources()
    changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    if changed:
        grade.notes.append(f"pplab's files on disk changed while the notebook ran ({', '.join(changed)[:200]}): "
                           f"the checks use the copy the grader read before grading began")
    grade.notes += found.notes
    for ex in wanted:
        if ex.answer in found.refused:
            grade.passed[ex.id], grade.messages[ex.id] = False, found.refused[ex.answer]
            grade.scores[ex.id] = 0.0
        elif ex.answer in found.answers:
            passed, message, score = run_check_process(ex.id, found.answers[ex.answer], sources, check_timeout,
                                                grade.notes, hidden=hidden, sandboxed=sandboxed, limits=limits)
            if not passed and "is not implemented yet" in message:
                continue                                 # the exercise's stub, untouched: missing, not 0
            grade.passed[ex.id], grade.messages[ex.id] = passed, message if passed else _name_the_limit(message, limits)
            grade.scores[ex.id] = ex.points if passed else min(max(score, 0.0), ex.points)
    return grade


def _written_answers(cells, exercise_notebooks) -> list[tuple[int, str]]:
    """Markdown cells the student wrote or changed: not in any exercise notebook of the
    course that this notebook answers, and not the stub."""
    given = set()
    for name in exercise_notebooks:
        for folder in ("exercises", "solutions"):
            file = Path(__file__).resolve().parents[2] / folder / f"{name}.ipynb"
            with contextlib.suppress(OSError, ValueError):
                given |= {src.strip() for _, kind, src in read_cells(file)[0] if kind == "markdown"}
    written = [(n, src) for n, kind, src in cells if kind == "markdown" and src.strip()
               and src.strip() not in given and src.strip() != MARKDOWN_STUB]
    return sorted(written + _predictions(cells))


def _predictions(cells) -> list[tuple[int, str]]:
    """The chapters' 'predict, then run' answers the student filled in, read from the source
    (`my_x = 3 * n  # your prediction: ...`), so the instructor sees what they guessed."""
    from ..checks.predictions import predictions_in
    found = []
    for n, kind, src in cells:
        guessed = {k: v for k, v in predictions_in(src).items() if v != "None"} if kind == "code" else {}
        if guessed:
            found.append((n, "predictions: " + "; ".join(f"`{k} = {v}`" for k, v in guessed.items())))
    return found


# -- running the notebook, for its notes only ----------------------------------------

NOTES_KEPT, NOTE_CHARS = 200, 500       # what the grader keeps of the runner's notes


def run_notebook(path: Path, notes: list, *, timeout: float, cell_timeout: float, hidden=(),
                 sandboxed: bool = True, limits: sandbox.Limits = sandbox.Limits(), sources: dict | None = None) -> bool:
    """Run the notebook top to bottom in a fresh kernel, in the sandbox (with `limits`, and
    pplab served from the copy `sources` were read from), in a scratch folder holding only
    a copy of it, with a time limit, and append what went wrong to `notes`.
    Nothing it prints or writes decides a mark: marks come from run_check_process. Returns
    False if the notebook could not be run at all."""
    import threading

    from . import runner

    with tempfile.TemporaryDirectory(prefix="pplab-grade-") as tmp:
        scratch = Path(tmp, "scratch")
        home = scratch / ".home"
        home.mkdir(parents=True)
        copy_path = scratch / _file_safe(path.name)
        shutil.copyfile(path, copy_path)
        # The runner's own code, read by the grader now: nothing a notebook wrote runs here.
        code = Path(runner.__file__).read_text() + "\nmain(sys.argv[1:])\n"
        notes_read, notes_write = os.pipe()
        argv = [sys.executable, "-c", code, str(copy_path), str(notes_write), str(cell_timeout)]
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "JUPYTER")) or k == "PYTHONPATH"}
        env.update(HOME=str(home), TMPDIR=str(scratch), MPLCONFIGDIR=str(home), IPYTHONDIR=str(home / ".ipython"),
                   JUPYTER_RUNTIME_DIR=str(home / "runtime"), JUPYTER_DATA_DIR=str(home / "data"))
        sandboxed = sandboxed and sandbox.why_not() is None
        if sandboxed:
            library = os.path.dirname(os.path.dirname((sources or {}).get("pplab", [""])[0]))
            if not sources or library in sandbox._course():       # never the checkout: a copy of its pplab
                copy_pplab(sources or pplab_sources(), Path(tmp, "library"))
                library = str(Path(tmp, "library"))
            env["PYTHONPATH"] = library                         # the kernel imports this pplab
            argv = sandbox.wrap(argv, workdir=str(scratch), read_only=[library], denied=hidden, env=env,
                                limits=limits)
        runner_proc = subprocess.Popen(argv, cwd=scratch, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                       stderr=subprocess.STDOUT, env=env, pass_fds=[notes_write],
                                       start_new_session=True)
        os.close(notes_write)
        from .check_process import _Tail

        output = _Tail(runner_proc.stdout)
        told: list[str] = []
        foreign = [0]

        def read_notes():
            with open(notes_read, "rb") as f:
                for line in f:
                    try:
                        record = json.loads(line)
                        if set(record) == {"note"} and len(told) < NOTES_KEPT:
                            told.append(str(record["note"])[:NOTE_CHARS])
                    except (ValueError, TypeError, AttributeError):
                        foreign[0] += 1               # a line cut short by the kill
        reader = threading.Thread(target=read_notes, daemon=True)
        reader.start()
        try:
            runner_proc.wait(timeout)
            stopped = False
        except subprocess.TimeoutExpired:
            stopped = True
        _kill_tree(runner_proc.pid)                  # the kernel, and anything it left running
        runner_proc.wait()
        reader.join(5)
        output.thread.join(5)
    notes += [_name_the_limit(n, limits) for n in told]
    limit = sandbox.stopped_by(runner_proc.returncode, [line.strip() for line in output.lines if line.strip()]) \
        if sandboxed else None
    if limit:
        notes.append(f"the notebook was stopped: {limit}")
        return True
    if stopped:
        notes.append(f"stopped after {timeout:g} s (the notebook's time limit)")
    elif runner_proc.returncode != 0 and not told:
        tail = output.lines[-1:] or ["no output"]
        notes.append(f"grader error (exit code {runner_proc.returncode}): {tail[0][:NOTE_CHARS]}")
        return False
    return not any(n.startswith("could not run the notebook") for n in told)


_LIMIT_ERRORS = {"memory": ("MemoryError", "can't allocate memory", "Cannot allocate memory"),
                 "disk": ("No space left on device",),
                 "processes": ("Resource temporarily unavailable", "can't start new thread")}


def _name_the_limit(note: str, limits: sandbox.Limits) -> str:
    """A cell that raised at one of the sandbox's limits: the note says which, and how to change it."""
    for name, signs in _LIMIT_ERRORS.items():
        if any(sign in note for sign in signs):
            value = getattr(limits, name)
            shown = value if name == "processes" else sandbox.isolation._size(value)
            return f"{note} (the submission's {name} limit: pplab grade --{name} {shown})"
    return note


def defined_names(source: str) -> list[str]:
    """Names a cell defines at top level (def, class, assignment), in order."""
    from .submission import defined_names
    return defined_names(source)
