"""pplab.data_parallel: the bucket boundary worked out by hand, and DDP on a group without rank 0.

The buckets of test_data_parallel.py never sum to exactly the cap, so `<=` and `<` read the
same there; and its DDPs span every rank, so "rank 0" and "the group's first rank" coincide.
"""
import pytest
import torch
import torch.distributed as dist
from torch import nn

import pplab
from pplab.data_parallel import DDP, reverse_buckets

pytestmark = pytest.mark.usefixtures("no_leftover_processes")


def test_a_bucket_may_fill_the_cap_exactly():
    """float32: a, b 16 bytes each, c 32 bytes; cap 32 bytes. Last parameter first:
    c alone fills the cap; b starts a new bucket, and a (16 + 16 = 32, not over) joins it."""
    a, b, c = torch.zeros(4), torch.zeros(4), torch.zeros(8)
    buckets = reverse_buckets([("a", a), ("b", b), ("c", c)], cap_bytes=32)
    assert [[name for name, _ in bucket] for bucket in buckets] == [["c"], ["b", "a"]]


def _ddp_on_ranks_1_and_2():
    group = dist.new_group([1, 2])                 # every rank creates it; rank 0 is not in it
    torch.manual_seed(dist.get_rank())             # a different start on every rank
    model = nn.Linear(3, 2)
    if dist.get_rank() == 0:
        return [q.detach().clone() for q in model.parameters()]
    DDP(model, group=group)
    return [q.detach().clone() for q in model.parameters()]


def test_ddp_on_a_group_starts_from_the_groups_first_rank():
    """The group's first rank is global rank 1: ranks 1 and 2 end with rank 1's start;
    rank 0, outside the group, keeps its own."""
    out = pplab.launch(_ddp_on_ranks_1_and_2, world_size=3, timeout=60)
    torch.manual_seed(1)
    rank1_start = [q.detach() for q in nn.Linear(3, 2).parameters()]
    for rank in (1, 2):
        assert all(torch.equal(a, b) for a, b in zip(out[rank], rank1_start)), rank
    assert not torch.equal(out[0][0], rank1_start[0])
