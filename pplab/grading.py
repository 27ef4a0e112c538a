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
     process kills every process below it before it writes its verdict, as the last line
     of its output, so a line forged by the answer always comes before it.
   A notebook that crashes, hangs or deadlocks loses nothing: its definitions are graded.

   The grader does not sandbox: student code runs with the grader's rights, so a notebook
   can still damage the machine or (deliberately, through the operating system) other
   processes of the same user. Grade in a container or a throwaway account if that matters.
"""
from __future__ import annotations

import ast
import concurrent.futures
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
    found = definitions(cells, {ex.answer for ex in EXERCISES.values()})
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
        # The runner loads this file on its own, without the pplab package (and torch): it
        # only drives a kernel.
        code = "import runpy, sys; runpy.run_path(sys.argv[1])['_runner_main'](sys.argv[2:])"
        argv = [sys.executable, "-c", code, __file__, str(scratch / path.name), str(records), str(cell_timeout)]
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


def _become_subreaper() -> None:
    """Processes orphaned below this one (a double fork, setsid) become its children, not
    init's: they stay in its tree, where _kill_tree finds them."""
    import ctypes

    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(36, 1, 0, 0, 0)      # PR_SET_CHILD_SUBREAPER
        except OSError:
            pass


def _kill_children() -> None:
    import os

    import psutil

    for _ in range(3):
        children = psutil.Process(os.getpid()).children()
        if not children:
            return
        for child in children:
            _kill_tree(child.pid)


def _runner_main(argv) -> None:
    path, records, cell_timeout = Path(argv[0]), Path(argv[1]), float(argv[2])
    _become_subreaper()
    try:
        _run_cells(path, records, cell_timeout)
    finally:
        _kill_children()


def _run_cells(path: Path, records: Path, cell_timeout: float) -> None:
    """Run the notebook cell by cell in a fresh kernel; append notes on what went wrong to
    `records` as soon as they are known."""
    from jupyter_core.utils import run_sync
    from nbclient import NotebookClient
    from nbclient.exceptions import CellTimeoutError, DeadKernelError

    def record(**item):
        with open(records, "a") as f:
            f.write(json.dumps(item) + "\n")

    try:
        nb = nbformat.read(path, as_version=4)
        # A kernel that imports torch can take a minute to start on a busy machine; the whole
        # notebook's time limit (enforced around this process) still bounds it.
        client = NotebookClient(nb, timeout=int(cell_timeout), kernel_name="python3", allow_errors=True,
                                startup_timeout=600, shutdown_kernel="immediate",
                                resources={"metadata": {"path": str(path.parent)}})
        with client.setup_kernel():
            for index, cell in enumerate(nb.cells):
                number = index + 1
                if cell.cell_type != "code":
                    continue
                try:
                    client.execute_cell(cell, index)
                except CellTimeoutError:
                    record(note=f"cell {number} timed out after {cell_timeout:g} s")
                    run_sync(client.km.interrupt_kernel)()      # Ctrl-C: a launch stops its ranks
                    if not _responds(client, index):
                        record(note="the kernel did not respond to an interrupt: the rest was not run")
                        break
                    continue
                except DeadKernelError:
                    record(note=f"kernel died in cell {number}")
                    break
                for out in cell.outputs:
                    if out.get("output_type") == "error":
                        value = (str(out.get("evalue", "")).strip().splitlines() or [""])[0][:150]
                        record(note=f"cell {number} raised {out.get('ename', 'an error')}" +
                               (f": {value}" if value else ""))
    except Exception as exc:  # noqa: BLE001 - the kernel would not start
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


# ----------------------------------------------------------------------------------
# 3. The student's definitions, taken from the notebook's source without running it

# Calls that, at the top level of a notebook, look like tampering with the grader rather
# than like an answer: listed in the notes when the grader leaves them out.
_TAMPERING_CALLS = {"setattr", "delattr", "exec", "eval", "compile", "globals", "__import__", "breakpoint"}
_TAMPERING_ATTRS = {"system", "popen", "remove", "unlink", "rename", "replace", "rmtree", "kill", "write_text",
                    "write_bytes", "run", "Popen", "call", "check_call", "check_output", "reload", "symlink_to"}


@dataclass
class Definitions:
    answers: dict = field(default_factory=dict)     # answer name -> pplab.checks.SourceAnswer
    notes: list = field(default_factory=list)       # what was left out, and why


def _python(source: str) -> str:
    try:
        from IPython.core.inputtransformer2 import TransformerManager
        return TransformerManager().transform_cell(source)      # %magics and !shell become Python
    except Exception:                                          # noqa: BLE001 - keep the raw source
        return source


