"""What exercise broadcast's checker (broadcast.py) runs in its sealed ranks, and the check that
an answer returned a new tensor, which chapter 1's ring collectives use too."""
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
