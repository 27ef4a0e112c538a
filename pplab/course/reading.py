"""The grader's first look at a submitted notebook, bounded: nothing a notebook holds can
stop the grading run.

    reading = read_submission(path, {"my_broadcast": ["00_broadcast"], ...})
    reading.notes          # "cell 5 holds 300,000 characters, more than the grader reads ...: skipped"
    reading.found          # submission.Definitions: the answers, the notes on what was left out
    reading.written        # [(cell number, markdown or predictions the student wrote)]

It raises Unreadable (a ValueError) with what to hand in instead when the notebook cannot be
read. Everything done with the submission's bytes before a check is bounded:

- Only a regular file is opened: os.lstat first, then open with O_NOFOLLOW | O_NONBLOCK
  and fstat on what was opened. A named pipe (which would block the read forever), a
  socket, a device, a symbolic link or a folder named *.ipynb is refused by name.
- At most MAX_NOTEBOOK_BYTES (20 MB) are read. Of the cells, the first MAX_CELLS (2,000)
  are read, and a code cell over MAX_CELL_CHARS (200,000 characters) is skipped, each with a
  note (the course's notebooks have at most 45 cells, of at most 5,200 characters).
- The JSON parse, the cells' shape, IPython's magics, Python's parser, the walk over the
  syntax tree (submission.definitions), the prediction lines and the written answers run in
  a child process of their own, which gets the bytes on its stdin and answers in plain JSON.
  It has READ_SECONDS (30 s) and READ_MEMORY (1 GiB of address space): a child that runs out
  of either, or crashes (deeply nested code can overflow the C stack), is killed and the
  notebook gets a note instead of marks. For a course-sized notebook the child's cost is
  mostly its start: Python, then IPython's import (for %magics), then a few milliseconds of
  parsing.

The child imports no torch (2 s a notebook) and reads nothing of pplab from disk: it gets
the source of this module, submission.py and checks/prediction_lines.py in its request, as
the grader read them before any notebook ran (a notebook run without the sandbox could
rewrite them since), registers pplab's packages bare (their __init__ files not run) with a
stand-in for SourceAnswer, and the grader builds the real SourceAnswers from the JSON.
"""
from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

MAX_NOTEBOOK_BYTES = 20 << 20       # a notebook larger than this is not read (clear its outputs)
MAX_CELLS = 2_000                   # cells after these are not read
MAX_CELL_CHARS = 200_000            # a code cell longer than this is not parsed
NOTES_ON_CELLS = 10                 # notes on skipped cells kept per notebook; the rest are counted
READ_SECONDS = 30.0                 # the child's deadline for one notebook
READ_MEMORY = 1 << 30               # the child's address space, in bytes

COURSE = Path(__file__).resolve().parents[2]      # exercises/ and solutions/: the markdown given to students
CHILD_MODULES = ("pplab.checks.prediction_lines", "pplab.course.submission", "pplab.course.reading")
HAND_IN = "hand in the .ipynb file Jupyter saves"


class Unreadable(ValueError):
    """The notebook is not read at all; the message says why and what to hand in."""


@dataclass
class Reading:
    notes: list = field(default_factory=list)       # on cells that were not read
    found: object = None                            # submission.Definitions
    written: list = field(default_factory=list)     # [(cell number, text)]


# -- in the grader: a regular file's bytes, then the child ------------------------------

