"""What runs in the sealed ranks of the pipeline-order and bubble exercises (pipeline.py judges).

Kept apart from the checker: a graded check's rank may import this module and nothing of the
checker (fresh_zygote.py), and, there, pplab.pipeline's schedules are not available at all
(denied.py), so the probe only lets pplab.pipeline.Action come back as plain data."""
from __future__ import annotations

from ..sealed.answers import allow_type
from ..sealed.forbidden import refuse_library
from ..sealed.library_view import unavailable


def _refuse_zero_bubble(fn) -> None:
    """In the sealed rank: Forbidden if the answer calls the library's schedules."""
    import importlib
    from ...pipeline import Action
    allow_type(Action)
    schedules = importlib.import_module("pplab.pipeline.schedules")
    if unavailable(schedules):                              # a graded check: the answer cannot reach them
        return
    make_schedule = schedules.make_schedule
    refuse_library(fn, "zero_bubble", "a zero-bubble schedule",
                   {"make_schedule": make_schedule, "zb_h1": schedules.zb_h1, "zb_v": schedules.zb_v},
                   "pplab.pipeline's schedules")
