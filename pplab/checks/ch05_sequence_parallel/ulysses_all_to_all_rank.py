"""The jobs and probes that ulysses_all_to_all.py runs in its sealed ranks.

Kept apart from the checker, which holds the references: a graded check's ranks may import
this module and nothing of the checker (fresh_zygote.py), and there the library modules the
exercise asks the student to write are not available at all (denied.py)."""
from __future__ import annotations

from .. import sealed


def _ulysses_rank(fn, trials):
    """In every sealed rank: both directions on this rank's shards; the router records what each sent."""
    for i, t in enumerate(trials):
        sealed.begin(i)
        sealed.phase("to_heads")
        y = fn(t["mine"], 1, 2)                           # sequence-sharded -> head-sharded
        sealed.phase("back")
        back = fn(t["heads"], 2, 1)                       # head-sharded -> sequence-sharded
        sealed.phase("")
        sealed.observe(i, {"to_heads": y, "back": back})
