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
   Whatever one submission holds (not a notebook, a symbolic link, a named pipe, huge or
   deeply nested code, output without end), it gets its own row with a note and the others
   are graded. Before any check, what the grader does with a submission's bytes is bounded
   (reading.py): only regular files are opened, never waiting and never through a link;
   at most 20 MB, 2,000 cells and 200,000 characters a code cell are read; the JSON parse,
   IPython's magics, Python's parser, the walk for definitions, the prediction lines and the
   written answers run in a child process with 30 s and 1 GiB, killed past either, so a
   pathological notebook costs seconds and gets a note. Each student has one identity
   (students.py): names are read in NFC, and two that differ only by case or Unicode form
   are both refused with a note, never merged; a student's folder is searched 8 levels deep,
   for at most 100 notebooks.

2. The CSV: one row per student, one column per exercise in chapter order (the points
   earned: 1 passed, 0 tried and failed for most; part of a capstone's points for the parts
   that were right, "missing" where no notebook of the student defines the answer or
   it is still the exercise's stub), the total, and the notes. Values a spreadsheet
   would read as a formula (=, +, -, @, a tab or a carriage return first) are quoted with
   a leading '. Written answers (markdown cells the student added or changed, and the
   predictions they filled in) go to ANSWERS/<student>.md, one file per student: the name
   is percent-encoded ('bob smith' -> bob%20smith.md), so no two students share one.
