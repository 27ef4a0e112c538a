"""pplab's floors, held to docs/architecture.md: no import circle (between modules or between the
diagram's boxes), no import from a floor above or, on the chapters' floor, from a later chapter, no
import of another box's private name, and the diagram in the doc equal to what the code draws
(tools/architecture.py). Imports inside functions count like any other. Each rule is also tried
on a hand-made example, so that a rule that stopped seeing anything would fail here."""
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("architecture", ROOT / "tools" / "architecture.py")
architecture = importlib.util.module_from_spec(spec)
spec.loader.exec_module(architecture)
MODULES = architecture.modules()
EDGES = architecture.imports(MODULES)


def test_no_import_circles():
    assert architecture.cycles(EDGES) == [], "import circles in pplab (see docs/architecture.md: split the idea " \
                                             "both sides need and put it below them)"


def test_no_import_from_a_floor_above():
    assert architecture.layer_problems(EDGES) == []


def test_no_circle_between_the_boxes_of_the_diagram():
    assert architecture.cycles(architecture.boxes(EDGES)) == []


def test_no_import_from_a_later_chapter():
    assert architecture.chapter_problems(EDGES) == []


def test_no_import_from_a_grading_floor_above():
    """The sealed machinery imports no checker and nothing of the course; the course imports the
    checks, never the reverse (docs/architecture.md's grading floors)."""
    assert architecture.grading_problems(EDGES) == []
    drawn = architecture.boxes(EDGES)
    assert "checks.sealed" in drawn["checks"] and "isolation" in drawn["checks.sealed"]     # the floors are used
    assert "checks" in drawn["course.grading"]


def test_the_grading_floors_catch_an_import_from_above_and_a_module_they_do_not_place():
    edges = {"pplab.checks.sealed.launch": {"pplab.checks.collectives", "pplab.checks.sealed.rank"},
             "pplab.checks.sealed.rank": {"pplab.course.grading", "pplab.isolation"},
             "pplab.checks.collectives": {"pplab.checks.sealed", "pplab.checks.core"},
             "pplab.checks.core": {"pplab.course.results"}, "pplab.checks.sealed": {"pplab.checks.sealed.launch"},
             "pplab.course.grading": {"pplab.checks", "pplab.checks.sealed.template", "pplab.course.results"},
             "pplab.course.results": set(), "pplab.course.newthing": set(), "pplab.isolation": set(),
             "pplab.checks": set(), "pplab.checks.sealed.template": set(), "pplab.zero.flat": {"pplab.trace"},
             "pplab.trace": set()}
    assert architecture.grading_problems(edges) == [
        "pplab.checks.core imports pplab.course.results: the grading floor checks may not import from grades, "
        "a floor above it",
        "pplab.checks.sealed.launch imports pplab.checks.collectives: the grading floor sealed may not import "
        "from checks, a floor above it",
        "pplab.checks.sealed.rank imports pplab.course.grading: the grading floor sealed may not import from "
        "grading, a floor above it",
        "pplab.course.newthing is on no grading floor: add it to GRADING_FLOORS in tools/architecture.py"]
    assert [architecture.box(m) for m in ("pplab.checks.sealed.rank", "pplab.checks.sealed", "pplab.checks.core",
                                          "pplab.course.grading", "pplab.course", "pplab.isolation", "pplab.zero.flat")] \
        == ["checks.sealed", "checks.sealed", "checks", "course.grading", "course", "isolation", "zero"]
    drawn = architecture.boxes(edges)
    assert drawn["checks.sealed"] == {"checks", "course.grading", "isolation"}
    assert architecture.cycles(drawn) == [["checks", "checks.sealed", "course.grading"]]   # a loop of boxes, too


def test_no_import_of_another_box_s_private_name_but_the_listed_ones():
    found = architecture.private_imports(MODULES)
    assert [p for p in found if p not in architecture.ALLOWED_PRIVATE] == [], \
        "make the name public where it is a shared idea, or move the code to where both can reach it"
    stale = sorted(architecture.ALLOWED_PRIVATE - set(found))
    assert stale == [], f"no longer imported: take them out of ALLOWED_PRIVATE in tools/architecture.py: {stale}"
    used = {pair for pair in architecture.LATER_CHAPTER_USES if pair[1] in EDGES[pair[0]]}
    assert used == set(architecture.LATER_CHAPTER_USES), "a LATER_CHAPTER_USES pair is no longer imported"


def write_package(root, files):
    """Hand-made modules under root/pplab: {dotted name: source} -> architecture.modules()'s shape."""
    mods = {}
    for name, source in files.items():
        path = root.joinpath(*name.split(".")).with_suffix(".py")
        if name.count(".") and any(other.startswith(name + ".") for other in files):
            path = root.joinpath(*name.split("."), "__init__.py")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(source)
        mods[name] = path
    return mods


