"""What runs in the sealed ranks of the pipeline-order and bubble exercises (pipeline.py judges).

Kept apart from the checker: a graded check's rank may import this module and nothing of the
checker (fresh_zygote.py), and, there, pplab.pipeline's schedules are not available at all
(denied.py), so the probe only lets pplab.pipeline.Action come back as plain data."""
from __future__ import annotations

from ..sealed.answers import allow_type


def _actions_come_back(fn) -> None:
    """In the sealed rank, before the answer runs: pplab.pipeline.Action may come back as plain data."""
    from ...pipeline import Action
    allow_type(Action)
