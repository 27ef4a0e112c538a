"""What runs in the sealed ranks of chapter 1's collective exercises (collectives.py judges).

Kept apart from the checker, which holds the references: a graded check's ranks may import
this module and nothing of the checker (fresh_zygote.py)."""
from __future__ import annotations

from .sealed.forbidden import refuse_library

import torch
import torch.distributed as dist

from . import sealed


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


def _reduce_scatter_rank(fn, inputs):
    """Run on every (sealed) rank: call the student's fn on each trial, record output and input."""
    p = dist.get_world_size()
    for i, input in enumerate(inputs):
        sealed.begin(i)
        output = torch.full((input.numel() // p,), -7777, dtype=input.dtype)
        returned = fn(output, input)
        sealed.observe(i, {"output": output, "input": input, "returned": _returned_copy(returned, output)})


def _all_reduce_rank(fn, inputs):
    """Run on every (sealed) rank: call the student's fn on each trial, record the tensor."""
    for i, tensor in enumerate(inputs):
        sealed.begin(i)
        returned = fn(tensor)
        sealed.observe(i, {"tensor": tensor, "returned": _returned_copy(returned, tensor)})


def _refuse_costmodel(fn) -> None:
    """In the sealed rank: Forbidden if the answer asks pplab.costmodel or pplab.costfit."""
    from .. import costfit, costmodel
    refuse_library(fn, "predict_time", "the fit and the time",
                   {"costmodel": costmodel, "predict": costmodel.predict, "cost": costmodel.cost,
                    "fit_timings": costfit.fit_timings, "_fit_line": costfit._fit_line},
                   "pplab.costmodel or pplab.costfit")
