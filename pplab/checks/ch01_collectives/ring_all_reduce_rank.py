"""What runs in the sealed ranks of chapter 1's collective exercises (collectives.py judges).

Kept apart from the checker, which holds the references: a graded check's ranks may import
this module and nothing of the checker (fresh_zygote.py)."""
from __future__ import annotations

from .. import sealed
from ..ch00_start_here.broadcast_rank import _returned_copy


def _all_reduce_rank(fn, inputs):
    """Run on every (sealed) rank: call the student's fn on each trial, record the tensor."""
    for i, tensor in enumerate(inputs):
        sealed.begin(i)
        returned = fn(tensor)
        sealed.observe(i, {"tensor": tensor, "returned": _returned_copy(returned, tensor)})
