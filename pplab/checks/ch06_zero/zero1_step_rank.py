"""What exercise zero1_step's checker (zero1_step.py) runs in its sealed ranks."""
from __future__ import annotations

import torch

from .. import sealed


LR, WD = 0.05, 0.1                                   # the step the ZeRO-1 answer is asked for


def _zero1_rank(fn, trials):
    """In every sealed rank: make_zero1 on the trial's flat parameter, then a step per gradient of this rank."""
    for i, trial in enumerate(trials):
        sealed.begin(i)
        sizes = []

        class AdamWOfThisCheck(torch.optim.AdamW):     # records what each rank asks it to optimize
            def __init__(self, params, *args, **kwargs):
                params = list(params)
                tensors = [q for g in params for q in g["params"]] if params and isinstance(params[0], dict) \
                    else params
                sizes.append(sum(t.numel() for t in tensors))
                super().__init__(params, lr=LR, weight_decay=WD)

        flat, history = trial["flat"], []
        step = fn(flat, AdamWOfThisCheck)
        for grad in trial["grads"]:
            step(grad)
            history.append(flat.clone())
        sealed.observe(i, {"history": history, "sizes": sizes})
