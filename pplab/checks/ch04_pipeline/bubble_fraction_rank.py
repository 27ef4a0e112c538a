"""What exercise bubble_fraction's checker (bubble_fraction.py) runs in its sealed ranks.

In a graded check pplab.pipeline's schedules are not available at all (denied.py), so the probe only
lets pplab.pipeline.Action come back as plain data."""
from __future__ import annotations

from .. import sealed
from ..sealed.forbidden import refuse_library
from ..sealed.library_view import unavailable


def _bubble_rank(fn, calls):
    """In the sealed rank: rebuild each trace as a pplab.trace.Timeline, call the answer on it."""
    from ...trace import Event, Timeline
    for i, (events, p) in enumerate(calls):
        sealed.begin(i)
        timeline = Timeline([Event(r, k, c, s, e, label, value=v) for r, k, c, s, e, label, v in events],
                            world_size=p, t0=0.0)
        sealed.observe(i, fn(timeline))


def _refuse_bubble_fraction(fn) -> None:
    """In the sealed rank: Forbidden if the answer asks the library for the busy or idle time. The
    Timeline's own measures stay within reach even when graded (the answer is handed a Timeline),
    so they are refused here by identity; pplab.pipeline.simulate is denied outright (denied.py)."""
    import importlib
    from ...trace import Timeline, union_length
    refused = {"busy": Timeline.busy, "bubble": Timeline.bubble, "utilization": Timeline.utilization,
               "union_length": union_length}
    simulate = importlib.import_module("pplab.pipeline.simulate")
    if not unavailable(simulate):
        refused["bubble_fraction"] = simulate.bubble_fraction
    refuse_library(fn, "bubble_fraction", "the bubble", refused,
                   "pplab's own measure (Timeline.busy, bubble or utilization, or bubble_fraction)")
