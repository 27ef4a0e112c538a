"""Answers that take the library's own implementation instead of writing it (issue 34, item 2),
as the grader gets them: source text, run only in the check's ranks.

Each exercise names the library function that answers it (TARGETS: module, name, and the
answer's body calling it as `lib`); each route (ROUTES) is one way a student's code can reach
that function. `submission(exercise, route)` is the whole submission, and `every_route(exercise)`
one that tries every route in turn and uses the first that yields the function. Graded, each
must earn 0 with the note "the library's X is not available while your answer is checked"
(or, for the routes that look in memory, find nothing there).
"""
from __future__ import annotations

import base64

from pplab.checks import SourceAnswer

# exercise -> (answer name, its parameters, denied module, function in it, body calling `lib`)
TARGETS = {
    "broadcast": ("my_broadcast", "tensor, src", "pplab.collectives", "_tree_broadcast",
                  "lib(tensor.view(-1), list(range(comm.world_size())), src, comm.rank(), None)"),
    "moe_dispatch": ("dispatch", "expert, num_experts, world_size", "pplab.expert_parallel", "dispatch_plan",
                     "return lib(expert, num_experts, world_size)"),
    "zero_bubble": ("zero_bubble_order", "num_stages, num_microbatches", "pplab.pipeline.schedules", "zb_h1",
                    "return [[(a.kind, a.microbatch) for a in acts] for acts in lib(num_stages, num_microbatches)]"),
    "ring_attention": ("ring_attention", "q, k, v, group=None", "pplab.sequence_parallel.ring_attention",
                       "ring_attention", "return lib(q, k, v, group, causal=True, layout='zigzag')"),
    "sharded_optimizer": ("ShardedOptimizer", "params, optimizer_class, group=None, **defaults", "pplab.zero",
                          "ZeroOptimizer", "return lib(params, optimizer_class, group=group, **defaults)"),
    "fsdp": ("FSDP", "units, compute_dtype=None", "pplab.zero.fully_sharded", "FullyShardedModule",
             "return lib(units, compute_dtype=compute_dtype)"),
}

# route -> (top-level statements, the expression giving `lib` inside the answer); {m}: module, {n}: name
ROUTES = {
    "private import": ("from {m} import {n}", "{n}"),
    "import as": ("import {m} as library", "library.{n}"),
    "exec(base64)": ("import base64", "_exec_base64()"),
    "computed getattr": ("import importlib", "getattr(importlib.import_module('pplab.' + {m_tail!r}), "
                                             "''.join(reversed({n_reversed!r})))"),
    "default argument": ("", "_default"),
    "functools.partial": ("import functools\nimport importlib\n"
                          "LIB = functools.partial(getattr(importlib.import_module({m!r}), {n!r}))", "LIB"),
    "container": ("import importlib\nLIBS = {{'impl': [getattr(importlib.import_module({m!r}), {n!r})]}}",
                  "LIBS['impl'][0]"),
    "reading the file": ("import os\nimport sys\nimport pplab", "_from_file()"),
    "gc.get_objects": ("import gc\nimport sys", "_from_memory()"),
}

_FROM_FILE = '''
def _from_file():
    """Find the module's .py wherever pplab can be found (its folder, sys.path, an editable
    install, git), and run it."""
    rel = {rel!r}
    places = [os.path.dirname(os.path.dirname(pplab.__file__))] + [p for p in sys.path if p]
    for module in list(sys.modules.values()):        # an editable install's finder maps pplab to its folder
        mapping = getattr(module, "__dict__", {{}}).get("MAPPING")
        if isinstance(mapping, dict):
            places += [os.path.dirname(p) for p in mapping.values() if isinstance(p, str)]
    for place in places:
        path = os.path.join(place, rel)
        if os.path.exists(path):
            namespace = {{"__name__": {m!r}}}
            exec(compile(open(path).read(), path, "exec"), namespace)
            return namespace[{n!r}]
        git = os.path.join(place, ".git")
        if os.path.exists(git):
            import subprocess
            shown = subprocess.run(["git", "-C", place, "show", "HEAD:" + rel], capture_output=True, text=True)
            if shown.returncode == 0:
                namespace = {{"__name__": {m!r}}}
                exec(shown.stdout, namespace)
                return namespace[{n!r}]
    raise FileNotFoundError("no copy of " + rel + " found")
'''

