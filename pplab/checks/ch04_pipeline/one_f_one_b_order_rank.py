"""What exercise one_f_one_b_order's checker (one_f_one_b_order.py) runs in its sealed ranks.

In a graded check pplab.pipeline's schedules are not available at all (denied.py), so the probe only
lets pplab.pipeline.Action come back as plain data."""
from __future__ import annotations

from ..sealed.answers import allow_type


def _actions_come_back(fn) -> None:
    """In the sealed rank, before the answer runs: pplab.pipeline.Action may come back as plain data."""
    from ...pipeline import Action
    allow_type(Action)