"""
from __future__ import annotations

import concurrent.futures
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path


from ..isolation import format_size
from . import formats, results, sandbox
from .results import MISSING, PASSED, ExerciseResult
from .check_process import copy_pplab, pplab_sources, run_check_process
from .students import answers_file_name, find_submissions
from .reading import MAX_CELL_CHARS, MAX_NOTEBOOK_BYTES, read_cells, read_submission  # noqa: F401 - read_cells: tests
from .runner import kill_tree



# ----------------------------------------------------------------------------------
# 2. Grading: run each notebook for its notes, then check its definitions elsewhere



@dataclass
class NotebookGrade:
    results: dict = field(default_factory=dict)     # exercise id -> ExerciseResult (results.py), for answers it defines
    notes: list = field(default_factory=list)       # "cell 4 raised ValueError: ...", "ignored cell 2, line 1: ..."
    written: list = field(default_factory=list)     # markdown the student wrote: (cell number, text)
    status: str = "graded"                          # "graded", "refused" (not read) or "failed to run"
    seconds: float = 0.0                            # running the notebook and its checks

    @property
    def passed(self) -> dict:                       # exercise id -> True/False
        return {ex: r.status == PASSED for ex, r in self.results.items()}

    @property
    def scores(self) -> dict:                       # exercise id -> points earned
        return {ex: r.points for ex, r in self.results.items()}


def chapter_order(exercise_ids) -> list[str]:
    """Exercise ids in the order of the course (pplab.checks.core.chapter_order)."""
    from ..checks.core import chapter_order

    return chapter_order(exercise_ids)


def grade(submissions: str | Path, out: str | Path, *, timeout: float = 600.0, cell_timeout: float = 120.0,
          check_timeout: float = 30.0, jobs: int = 1, exercises=None, answers: str | Path | None = None,
          sandboxed: bool = True, limits: sandbox.Limits = sandbox.Limits(), log=None, fmt: str = "csv") -> list[dict]:
    """Grade every submission and write one CSV row per student; return the rows.

    timeout: seconds for running each notebook, after which it and everything it started
      are killed; cell_timeout: seconds for each cell, after which the kernel is
      interrupted and the next cell runs; check_timeout: seconds per launch of ranks (and
      per call of an answer) in the grader's checks; jobs: notebooks graded at the same
      time; exercises: the ids to grade (default: all); answers: folder for each student's
      written answers (default: next to `out`, named after it); sandboxed: run student code
      in the sandbox where the machine has one (sandbox.py); limits: what each sandbox
      may take (sandbox.Limits: memory, processes, disk); fmt: what to write to `out`
      (formats.FORMATS: csv, json or junit).

    Columns: student, one per exercise in chapter order (the points earned: 1 passed, 0
    failed for a one-point exercise; part of its points for a capstone right in some parts or
    an answer scored on how good it is; "missing"), total, notes. An exercise found in several
    notebooks of a student counts its best. Notes number cells from 1, markdown included. `log` gets one line per student
    and a summary at the end.
    """
    from ..checks import EXERCISES
    from ..checks.core import RENAMED, unknown_exercise

    started = time.monotonic()
    if not cell_timeout > check_timeout:
        raise ValueError(f"cell_timeout ({cell_timeout:g} s) must be longer than check_timeout "
                         f"({check_timeout:g} s), or a hung check would look like a hung cell")
    ids = list(EXERCISES if exercises is None else exercises)
    unknown = [ex for ex in ids if ex not in EXERCISES]
    ids = chapter_order(ex for ex in ids if ex in EXERCISES)
    renamed = [ex for ex in unknown if ex in RENAMED]
    if renamed:
        raise ValueError("; ".join(unknown_exercise(ex) for ex in renamed))
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
    rows, written, graded = [], {}, []
    for student in sorted(set(students) | set(refused)):
        notebooks = students.get(student, [])
        result = results.combine(student, [(nb, grades[(student, nb)]) for nb in notebooks], ids,
                                 refused.get(student, []))
        if no_sandbox:
            result.isolation = f"not sandboxed ({no_sandbox})"
        for nb in notebooks:
            written[student] = written.get(student, []) + [(nb.name, n, text) for n, text in grades[(student, nb)].written]
        graded.append(result)
        row = formats.csv_row(result)
        rows.append(row)
        if log:
            log(f"{student}: {row['total']}/{_points(sum(EXERCISES[ex].points for ex in ids))}" + (f" ({row['notes'][:300]})" if row["notes"] else ""))
    formats.write(graded, out, fmt, exercise_ids=ids)
    _write_answers(written, Path(answers) if answers else Path(out).with_name(Path(out).stem + "_answers"))
    if log:
        statuses = [g.status for g in grades.values()]
        log(f"summary: {len(rows)} student(s), {len(tasks)} notebook(s): {statuses.count('graded')} graded, "
            f"{statuses.count('failed to run')} failed to run, {statuses.count('refused')} refused, "
            f"{sum(len(r) for r in refused.values())} file(s) or name(s) refused; {time.monotonic() - started:.0f} s" +
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


_csv_safe = formats.csv_safe              # moved to formats.py, with the CSV writer


def _write_answers(written: dict, folder: Path) -> None:
    """Each student's written answers (markdown they wrote) into FOLDER/<student>.md, one
    file per student whatever their names (students.answers_file_name)."""
    if not any(written.values()):
        return
    folder.mkdir(parents=True, exist_ok=True)
    for student, items in written.items():
        if items:
            text = "".join(f"## {name}, cell {n}\n\n{body.strip()}\n\n" for name, n, body in items)
            (folder / answers_file_name(student)).write_text(f"# {student}: written answers\n\n{text}",
                                                             encoding="utf-8")


def _file_safe(name: str) -> str:
    """A name for the scratch copy of a notebook (not unique: one notebook per scratch folder)."""
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name).lstrip(".") or "_"


def _grade_safely(path: Path, settings: dict) -> NotebookGrade:
    """grade_notebook, but whatever goes wrong stays with this notebook: a note, not a crash."""
    try:
        return grade_notebook(path, **settings)
    except Exception as exc:  # noqa: BLE001 - one submission must never stop the others
        return NotebookGrade(notes=[f"grader error on this notebook ({type(exc).__name__}: {str(exc)[:200]}): "
                                    f"it was not graded; please report it"], status="failed to run")


def grade_notebook(path: str | Path, *, timeout: float = 600.0, cell_timeout: float = 120.0,
                   check_timeout: float = 30.0, sources: dict | None = None, exercises=None, hidden=(),
                   sandboxed: bool = True, limits: sandbox.Limits = sandbox.Limits(), on_result=None) -> NotebookGrade:
    """Run one notebook for its notes (which cells raised, timed out, killed the kernel),
    then check the answers it defines (its source, whatever the run did), each in a fresh
    process of the grader's. on_result(ExerciseResult) is called as each check ends (the
    Gradescope runner keeps what finished before its deadline)."""
    from ..checks import EXERCISES

    sources = sources or pplab_sources()
    path = Path(path)
    grade = NotebookGrade()
    started = time.monotonic()
    wanted = [EXERCISES[ex] for ex in (exercises or EXERCISES)]
    answers: dict[str, list] = {}
    for ex in wanted:
        answers.setdefault(ex.answer, []).append(ex.notebook)
    try:                  # bounded: a regular file only, parsed in a child with a deadline (reading.py)
        reading = read_submission(path, answers, sources=sources)
    except (ValueError, OSError) as exc:
        grade.notes.append(f"could not read the notebook: {exc}")
        grade.status = "refused"
        return grade
    grade.notes += reading.notes
    found, grade.written = reading.found, reading.written
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
            grade.results[ex.id] = ExerciseResult.of(ex.id, results.FAILED, 0.0, found.refused[ex.answer])
        elif ex.answer in found.answers:
            verdict = run_check_process(ex.id, found.answers[ex.answer], sources, check_timeout,
                                        grade.notes, hidden=hidden, sandboxed=sandboxed, limits=limits)
            if verdict.status == MISSING:
                continue                                 # the exercise's stub, untouched: missing, not 0
            message = verdict.message if verdict.passed else _name_the_limit(verdict.message, limits)
            grade.results[ex.id] = ExerciseResult.of(ex.id, verdict.status, ex.points if verdict.passed else
                                                     verdict.score, message, verdict.hint, verdict.seconds)
        else:
            continue
        if on_result:
            on_result(grade.results[ex.id])
    grade.seconds = round(time.monotonic() - started, 2)
    return grade


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
        kill_tree(runner_proc.pid)                  # the kernel, and anything it left running
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
            shown = value if name == "processes" else format_size(value)
            return f"{note} (the submission's {name} limit: pplab grade --{name} {shown})"
    return note


def defined_names(source: str) -> list[str]:
    """Names a cell defines at top level (def, class, assignment), in order."""
    from .submission import defined_names
    return defined_names(source)
