"""Where learners open a chapter alone (Colab, a downloaded notebook): the lines that install pplab.

    python tools/install_cell.py            # say which notebooks or README rows are out of date
    python tools/install_cell.py --write    # rewrite them

A notebook opened without the repository cannot import a helper from pplab to install pplab, so
each notebook's first code cell starts with the same few lines of plain Python, written here once
(INSTALL_LINES) and pasted into every notebook by --write; tests/test_lone_notebook.py fails when
a notebook or the README's Colab table differs from what this file writes.

The lines install the released wheel of the course's own version (pyproject's) from the
repository's GitHub release: no index has pplab, and a wheel needs no build step on the learner's
side. torch is a range in pplab's dependencies (torch>=2.2), so Colab's preinstalled torch
satisfies it and is kept, not reinstalled. PPLAB_INSTALL overrides what is installed (a local
wheel, or pip options after it): the tests install the wheel they built that way.
"""
from __future__ import annotations

import json
import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
README = ROOT / "README.md"
START, END = "<!-- colab-links:start -->", "<!-- colab-links:end -->"

# The course's public repository (owner/name on GitHub). No file of the course named one when this
# was written: this one line is the place to change it, then run --write.
REPOSITORY = "pplab-course/pplab"
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
WHEEL = f"https://github.com/{REPOSITORY}/releases/download/v{VERSION}/pplab-{VERSION}-py3-none-any.whl"
FIRST_LINE = "# Opened alone (Colab, a download)? Install pplab, the course's version; a torch you have is kept."

INSTALL_LINES = f"""{FIRST_LINE}
import os
try:
    import pplab
except ImportError:
    wheel = os.environ.get("PPLAB_INSTALL", "{WHEEL}")
    %pip install -q {{wheel}}
"""


def with_install_lines(source: str) -> str:
    """`source` (a first code cell) with the install lines on top, replacing any older version of them."""
    lines = source.splitlines(keepends=True)
    if lines and lines[0].startswith("# Opened alone"):
        end = next(i for i, line in enumerate(lines) if line.lstrip().startswith("%pip install"))
        lines = lines[end + 1:]
        while lines and not lines[0].strip():
            lines = lines[1:]
    rest = "".join(lines)
    return INSTALL_LINES + "\n" + rest if rest else INSTALL_LINES.rstrip("\n")


def colab_url(notebook: str) -> str:
    return f"https://colab.research.google.com/github/{REPOSITORY}/blob/main/notebooks/{notebook}.ipynb"


BINDER = f"https://mybinder.org/v2/gh/{REPOSITORY}/main?urlpath=lab/tree/notebooks/00_start_here.ipynb"


def colab_table() -> str:
    """The README's block: the Binder badge, and one 'open in Colab' link per notebook."""
    rows = [f"| `{nb.stem}` | [open in Colab]({colab_url(nb.stem)}) |" for nb in sorted(NOTEBOOKS.glob("*.ipynb"))]
    badge = f"[![launch the course on Binder](https://mybinder.org/badge_logo.svg)]({BINDER})"
    return "\n".join([START, badge, "", "| notebook | |", "|---|---|", *rows, END])


def _first_code_cell(cells: list[dict]) -> dict:
    return next(c for c in cells if c["cell_type"] == "code")


def out_of_date(write: bool = False) -> list[str]:
    """Notebooks (and README.md) whose install lines or Colab table differ from this file's; with
    write=True, rewrite them (only the first code cell's source, and the README's table)."""
    stale = []
    for path in sorted(NOTEBOOKS.glob("*.ipynb")):
        text = path.read_text()
        nb = json.loads(text)
        cell = _first_code_cell(nb["cells"])
        source = "".join(cell["source"])
        wanted = with_install_lines(source)
        if source != wanted:
            stale.append(str(path.relative_to(ROOT)))
            if write:
                cell["source"] = wanted.splitlines(keepends=True)
                path.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n")
    readme = README.read_text()
    table = re.search(re.escape(START) + ".*?" + re.escape(END), readme, re.S)
    if table is None or table[0] != colab_table():
        stale.append("README.md")
        if write:
            if table is None:
                raise SystemExit(f"README.md has no {START} ... {END} block to write the Colab links into")
            README.write_text(readme.replace(table[0], colab_table()))
    return stale


if __name__ == "__main__":
    write = "--write" in sys.argv[1:]
    stale = out_of_date(write)
    print(("rewrote: " if write else "out of date: ") + (", ".join(stale) or "nothing"))
    sys.exit(0 if write or not stale else 1)
