"""pplab's import graph, read from the code: cycles, layers, and the diagram in docs/architecture.md.

    python tools/architecture.py            # print the diagram and any problem
    python tools/architecture.py --write    # rewrite the diagram in docs/architecture.md

tests/test_architecture.py fails when pplab has an import circle, when a module imports from a
layer above its own or, on the chapters' floor, from a later chapter or, on the course floor, from a
grading floor above its own (isolation, checks.sealed, checks, then course's modules), when a module imports
another box's private name (`from pplab.x import _y`, `x._y`), or when the diagram in
docs/architecture.md is not what the code draws. Every import counts, also one inside a function
(it is still a dependency: it only comes later).
"""
from __future__ import annotations

import ast
import functools
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "pplab"
DOC = ROOT / "docs" / "architecture.md"
START, END = "<!-- import-graph:start -->", "<!-- import-graph:end -->"

# Layers, bottom to top: a module may import from its own layer and those below, never above.
# Each entry is a top-level name in pplab (a module or a folder).
LAYERS = [
    ("base", ["trace", "split", "data", "memory", "hardware", "flops", "stand_in"]),
    ("runtime", ["runtime"]),
    ("observe", ["swimlane"]),
    ("chapters", ["collectives", "costmodel", "costfit", "data_parallel", "tensor_parallel", "pipeline",
                  "sequence_parallel", "zero", "models", "mesh", "hybrid", "planner", "expert_parallel",
                  "grad_clip", "rng", "recompute", "mixed_precision", "cluster",
                  "overlap", "fp8", "experts_at_scale"]),
    ("course", ["isolation", "checks", "course", "__main__"]),
]

# The course floor, finer: the grading floors, bottom to top. A box is a module or a package of
# pplab (its dotted name under pplab), and a module belongs to the longest box naming it or a
# package above it; every module of pplab.course is a box of its own. A box may import from its own
# grading floor and those below, never above: the sealed machinery imports no checker and nothing
# of the course, the chapters' checkers use it; the course uses the checks, never the reverse.
GRADING_FLOORS = [
    ("isolation", ["isolation"]),                          # Linux isolation, for sealed ranks and the sandbox
    ("sealed", ["checks.sealed"]),                         # how a check runs student code in isolation
    ("checks", ["checks"]),                                # what each exercise asks and how it is judged
    ("grades", ["course.results", "course.formats"]),      # what a grade holds, and the files it is written to
    ("submissions", ["course.submission", "course.exercises", "course.reading", "course.students"]),
    ("processes", ["course.runner", "course.sandbox", "course.check_process"]),   # where student code runs
    ("grading", ["course.grading", "course.api", "course.deadline", "course.gradescope", "course"]),  # `course`: the face
    ("command line", ["course.cli", "__main__"]),
]

# The chapters' floor, finer: a chapter may use an earlier chapter's code, never a later one's (a
# module used by both goes down to the earlier one, or to the base floor). The chapters in the
# order of docs/architecture.md's table; each top-level name of the chapters' floor by the chapter
# that brings it, and a module a later chapter added to an earlier one's folder by its own.
CHAPTER_ORDER = ["1", "2", "3", "4", "5", "6", "7", "8", "9", "9b", "10a", "10b", "10c", "10d", "10",
                 "11a", "11b", "11c", "11d"]
CHAPTERS = {
    "collectives": "1", "costmodel": "1", "costfit": "1", "data_parallel": "2", "tensor_parallel": "3",
    "pipeline": "4", "sequence_parallel": "5", "zero": "6", "models": "7", "mesh": "7", "hybrid": "7",
    "planner": "7", "expert_parallel": "8", "zero.offload": "9", "grad_clip": "9", "rng": "9",
    "recompute": "9", "mixed_precision": "9b", "cluster": "10b", "zero.plusplus": "10c",
    "planner.placement": "10d", "planner.at_scale": "10", "planner.closed_forms": "10", "planner.published": "10",
    "overlap": "11a",
    "fp8": "11b", "zero.fp8_gather": "11b",
    "experts_at_scale": "11d",
    "sequence_parallel.packed": "11c", "sequence_parallel.allgather_cp": "11c",
}
# A later chapter that taught an earlier module something new, in place (each pair must still be imported):
LATER_CHAPTER_USES = {
    ("pplab.planner.predict", "pplab.cluster"):
        "chapter 10d taught chapter 7's planner to price what crosses the slow tier: plan(..., cluster=)",
}

# Private names imported across boxes of the diagram that cannot be made public this round
# (each must still be imported; the test fails on one that is gone, so the list only shrinks):
ALLOWED_PRIVATE: set[str] = set()      # none left (issue 39 made the last ones public)


