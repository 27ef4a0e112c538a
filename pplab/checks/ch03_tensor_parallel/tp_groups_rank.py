"""The jobs and probes that tp_groups.py runs in its sealed ranks.

Kept apart from the checker, which holds the references: a graded check's ranks may import
this module and nothing of the checker (fresh_zygote.py), and there the library modules the
exercise asks the student to write are not available at all (denied.py)."""
from __future__ import annotations

import torch.distributed as dist


def _groups(members):
    """Every rank creates every sub-group (torch requires it); returns this rank's (group, ranks)."""
    if members is None:
        return None, list(range(dist.get_world_size()))
    groups = [dist.new_group(m) for m in members]
    return next((g, m) for g, m in zip(groups, members) if dist.get_rank() in m)
