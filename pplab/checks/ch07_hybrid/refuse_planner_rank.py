"""The probe pick_layout and design_layout run in their sealed rank: the answer may not ask
pplab.planner for the layouts' times and memory."""
from __future__ import annotations

from ..sealed.forbidden import refuse_library


def _refuse_planner(fn) -> None:
    """In the sealed rank: Forbidden if the answer asks pplab.planner for the times and memory."""
    from ... import planner
    refuse_library(fn, "pick_layout", "the layouts' times and memory",
                   {"plan": planner.plan, "predict": planner.predict}, "pplab.planner")
