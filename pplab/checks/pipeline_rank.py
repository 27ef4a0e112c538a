"""What runs in the sealed ranks of the pipeline-order and bubble exercises (pipeline.py judges).

Kept apart from the checker: a graded check's rank may import this module and nothing of the
checker (fresh_zygote.py), and, there, pplab.pipeline's schedules are not available at all
(denied.py), so the probe only lets pplab.pipeline.Action come back as plain data."""
from __future__ import annotations

from . import sealed
from .sealed.answers import allow_type
from .sealed.forbidden import refuse_library
from .sealed.library_view import unavailable


def _refuse_zero_bubble(fn) -> None:
    """In the sealed rank: Forbidden if the answer calls the library's schedules."""
    import importlib
    from ..pipeline import Action
    allow_type(Action)
    schedules = importlib.import_module("pplab.pipeline.schedules")
    if unavailable(schedules):                              # a graded check: the answer cannot reach them
        return
    make_schedule = schedules.make_schedule
    refuse_library(fn, "zero_bubble", "a zero-bubble schedule",
                   {"make_schedule": make_schedule, "zb_h1": schedules.zb_h1, "zb_v": schedules.zb_v},
                   "pplab.pipeline's schedules")


def _actions_come_back(fn) -> None:
    """In the sealed rank, before the answer runs: pplab.pipeline.Action may come back as plain data."""
    from ..pipeline import Action
    allow_type(Action)


def _refuse_gpipe(fn) -> None:
    """In the sealed rank: Forbidden if the answer asks the library for GPipe."""
    import importlib
    from ..pipeline import Action
    allow_type(Action)
    schedules = importlib.import_module("pplab.pipeline.schedules")
    if unavailable(schedules):                              # a graded check: the answer cannot reach them
        return
    refuse_library(fn, "gpipe_order", "GPipe's order", {"make_schedule": schedules.make_schedule,
                                                        "gpipe": schedules.gpipe}, "pplab.pipeline's schedules")


def _bubble_rank(fn, calls):
    """In the sealed rank: rebuild each trace as a pplab.trace.Timeline, call the answer on it."""
    from ..trace import Event, Timeline
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
    from ..trace import Timeline, _union_length
    refused = {"busy": Timeline.busy, "bubble": Timeline.bubble, "utilization": Timeline.utilization,
               "_union_length": _union_length}
    simulate = importlib.import_module("pplab.pipeline.simulate")
    if not unavailable(simulate):
        refused["bubble_fraction"] = simulate.bubble_fraction
    refuse_library(fn, "bubble_fraction", "the bubble", refused,
                   "pplab's own measure (Timeline.busy, bubble or utilization, or bubble_fraction)")


def _gpipe_rank(fn, calls):
    """In the sealed rank: call the answer; a Schedule it returns comes back as plain data."""
    from ..pipeline import Action, Schedule
    allow_type(Action)
    for i, args in enumerate(calls):
        sealed.begin(i)
        out = fn(*args)
        if isinstance(out, Schedule):
            out = {"num_ranks": out.num_ranks, "num_microbatches": out.num_microbatches, "chunks": out.chunks,
                   "stage_to_rank": list(out.stage_to_rank),
                   "actions": [[(a.kind, a.microbatch, a.stage, a.chunk) if isinstance(a, Action) else a
                                for a in acts] for acts in out.actions]}
        sealed.observe(i, out)
