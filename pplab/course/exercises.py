"""Exercise notebooks made from the solutions: one source of truth.

Every exercise is written once, in solutions/, with the answer between `### BEGIN SOLUTION`
and `### END SOLUTION`. `pplab exercises` writes exercises/ from it: in code cells the marked
lines become `raise NotImplementedError("write your solution here")`, in markdown cells
"_Your answer here._", and outputs are cleared. `pplab exercises --check` names the exercise
notebooks that are out of date (a test runs it).
"""
from __future__ import annotations

import copy
from pathlib import Path

import nbformat

BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"
CODE_STUB = 'raise NotImplementedError("write your solution here")'
MARKDOWN_STUB = "_Your answer here._"


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


def solution_lines(solution: nbformat.NotebookNode) -> int:
    """Lines of code a student writes: inside the solution markers of code cells, blank lines
    and comments left out."""
    count, inside = 0, False
    for cell in solution.cells:
        if cell.cell_type != "code":
            continue
        for line in cell.source.split("\n"):
            marker = line.strip()
            if marker.startswith(BEGIN) or marker.startswith(END):
                inside = marker.startswith(BEGIN)
            elif inside and marker and not marker.startswith("#"):
                count += 1
    return count


def exercises_table(solutions: dict[str, nbformat.NotebookNode]) -> str:
    """exercises/README.md: each exercise, its chapter, what the student builds, the lines of
    code the solution takes and the points the grader gives (from the checks' registry)."""
    from ..checks import EXERCISES
    from ..checks.core import chapter_order
    by_notebook = {ex.notebook: ex for ex in EXERCISES.values()}
    course = {EXERCISES[ex].notebook: i for i, ex in enumerate(chapter_order(EXERCISES))}
    rows, total = [], 0
    for name in sorted(solutions, key=lambda n: (Path(n).stem.split("_")[0], course.get(Path(n).stem, len(course)), n)):
        stem = Path(name).stem
        ex = by_notebook.get(stem)
        lines = solution_lines(solutions[name])
        total += lines
        points = getattr(ex, "points", 1) if ex else "-"
        chapter = stem.split("_")[0].lstrip("0") or "0"          # 03b_linear_3d: chapter notebook 03b
        rows.append(f"| `{stem}` | {chapter} | {ex.title if ex else '(no check)'} | {lines} | {points} |")
    return ("# Exercises\n\n"
            "Written by `pplab exercises` from `solutions/` (do not edit by hand). Lines: the code a\n"
            "solution writes between its markers, comments and blank lines left out.\n\n"
            "| exercise | chapter | what you build | lines | points |\n|---|---|---|---|---|\n"
            + "\n".join(rows) + f"\n\n{len(rows)} exercises, {total} lines of solution code in all.\n")


def sync_exercises(solutions: str | Path, exercises: str | Path, check: bool = False) -> list[str]:
    """Write exercises/X.ipynb for every solutions/X.ipynb; return what was (or, with
    check=True, would be) out of date: "X.ipynb (stale)", "(missing)" or "(no solution)"."""
    solutions, exercises = Path(solutions), Path(exercises)
    if not solutions.is_dir():
        raise FileNotFoundError(f"no solutions folder at {solutions}: run from the course repository "
                                f"or pass --solutions DIR")
    read = {path.name: nbformat.read(path, as_version=4) for path in sorted(solutions.glob("*.ipynb"))}
    wanted = {name: notebook_text(exercise_notebook(nb, name)) for name, nb in read.items()}
    wanted["README.md"] = exercises_table(read)
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
