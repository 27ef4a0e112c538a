"""The probe fp8_blocks.py runs in its exercise's sealed rank (the answer is called by call_each).

Kept apart from the checker, which holds the reference: a graded check's rank may import this
module and nothing of the checker (fresh_zygote.py), and there pplab.fp8 is not available (denied.py)."""
from __future__ import annotations

import importlib

from ..sealed.forbidden import refuse_library
from ..sealed.library_view import unavailable


def _refuse_fp8(fn) -> None:
    """In the sealed rank: Forbidden if the answer calls pplab.fp8's own tile quantiser."""
    fp8 = importlib.import_module("pplab.fp8")
    if unavailable(fp8):                                    # a graded check: the answer cannot reach it
        return
    refuse_library(fn, "fp8_blocks", "quantisation in tiles",
                   {"quantise_tiles": fp8.quantise_tiles, "dequantise_tiles": fp8.dequantise_tiles,
                    "tile_amax": fp8.tile_amax, "fake_quantise": fp8.fake_quantise}, "pplab.fp8")
