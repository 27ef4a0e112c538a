"""Take an exercise's answer function from its notebook: the solution lives only there."""
import re
from pathlib import Path

import nbformat

from pplab import checks
from pplab.course.exercises import exercise_notebook

REPO = Path(__file__).resolve().parents[1]


def notebook_function(nb, name):
    """Run the code cells of `nb` up to the one that defines `name`; return it."""
    namespace = {"__name__": f"notebook_{name}"}
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        exec(compile(cell.source, f"<{name} notebook cell {i}>", "exec"), namespace)
        if re.search(rf"^(def|class) {name}\b", cell.source, re.M):
            return namespace[name]
    raise AssertionError(f"no cell defines {name}")


def solution_notebook(exercise_id):
    return nbformat.read(REPO / "solutions" / f"{checks.get_exercise(exercise_id).notebook}.ipynb", 4)


def solution_definitions(exercise_id):
    """The answer's name, and what the grader takes from the solution notebook's source for it
    (submission.definitions: .answers[name], a SourceAnswer; .notes, what it ignored)."""
    from pplab.course import submission

    name = checks.get_exercise(exercise_id).answer
    cells = [(n, c.source) for n, c in enumerate(solution_notebook(exercise_id).cells, 1) if c.cell_type == "code"]
    return name, submission.definitions(cells, {name})


def solution(exercise_id):
    """The solution's function, as the solution notebook defines it."""
    return notebook_function(solution_notebook(exercise_id), checks.get_exercise(exercise_id).answer)


def stub(exercise_id):
    """The student's starting point: the same notebook with the solution cut out."""
    nb = exercise_notebook(solution_notebook(exercise_id))
    return notebook_function(nb, checks.get_exercise(exercise_id).answer)
