"""The probe fp8_blocks.py runs in its exercise's sealed rank (the answer is called by call_each).

Kept apart from the checker, which holds the reference: a graded check's rank may import this
module and nothing of the checker (fresh_zygote.py), and there pplab.fp8 is not available (denied.py)."""
from __future__ import annotations


from ..sealed.forbidden import refuse_module


def _refuse_fp8(fn) -> None:
    """In the sealed rank: Forbidden if the answer calls pplab.fp8's own tile quantiser."""
    refuse_module(fn, "fp8_blocks", "quantisation in tiles", "pplab.fp8",
                  ("quantise_tiles", "dequantise_tiles", "tile_amax", "fake_quantise"))
