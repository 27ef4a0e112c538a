"""What a student may not call: the library collectives an exercise asks them to build
from point-to-point operations (the router refuses them when called, rank.py;
`forbidden_references` looks in the answer's code for one bound by name before the
launch), and the library's own answer to an exercise (`refuse_library`). Both look
inside the answer, so they run where it exists: in the sealed rank (a checker passes
`probe=` to run_sealed or call_each). core.py (pplab/checks) re-exports the names checkers use.
"""
from __future__ import annotations

import contextlib
import dis
import importlib
import inspect

import torch.distributed as dist

from ...runtime import comm
from .answers import SourceAnswer
from .failures import Forbidden
from .library_view import unavailable

# What a student may not call when an exercise asks them to build a collective from
# point-to-point operations. Looked up by name so a missing one (older torch) is skipped.
_TORCH_COLLECTIVES = (
    "broadcast", "all_reduce", "reduce", "all_gather", "all_gather_into_tensor", "_all_gather_base",
    "reduce_scatter", "reduce_scatter_tensor", "_reduce_scatter_base", "gather", "scatter",
    "all_to_all", "all_to_all_single", "broadcast_object_list", "all_gather_object", "gather_object",
    "scatter_object_list", "all_reduce_coalesced", "all_gather_coalesced")
_COMM_COLLECTIVES = ("broadcast", "all_reduce", "reduce", "all_gather", "all_gather_into_tensor",
                     "reduce_scatter_tensor", "gather", "scatter", "all_to_all_single")


def _collectives_module():
    """pplab.collectives (the course's own collectives built from p2p), if there is one."""
    try:
        return importlib.import_module("pplab.collectives")
    except ImportError:
        return None


def _forbidden_targets():
    """(owner, shown name, attribute) of every collective an exercise may forbid."""
    targets = [(dist, f"torch.distributed.{n}", n) for n in _TORCH_COLLECTIVES]
    targets += [(comm, f"pplab.comm.{n}", n) for n in _COMM_COLLECTIVES]
    module = _collectives_module()
    if module is not None:
        targets += [(module, f"pplab.collectives.{n}", n) for n, f in vars(module).items()
                    if inspect.isfunction(f) and f.__module__ == module.__name__ and not n.startswith("_")]
    return [(owner, shown, n) for owner, shown, n in targets if hasattr(owner, n)]


def _forbidden_message(exercise_id: str, builds: str, shown: str, verb: str = "called") -> str:
    replaced = shown.rsplit(".", 1)[-1].rstrip(")") in (builds, {"all_reduce": "allreduce"}.get(builds))
    what = "the library collective it replaces" if replaced else "a library collective"
    return (f"exercise '{exercise_id}' asks you to build {builds} from point-to-point sends and receives "
            f"(pplab.comm.send/recv/isend/irecv); you {verb} {shown}, {what}.")


def forbidden_references(fn, exercise_id: str, builds: str) -> str | None:
    """A Fail message if `fn` (or a function of the student's it calls) names a forbidden
    collective imported by name (e.g. `from pplab.collectives import broadcast`), else None.

    Calls through a module (`dist.broadcast(...)`) are refused when they run (the router);
    a name bound before the check would slip past that, so look for it here, in the rank.
    """
    if isinstance(fn, SourceAnswer):
        raise TypeError("forbidden_references looks at a function: run it in the sealed rank (probe=)")
    forbidden = {id(getattr(owner, n)): shown for owner, shown, n in _forbidden_targets()}
    seen, todo = set(), [fn]
    while todo:
        f = todo.pop()
        code = getattr(f, "__code__", None)
        if code is None or id(f) in seen:
            continue
        seen.add(id(f))
        names, codes = set(), [code]
        while codes:                                    # nested functions and comprehensions too
            c = codes.pop()
            names |= set(c.co_names) | set(c.co_freevars)
            codes += [k for k in c.co_consts if inspect.iscode(k)]
        cells = {}
        for name, cell in zip(code.co_freevars, f.__closure__ or ()):
            with contextlib.suppress(ValueError):       # an empty cell
                cells[name] = cell.cell_contents
        for name in sorted(names):
            value = cells.get(name, getattr(f, "__globals__", {}).get(name))
            if id(value) in forbidden and value is not None:
                return _forbidden_message(exercise_id, builds, forbidden[id(value)], verb="use")
            if inspect.isfunction(value) and value.__module__ == getattr(fn, "__module__", None):
                todo.append(value)                      # a helper of the student's: look inside
    return None


def refuse_library(fn, exercise_id: str, what: str, library: dict, shown: str) -> None:
    """Fail if `fn`, or any function or class of the student's it reaches (helpers, at any
    depth; nested functions included), uses the library's own answer: an attribute of that
    name (`pipeline.bubble_fraction(...)`), or the object under any name. Run in the
    sealed rank, where the answer is a function (a checker's probe= to run_sealed or
    call_each)."""
    if isinstance(fn, SourceAnswer):
        raise TypeError("refuse_library looks at a function: run it in the sealed rank (probe=)")
    library = {name: obj for name, obj in library.items() if not unavailable(obj)}   # denied: out of reach already
    if any(fn is obj for obj in library.values()):         # the library's own function handed in as the answer
        raise Forbidden(f"exercise '{exercise_id}' asks you to work out {what} yourself; you handed in {shown}'s "
                        f"own function, the library's answer.")
    home = getattr(fn, "__module__", None)
    todo, seen = [fn], set()
    while todo:
        f = todo.pop()
        if id(f) in seen:
            continue
        seen.add(id(f))
        if inspect.isclass(f):                              # a class of the student's: its methods
            todo += [m for m in vars(f).values() if inspect.isfunction(m)]
            continue
        names = getattr(f, "__globals__", {})
        cells = [c.cell_contents for c in getattr(f, "__closure__", None) or () if _filled(c)]
        codes, found = [getattr(f, "__code__", None)], False
        while codes and not found:
            code = codes.pop()
            if code is None:
                continue
            codes += [c for c in code.co_consts if inspect.iscode(c)]
            for ins in dis.get_instructions(code):
                if ins.opname in ("LOAD_ATTR", "LOAD_METHOD", "IMPORT_FROM") and ins.argval in library:
                    found = True                            # lib.answer(...), or `from lib import answer` inside
                elif ins.opname in ("LOAD_GLOBAL", "LOAD_NAME"):
                    value = names.get(ins.argval)
                    found = found or any(value is v for v in library.values())
                    if (inspect.isfunction(value) or inspect.isclass(value)) and value.__module__ == home:
                        todo.append(value)                  # a helper of the student's: look inside
        if found or any(c is v for c in cells for v in library.values()):
            raise Forbidden(f"exercise '{exercise_id}' asks you to work out {what} yourself; you use {shown}, "
                            f"the library's answer.")
        todo += [c for c in cells if (inspect.isfunction(c) or inspect.isclass(c)) and c.__module__ == home]


def refuse_module(fn, exercise_id: str, what: str, module: str, names, shown: str | None = None) -> None:
    """refuse_library for the names of one module of pplab (a dotted name): Fail if the answer uses
    any of them. In a graded check the module does not exist for the answer: nothing to refuse."""
    lib = importlib.import_module(module)
    if unavailable(lib):
        return
    refuse_library(fn, exercise_id, what, {name: getattr(lib, name) for name in names}, shown or module)


def _filled(cell) -> bool:
    try:
        cell.cell_contents
        return True
    except ValueError:
        return False
