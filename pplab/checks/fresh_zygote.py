"""A graded check's zygote: a fresh interpreter, so that what the ranks inherit never held
the implementation the exercise asks for.

A zygote forked from the checker (zygote.py) carries all the checker ever imported: the
checker module with its references, and through it the library modules, whose function
objects a rank finds with gc.get_objects() or sys.modules however imports are refused. So
when `pplab grade` checks an exercise listed in denied.py (the answer is a SourceAnswer),
run_check starts this zygote instead: `python -I` (no current folder, no PYTHONPATH),
which imports torch and, from source text the checker sends on its stdin, only what the
ranks may reach (library_view.py): the library minus the denied modules, the sealed
machinery and the `*_rank` modules holding the checkers' jobs (none holds a reference).
Then it serves launches exactly as the forked zygote does (`_zygote_main`).

Each rank also hides the files (isolation.py's `hide`, in its mount namespace): every
folder pplab is found in, and beside it the course's .git and solutions/. Where the system
gives no namespaces, the files stay readable (a rank could read a denied module's .py and
run it): the import and the memory are still clean, the files are not.

The in-notebook path (pplab.check with a function object) keeps the forked zygote: the
learner's function lives in a process that imported the library, so there the refusals
(refuse_library, forbidden_references) are what stands between it and the library.
"""
from __future__ import annotations

import contextlib
import json
import os
import pkgutil
import socket
import subprocess
import sys
import importlib.util

from . import library_view
from .denied import CHECKS_NOTE, note
from .zygote import Zygote, serving

# pplab.checks modules the ranks need (and their jobs, the *_rank modules): none holds a reference
_MACHINERY = {"answers", "failures", "forbidden", "router", "isolation", "sealed_rank", "zygote", "sealed",
              "library_view"}

_BOOT = r'''
import json, socket, sys, types
payload = json.loads(sys.stdin.buffer.read())
sys.stdin.close()
view = types.ModuleType("pplab.checks.library_view")
exec(compile(payload["view"][1], payload["view"][0], "exec"), view.__dict__)
view.install(payload.pop("sources"), payload["denied"], payload["checks_note"])
sys.modules["pplab.checks.library_view"] = view
from pplab.checks import sealed_rank, zygote
from pplab.checks.answers import SourceAnswer
name, statements, params = payload["answer"]
answer = SourceAnswer(name, tuple(tuple(s) for s in statements), None if params is None else tuple(map(tuple, params)))
sealed_rank._STATE["hide"] = payload["hide"]
for module in payload["preload"]:                  # once here, not compiled again in every rank
    try:
        __import__(module)
    except ImportError:
        pass
control = socket.socket(fileno=payload["fd"])
del payload, view
try:
    zygote._zygote_main(control, answer)
finally:
    import os
    os._exit(0)                                    # no interpreter teardown: the check waits for this exit
'''


class FreshZygote(Zygote):
    """A Zygote (same launch/end protocol) that is a fresh `python -I` serving only what is allowed."""

    def __init__(self, answer, denies, preload=()):
        self.control, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        payload = {"view": [library_view.__file__, _source("pplab.checks.library_view")],
                   "sources": served(denies), "denied": {m: note(m) for m in denies}, "checks_note": CHECKS_NOTE,
                   "hide": hidden_paths(denies), "fd": theirs.fileno(), "preload": list(preload),
                   "answer": [answer.name, [list(s) for s in answer.statements],
                              None if answer.params is None else [list(p) for p in answer.params]]}
        self.proc = subprocess.Popen([sys.executable, "-I", "-c", _BOOT], stdin=subprocess.PIPE,
                                     pass_fds=(theirs.fileno(),), close_fds=True)
        theirs.close()
        self.pid = self.proc.pid
        with contextlib.suppress(OSError):
            self.proc.stdin.write(json.dumps(payload).encode())
            self.proc.stdin.close()

    def close(self) -> None:
        self.control.close()                             # the zygote kills its ranks and exits
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _source(name: str) -> str:
    spec = importlib.util.find_spec(name)
    text = spec.loader.get_source(name) if hasattr(spec.loader, "get_source") else None
    if text is None:
        with open(spec.origin, encoding="utf-8") as f:
            text = f.read()
    return text


