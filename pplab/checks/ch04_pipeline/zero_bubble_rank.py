"""What exercise zero_bubble's checker (zero_bubble.py) runs in its sealed ranks."""
from __future__ import annotations

from .schedules_refused_rank import refuse_schedules


def _refuse_zero_bubble(fn) -> None:
    """In the sealed rank: Forbidden if the answer calls the library's schedules."""
    refuse_schedules(fn, "zero_bubble", "a zero-bubble schedule", ("make_schedule", "zb_h1", "zb_v"))
