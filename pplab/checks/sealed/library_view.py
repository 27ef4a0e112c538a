"""What `import pplab...` finds inside a graded check's ranks: the library minus what the
exercise asks the student to build, and none of the checker's own modules.

The fresh zygote (fresh_zygote.py) runs this file first, before anything of pplab: it
imports nothing of pplab itself (only the standard library), so it can be run from its
source text. `install(sources, denied, checks_note)` puts a finder first on sys.meta_path
that answers every `pplab...` import:

* a module in `sources` (the library's allowed modules and the check's rank-side
  machinery, as text the checker sent): run from that text, never from a file;
* a module in `denied` (or inside a denied package): a stand-in that holds nothing of it.
  A student's `import` of it, or any name looked up on it from the student's code, raises
  `Unavailable` with the note ("the library's pplab.collectives is not available while your
  answer is checked"). The library's own modules that import it (a package's face) get a
  `Missing` placeholder for each name instead, so the rest of the library still loads; a
  placeholder only raises the same note when used;
* anything else of pplab (the checkers, the course): Unavailable.

This is the import route only. The files themselves are hidden by isolate()'s mounts
(the rank's mount namespace), and the memory the ranks inherit never held a denied
module because the zygote is a fresh interpreter.
"""
from __future__ import annotations

import importlib.abc
import importlib.util
import sys


class Unavailable(ImportError):
    """A module the exercise asks the student to write (or a checker's own), while it is checked."""


def _note(module: str, denied: dict) -> str:
    return denied.get(module) or f"{module} is not available while your answer is checked"


def _called_by_library(depth: int = 2) -> bool:
    """Whether the code asking (skipping the import machinery) is a module of pplab's own
    library, run by this finder: its globals are that module's namespace."""
    frame = sys._getframe(depth)
    while frame is not None and frame.f_globals.get("__name__", "").startswith(("importlib", "_frozen_importlib")):
        frame = frame.f_back
    if frame is None:
        return False
    name = frame.f_globals.get("__name__", "")
    module = sys.modules.get(name)
    return (name == "pplab" or name.startswith("pplab.")) and getattr(module, "__dict__", None) is frame.f_globals \
        and isinstance(getattr(module, "__loader__", None), _View)


class Missing:
    """What a library module binds in place of a name of a denied module: it holds nothing,
    and using it raises the note."""

    def __init__(self, module: str, name: str, note: str):
        self.__name__ = self.__qualname__ = name
        self.__module__, self._note = module, note

    def __call__(self, *args, **kwargs):
        raise Unavailable(self._note)

    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        raise Unavailable(self._note)

    def __iter__(self):
        raise Unavailable(self._note)

    def __mro_entries__(self, bases):                    # a library class built on a denied one: denied too
        raise Unavailable(self._note)

    def __repr__(self) -> str:
        return f"<{self.__module__}.{self.__name__}: not available while your answer is checked>"


class _View(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, sources: dict, denied: dict, checks_note: str):
        self.sources, self.denied, self.checks_note = sources, denied, checks_note

    def _denied(self, name: str):
        return next((d for d in self.denied if name == d or name.startswith(d + ".")), None)

    def find_spec(self, name, path=None, target=None):
        if name != "pplab" and not name.startswith("pplab."):
            return None
        if self._denied(name):
            return importlib.util.spec_from_loader(name, self, origin="not available", is_package=True)
        if name not in self.sources:
            raise Unavailable(f"{name} {self.checks_note}" if name.startswith(("pplab.checks", "pplab.course"))
                              else f"no module named {name!r} in pplab")
        file, _, package = self.sources[name]
        spec = importlib.util.spec_from_loader(name, self, origin=file, is_package=package)
        if package:
            spec.submodule_search_locations = []              # submodules come from here, never from a folder
        spec.has_location = True
        return spec

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        name = module.__name__
        denied = self._denied(name)
        if denied:
            _stand_in(module, _note(denied, self.denied))
            if not _called_by_library(3):
                raise Unavailable(module.__unavailable__)
            return
        file, text, _ = self.sources[name]
        module.__file__ = file
        try:
            exec(compile(text, file, "exec"), module.__dict__)
        except Unavailable as exc:                           # it needs a denied module as it loads: denied too
            _stand_in(module, str(exc))
            if not _called_by_library(3):
                raise

    def get_source(self, name):                              # tracebacks and linecache show the library's lines
        return self.sources[name][1] if name in self.sources else None


def _stand_in(module, note: str) -> None:
    """Make `module` hold nothing but the note: the student's code gets Unavailable for any name
    it asks for; a library module importing names from it gets placeholders."""
    for key in [k for k in vars(module) if not k.startswith("__")]:
        delattr(module, key)
    module.__unavailable__ = note

    def lookup(attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        if _called_by_library():
            return Missing(module.__name__, attr, note)
        raise Unavailable(note)
    module.__getattr__ = lookup


def unavailable(obj) -> bool:
    """Whether `obj` is a denied module's stand-in or one of its placeholders (a probe then has
    nothing to refuse: the answer cannot reach the library)."""
    return isinstance(obj, Missing) or "__unavailable__" in getattr(obj, "__dict__", {})


def install(sources: dict, denied: dict, checks_note: str) -> None:
    """Serve pplab from `sources` ({name: [file, text, is a package]}), deny `denied` ({module: note})."""
    for name in [n for n in sys.modules if n == "pplab" or n.startswith("pplab.")]:
        del sys.modules[name]
    sys.meta_path.insert(0, _View(sources, denied, checks_note))
    sys.path_importer_cache.clear()
