"""pplab's floors, held to docs/architecture.md: no import circle, no import from a floor above,
and the diagram in the doc equal to what the code draws (tools/architecture.py)."""
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("architecture", ROOT / "tools" / "architecture.py")
architecture = importlib.util.module_from_spec(spec)
spec.loader.exec_module(architecture)
EDGES = architecture.imports(architecture.modules())


def test_no_import_circles():
    assert architecture.cycles(EDGES) == [], "import circles in pplab (see docs/architecture.md: split the idea " \
                                             "both sides need and put it below them)"


def test_no_import_from_a_floor_above():
    assert architecture.layer_problems(EDGES) == []


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
