"""What exercise clip_sharded's checker (clip_sharded.py) runs in its sealed ranks."""
from __future__ import annotations

import torch
import torch.distributed as dist

from .. import sealed


def _mesh(tp, dp):
    """(tp groups, dp groups) of global ranks, tp innermost (pplab.mesh's layout)."""
    return ([[j * tp + r for r in range(tp)] for j in range(dp)], [[j * tp + r for j in range(dp)] for r in range(tp)])


def _rank_job(fn, trials):
    """In each sealed rank: make every tp and dp group of the trial's mesh, call the answer, record."""
    rank = dist.get_rank()
    for i, t in enumerate(trials):
        sealed.begin(i)
        tp_groups, dp_groups = _mesh(t["tp"], t["dp"])
        made_tp = [dist.new_group(g) for g in tp_groups]         # every rank makes every group, in order
        made_dp = [dist.new_group(g) for g in dp_groups]
        tp_group = next(g for g, m in zip(made_tp, tp_groups) if rank in m)
        dp_group = next(g for g, m in zip(made_dp, dp_groups) if rank in m)
        shards = [dict(s) for s in t["shards"]]
        norm = fn(shards, t["max_norm"], t["norm_type"], tp_group, dp_group)
        if torch.is_tensor(norm) and norm.numel() == 1:
            norm = norm.item()
        sealed.observe(i, {"norm": float(norm) if isinstance(norm, (int, float)) else repr(norm)[:80],
                           "grads": [s["grad"] for s in shards]})
