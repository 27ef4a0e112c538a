"""What exercise gpipe_order's checker (gpipe_order.py) runs in its sealed ranks."""
from __future__ import annotations

from .. import sealed
from ..sealed.answers import allow_type
from .schedules_refused_rank import refuse_schedules


def _refuse_gpipe(fn) -> None:
    """In the sealed rank: Forbidden if the answer asks the library for GPipe."""
    refuse_schedules(fn, "gpipe_order", "GPipe's order", ("make_schedule", "gpipe"))


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
