"""The probe of the exercises that build a schedule (gpipe_order, zero_bubble), run in their
sealed ranks: the answer may not ask pplab.pipeline's schedules for it.

In a graded check those schedules are not available at all (denied.py): the probe then only lets
pplab.pipeline.Action come back as plain data."""
from __future__ import annotations

from ..sealed.answers import allow_type
from ..sealed.forbidden import refuse_library
from ..sealed.library_view import unavailable


def refuse_schedules(fn, exercise_id: str, what: str, names) -> None:
    """Forbidden if `fn` reaches any of pplab.pipeline.schedules' `names` (what they would build: `what`)."""
    import importlib
    from ...pipeline import Action
    allow_type(Action)
    schedules = importlib.import_module("pplab.pipeline.schedules")
    if unavailable(schedules):                              # a graded check: the answer cannot reach them
        return
    refuse_library(fn, exercise_id, what, {name: getattr(schedules, name) for name in names},
                   "pplab.pipeline's schedules")
