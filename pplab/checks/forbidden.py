"""What a student may not call: the library collectives an exercise asks them to build
from point-to-point operations (`forbidden_references` looks for them in the answer's code
before a launch, `watch_comm` blocks them inside a rank and counts the sends and receives
posted instead), and the library's own answer to an exercise (`refuse_library`).
Split from core.py, which re-exports every name here that checkers use.
"""
from __future__ import annotations

import contextlib
import dis
import importlib
import inspect

import torch.distributed as dist

from ..runtime import comm
from .answers import SourceAnswer
from .core import Forbidden
from .running import inspect_answer

# What a student may not call when an exercise asks them to build a collective from
# point-to-point operations. Looked up by name so a missing one (older torch) is skipped.
_TORCH_COLLECTIVES = (
    "broadcast", "all_reduce", "reduce", "all_gather", "all_gather_into_tensor", "_all_gather_base",
    "reduce_scatter", "reduce_scatter_tensor", "_reduce_scatter_base", "gather", "scatter",
    "all_to_all", "all_to_all_single", "broadcast_object_list", "all_gather_object", "gather_object",
    "scatter_object_list", "all_reduce_coalesced", "all_gather_coalesced")
_COMM_COLLECTIVES = ("broadcast", "all_reduce", "reduce", "all_gather", "all_gather_into_tensor",
                     "reduce_scatter_tensor", "gather", "scatter", "all_to_all_single")
# Every torch.distributed collective ends in a method of the process group: blocking
# these too catches a collective imported by name (`from torch.distributed import broadcast`).
_PROCESS_GROUP_COLLECTIVES = (
    "broadcast", "allreduce", "allreduce_coalesced", "reduce", "allgather", "_allgather_base",
    "allgather_coalesced", "allgather_into_tensor_coalesced", "reduce_scatter", "_reduce_scatter_base",
    "reduce_scatter_tensor_coalesced", "gather", "scatter", "alltoall", "alltoall_base")


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
    targets += [(dist.ProcessGroup, f"a library collective (ProcessGroup.{n})", n)
                for n in _PROCESS_GROUP_COLLECTIVES]
    return [(owner, shown, n) for owner, shown, n in targets if hasattr(owner, n)]


def _forbidden_message(exercise_id: str, builds: str, shown: str, verb: str = "called") -> str:
    replaced = shown.rsplit(".", 1)[-1].rstrip(")") in (builds, {"all_reduce": "allreduce"}.get(builds))
    what = "the library collective it replaces" if replaced else "a library collective"
    return (f"exercise '{exercise_id}' asks you to build {builds} from point-to-point sends and receives "
            f"(pplab.comm.send/recv/isend/irecv); you {verb} {shown}, {what}.")


def forbidden_references(fn, exercise_id: str, builds: str) -> str | None:
    """A Fail message if `fn` (or a function of the student's it calls) names a forbidden
    collective imported by name (e.g. `from pplab.collectives import broadcast`), else None.

    Calls through a module (`dist.broadcast(...)`) are caught when they run (watch_comm);
    a name bound before the check would slip past that, so look for it here. A
    SourceAnswer is looked at in a child process, where its definitions run.
    """
    if isinstance(fn, SourceAnswer):
        return inspect_answer(fn, forbidden_references, exercise_id, builds)
    forbidden = {id(getattr(owner, n)): shown for owner, shown, n in _forbidden_targets()
                 if owner is not dist.ProcessGroup}
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


class CommWatch:
    """What the code on this rank did while watched: forbidden calls, receives posted,
    sends posted as (destination's rank in the group, bytes)."""

    def __init__(self):
        self.forbidden: list[str] = []
        self.receives = 0
        self.sends: list[tuple[int, int]] = []

    def raise_if_forbidden(self):
        """A forbidden call the student's code caught and ignored still fails the check."""
        if self.forbidden:
            raise Forbidden(self.forbidden[0])


_MISSING = object()


@contextlib.contextmanager
def watch_comm(exercise_id: str, builds: str):
    """Inside a rank: make every library collective raise a clear error, and count the
    point-to-point receives and sends this rank posts (at the process group, so those of
    pplab.comm and torch.distributed, blocking or not, all count). Restored on exit.
    """
    watch = CommWatch()
    saved = []

    def blocked(shown):
        def collective(*args, **kwargs):
            message = _forbidden_message(exercise_id, builds, shown)
            watch.forbidden.append(message)
            raise Forbidden(message)
        return collective

    def counted(original):
        def receive(*args, **kwargs):
            watch.receives += 1
            return original(*args, **kwargs)
        return receive

    def logged(original):
        def send(group, tensors, dst, *args, **kwargs):
            watch.sends.append((dst, sum(t.numel() * t.element_size() for t in tensors)))
            return original(group, tensors, dst, *args, **kwargs)
        return send

    def replace(owner, name, new):
        # Save the attribute as stored (vars), not as looked up: a pybind method looked up
        # on its class loses its binding, and an inherited one must be deleted, not copied.
        saved.append((owner, name, vars(owner).get(name, _MISSING)))
        setattr(owner, name, new)

    try:
        for owner, shown, name in _forbidden_targets():
            replace(owner, name, blocked(shown))
        for name in ("recv", "recv_anysource"):
            if hasattr(dist.ProcessGroup, name):
                replace(dist.ProcessGroup, name, counted(getattr(dist.ProcessGroup, name)))
        if hasattr(dist.ProcessGroup, "send"):
            replace(dist.ProcessGroup, "send", logged(dist.ProcessGroup.send))
        yield watch
    finally:
        for owner, name, original in reversed(saved):
            if original is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, original)



def refuse_library(fn, exercise_id: str, what: str, library: dict, shown: str) -> None:
    """Fail if `fn`, or any function or class of the student's it reaches (helpers, at any
    depth; nested functions included), uses the library's own answer: an attribute of that
    name (`pipeline.bubble_fraction(...)`), or the object under any name."""
    if isinstance(fn, SourceAnswer):
        message = inspect_answer(fn, _refused, exercise_id, what, library, shown)
        if message:
            raise Forbidden(str(message))
        return
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
                if ins.opname in ("LOAD_ATTR", "LOAD_METHOD") and ins.argval in library:
                    found = True
                elif ins.opname in ("LOAD_GLOBAL", "LOAD_NAME"):
                    value = names.get(ins.argval)
                    found = found or any(value is v for v in library.values())
                    if (inspect.isfunction(value) or inspect.isclass(value)) and value.__module__ == home:
                        todo.append(value)                  # a helper of the student's: look inside
        if found or any(c is v for c in cells for v in library.values()):
            raise Forbidden(f"exercise '{exercise_id}' asks you to work out {what} yourself; you use {shown}, "
                            f"the library's answer.")
        todo += [c for c in cells if (inspect.isfunction(c) or inspect.isclass(c)) and c.__module__ == home]


def _refused(fn, *args):
    try:
        refuse_library(fn, *args)
    except Forbidden as refused:
        return str(refused)
    return None


def _filled(cell) -> bool:
    try:
        cell.cell_contents
        return True
    except ValueError:
        return False