def served(denies) -> dict:
    """{module: [file, source, is a package]} of what the ranks may import: pplab's library minus
    `denies` (and what lies inside a denied package), and of pplab.checks only the machinery
    and the *_rank job modules (the package's face empty: it imports every checker)."""
    import pplab
    found = {"pplab": [pplab.__file__, _source("pplab"), True]}

    def walk(package, locations):
        for info in pkgutil.iter_modules(locations, package + "."):
            name, leaf = info.name, info.name.rpartition(".")[2]
            if any(name == d or name.startswith(d + ".") for d in denies) or name.startswith("pplab.course"):
                continue
            if package == "pplab.checks" and leaf not in _MACHINERY and not leaf.endswith("_rank"):
                continue
            spec = info.module_finder.find_spec(name)
            text = spec.loader.get_source(name) if hasattr(spec.loader, "get_source") else None
            if text is None:
                with open(spec.origin, encoding="utf-8") as f:
                    text = f.read()
            if name == "pplab.checks":
                text = '"""The checks: in a graded check\'s rank, only the machinery and the jobs."""\n'
            found[name] = [spec.origin, text, info.ispkg]
            if info.ispkg:
                walk(name, spec.submodule_search_locations)
    walk("pplab", list(pplab.__path__))
    return found


def hidden_paths(denies=()) -> dict:
    """{path: {file left in it: text}}: every folder pplab can be found in (the one imported, an
    editable install's, one on sys.path), each left holding only a stub for each denied module
    that raises its note, and beside each the course's .git and solutions/, hidden whole."""
    import pplab
    places = {os.path.realpath(p) for p in getattr(pplab, "__path__", ()) if os.path.isdir(p)}
    for finder in list(sys.meta_path):
        with contextlib.suppress(Exception):
            spec = finder.find_spec("pplab", None)
            if spec is not None and spec.origin and os.path.isfile(spec.origin):
                places.add(os.path.realpath(os.path.dirname(spec.origin)))
    for entry in sys.path:
        folder = os.path.join(entry or ".", "pplab")
        if os.path.isfile(os.path.join(folder, "__init__.py")):
            places.add(os.path.realpath(folder))
    stubs = {}
    for module in denies:                                # pplab.a.b: a/b.py, or a/b/__init__.py if a package
        rel = os.path.join(*module.split(".")[1:])
        package = any(os.path.isdir(os.path.join(p, rel)) for p in places)
        stubs[os.path.join(rel, "__init__.py") if package else rel + ".py"] = f"raise ImportError({note(module)!r})\n"
    hidden = {p: stubs for p in places}
    for root in {os.path.dirname(p) for p in places}:
        for beside in (".git", "solutions"):
            if os.path.lexists(os.path.join(root, beside)):
                hidden[os.path.realpath(os.path.join(root, beside))] = {}
    return hidden


def jobs_of(checker) -> list:
    """The *_rank modules whose jobs and probes `checker`'s module uses (what its ranks import)."""
    module = sys.modules.get(getattr(checker, "__module__", ""))
    return sorted({f.__module__ for f in vars(module).values() if callable(f) and
                   str(getattr(f, "__module__", "")).startswith("pplab.checks.") and f.__module__.endswith("_rank")}) \
        if module else []


def fresh_zygote(answer, denies, preload=()):
    """As zygote.zygote(answer), with a fresh interpreter that never loaded `denies`; preload:
    modules it imports before it forks ranks (the checker's jobs, the chapter they run)."""
    return serving(lambda: FreshZygote(answer, tuple(denies), preload))
