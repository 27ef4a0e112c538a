"""pplab's import graph, read from the code: cycles, layers, and the diagram in docs/architecture.md.

    python tools/architecture.py            # print the diagram and any problem
    python tools/architecture.py --write    # rewrite the diagram in docs/architecture.md

tests/test_architecture.py fails when pplab has an import circle, when a module imports from a
layer above its own, or when the diagram in docs/architecture.md is not what the code draws.
Every import counts, also one inside a function (it is still a dependency).
"""
from __future__ import annotations

import ast
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
                  "grad_clip", "rng", "recompute", "mixed_precision", "cluster"]),
    ("course", ["isolation", "checks", "course", "__main__"]),
]


def modules() -> dict[str, Path]:
    """{dotted name: file} of every module in pplab."""
    found = {}
    for file in sorted(PACKAGE.rglob("*.py")):
        parts = list(file.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = file
    return found


def imports(mods: dict[str, Path]) -> dict[str, set[str]]:
    """{module: the pplab modules it imports}, relative imports resolved, at any depth of the code."""
    edges = {m: set() for m in mods}
    for mod, file in mods.items():
        package = mod if file.name == "__init__.py" else mod.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(file.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join(up + ([base] if base else []))
                # `from . import callboard` imports the module callboard, not the package's face
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            for name in names:
                while name and name not in mods:
                    name = name.rpartition(".")[0]
                if name and name != mod and name != "pplab":
                    edges[mod].add(name)
    return edges


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

    sys.setrecursionlimit(10_000)
    for v in sorted(edges):
        if v not in index:
            visit(v)
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


def diagram(edges) -> str:
    """A mermaid graph of the top-level names, arrows = imports, grouped by layer."""
    tops = {}
    for mod, targets in edges.items():
        if mod == "pplab":
            continue
        for target in targets:
            a, b = top(mod), top(target)
            if a != b:
                tops.setdefault(a, set()).add(b)
        tops.setdefault(top(mod), set())
    lines = ["```mermaid", "graph BT"]
    for floor, (name, members) in enumerate(LAYERS):
        present = [m for m in members if m in tops]
        if present:
            lines.append(f'  subgraph floor{floor}["{name}"]')
            lines += [f"    {m}" for m in present]
            lines.append("  end")
    for a in sorted(tops):
        for b in sorted(tops[a]):
            lines.append(f"  {a} --> {b}")
    lines.append("```")
    return "\n".join(lines)


def main() -> int:
    edges = imports(modules())
    found = cycles(edges)
    problems = [f"import circle: {' <-> '.join(c)}" for c in found] + layer_problems(edges)
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
