"""A graded check's zygote: a fresh interpreter, so that what the ranks inherit never held
the implementation the exercise asks for.

A zygote forked from the checker (zygotes.py) carries all the checker ever imported: the
checker module with its references, and through it the library modules, whose function
objects a rank finds with gc.get_objects() or sys.modules however imports are refused. So
when `pplab grade` checks an exercise listed in denied.py (the answer is a SourceAnswer),
run_check starts this zygote instead: a child of the template (template.py), an
interpreter that imported torch and nothing of pplab, which imports, from source text the
checker sends through a pipe, only what the ranks may reach (library_view.py): the library
minus the denied modules, the sealed machinery and the `*_rank` modules holding the
checkers' jobs (none holds a reference). Then it serves launches exactly as the forked
zygote does (`_zygote_main`).

Each rank also hides the files (pplab/isolation.py's `hide`, in its mount namespace): every
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
import select
import signal
import socket
import sys
import importlib.util

from . import library_view, template
from .denied import CHECKS_NOTE, note
from .zygotes import Zygote, serving

# What the ranks may import of pplab.checks: this floor (the sealed machinery) and the checkers' jobs
# (the *_rank modules), none holding a reference; but not the modules only the checker's side runs.
_CHECKER_SIDE = {"pplab.checks.sealed.denied", "pplab.checks.sealed.fresh_zygote", "pplab.checks.sealed.template"}


class FreshZygote(Zygote):
    """A Zygote (same launch/end protocol) forked from the template (template.py), which never
    imported pplab, and serving only what is allowed: the payload it reads says what."""

    def __init__(self, answer, denies, preload=()):
        self.control, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        payload = {"view": [library_view.__file__, _source("pplab.checks.sealed.library_view")],
                   "sources": served(denies), "denied": {m: note(m) for m in denies}, "checks_note": CHECKS_NOTE,
                   "hide": hidden_paths(denies), "preload": list(preload),
                   "answer": [answer.name, [list(s) for s in answer.statements],
                              None if answer.params is None else [list(p) for p in answer.params]]}
        read, write = os.pipe()
        try:
            self.pid = template.fork_zygote(theirs.fileno(), read)
            self.exited = os.pidfd_open(self.pid)       # readable once it has exited (it is not our child)
        except BaseException:
            os.close(write)
            self.control.close()
            raise
        finally:
            theirs.close()
            os.close(read)
        try:
            with open(write, "wb") as pipe:
                pipe.write(json.dumps(payload).encode())
        except OSError:
            pass                                         # it died reading: the first launch says so

    def close(self) -> None:
        """End the zygote (it kills its ranks and exits) and wait until it has."""
        with contextlib.suppress(OSError):
            self.control.shutdown(socket.SHUT_WR)        # what it reads as the end of the check
        if not select.select([self.exited], [], [], 10)[0]:
            signal.pidfd_send_signal(self.exited, signal.SIGKILL)   # its ranks die with it (PR_SET_PDEATHSIG)
            select.select([self.exited], [], [], 10)
        os.close(self.exited)
        self.control.close()


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
    and the *_rank job modules of each chapter's package (the faces empty: they import every checker)."""
    import pplab
    found = {"pplab": [pplab.__file__, _source("pplab"), True]}

    def walk(package, locations):
        for info in pkgutil.iter_modules(locations, package + "."):
            name, leaf = info.name, info.name.rpartition(".")[2]
            if any(name == d or name.startswith(d + ".") for d in denies) or name.startswith("pplab.course"):
                continue
            chapter = package == "pplab.checks" and info.ispkg and leaf.startswith("ch")   # ch04_pipeline/
            in_chapter = package.startswith("pplab.checks.ch")                         # only its *_rank jobs
            if ((package == "pplab.checks" or in_chapter) and leaf != "sealed" and not chapter
                    and not leaf.endswith("_rank")) or name in _CHECKER_SIDE:
                continue
            spec = info.module_finder.find_spec(name)
            text = spec.loader.get_source(name) if hasattr(spec.loader, "get_source") else None
            if text is None:
                with open(spec.origin, encoding="utf-8") as f:
                    text = f.read()
            if name == "pplab.checks" or chapter:          # their faces import every checker
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
    """As zygotes.zygote(answer), with a fresh interpreter that never loaded `denies`; preload:
    modules it imports before it forks ranks (the checker's jobs, the chapter they run)."""
    return serving(lambda: FreshZygote(answer, tuple(denies), preload))
