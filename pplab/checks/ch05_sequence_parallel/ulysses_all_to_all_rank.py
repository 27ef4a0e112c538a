"""What exercise ulysses_all_to_all's checker (ulysses_all_to_all.py) runs in its sealed ranks."""
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
