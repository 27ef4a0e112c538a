"""What exercise quantised_gather's checker (quantised_gather.py) runs in its sealed ranks."""
from __future__ import annotations

import torch

from .. import sealed
from ..sealed.forbidden import refuse_module


def _rank_job(fn, trials):
    """In every sealed rank: the answer gathers into a NaN-filled buffer; record what it wrote."""
    for i, t in enumerate(trials):
        sealed.begin(i)
        output = torch.full((t["p"] * t["input"].numel(),), float("nan"))
        fn(output, t["input"].clone(), t["block"])
        sealed.observe(i, {"output": output})


def _refuse_plusplus(fn) -> None:
    """In the sealed rank: Forbidden if the answer calls pplab.zero.plusplus's own quantiser or gather."""
    refuse_module(fn, "quantised_gather", "the quantised all-gather", "pplab.zero.plusplus",
                  ("quantised_all_gather", "quantize", "dequantize"))
