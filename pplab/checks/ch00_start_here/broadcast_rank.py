"""What runs in the sealed ranks of chapter 1's collective exercises (collectives.py judges).

Kept apart from the checker, which holds the references: a graded check's ranks may import
this module and nothing of the checker (fresh_zygote.py)."""
from __future__ import annotations

import torch

from .. import sealed


def _returned_copy(returned, tensor):
    """What the answer returned, if that is a tensor other than the one it was given."""
    return returned.detach().clone() if isinstance(returned, torch.Tensor) and returned is not tensor else None


def _broadcast_rank(fn, trials):
    """Run on every (sealed) rank: call the student's fn on each trial, record what it left in the tensor."""
    for i, trial in enumerate(trials):
        sealed.begin(i)
        tensor = trial["tensor"]
        returned = fn(tensor, trial["src"])
        sealed.observe(i, {"tensor": tensor, "returned": _returned_copy(returned, tensor)})
