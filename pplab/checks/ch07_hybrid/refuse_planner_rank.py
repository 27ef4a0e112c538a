"""The jobs and probes that refuse_planner.py runs in its sealed ranks.

Kept apart from the checker, which holds the references: a graded check's ranks may import
this module and nothing of the checker (fresh_zygote.py), and there the library modules the
exercise asks the student to write are not available at all (denied.py)."""
from __future__ import annotations

from ..sealed.forbidden import refuse_library


def _refuse_planner(fn) -> None:
    """In the sealed rank: Forbidden if the answer asks pplab.planner for the times and memory."""
    from ... import planner
    refuse_library(fn, "pick_layout", "the layouts' times and memory",
                   {"plan": planner.plan, "predict": planner.predict}, "pplab.planner")
