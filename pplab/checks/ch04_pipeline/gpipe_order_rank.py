"""What runs in the sealed ranks of the pipeline-order and bubble exercises (pipeline.py judges).

Kept apart from the checker: a graded check's rank may import this module and nothing of the
checker (fresh_zygote.py), and, there, pplab.pipeline's schedules are not available at all
(denied.py), so the probe only lets pplab.pipeline.Action come back as plain data."""
from __future__ import annotations

from .. import sealed
from ..sealed.answers import allow_type
from ..sealed.forbidden import refuse_library
from ..sealed.library_view import unavailable


def _refuse_gpipe(fn) -> None:
    """In the sealed rank: Forbidden if the answer asks the library for GPipe."""
    import importlib
    from ...pipeline import Action
    allow_type(Action)
    schedules = importlib.import_module("pplab.pipeline.schedules")
    if unavailable(schedules):                              # a graded check: the answer cannot reach them
        return
    refuse_library(fn, "gpipe_order", "GPipe's order", {"make_schedule": schedules.make_schedule,
                                                        "gpipe": schedules.gpipe}, "pplab.pipeline's schedules")


def _gpipe_rank(fn, calls):
    """In the sealed rank: call the answer; a Schedule it returns comes back as plain data."""
    from ...pipeline import Action, Schedule
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
