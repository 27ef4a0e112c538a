"""The process groups the tensor-parallel jobs of chapter 3 build in a sealed rank."""
from __future__ import annotations

import torch.distributed as dist


def _groups(members):
    """Every rank creates every sub-group (torch requires it); returns this rank's (group, ranks)."""
    if members is None:
        return None, list(range(dist.get_world_size()))
    groups = [dist.new_group(m) for m in members]
    return next((g, m) for g, m in zip(groups, members) if dist.get_rank() in m)
