"""The jobs and probes that loss_scaler.py runs in its sealed ranks.

Kept apart from the checker, which holds the references: a graded check's ranks may import
this module and nothing of the checker (fresh_zygote.py), and there the library modules the
exercise asks the student to write are not available at all (denied.py)."""
from __future__ import annotations

import torch

from .. import sealed


LR = 0.1                                            # the learning rate of the step each rank takes


def _rank_job(fn, trials):
    """In every sealed rank: the student's scaler in front of SGD on this rank's shard."""
    for i, t in enumerate(trials):
        sealed.begin(i)
        scaler = fn(init_scale=t["init"], growth_interval=t["interval"])
        shard = torch.nn.Parameter(t["start"].clone())
        optimizer = torch.optim.SGD([shard], lr=LR)
        stepped, scales, shards = [], [], []
        for grad in t["grads"]:
            shard.grad = grad * float(scaler.scale)          # the gradient of the scaled loss
            stepped.append(bool(scaler.step(optimizer)))
            scales.append(float(scaler.scale))
            shards.append(shard.detach().clone())
            optimizer.zero_grad()
        sealed.observe(i, {"stepped": stepped, "scales": scales, "shards": shards})
