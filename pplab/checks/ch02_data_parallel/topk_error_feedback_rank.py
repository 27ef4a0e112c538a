"""What exercise topk_error_feedback's checker (topk_error_feedback.py) runs in its sealed ranks."""
from __future__ import annotations

import torch

from .. import sealed


def _topk_rank(fn, steps):
    """In the sealed rank: the runs of topk_ef_step, each step's memory the answer's own
    new_memory of the step before (what error feedback carries), zeros at a run's start."""
    memory = None
    for i, (grad, k, first) in enumerate(steps):
        sealed.begin(i)
        memory = torch.zeros_like(grad) if first else memory
        out = fn(grad.clone(), memory.clone(), k)
        sealed.observe(i, out)
        memory = out[2].detach().double().float()        # a malformed result: the checker says why, at this step
