"""What chapter 6's checkers of zero1_step, zero_bytes, stage3_unit share.

A rank job only records: what the answer returned, the optimizer sizes, the bytes kept after
forward; the collectives each rank called are the router's record. Every verdict is reached
here, after the ranks return.

"""
from __future__ import annotations

from ..core import _fmt


TOL = 1e-9


def _off(a, b, tol=TOL) -> str:
    """' (off by 2.3e-08, 2.9e-09 allowed)' where the two values print alike, else ''."""
    return f" (off by {abs(a - b):.2g}, {tol + tol * abs(b):.2g} allowed)" if _fmt(a) == _fmt(b) else ""
