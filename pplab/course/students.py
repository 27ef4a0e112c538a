"""Who handed in what: the submissions folder read as one identity per student.

    refused = {}
    found = find_submissions(folder, refused)   # {student: [notebooks]}; refused: {student: [notes]}
    answers_file_name("bob smith")             # 'bob%20smith.md', never the same as bob_smith's

A student is DIR/<student>.ipynb, or every notebook under DIR/<student>/ (both, if both are
there). The name is read as Unicode in NFC, so 'zoë' typed with one code point or with 'e'
and a combining diaeresis is one name. Two entries whose names are equal once normalised and
casefolded but written differently ('Bob' and 'bob', the two 'zoë's) cannot be told apart by
an instructor: each gets a row of its own with a note, and neither is graded, rather than
one silently taking the other's marks or written answers.

Only regular files are notebooks. A symbolic link, a named pipe, a socket, a device or a
folder named *.ipynb gets a note on its student's row (a FIFO would block the grader's
read forever). The walk never follows a link, goes at most MAX_DEPTH folders deep and takes
at most MAX_NOTEBOOKS notebooks per student; what it leaves out is named in a note.
"""
from __future__ import annotations

import os
import stat
import unicodedata
from pathlib import Path

from .reading import HAND_IN, what_it_is

MAX_DEPTH = 8               # folders below DIR/<student>/ that are searched for notebooks
MAX_NOTEBOOKS = 100         # notebooks graded per student (the course has under 50)


def student_name(raw: str) -> str:
    """The name as the CSV shows it: NFC, and a byte that is not UTF-8 shown as U+FFFD."""
    text = raw.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
    return unicodedata.normalize("NFC", text)


def identity(raw: str) -> str:
    """What must differ between two students: the name in NFC, casefolded."""
    return unicodedata.normalize("NFC", student_name(raw).casefold())


def find_submissions(directory: str | Path, refused: dict | None = None) -> dict[str, list[Path]]:
    """{student: notebooks}: DIR/<student>.ipynb, or every notebook under DIR/<student>/.

    Whatever is not a notebook that can be graded (a link, a FIFO, a folder named *.ipynb,
    a name another student's reads as) goes into `refused` as {student: [why]}, and that
    student gets a row with the note."""
    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"no submissions folder at {directory}")
    refused = {} if refused is None else refused
    entries: dict[str, tuple[list, list]] = {}          # raw name -> (notebooks, notes)

    for entry in sorted(os.scandir(directory), key=lambda e: e.name):
        if entry.name.startswith("."):
            continue
        mode = entry.stat(follow_symlinks=False).st_mode
        if entry.name.endswith(".ipynb"):
            notebooks, notes = entries.setdefault(entry.name[:-len(".ipynb")], ([], []))
            if stat.S_ISREG(mode):
                notebooks.append(Path(entry.path))
            else:
                notes.append(_refusal(entry.name, mode, os.readlink(entry.path) if stat.S_ISLNK(mode) else None))
        elif stat.S_ISLNK(mode):
            entries.setdefault(entry.name, ([], []))[1].append(_refusal(entry.name, mode, os.readlink(entry.path)))
        elif stat.S_ISDIR(mode):
            notebooks, notes = entries.setdefault(entry.name, ([], []))
            _walk(Path(entry.path), directory, notebooks, notes)

    by_identity: dict[str, list[str]] = {}
    for raw, (notebooks, notes) in entries.items():
        if notebooks or notes:                    # a folder without notebooks is nobody
            by_identity.setdefault(identity(raw), []).append(raw)
    found: dict[str, list[Path]] = {}
    for raws in by_identity.values():
        if len(raws) > 1:
            shown = [student_name(raw) for raw in raws]
            for raw in raws:                  # one row each, told apart where the names look the same
                row = student_name(raw) if shown.count(student_name(raw)) == 1 else ascii(raw)[1:-1]
                others = ", ".join(ascii(other) for other in raws if other != raw)
                refused.setdefault(row, []).append(
                    f"refused: the name {ascii(raw)} is the same student as {others} once case and Unicode form "
                    f"are ignored, so the grader cannot tell them apart: neither was graded; rename one and grade "
                    f"again")
            continue
        raw = raws[0]
        notebooks, notes = entries[raw]
        if notes:
            refused.setdefault(student_name(raw), []).extend(notes)
        if notebooks:
            found[student_name(raw)] = sorted(notebooks)
    return found


def _walk(folder: Path, directory: Path, notebooks: list, notes: list) -> None:
    """The regular *.ipynb files under a student's folder, breadth first, never through a link."""
    todo, too_deep = [(folder, 0)], []
    while todo:
        here, depth = todo.pop(0)
        try:
            children = sorted(os.scandir(here), key=lambda e: e.name)
        except OSError as err:
            notes.append(f"{here.relative_to(directory)} could not be listed ({err.strerror}): skipped")
            continue
        for entry in children:
            path = Path(entry.path)
            mode = entry.stat(follow_symlinks=False).st_mode
            if entry.name == ".ipynb_checkpoints":
                continue
            if stat.S_ISLNK(mode):
                notes.append(_refusal(str(path.relative_to(directory)), mode, os.readlink(path)))
            elif entry.name.endswith(".ipynb"):
                if not stat.S_ISREG(mode):
                    notes.append(_refusal(str(path.relative_to(directory)), mode))
                elif len(notebooks) < MAX_NOTEBOOKS:
                    notebooks.append(path)
                else:
                    notes.append(f"{path.relative_to(directory)}: more than {MAX_NOTEBOOKS} notebooks, the most the "
                                 f"grader takes from one student: skipped")
            elif stat.S_ISDIR(mode):
                if depth < MAX_DEPTH:
                    todo.append((path, depth + 1))
                else:
                    too_deep.append(str(path.relative_to(directory)))
    if too_deep:
        notes.append(f"{too_deep[0]}{' and others' if len(too_deep) > 1 else ''}: more than {MAX_DEPTH} folders "
                     f"deep, not searched for notebooks")


def _refusal(name: str, mode: int, target: str | None = None) -> str:
    if stat.S_ISLNK(mode):
        return f"{name} is a symbolic link (to {target}): refused, hand in the notebook itself"
    return f"{name} is {what_it_is(mode)}, not a notebook file: refused, {HAND_IN}"


def answers_file_name(student: str) -> str:
    """The file of a student's written answers: a different file for every different name.

    Letters and digits of ASCII, '-' and '_' are kept; every other character becomes %XX
    for each byte of its UTF-8 ('bob smith' -> 'bob%20smith', 'zoë' -> 'zo%C3%AB'), so no two
    names share a file ('%' itself is encoded). A name too long for a file name keeps its
    first 200 characters and a hash of the whole ('~' marks it: it is encoded elsewhere)."""
    import hashlib

    encoded = "".join(c if (c.isascii() and c.isalnum()) or c in "-_" else
                      "".join(f"%{b:02X}" for b in c.encode("utf-8", "surrogatepass")) for c in student)
    if len(encoded) > 200:
        encoded = encoded[:200] + "~" + hashlib.sha256(student.encode("utf-8", "surrogatepass")).hexdigest()[:32]
    return encoded + ".md"
