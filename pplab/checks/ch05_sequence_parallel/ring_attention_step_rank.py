"""What exercise ring_attention_step's checker (ring_attention_step.py) runs in its sealed ranks."""
from __future__ import annotations

import math
import torch

from .. import sealed


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
