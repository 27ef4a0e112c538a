"""What exercise online_softmax_merge's checker (online_softmax_merge.py) runs in its sealed ranks."""
from __future__ import annotations

import torch

from .. import sealed
from ..sealed.forbidden import refuse_library


def _blockwise_rank(fn, calls):
    """In the sealed rank: each call under pplab.memory.PeakMemory (the most bytes its tensors held at once)."""
    from ...memory import PeakMemory
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