_FROM_MEMORY = '''
def _from_memory():
    """The function object, wherever it lies in this process: gc, every module, every frame."""
    for obj in gc.get_objects():
        if callable(obj) and getattr(obj, "__name__", None) == {n!r} and getattr(obj, "__module__", None) == {m!r}:
            return obj
    for module in list(sys.modules.values()):
        found = getattr(module, "__dict__", {{}}).get({n!r})
        if callable(found) and getattr(found, "__module__", None) == {m!r}:
            return found
    frame = sys._getframe()
    while frame is not None:
        for value in list(frame.f_globals.values()) + list(frame.f_locals.values()):
            if callable(value) and getattr(value, "__module__", None) == {m!r}:
                return value
        frame = frame.f_back
    raise LookupError("nothing of {m} in this process's memory")
'''

_EXEC_BASE64 = '''
def _exec_base64():
    namespace = {{}}
    exec(base64.b64decode({code!r}).decode(), namespace)
    return namespace["lib"]
'''


def _route_code(exercise: str, route: str) -> tuple[str, str]:
    """(top-level statements, expression for lib) of one route to one exercise's library function."""
    _, _, m, n, _ = TARGETS[exercise]
    top, expr = ROUTES[route]
    fill = {"m": m, "n": n, "m_tail": m.partition(".")[2], "n_reversed": n[::-1]}
    top, expr = top.format(**fill), expr.format(**fill)
    if route == "exec(base64)":
        code = base64.b64encode(f"import importlib\nlib = getattr(importlib.import_module({m!r}), {n!r})".encode())
        top += _EXEC_BASE64.format(code=code.decode())
    elif route == "reading the file":
        rel = m.replace(".", "/") + ".py"
        top += _FROM_FILE.format(rel=rel, m=m, n=n)
    elif route == "gc.get_objects":
        top += _FROM_MEMORY.format(m=m, n=n)
    return top, expr


def _answer(exercise: str, lib: str, default: str = "") -> str:
    name, params, _, _, body = TARGETS[exercise]
    extra = f", _default={default}" if default else ""
    return f"def {name}({params}{extra}):\n    lib = {lib}\n    {body}\n"


_HEADER = "import torch\nfrom pplab import comm\n"


def submission(exercise: str, route: str) -> SourceAnswer:
    """The answer to `exercise` that takes the library's function by `route`."""
    name, _, m, n, _ = TARGETS[exercise]
    top, expr = _route_code(exercise, route)
    default = f"getattr(__import__({m!r}, fromlist=['_']), {n!r})" if route == "default argument" else ""
    source = _HEADER + top + "\n\n" + _answer(exercise, expr, default)
    return SourceAnswer(name, (("<cell 1>", 1, source),))


def every_route(exercise: str) -> SourceAnswer:
    """One answer that tries every route in turn (each in its own try) and uses the first that
    yields the function; if none does, it raises what the first route met."""
    name, params, m, n, body = TARGETS[exercise]
    tops, getters = [], []
    for i, route in enumerate(ROUTES):
        top, expr = _route_code(exercise, route)
        if route == "default argument":
            expr = f"getattr(__import__({m!r}, fromlist=['_']), {n!r})"
        # a top-level import that fails must not stop the other routes: each runs in a function
        tops.append(f"def _route_{i}():\n" + "".join(f"    {line}\n" for line in top.splitlines() if line.strip())
                    + f"    return {expr}\n" if route not in ("exec(base64)", "reading the file", "gc.get_objects")
                    else top + f"\ndef _route_{i}():\n    return {expr}\n")
        getters.append(f"_route_{i}")
    source = _HEADER + "\n".join(tops) + f'''

def _library():
    first = None
    for route in ({", ".join(getters)},):
        try:
            return route()
        except Exception as exc:
            first = first or exc
    raise first


def {name}({params}):
    lib = _library()
    {body}
'''
    return SourceAnswer(name, (("<cell 1>", 1, source),))
