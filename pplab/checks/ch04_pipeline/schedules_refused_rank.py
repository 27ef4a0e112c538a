"""The probe of the exercises that build a schedule (gpipe_order, zero_bubble), run in their
sealed ranks: the answer may not ask pplab.pipeline's schedules for it.

In a graded check those schedules are not available at all (denied.py): the probe then only lets
pplab.pipeline.Action come back as plain data."""
from __future__ import annotations

from ..sealed.answers import allow_type
from ..sealed.forbidden import refuse_module


def refuse_schedules(fn, exercise_id: str, what: str, names) -> None:
    """Forbidden if `fn` reaches any of pplab.pipeline.schedules' `names` (what they would build: `what`)."""
    from ...pipeline import Action
    allow_type(Action)
    refuse_module(fn, exercise_id, what, "pplab.pipeline.schedules", names, shown="pplab.pipeline's schedules")