def _bound(node) -> list[str]:
    """The names a top-level definition binds: def, class, import, assignment to plain names."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return [node.name]
    if isinstance(node, ast.Import):
        return [a.asname or a.name.split(".")[0] for a in node.names]
    if isinstance(node, ast.ImportFrom):
        return [a.asname or a.name for a in node.names]
    targets = node.targets if isinstance(node, ast.Assign) else \
        [node.target] if isinstance(node, ast.AnnAssign) and node.value is not None else []
    names = []
    for target in targets:
        parts = target.elts if isinstance(target, (ast.Tuple, ast.List)) else [target]
        if not all(isinstance(t, ast.Name) for t in parts):
            return []                                   # `x.y = ...`, `d[k] = ...`: not a definition
        names += [t.id for t in parts]
    return names


def _loads(source: str) -> set[str]:
    """Global names a statement's code reads: at the top level and in every function and
    class body inside it (decorators, default values and annotations included)."""
    import symtable

    names, tables = set(), [symtable.symtable(source, "<cell>", "exec")]
    while tables:
        table = tables.pop()
        for symbol in table.get_symbols():
            if symbol.is_referenced() and (table.get_type() == "module" or symbol.is_global()):
                names.add(symbol.get_name())
        tables += table.get_children()
    return names


def _walk_here(node):
    """ast.walk, without going into the bodies of functions and lambdas (code that runs
    only when called)."""
    todo = [node]
    while todo:
        n = todo.pop()
        yield n
        body = n.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) else \
            [n.body] if isinstance(n, ast.Lambda) else []
        todo += [c for c in ast.iter_child_nodes(n) if not any(c is b for b in body)]


def _tampering(node, modules: set[str]) -> bool:
    """An assignment to an attribute or item of a module (or of globals()), or a call that
    patches, evaluates, writes files or starts processes, run at the top level."""
    def root(target):
        while isinstance(target, (ast.Attribute, ast.Subscript, ast.Starred)):
            target = target.value
        return target

    for n in _walk_here(node):
        targets = []
        if isinstance(n, (ast.Assign, ast.Delete)):
            targets = n.targets
        elif isinstance(n, (ast.AugAssign, ast.AnnAssign)):
            targets = [n.target]
        for target in targets:
            for t in (target.elts if isinstance(target, (ast.Tuple, ast.List)) else [target]):
                if isinstance(t, (ast.Attribute, ast.Subscript)):
                    base = root(t)
                    if isinstance(base, ast.Call) or (isinstance(base, ast.Name) and base.id in modules):
                        return True
        if isinstance(n, ast.Call):
            f = n.func
            if isinstance(f, ast.Name) and f.id in _TAMPERING_CALLS:
                return True
            if isinstance(f, ast.Attribute) and f.attr in _TAMPERING_ATTRS:
                return True
            if isinstance(f, ast.Name) and f.id == "open":
                mode = n.args[1] if len(n.args) > 1 else next((k.value for k in n.keywords if k.arg == "mode"), None)
                if not (mode is None or (isinstance(mode, ast.Constant) and set(str(mode.value)) <= set("rbt"))):
                    return True
    return False


def _shown(node, source: str) -> str:
    if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        text = " = ".join(ast.unparse(t) for t in targets) + " = ..."
    else:
        text = (source.strip().splitlines() or [""])[0]
    return text if len(text) <= 80 else text[:79] + "…"


def definitions(cells, answers) -> Definitions:
    """The answers the notebook defines, as SourceAnswers: for each answer name, the last
    top-level definition of it and, transitively, the last top-level definition of every
    global name that code reads (helpers, constants, imports, classes), in notebook order.

    cells: [(cell number, source)] of code cells. Nothing else at the top level is kept
    (expressions, calls, attribute or item assignments, for/if/with/try blocks): the grader
    runs only definitions. Kept or not, statements that look like tampering are named in
    the notes, and a definition whose value looks like tampering is left out.
    """
    from .checks import SourceAnswer

    found = Definitions()
    statements = []                              # (cell, line, node, source), in notebook order
    for number, source in cells:
        python = _python(source)
        try:
            tree = ast.parse(python)
        except SyntaxError as err:
            found.notes.append(f"cell {number} has a syntax error (line {err.lineno}): it was not graded")
            continue
        lines = python.splitlines(keepends=True)
        for node in tree.body:
            first = node.decorator_list[0] if getattr(node, "decorator_list", None) else node
            line, col = first.lineno, first.col_offset - (first is not node)        # "@" comes before it
            text = "".join(lines[line - 1:node.end_lineno])
            text = text[col:len(text) - len(lines[node.end_lineno - 1]) + node.end_col_offset]
            statements.append((number, line, node, text))
    modules = {"sys", "builtins", "__builtins__", "os"}
    for _, _, node, _ in statements:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            modules.update(_bound(node))
    last, kept_ok = {}, {}
    for i, (number, line, node, source) in enumerate(statements):
        tampering = _tampering(node, modules)
        if tampering:
            found.notes.append(f"ignored cell {number}, line {line}: `{_shown(node, source)}`: the grader runs only "
                               f"definitions")
        for name in _bound(node):
            last[name] = i
        kept_ok[i] = not tampering and bool(_bound(node))
    elsewhere = {t.id for _, _, node, _ in statements if not _bound(node)
                 for t in ast.walk(node) if isinstance(t, ast.Name) and isinstance(t.ctx, ast.Store)}
    for answer in sorted(answers):
        if answer not in last or not kept_ok[last[answer]]:
            continue
        keep, todo, unbound = set(), [last[answer]], set()
        while todo:
            i = todo.pop()
            if i in keep:
                continue
            keep.add(i)
            try:
                needed = _loads(statements[i][3])
            except SyntaxError:
                needed = set()
            for name in needed:
                if name in last and kept_ok[last[name]]:
                    todo.append(last[name])
                elif name in elsewhere:
                    unbound.add(name)
        for name in sorted(unbound):
            found.notes.append(f"{answer} uses `{name}`, which no definition at the top level binds (the grader "
                               f"runs only def, class, import and assignments to plain names)")
        node = statements[last[answer]][2]
        params = None
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.decorator_list:
            params = _params(node.args)
        found.answers[answer] = SourceAnswer(answer, tuple((f"<cell {statements[i][0]}>", statements[i][1],
                                                            statements[i][3]) for i in sorted(keep)), params)
    return found


def _params(args: ast.arguments) -> tuple:
    """(name, kind, has a default) of each parameter, read from the source."""
    out = [(a.arg, "positional_only", False) for a in args.posonlyargs]
    out += [(a.arg, "positional_or_keyword", False) for a in args.args]
    n_defaults = len(args.defaults)
    for k in range(n_defaults):                          # defaults belong to the last positional ones
        j = len(out) - n_defaults + k
        out[j] = (out[j][0], out[j][1], True)
    if args.vararg:
        out.append((args.vararg.arg, "var_positional", False))
    out += [(a.arg, "keyword_only", d is not None) for a, d in zip(args.kwonlyargs, args.kw_defaults)]
    if args.kwarg:
        out.append((args.kwarg.arg, "var_keyword", False))
    return tuple(out)


def defined_names(source: str) -> list[str]:
    """Names a cell defines at top level (def, class, import, assignment), in order."""
    try:
        tree = ast.parse(_python(source))
    except SyntaxError:
        return []
    return [name for node in tree.body if not isinstance(node, (ast.Import, ast.ImportFrom))
            for name in _bound(node)]


# ----------------------------------------------------------------------------------
# 4. The check, in a fresh process of the grader's where no student code runs

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
    process. Its verdict is the last line it writes to its stdout, after it has killed
    every process below it: a line written by anything else comes before it (and is
    named in `notes`)."""
    notes = [] if notes is None else notes
    import threading

    limit = 4 * check_timeout + 120                         # a few launches, each bounded by check_timeout
    job = {"sources": sources, "exercise": exercise_id, "timeout": check_timeout, "name": answer.name,
           "statements": [list(s) for s in answer.statements],
           "params": None if answer.params is None else [list(p) for p in answer.params]}
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    with tempfile.TemporaryDirectory(prefix="pplab-check-") as cwd:
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
        try:
            proc.wait(limit)
        except subprocess.TimeoutExpired:
            _kill_tree(proc.pid)
            proc.wait()
            return False, f"the check did not finish within {limit:g} s (the grader's limit for one check)"
        _kill_tree(proc.pid)                                # nothing of it may write after its verdict
        reader.join(10)
    text = [line.decode(errors="replace").strip() for line in lines if line.strip()]
    try:
        verdict = json.loads(text[-1])
        message = str(verdict["message"])
        if len(text) > 1:                                   # written by the answer, from a rank
            notes.append(f"{exercise_id}: ignored {len(text) - 1} line(s) written to the check's verdict channel "
                         f"by the answer")
        return verdict["passed"] is True, message
    except (IndexError, ValueError, KeyError, TypeError):
        tail = text[-1][:200] if text else "no output"
        return False, f"the check process failed (exit code {proc.returncode}): {tail}"


def _check_main(job: dict) -> None:
    """In the check process: check the answer, kill every process below this one, then
    write the verdict as the last line of stdout."""
    _become_subreaper()
    out = os.dup(1)
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):                                # ranks print here: not on the verdict's channel
        os.dup2(devnull, fd)
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
    os.write(out, ("\n" + json.dumps(verdict) + "\n").encode())
    os._exit(0)