def what_it_is(mode: int) -> str:
    """'a named pipe (FIFO)', 'a folder', ... for a file that is not a regular file."""
    kinds = [(stat.S_ISFIFO, "a named pipe (FIFO)"), (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
             (stat.S_ISBLK, "a block device"), (stat.S_ISLNK, "a symbolic link"), (stat.S_ISDIR, "a folder")]
    return next((words for test, words in kinds if test(mode)), "not a regular file")


def not_a_notebook(name: str, mode: int) -> str:
    return f"{name} is {what_it_is(mode)}, not a notebook file: refused, {HAND_IN}"


def read_bytes(path: str | Path, limit: int = MAX_NOTEBOOK_BYTES) -> bytes:
    """The bytes of a regular file of at most `limit` bytes, else Unreadable. Never follows
    a link and never waits: a FIFO is refused before it is opened (and, if it was swapped
    in since, opened without blocking and refused by fstat)."""
    path = Path(path)
    info = os.lstat(path)
    if not stat.S_ISREG(info.st_mode):
        raise Unreadable(not_a_notebook(path.name, info.st_mode))
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as err:
        raise Unreadable(f"{path.name} could not be opened ({err.strerror}): {HAND_IN}") from None
    with open(fd, "rb") as f:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise Unreadable(not_a_notebook(path.name, info.st_mode))
        data = f.read(limit + 1) if info.st_size <= limit else b""
    if info.st_size > limit or len(data) > limit:
        size = max(info.st_size, len(data))
        raise Unreadable(f"the notebook is {size / 2**20:.0f} MB, more than the grader reads "
                         f"({limit >> 20} MB): clear its outputs and hand it in again")
    return data


def read_submission(path: str | Path, answers: dict, *, sources: dict | None = None,
                    seconds: float = READ_SECONDS, memory: int = READ_MEMORY) -> Reading:
    """Read a submitted notebook in a child with a deadline and a memory limit.

    answers: {answer name: [the course notebooks that ask for it]}, the answers to look
    for; markdown of those notebooks that the student did not change is not 'written'.
    sources: pplab's sources as the grader read them (check_process.pplab_sources); the
    child runs its modules from there (default: read from disk now)."""
    from ..checks import SourceAnswer
    from .exercises import MARKDOWN_STUB
    from .submission import Definitions

    data = read_bytes(path)
    root = Path(__file__).resolve().parents[2]
    modules = {name: (sources[name][:2] if sources else
                      [str(root.joinpath(*name.split("."))) + ".py",
                       root.joinpath(*name.split(".")).with_suffix(".py").read_text()]) for name in CHILD_MODULES}
    request = json.dumps({"modules": modules, "answers": answers, "course": str(COURSE), "stub": MARKDOWN_STUB,
                          "memory": memory, "path": [p for p in sys.path if p]}).encode() + b"\n"
    # -S: no site (its .pth files cost more than the parse); the grader's sys.path comes in the request
    child = subprocess.Popen([sys.executable, "-S", "-c", BOOT], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        out, err = child.communicate(request + data, timeout=seconds)
    except subprocess.TimeoutExpired:
        child.kill()                              # it starts nothing: killing it leaves nothing behind
        child.communicate()
        raise Unreadable(f"reading it (JSON, cells, Python's parser) took more than {seconds:g} s, the grader's "
                         f"limit for one notebook: {HAND_IN}, without generated cells") from None
    finally:
        if child.poll() is None:                  # the grader itself was interrupted
            child.kill()
            child.wait()
    if child.returncode == MEMORY_EXIT:
        raise Unreadable(f"reading it needed more than {memory / 2**30:.3g} GiB, the grader's limit for one "
                         f"notebook: {HAND_IN}, without generated cells")
    try:
        reply = json.loads(out)
    except ValueError:
        reply = None
    if child.returncode != 0 or not isinstance(reply, dict):
        how = f"signal {-child.returncode}" if child.returncode < 0 else f"exit code {child.returncode}"
        tail = err.decode(errors="replace").strip().splitlines()[-1:] or ["no message"]
        raise Unreadable(f"the grader's reader stopped on it ({how}: {tail[0][:200]}): {HAND_IN}")
    if "refused" in reply:
        raise Unreadable(reply["refused"])
    found = Definitions(notes=reply["definition_notes"], refused=reply["refused_answers"])
    for name, statements, params in reply["answers"]:
        found.answers[name] = SourceAnswer(name, tuple(tuple(s) for s in statements),
                                           None if params is None else tuple(tuple(p) for p in params))
    return Reading(reply["notes"], found, [tuple(w) for w in reply["written"]])


# -- in the child: plain data in, plain JSON out ----------------------------------------

MEMORY_EXIT = 3                   # the child's exit code when it ran out of memory

# Run as `python -S -c BOOT`, the request on stdin: pplab's packages registered without
# running their __init__ (which imports torch) and with nothing to find on disk, the child's
# modules run from the sources in the request, and a SourceAnswer that is only a tuple.
BOOT = """
import json, sys, types
header = json.loads(sys.stdin.buffer.readline())
sys.path[:] = header["path"]
for name in ("pplab", "pplab.course", "pplab.checks"):
    sys.modules[name] = package = types.ModuleType(name)
    package.__path__ = []
sys.modules["pplab.checks"].SourceAnswer = lambda name, statements, params: (name, statements, params)
for name, (file, text) in header["modules"].items():
    sys.modules[name] = module = types.ModuleType(name)
    module.__file__, module.__package__ = file, name.rpartition(".")[0]
    exec(compile(text, file, "exec"), module.__dict__)
sys.modules["pplab.course.reading"]._child(header)
"""


def _child(header: dict) -> None:
    import resource

    try:
        resource.setrlimit(resource.RLIMIT_AS, (header["memory"], header["memory"]))
    except (ValueError, OSError):          # macOS may refuse it: the deadline still holds
        pass
    try:
        reply = parse(sys.stdin.buffer.read(MAX_NOTEBOOK_BYTES + 1), header["answers"], Path(header["course"]),
                      header["stub"])
    except MemoryError:
        os._exit(MEMORY_EXIT)
    sys.stdout.write(json.dumps(reply))


def parse(data: bytes, answers: dict, course: Path = COURSE, stub: str = "") -> dict:
    """What the grader takes from a notebook's bytes, as plain data (what the child sends).
    stub: the markdown the course puts where a written answer goes (exercises.py)."""
    from .submission import definitions

    try:
        cells, notes = cells_of(data)
    except Unreadable as exc:
        return {"refused": str(exc)}
    found = definitions([(n, src) for n, kind, src in cells if kind == "code"], set(answers))
    notebooks = {notebook for name in found.answers for notebook in answers[name] if notebook}
    return {"notes": notes, "definition_notes": found.notes, "refused_answers": found.refused,
            "answers": list(found.answers.values()), "written": written_answers(cells, notebooks, course, stub)}


def read_cells(path: str | Path) -> tuple[list[tuple[int, str, str]], list[str]]:
    """[(cell number, cell type, source)] of a notebook file, and notes on what could not be
    read (in this process: for the course's own notebooks and for tests)."""
    return cells_of(read_bytes(path))


def cells_of(data: bytes) -> tuple[list[tuple[int, str, str]], list[str]]:
    """[(cell number, cell type, source)] of a notebook's bytes, read without trusting its
    shape, and notes on what could not be read. Raises Unreadable if it is not a notebook."""
    try:
        nb = json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise Unreadable(f"not a notebook (not JSON: {type(exc).__name__})") from None
    if not isinstance(nb, dict) or not isinstance(nb.get("cells"), list):
        old = isinstance(nb, dict) and "worksheets" in nb
        raise Unreadable("not a notebook in nbformat 4" + (" (nbformat 3: open and save it in Jupyter)" if old
                                                           else " (no list of cells)"))
    cells, notes = [], []
    if len(nb["cells"]) > MAX_CELLS:
        notes.append(f"the notebook has {len(nb['cells']):,} cells, more than the grader reads ({MAX_CELLS:,}): "
                     f"cells after {MAX_CELLS:,} were skipped")
    for number, cell in enumerate(nb["cells"][:MAX_CELLS], 1):
        kind = cell.get("cell_type") if isinstance(cell, dict) else None
        source = cell.get("source", None) if isinstance(cell, dict) else None
        if isinstance(source, list) and all(isinstance(s, str) for s in source):
            source = "".join(source)
        if kind not in ("code", "markdown", "raw") or not isinstance(source, str):
            notes.append(f"cell {number} is not a well-formed cell (no cell_type or source): skipped")
            continue
        if kind == "code" and len(source) > MAX_CELL_CHARS:
            notes.append(f"cell {number} holds {len(source):,} characters, more than the grader reads "
                         f"({MAX_CELL_CHARS:,}): skipped")
            continue
        cells.append((number, kind, source))
    if len(notes) > NOTES_ON_CELLS:
        notes[NOTES_ON_CELLS:] = [f"and {len(notes) - NOTES_ON_CELLS:,} more cells skipped for these reasons"]
    return cells, notes


def written_answers(cells, exercise_notebooks, course: Path = COURSE, stub: str = "") -> list[tuple[int, str]]:
    """Markdown cells the student wrote or changed (not in any exercise notebook of the
    course that this notebook answers, and not the stub), and the predictions they filled in."""
    given = set()
    for name in exercise_notebooks:
        for folder in ("exercises", "solutions"):
            try:
                given |= {src.strip() for _, kind, src in read_cells(course / folder / f"{name}.ipynb")[0]
                          if kind == "markdown"}
            except (OSError, ValueError):
                pass
    written = [(n, src) for n, kind, src in cells if kind == "markdown" and src.strip()
               and src.strip() not in given and src.strip() != stub]
    return sorted(written + _predictions(cells))


def _predictions(cells) -> list[tuple[int, str]]:
    """The chapters' 'predict, then run' answers the student filled in, read from the source
    (`my_x = 3 * n  # your prediction: ...`), so the instructor sees what they guessed."""
    from ..checks.prediction_lines import predictions_in

    found = []
    for n, kind, src in cells:
        guessed = {k: v for k, v in predictions_in(src).items() if v != "None"} if kind == "code" else {}
        if guessed:
            found.append((n, "predictions: " + "; ".join(f"`{k} = {v}`" for k, v in guessed.items())))
    return found
