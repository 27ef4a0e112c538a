"""A student's answer (the function, or its source), and what may come back from it.

A checker never runs the student's code in its own process. It hands the answer to
`sealed.run_sealed(job, answer, ...)` (ranks) or `sealed.call_each(answer, ...)` (one
call per case), and reads back plain data: numbers, strings, None, lists, tuples, dicts
and tensors, decoded with `torch.load(weights_only=True)` (never plain pickle), so
nothing a rank sends can run code in the checker's process. See pplab/checks/core.py's docstring for
the whole contract.

The answer is either the function itself (`pplab.check("broadcast", my_broadcast)` in
a notebook: forked ranks inherit it) or, when grading, a `SourceAnswer`: the student's
definitions as source text, run (`resolve()`) only in the child processes that call
the answer, in a fresh module, in a fresh working directory.
"""
from __future__ import annotations

import inspect
import io
import linecache
import os
import sys
import tempfile
import types
from dataclasses import dataclass

import torch


# ----------------------------------------------------------------------------------
# The answer as source (the grader's form)

_KINDS = {"positional_only": inspect.Parameter.POSITIONAL_ONLY,
          "positional_or_keyword": inspect.Parameter.POSITIONAL_OR_KEYWORD,
          "var_positional": inspect.Parameter.VAR_POSITIONAL,
          "keyword_only": inspect.Parameter.KEYWORD_ONLY, "var_keyword": inspect.Parameter.VAR_KEYWORD}


@dataclass(frozen=True)
class SourceAnswer:
    """A student's answer as source: the definitions it needs, run only where it is called.

    name: the name the answer is bound to; statements: ((filename, first line, source),
    ...) in notebook order, e.g. ("<cell 5>", 1, "def my_broadcast(tensor, src): ...");
    params: for an answer that is a plain `def`, its parameters as (name, kind, has a
    default) read from the source without running it, so that a checker can look at its
    signature here (inspect.signature works on it); None otherwise.
    """

    name: str
    statements: tuple = ()
    params: tuple | None = None

    @property
    def __name__(self) -> str:              # messages say "my_broadcast raised ...", as for a function
        return self.name

    @property
    def __signature__(self):
        if self.params is None:
            return None
        return inspect.Signature([inspect.Parameter(name, _KINDS[kind], default=... if default else
                                                    inspect.Parameter.empty) for name, kind, default in self.params])

    def __call__(self, *args, **kwargs):
        raise TypeError(f"{self.name} is source code: it runs only in a child process. Call it with "
                        f"sealed.call_each({self.name}, ...) or sealed.run_sealed(job, {self.name}, ...).")

    @property
    def filenames(self) -> set:
        return {filename for filename, _, _ in self.statements}

    def resolve(self, workdir: str | None = None):
        """In the child that calls the answer: run the definitions in a fresh module (in
        `workdir`, or a fresh temporary folder), return what `name` is bound to."""
        os.chdir(workdir or tempfile.mkdtemp(prefix="pplab-answer-"))
        module = types.ModuleType("submission")
        module.__file__ = "<submission>"
        sys.modules["submission"] = module
        texts: dict[str, list[str]] = {}
        for filename, line, source in self.statements:
            lines = texts.setdefault(filename, [])
            lines += ["\n"] * (line - 1 - len(lines))
            lines += [s + "\n" for s in source.split("\n")]
        for filename, lines in texts.items():      # tracebacks show the student's lines
            linecache.cache[filename] = (sum(map(len, lines)), None, lines, filename)
        for filename, line, source in self.statements:
            exec(compile("\n" * (line - 1) + source, filename, "exec"), module.__dict__)
        if self.name not in module.__dict__:
            raise NameError(f"{self.name} is not defined by the definitions taken from the notebook")
        return module.__dict__[self.name]


def answer_files(answer) -> set:
    """The file names the answer's own frames have in a traceback."""
    if isinstance(answer, SourceAnswer):
        return answer.filenames
    if inspect.isclass(answer):                 # a class: its methods, and those of its bases written with it
        return {f.__code__.co_filename for c in answer.__mro__ if c.__module__ == answer.__module__
                for f in vars(c).values() if hasattr(f, "__code__")}
    filename = getattr(getattr(answer, "__code__", None), "co_filename", None)
    return {filename} if filename else set()


# ----------------------------------------------------------------------------------
# Plain data across a process boundary

_SAFE_TYPES: list = []


def allow_type(cls) -> None:
    """Let instances of a small dataclass of pplab's (e.g. pipeline.Action) come back
    from a child. Its fields must be plain data; it must run no code when built."""
    if cls not in _SAFE_TYPES:
        _SAFE_TYPES.append(cls)


def _plain(x):
    """numpy numbers and arrays as Python numbers and tensors (what a student may return)."""
    if type(x).__module__ == "numpy":
        return torch.from_numpy(x.copy()) if hasattr(x, "shape") and x.shape else x.item()
    if type(x) in (list, tuple):
        return type(x)(_plain(v) for v in x)
    if type(x) is dict:
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, torch.Tensor):
        return x.detach().cpu()
    return x


def encode(value) -> bytes:
    """In a child: `value` as bytes the checker's process can decode safely. Something that
    is not plain data becomes a NotPlainData marker naming its type."""
    buffer = io.BytesIO()
    try:
        torch.save(_plain(value), buffer)
        decode(buffer.getvalue())
    except Exception:  # noqa: BLE001 - anything that does not come back as plain data
        buffer = io.BytesIO()
        torch.save(("__pplab_not_plain_data__", type(value).__name__), buffer)
    return buffer.getvalue()


def decode(data: bytes):
    """In the checker's process: the plain data `encode` made (raises if it is not that)."""
    if not isinstance(data, bytes):
        raise TypeError(f"expected bytes, got {type(data).__name__}")
    with torch.serialization.safe_globals(list(_SAFE_TYPES)):
        return torch.load(io.BytesIO(data), weights_only=True)


def _not_plain(value) -> str | None:
    if isinstance(value, tuple) and len(value) == 2 and value[0] == "__pplab_not_plain_data__":
        return str(value[1])
    return None
