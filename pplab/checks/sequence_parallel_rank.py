"""The jobs and probes that sequence_parallel.py runs in its exercises' sealed ranks.

Kept apart from the checker, which holds the references: a graded check's ranks may import
this module and nothing of the checker (fresh_zygote.py), and there the library modules the
exercise asks the student to write are not available at all (denied.py)."""
from __future__ import annotations

import math

import torch

from . import sealed
from .sealed.forbidden import refuse_library


def _blockwise_rank(fn, calls):
    """In the sealed rank: each call under pplab.memory.PeakMemory (the most bytes its tensors held at once)."""
    from ..memory import PeakMemory
    for i, args in enumerate(calls):
        sealed.begin(i)
        with PeakMemory() as mem:
            returned = fn(*args)
        sealed.observe(i, {"returned": returned, "peak": mem.peak})


def _refuse_sdpa(fn) -> None:
    """In the sealed rank: Forbidden if the answer calls torch's own attention."""
    refuse_library(fn, "online_softmax_merge", "attention block by block",
                   {"scaled_dot_product_attention": torch.nn.functional.scaled_dot_product_attention},
                   "torch.nn.functional.scaled_dot_product_attention")


def _ring_rank(fn, trials):
    """In every sealed rank: p steps of the answer on this rank's q, k, v; each step a phase of its own."""
    for i, t in enumerate(trials):
        sealed.begin(i)
        q, k, v = t["q"], t["k"], t["v"]
        out = torch.zeros_like(q)
        lse = torch.full(q.shape[:-1], -math.inf, dtype=q.dtype)
        steps = []
        for step in range(t["p"]):
            sealed.phase(f"step {step}")
            returned = fn(q, k, v, out, lse, step)
            if not (isinstance(returned, (tuple, list)) and len(returned) == 4):
                steps.append({"bad": type(returned).__name__})
                break
            out, lse, k, v = returned
            steps.append({"out": out.clone() if isinstance(out, torch.Tensor) else out,
                          "lse": lse.clone() if isinstance(lse, torch.Tensor) else lse,
                          "k": k.clone() if isinstance(k, torch.Tensor) else k,
                          "v": v.clone() if isinstance(v, torch.Tensor) else v})
        sealed.phase("")
        sealed.observe(i, steps)


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
