"""The probe that node_limited_routing.py runs in its exercise's sealed rank.

Kept apart from the checker, which holds the reference: a graded check's ranks may import
this module and nothing of the checker (fresh_zygote.py), and there the library module the
exercise asks the student to write is not available at all (denied.py)."""
from __future__ import annotations

from ..sealed.forbidden import refuse_library


def _refuse_experts_at_scale(fn) -> None:
    """In the sealed rank: Forbidden if the answer asks pplab.experts_at_scale for the routing."""
    from ... import experts_at_scale
    refuse_library(fn, "node_limited_routing", "the routing", {"node_limited_topk": experts_at_scale.node_limited_topk},
                   "pplab.experts_at_scale")