def modules() -> dict[str, Path]:
    """{dotted name: file} of every module in pplab."""
    found = {}
    for file in sorted(PACKAGE.rglob("*.py")):
        parts = list(file.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = file
    return found


@functools.lru_cache(maxsize=None)
def _tree(file: Path) -> ast.AST:
    return ast.parse(file.read_text())       # parsed once for every rule (a file does not change in a run)


def _imported(mod: str, file: Path, mods) -> list[tuple[str, str, int]]:
    """(what, as, line) for every import of a pplab module in `file`, at any depth of the code:
    `what` is the dotted name imported, relative imports resolved (`from .mesh import _order` ->
    pplab.mesh._order), `as` the name it is bound to in the importing module."""
    package = mod if file.name == "__init__.py" else mod.rsplit(".", 1)[0]
    found = []
    for node in ast.walk(_tree(file)):
        if isinstance(node, ast.Import):
            found += [(a.name, a.asname or a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(up + ([base] if base else []))
            found += [(f"{base}.{a.name}", a.asname or a.name, node.lineno) for a in node.names]
    return [f for f in found if f[0] == "pplab" or f[0].startswith("pplab.")]


def owner(name: str, mods) -> str:
    """The module a dotted name lives in: pplab.mesh._order -> pplab.mesh; pplab.zero -> pplab.zero."""
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name


def imports(mods: dict[str, Path]) -> dict[str, set[str]]:
    """{module: the pplab modules it imports}, relative imports resolved, at any depth of the code."""
    edges = {m: set() for m in mods}
    for mod, file in mods.items():
        for what, _, _ in _imported(mod, file, mods):
            name = owner(what, mods)      # `from . import callboard` imports the module, not the face
            if name and name != mod and name != "pplab":
                edges[mod].add(name)
    return edges


def private_imports(mods: dict[str, Path]) -> list[str]:
    """Every import of another box's private name: `from pplab.x import _y`, or `x._y` where x
    names a pplab module imported. Inside one box (pplab.swimlane.figure using
    pplab.swimlane.layout's helpers) a private name is shared among friends and not counted. A box
    here is a top-level name: checks/ (with checks/sealed/) and course/ are one box each for this rule."""
    found = set()
    for mod, file in mods.items():
        bound = {}                                        # name in this module -> the pplab module it is
        for what, alias, _ in _imported(mod, file, mods):
            there = owner(what, mods)
            if what in mods:
                bound[alias] = what
            elif what.rpartition(".")[2].startswith("_") and not what.endswith("__"):
                if top(there) != top(mod):
                    found.add(f"{mod} imports {what}")
        for node in ast.walk(_tree(file)):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and \
                    node.value.id in bound and node.attr.startswith("_") and not node.attr.endswith("__"):
                if top(bound[node.value.id]) != top(mod):
                    found.add(f"{mod} imports {bound[node.value.id]}.{node.attr}")
    return sorted(found)


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10_000))     # deep import chains; put back after, other tests parse
    try:
        for v in sorted(edges):
            if v not in index:
                visit(v)
    finally:
        sys.setrecursionlimit(limit)
    return out


def top(mod: str) -> str:
    """The top-level name in pplab a module belongs to: pplab.zero.flat -> zero."""
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 else "pplab"


def layer_of(name: str) -> int | None:
    for i, (_, names) in enumerate(LAYERS):
        if name in names:
            return i
    return None


def layer_problems(edges) -> list[str]:
    """Imports from a higher layer, and top-level names no layer lists."""
    problems = []
    for mod, targets in sorted(edges.items()):
        if mod == "pplab":
            continue                               # the package's face hands on names from every layer
        here = layer_of(top(mod))
        if here is None:
            problems.append(f"pplab.{top(mod)} is in no layer: add it to LAYERS in tools/architecture.py "
                            f"and to docs/architecture.md")
            continue
        for target in sorted(targets):
            there = layer_of(top(target))
            if there is not None and there > here:
                problems.append(f"{mod} imports {target}: {LAYERS[here][0]} may not import from "
                                f"{LAYERS[there][0]}, a layer above it")
    return sorted(set(problems))


def chapter_of(mod: str) -> str | None:
    """The chapter a module of the chapters' floor belongs to (None off that floor)."""
    parts = mod.split(".")[1:]
    while parts:
        if ".".join(parts) in CHAPTERS:
            return CHAPTERS[".".join(parts)]
        parts.pop()
    return None


def chapter_problems(edges) -> list[str]:
    """Imports on the chapters' floor from a later chapter, and names of that floor no chapter lists.
    A package's face may hand on what later chapters added to its folder."""
    chapters_floor = dict(LAYERS)["chapters"]
    packages = {m for m in edges if any(o.startswith(m + ".") for o in edges)}
    problems = [f"pplab.{name} is in no chapter: add it to CHAPTERS in tools/architecture.py"
                for name in sorted({top(m) for m in edges} & set(chapters_floor)) if name not in CHAPTERS]
    for mod, targets in sorted(edges.items()):
        here = chapter_of(mod)
        for target in sorted(targets):
            there = chapter_of(target)
            if here is None or there is None or (mod in packages and target.startswith(mod + ".")):
                continue
            if CHAPTER_ORDER.index(there) > CHAPTER_ORDER.index(here) and (mod, target) not in LATER_CHAPTER_USES:
                problems.append(f"{mod} (chapter {here}) imports {target} (chapter {there}), a later chapter: "
                                f"move what both need down to chapter {here} or below")
    return problems


def box(mod: str) -> str:
    """The diagram's box a module is drawn in: its top-level name (pplab.zero.flat -> zero), but on
    the course floor the grading floors' box (pplab.checks.sealed.rank -> checks.sealed,
    pplab.course.grading -> course.grading)."""
    if layer_of(top(mod)) != len(LAYERS) - 1:
        return top(mod)
    name = mod.partition(".")[2]
    named = [b for _, members in GRADING_FLOORS for b in members if name == b or name.startswith(b + ".")]
    return max(named, key=len) if named else top(mod)


def grading_floor_of(name: str) -> int | None:
    for i, (_, members) in enumerate(GRADING_FLOORS):
        if name in members:
            return i
    return None


def grading_problems(edges) -> list[str]:
    """On the course floor: imports from a grading floor above (a checker imported by the sealed
    machinery, the course by a checker), and modules no grading floor places."""
    problems = []
    for mod, targets in sorted(edges.items()):
        if layer_of(top(mod)) != len(LAYERS) - 1:
            continue
        mine = grading_floor_of(box(mod))
        if mine is None or (top(mod) == "course" and mod != "pplab.course" and box(mod) == "course"):
            problems.append(f"{mod} is on no grading floor: add it to GRADING_FLOORS in tools/architecture.py")
            continue
        for target in sorted(targets):
            theirs = grading_floor_of(box(target))
            if theirs is not None and theirs > mine:
                problems.append(f"{mod} imports {target}: the grading floor {GRADING_FLOORS[mine][0]} may not "
                                f"import from {GRADING_FLOORS[theirs][0]}, a floor above it")
    return problems


def boxes(edges) -> dict[str, set[str]]:
    """The diagram's graph: {box: the boxes it imports}, a box being a top-level name or, on the
    course floor, a grading floor's box (`box`). It has no circle either: two boxes that need each
    other round a loop of modules hold an idea in the wrong box."""
    tops = {}
    for mod, targets in edges.items():
        if mod == "pplab":
            continue
        tops.setdefault(box(mod), set())
        for target in targets:
            a, b = box(mod), box(target)
            if a != b:
                tops[a].add(b)
                tops.setdefault(b, set())
    return tops


def _node(name: str) -> str:
    """A box as mermaid writes it: checks.sealed -> checks_sealed["checks.sealed"] (no dots in an id)."""
    return f'{name.replace(".", "_")}["{name}"]' if "." in name else name


def diagram(edges) -> str:
    """A mermaid graph of the boxes, arrows = imports, grouped by layer; the course floor drawn as
    its grading floors, bottom to top."""
    tops = boxes(edges)
    floors = [(f"floor{i}", name, members) for i, (name, members) in enumerate(LAYERS[:-1])] + \
        [(f"grading{i}", f"{LAYERS[-1][0]}: {name}", members) for i, (name, members) in enumerate(GRADING_FLOORS)]
    lines = ["```mermaid", "graph BT"]
    for key, name, members in floors:
        present = [m for m in members if m in tops]
        if present:
            lines.append(f'  subgraph {key}["{name}"]')
            lines += [f"    {_node(m)}" for m in present]
            lines.append("  end")
    for a in sorted(tops):
        for b in sorted(tops[a]):
            lines.append(f"  {a.replace('.', '_')} --> {b.replace('.', '_')}")
    lines.append("```")
    return "\n".join(lines)


def main() -> int:
    mods = modules()
    edges = imports(mods)
    found = cycles(edges)
    problems = [f"import circle: {' <-> '.join(c)}" for c in found] + layer_problems(edges) + \
        [f"circle between boxes: {' <-> '.join(c)}" for c in cycles(boxes(edges))] + \
        chapter_problems(edges) + grading_problems(edges) + \
        [f"private name: {p}" for p in private_imports(mods) if p not in ALLOWED_PRIVATE]
    text = diagram(edges)
    if "--write" in sys.argv:
        doc = DOC.read_text()
        head, _, rest = doc.partition(START)
        _, _, tail = rest.partition(END)
        DOC.write_text(f"{head}{START}\n{text}\n{END}{tail}")
        print(f"wrote the diagram into {DOC.relative_to(ROOT)}")
    else:
        print(text)
    for p in problems:
        print("PROBLEM:", p)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
