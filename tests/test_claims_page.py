"""docs/claims.md lists every measured claim of the chapters and the cell that asserts it: each
cell it names must exist and assert something (or compare a prediction, which the tests hold to
its worked answer)."""
import re
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGE = (ROOT / "docs" / "claims.md").read_text()


def rows():
    """(notebook, cell, claim) for every table row of the page, under its notebook's heading."""
    found, notebook = [], None
    for line in PAGE.splitlines():
        if line.startswith("## "):
            m = re.search(r"`(notebooks/[\w.]+\.ipynb)`", line)
            notebook = m[1] if m else None
        elif notebook and (m := re.match(r"\| (\d+) \| (.+) \|$", line)):
            found.append((notebook, int(m[1]), m[2]))
    return found


def test_the_page_covers_every_notebook():
    named = {nb for nb, _, _ in rows()}
    assert named == {f"notebooks/{p.name}" for p in (ROOT / "notebooks").glob("*.ipynb")}


@pytest.mark.parametrize("notebook, cell, claim", rows(), ids=[f"{n[10:12]}-{c}" for n, c, _ in rows()])
def test_each_listed_cell_asserts(notebook, cell, claim):
    cells = nbformat.read(ROOT / notebook, 4).cells
    assert cell < len(cells) and cells[cell].cell_type == "code", f"{notebook} has no code cell {cell}"
    assert re.search(r"\bassert\b|assert_close\(|compare_(prediction|choice)\(", cells[cell].source), \
        f"{notebook} cell {cell} asserts nothing, yet docs/claims.md says it checks: {claim}"
