"""One name per exercise: its notebook exercises/NNx_<id>.ipynb (and solutions/), where NNx is the
chapter notebook it belongs to, its id, its checker module pplab/checks/chNN_<chapter>/<id>.py and
its wrong answers agree; the course's order is the order the chapter notebooks link the exercises."""
import ast
import importlib
import json
import re
from pathlib import Path

import pytest

from pplab import checks
from pplab.checks.core import RENAMED
from pplab.course import grading
from pplab.course.results import _known_exercises

REPO = Path(__file__).resolve().parents[1]


def _chapter_notebook(prefix: str) -> list[Path]:
    return sorted((REPO / "notebooks").glob(f"{prefix}_*.ipynb"))      # "10" finds 10_at_scale, not 10a_...


def _links(notebook: Path) -> list[str]:
    """The exercise notebooks a chapter notebook links, in the order it first names them."""
    text = "".join("".join(c["source"]) for c in json.loads(notebook.read_text(encoding="utf-8"))["cells"])
    found = re.findall(r"exercises/([0-9]{2}[a-z]?_\w+)\.ipynb", text)
    return list(dict.fromkeys(found))


@pytest.mark.parametrize("exercise_id", sorted(checks.EXERCISES))
def test_notebook_id_and_checker_module_agree(exercise_id):
    ex = checks.EXERCISES[exercise_id]
    prefix, rest = ex.notebook.split("_", 1)
    assert rest == exercise_id, f"{exercise_id}'s notebook is {ex.notebook}: it should be {prefix}_{exercise_id}"
    assert re.fullmatch(r"[0-9]{2}[a-z]?", prefix), ex.notebook
    assert exercise_id.isidentifier(), f"{exercise_id!r} cannot name its checker module"
    for folder in ("exercises", "solutions"):
        assert (REPO / folder / f"{ex.notebook}.ipynb").is_file(), f"{folder}/{ex.notebook}.ipynb"
    chapter = _chapter_notebook(prefix)
    assert len(chapter) == 1, f"{ex.notebook}: the prefix {prefix} names no single chapter notebook ({chapter})"
    assert ex.notebook in _links(chapter[0]), f"{chapter[0].name} does not link exercises/{ex.notebook}.ipynb"
    package, _, module = ex.checker.__module__.rpartition(".")
    assert module == exercise_id, f"{exercise_id} is checked in {ex.checker.__module__}"
    assert re.fullmatch(rf"pplab\.checks\.ch{prefix[:2]}_[a-z_]+", package), ex.checker.__module__
    solution = (REPO / "solutions" / f"{ex.notebook}.ipynb").read_text(encoding="utf-8")
    assert f'pplab.check(\\"{exercise_id}\\"' in solution, f"{ex.notebook} does not check {exercise_id!r}"


def test_no_exercise_notebook_without_its_exercise():
    notebooks = {p.stem for p in (REPO / "exercises").glob("*.ipynb")}
    assert notebooks == {p.stem for p in (REPO / "solutions").glob("*.ipynb")}
    assert notebooks == {ex.notebook for ex in checks.EXERCISES.values()}


def test_rank_modules_are_named_for_their_exercise_or_what_they_share():
    """Inside a chapter's package: <id>.py, <id>_rank.py, and shared modules that register nothing."""
    for ex in checks.EXERCISES.values():
        package = importlib.import_module(ex.checker.__module__.rpartition(".")[0])
        folder = Path(package.__file__).parent
        for path in folder.glob("*_rank.py"):
            owner = path.stem[: -len("_rank")]
            assert (folder / f"{owner}.py").is_file() or owner not in checks.EXERCISES, path


# wrong-answer files that hold several chapters' answers, by theme (each other one: wrong_solutions_chNN_<subject>)
SEVERAL_CHAPTERS = {"chapters", "collectives", "hard", "near_layouts", "scored", "unreachable"}


def _wrong_ids(path: Path) -> set[str]:
    """The exercise ids a wrong-answer file registers (WRONG = {"id": ...}, WRONG["id"] = / += ...),
    read from its source: importing every file costs seconds, test_checks.py does it."""
    ids = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AugAssign) else []
        for target in targets:
            if isinstance(target, ast.Name) and target.id == "WRONG" and isinstance(node.value, ast.Dict):
                ids |= {k.value for k in node.value.keys if isinstance(k, ast.Constant)}
            elif isinstance(target, ast.Subscript) and getattr(target.value, "id", "") == "WRONG":
                ids.add(target.slice.value)
    return ids


def test_wrong_answers_are_registered_under_current_ids_in_files_named_by_chapter():
    registered = set()
    for path in sorted((REPO / "tests").glob("wrong_solutions*.py")):
        subject, ids = path.stem.removeprefix("wrong_solutions_"), _wrong_ids(path)
        assert ids <= set(checks.EXERCISES), (path.name, ids - set(checks.EXERCISES))
        assert subject in SEVERAL_CHAPTERS or re.fullmatch(r"ch[0-9]{2}_[a-z0-9_]+", subject), path.name
        if subject not in SEVERAL_CHAPTERS:             # its exercises are that chapter's
            for ex in ids:
                assert checks.EXERCISES[ex].checker.__module__.startswith(f"pplab.checks.{subject[:4]}_"), (path.name, ex)
        registered |= ids
    assert registered == set(checks.EXERCISES)          # every exercise has wrong answers


def test_the_course_order_is_the_order_the_chapter_notebooks_link_them():
    """Independent of the registry: read the links in notebooks/NNx_*.ipynb, chapter by chapter."""
    linked = [stem for nb in sorted((REPO / "notebooks").glob("[0-9][0-9]*.ipynb")) for stem in _links(nb)]
    by_notebook = {ex.notebook: ex.id for ex in checks.EXERCISES.values()}
    assert grading.chapter_order(reversed(list(checks.EXERCISES))) == [by_notebook[s] for s in linked]


@pytest.mark.parametrize("old, new", sorted(RENAMED.items()))
def test_an_old_id_says_the_new_one(old, new):
    assert new in checks.EXERCISES and old not in checks.EXERCISES
    for use in (lambda: checks.run_check(old, None), lambda: _known_exercises([old]),
                lambda: grading.grade(REPO / "no-such-folder", REPO / "no.csv", exercises=[old])):
        with pytest.raises(ValueError, match=rf"exercise '{re.escape(old)}' is now called '{new}' "
                                             rf"\(notebook {checks.EXERCISES[new].notebook}\)"):
            use()