def test_an_import_inside_a_function_is_an_edge_for_circles_and_floors(tmp_path):
    mods = write_package(tmp_path, {
        "pplab.trace": "import os\n\ndef draw():\n    from .swimlane import figure\n    return figure\n",
        "pplab.swimlane.figure": "from .. import trace\n",
        "pplab.swimlane": "",
        "pplab.hybrid": "from . import cluster\n",
        "pplab.cluster": "class Cluster:\n    def train(self):\n        from .hybrid import train\n",
    })
    edges = architecture.imports(mods)
    assert edges["pplab.trace"] == {"pplab.swimlane.figure"}
    assert edges["pplab.cluster"] == {"pplab.hybrid"}
    assert architecture.cycles(edges) == [["pplab.cluster", "pplab.hybrid"], ["pplab.swimlane.figure", "pplab.trace"]]
    assert architecture.layer_problems(edges) == \
        ["pplab.trace imports pplab.swimlane.figure: base may not import from observe, a layer above it"]


def test_an_import_from_a_later_chapter_is_caught_but_a_face_may_hand_it_on():
    edges = {"pplab.data_parallel.overlap": {"pplab.pipeline.executor", "pplab.collectives"},
             "pplab.pipeline.executor": set(), "pplab.collectives": set(),
             "pplab.planner": {"pplab.planner.at_scale", "pplab.cluster"}, "pplab.planner.at_scale": {"pplab.cluster"},
             "pplab.cluster": set(), "pplab.zero.plusplus": {"pplab.cluster"},
             "pplab.planner.predict": {"pplab.cluster"},
             "pplab.tensor_parallel.layers": {"pplab.pipeline.actions"}, "pplab.pipeline.actions": set()}
    assert architecture.chapter_problems(edges) == [
        "pplab.data_parallel.overlap (chapter 2) imports pplab.pipeline.executor (chapter 4), a later chapter: "
        "move what both need down to chapter 2 or below",
        "pplab.planner (chapter 7) imports pplab.cluster (chapter 10b), a later chapter: "
        "move what both need down to chapter 7 or below",
        "pplab.tensor_parallel.layers (chapter 3) imports pplab.pipeline.actions (chapter 4), a later chapter: "
        "move what both need down to chapter 3 or below"]                 # the very next chapter, too
    assert architecture.chapter_problems({"pplab.newthing": set()}) == []        # not on the chapters' floor
    assert architecture.boxes(edges)["data_parallel"] == {"pipeline", "collectives"}
    assert architecture.cycles(architecture.boxes({"pplab.zero.plusplus": {"pplab.cluster"},
                                                   "pplab.cluster": {"pplab.hybrid"},
                                                   "pplab.hybrid": {"pplab.zero"}, "pplab.zero": set()})) == \
        [["cluster", "hybrid", "zero"]]                # no two modules loop, but the boxes do


def test_a_private_name_of_another_box_is_reported_inside_a_box_it_is_not(tmp_path):
    mods = write_package(tmp_path, {
        "pplab.mesh": "def _sizes(s):\n    return s\n\ndef _order(o):\n    return o\n",
        "pplab.cluster": "from . import mesh\nfrom .mesh import _order, DIMS\n\n"
                         "def place(s):\n    import pplab.mesh as m\n    return mesh._sizes(s), m._sizes(s), mesh.__name__\n",
        "pplab.zero": "from .flat import _pad\n",
        "pplab.zero.flat": "def _pad():\n    pass\n",
    })
    assert architecture.private_imports(mods) == ["pplab.cluster imports pplab.mesh._order",
                                                  "pplab.cluster imports pplab.mesh._sizes"]


def test_the_cycle_finder_finds_a_circle():
    """An independent check of the tool itself: a hand-made graph with one loop and one chain."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert architecture.cycles(graph) == [["a", "b", "c"]]
    assert architecture.layer_problems({"pplab.swimlane.figure": {"pplab.trace"},
                                        "pplab.trace": {"pplab.swimlane.figure"}}) == \
        ["pplab.trace imports pplab.swimlane.figure: base may not import from observe, a layer above it"]


def test_the_diagram_in_the_doc_is_the_code_s():
    doc = (ROOT / "docs" / "architecture.md").read_text()
    drawn = doc.split(architecture.START)[1].split(architecture.END)[0].strip()
    assert drawn == architecture.diagram(EDGES), "run `python tools/architecture.py --write` and commit the doc"
