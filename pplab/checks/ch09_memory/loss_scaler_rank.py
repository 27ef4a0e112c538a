"""What exercise loss_scaler's checker (loss_scaler.py) runs in its sealed ranks."""
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
