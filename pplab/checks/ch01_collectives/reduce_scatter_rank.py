"""What exercise reduce_scatter's checker (reduce_scatter.py) runs in its sealed ranks."""
from __future__ import annotations

import torch
import torch.distributed as dist

from .. import sealed
from ..ch00_start_here.broadcast_rank import _returned_copy


def _reduce_scatter_rank(fn, inputs):
    """Run on every (sealed) rank: call the student's fn on each trial, record output and input."""
    p = dist.get_world_size()
    for i, input in enumerate(inputs):
        sealed.begin(i)
        output = torch.full((input.numel() // p,), -7777, dtype=input.dtype)
        returned = fn(output, input)
        sealed.observe(i, {"output": output, "input": input, "returned": _returned_copy(returned, output)})
