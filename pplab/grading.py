"""Exercise notebooks made from the solutions, and grading of submitted notebooks.

1. One source of truth. Every exercise is written once, in solutions/, with the
   answer between `### BEGIN SOLUTION` and `### END SOLUTION`. `pplab exercises`
   writes exercises/ from it: in code cells the marked lines become
   `raise NotImplementedError("write your solution here")`, in markdown cells
   "_Your answer here._", and outputs are cleared. `pplab exercises --check` names
   the exercise notebooks that are out of date (a test runs it).

2. Grading. `pplab grade SUBMISSIONS --out grades.csv` runs every submitted notebook
   in a fresh kernel, in its own process with a time limit. It does not trust what
   the notebook printed: after every cell that defines an exercise's answer at top
   level (`def my_broadcast(...)`), it runs a cell of its own that checks that answer
   with fresh random inputs, and keeps the result. A notebook that crashes, hangs or
   deadlocks keeps what it passed before; it never stops the others.

   The grader does not sandbox: student code runs with the grader's rights. Run it in
   a container or a throwaway account if that matters.
"""
from __future__ import annotations

import ast
import concurrent.futures
import copy
import csv
import json
import secrets
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import nbformat

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
# 2. Grading: the grader process, one runner process per notebook, and the kernel


@dataclass
class NotebookGrade:
    passed: dict = field(default_factory=dict)      # exercise id -> True/False (last check in the notebook)
    messages: dict = field(default_factory=dict)    # exercise id -> the check's message
    notes: list = field(default_factory=list)       # "cell 4 timed out after 120 s", "kernel died in cell 6"


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

    timeout: seconds for each notebook, after which it and everything it started are
      killed; cell_timeout: seconds for each cell, after which the kernel is interrupted
      and the next cell runs; check_timeout: seconds per launch of ranks in the grader's
      checks; jobs: notebooks graded at the same time.

    Columns: student, one per exercise of the registry (1 passed, 0 not), total, notes.
    An exercise found in several notebooks of a student counts if any passed; within a
    notebook the last check of it counts. Notes number cells from 1, markdown included.
    """
    from .checks import EXERCISES

    if not cell_timeout > check_timeout:
        raise ValueError(f"cell_timeout ({cell_timeout:g} s) must be longer than check_timeout "
                         f"({check_timeout:g} s), or a hung check would look like a hung cell")
    students = find_submissions(submissions)
    tasks = [(student, nb) for student, notebooks in students.items() for nb in notebooks]
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        futures = {task: pool.submit(grade_notebook, task[1], timeout=timeout, cell_timeout=cell_timeout,
                                     check_timeout=check_timeout) for task in tasks}
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
                   check_timeout: float = 30.0) -> NotebookGrade:
    """Run one notebook in its own process (and session) with a time limit; what its
    grader cells recorded before a crash, a hang or the limit still counts."""
    path = Path(path).resolve()
    grade = NotebookGrade()
    with tempfile.TemporaryDirectory(prefix="pplab-grade-") as tmp:
        results, log = Path(tmp, "results.jsonl"), Path(tmp, "runner.log")
        results.touch()
        # The runner loads this file on its own, without the pplab package (and torch):
        # it only drives a kernel. It runs in the temporary folder, so that nothing in
        # the student's folder can shadow a module it imports.
        code = "import runpy, sys; runpy.run_path(sys.argv[1])['_runner_main'](sys.argv[2:])"
        argv = [sys.executable, "-c", code, __file__, str(path), str(results), str(cell_timeout),
                str(check_timeout), json.dumps(_answers())]
        with open(log, "wb") as log_file:
            runner = subprocess.Popen(argv, cwd=tmp, stdin=subprocess.DEVNULL, stdout=log_file,
                                      stderr=subprocess.STDOUT, start_new_session=True)
            try:
                runner.wait(timeout)
                stopped = False
            except subprocess.TimeoutExpired:
                _kill_tree(runner.pid)
                runner.wait()
                stopped = True
        for line in results.read_text().splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue                                    # a line cut short by the kill
            if "note" in record:
                grade.notes.append(record["note"])
            else:
                grade.passed[record["exercise"]] = bool(record["passed"])
                grade.messages[record["exercise"]] = record["message"]
        if stopped:
            grade.notes.append(f"stopped after {timeout:g} s (the notebook's time limit)")
        elif runner.returncode != 0 and not grade.notes:
            tail = log.read_text(errors="replace").strip().splitlines()[-1:] or ["no output"]
            grade.notes.append(f"grader error (exit code {runner.returncode}): {tail[0]}")
    return grade


def _kill_tree(pid: int) -> None:
    """Kill a process and every process below it: freeze them all first, so none can
    start another or be orphaned out of reach while we go."""
    import psutil

    try:
        root = psutil.Process(pid)
    except psutil.NoSuchProcess:
        return
    frozen: dict[int, psutil.Process] = {}
    for _ in range(3):                                  # catch what was forked while we froze
        for proc in [root] + root.children(recursive=True):
            if proc.pid not in frozen:
                try:
                    proc.suspend()
                    frozen[proc.pid] = proc
                except psutil.NoSuchProcess:
                    pass
    for proc in frozen.values():
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(list(frozen.values()), timeout=10)


# -- the runner: a process of its own for one notebook ------------------------------

def _answers() -> dict[str, list[str]]:
    """{name the student defines: [exercise ids]} from the registry."""
    from .checks import EXERCISES

    names: dict[str, list[str]] = {}
    for ex in EXERCISES.values():
        names.setdefault(ex.answer, []).append(ex.id)
    return names


def defined_names(source: str) -> list[str]:
    """Names a cell defines at top level (def, class, assignment), in order."""
    try:
        from IPython.core.inputtransformer2 import TransformerManager
        source = TransformerManager().transform_cell(source)   # %magics and !shell become Python
    except Exception:                                          # noqa: BLE001 - keep the raw source
        pass
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    names = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.append(node.name)
        elif isinstance(node, ast.Assign):
            names += [t.id for t in node.targets if isinstance(t, ast.Name)]
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.append(node.target.id)
    return names


def _runner_main(argv) -> None:
    path, results, cell_timeout, check_timeout = Path(argv[0]), Path(argv[1]), float(argv[2]), float(argv[3])
    try:
        run_notebook(path, results, cell_timeout, check_timeout, answers=json.loads(argv[4]))
    finally:
        _kill_children()


def _kill_children() -> None:
    import os

    import psutil

    for child in psutil.Process(os.getpid()).children():
        _kill_tree(child.pid)


def instrument(source: nbformat.NotebookNode, answers: dict[str, list[str]], check_timeout: float):
    """The student's code cells, each followed by a grader cell per answer it defines
    (answers: {name: [exercise ids]}). Returns (notebook, plan) with plan[i] =
    (the student's cell number, exercise id or None, the grader cell's nonce)."""
    cells, plan = [], []
    for number, cell in enumerate(source.cells, 1):
        if cell.cell_type != "code":
            continue
        cells.append(nbformat.v4.new_code_cell(cell.source))
        plan.append((number, None, None))
        for name in defined_names(cell.source):
            for exercise_id in answers.get(name, ()):
                nonce = secrets.token_hex(16)       # only this cell knows it: later cells cannot forge it
                cells.append(nbformat.v4.new_code_cell(
                    f'__import__("pplab.grading").grading.grade_in_kernel('
                    f'{exercise_id!r}, globals(), {name!r}, {nonce!r}, {check_timeout!r})'))
                plan.append((number, exercise_id, nonce))
    return nbformat.v4.new_notebook(cells=cells, metadata=source.metadata), plan


def run_notebook(path: Path, results: Path, cell_timeout: float, check_timeout: float,
                 answers: dict[str, list[str]]) -> None:
    """Run the instrumented notebook cell by cell in a fresh kernel; append each check's
    result, and notes on what went wrong, to `results` as soon as they are known."""
    from jupyter_core.utils import run_sync
    from nbclient import NotebookClient
    from nbclient.exceptions import CellTimeoutError, DeadKernelError

    def record(**item):
        with open(results, "a") as f:
            f.write(json.dumps(item) + "\n")

    try:
        nb, plan = instrument(nbformat.read(path, as_version=4), answers, check_timeout)
        # A kernel that imports torch can take a minute to start on a busy machine; the whole
        # notebook's time limit (enforced around this process) still bounds it.
        client = NotebookClient(nb, timeout=int(cell_timeout), kernel_name="python3", allow_errors=True,
                                startup_timeout=600, shutdown_kernel="immediate",
                                resources={"metadata": {"path": str(path.parent)}})
        with client.setup_kernel():
            for index, cell in enumerate(nb.cells):
                number, exercise_id, nonce = plan[index]
                what = f"the grader's check of {exercise_id} after cell {number}" if exercise_id else \
                    f"cell {number}"
                try:
                    client.execute_cell(cell, index)
                except CellTimeoutError:
                    late = f"{what} timed out after {cell_timeout:g} s"
                    record(**({"exercise": exercise_id, "passed": False, "message": late} if exercise_id
                              else {"note": late}))
                    run_sync(client.km.interrupt_kernel)()      # Ctrl-C: a launch stops its ranks
                    if not _responds(client, index):
                        record(note="the kernel did not respond to an interrupt: the rest was not run")
                        break
                    continue
                except DeadKernelError:
                    record(note=f"kernel died in {what}")
                    if exercise_id:
                        record(exercise=exercise_id, passed=False, message="")    # the note says why
                    break
                if exercise_id:
                    result = _result_in_output(cell, nonce)
                    record(exercise=exercise_id, **(result or {"passed": False,
                                                               "message": f"{what} printed no result"}))
    except Exception as exc:  # noqa: BLE001 - not a notebook, or the kernel would not start
        record(note=f"could not run the notebook: {type(exc).__name__}: {str(exc)[:200]}")


def _responds(client, index, seconds: float = 30.0) -> bool:
    """After an interrupt: does the kernel run a trivial cell again?"""
    from nbclient.exceptions import CellTimeoutError, DeadKernelError

    saved, client.timeout = client.timeout, int(seconds)
    try:
        client.execute_cell(nbformat.v4.new_code_cell("pass"), index)
        return True
    except (CellTimeoutError, DeadKernelError):
        return False
    finally:
        client.timeout = saved


def _result_in_output(cell, nonce: str):
    text = "".join(o.get("text", "") for o in cell.outputs if o.get("output_type") == "stream")
    for line in text.splitlines():
        if line.startswith(nonce + " "):
            return json.loads(line[len(nonce) + 1:])
    return None


# -- inside the student's kernel ----------------------------------------------------

def grade_in_kernel(exercise_id: str, namespace: dict, name: str, nonce: str, timeout: float) -> None:
    """The grader's cell: check the student's `name` with fresh random inputs, print the
    result tagged with this cell's nonce. Never raises: a broken answer is a failed check."""
    from .checks import run_check

    started = time.monotonic()
    try:
        if name not in namespace:
            result = {"passed": False, "message": f"{name} was not defined (its cell raised an error?)"}
        else:
            r = run_check(exercise_id, namespace[name], timeout=timeout)
            result = {"passed": r.passed, "message": r.message}
    except BaseException as exc:  # noqa: BLE001 - the student's code may raise anything
        result = {"passed": False, "message": f"the check raised {type(exc).__name__}: {exc}"}
    result["seconds"] = round(time.monotonic() - started, 2)
    print(f"{nonce} {json.dumps(result)}", flush=True)
