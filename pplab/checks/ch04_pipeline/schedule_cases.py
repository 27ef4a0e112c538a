"""What chapter 4's checkers of gpipe_order, one_f_one_b_order, bubble_fraction, zero_bubble share.

A schedule is a list with one list per rank (stage r lives on rank r) of what that rank
computes, in order: ("F", i) or ("B", i) for micro-batch i, the strings "F3" / "B3", or
pplab.pipeline.Action; gpipe_order may also return a pplab.pipeline.Schedule, and with
chunks takes ("F", i, chunk) / "F3.1" (stage = chunk·p + rank). The checks need no ranks:
they play the schedule out with pplab.pipeline.validate (every F and B once, on the right
rank, no deadlock) and simulate (t_f = 1, t_b = 2) for a few seeded (p, m), m < p and m
not a multiple of p among them, and compare the step's length and each rank's peak
activations with the library's GPipe and 1F1B (looped GPipe: gpipe_order.py's own).
bubble_fraction's answer runs on seeded simulated traces (bubble_fraction.py).

"""
from __future__ import annotations

import random
import re

from ..core import Fail, allow_type


T_F, T_B = 1.0, 2.0


def _cases(seed: int) -> list[tuple[int, int]]:
    """(p, m): m a multiple of p, m > p not a multiple (p >= 3: a middle rank, and more than one
    micro-batch to drain), m < p - 1, and one more at random."""
    rng = random.Random(seed)
    p = [rng.randint(2, 5), rng.randint(3, 5), rng.randint(2, 5), rng.randint(3, 5)]
    return [(p[0], p[0] * rng.randint(1, 3)), (p[1], p[1] * rng.randint(1, 2) + rng.randint(1, p[1] - 1)),
            (p[3], rng.randint(1, p[3] - 2)), (p[2], rng.randint(1, 10))]


def _action(a, rank: int, where: str, kinds: str = "FB"):
    from ...pipeline import Action
    if isinstance(a, Action) and a.kind in kinds:
        return a
    if isinstance(a, str) and (found := re.fullmatch(rf"([{kinds}])(\d+)", a.strip())):
        return Action(found[1], int(found[2]), rank)
    if isinstance(a, (tuple, list)) and len(a) == 2 and a[0] in kinds and isinstance(a[1], int) \
            and not isinstance(a[1], bool):
        return Action(a[0], a[1], rank)
    named = " or ".join(f"('{k}', i)" for k in kinds)
    raise Fail(f"{where}{a!r} is not an action: write {named} for micro-batch i (or the string "
               f"'{kinds[0]}3', or pplab.pipeline.Action).", seed_matters=False)


def _schedule(fn, out, p: int, m: int, where: str, kinds: str = "FB"):
    """Check what the student's generator returned with pplab.pipeline.validate."""
    from ...pipeline import Action, Schedule, ScheduleError, validate
    allow_type(Action)                                   # comes back from the sealed rank
    if not isinstance(out, (list, tuple)) or len(out) != p or not all(isinstance(r, (list, tuple)) for r in out):
        got = f"{len(out)} items" if isinstance(out, (list, tuple)) else type(out).__name__
        raise Fail(f"{where}{fn.__name__} must return one list of actions per rank ({p} lists, rank r's list at "
                   f"index r), got {got}.")
    actions = [[_action(a, r, f"{where}rank {r}, step {k}: ", kinds) for k, a in enumerate(acts)]
               for r, acts in enumerate(out)]
    schedule = Schedule(fn.__name__, p, m, 1, actions, list(range(p)))
    try:
        return validate(schedule)
    except ScheduleError as err:
        raise Fail(f"{where}this schedule cannot run as a training step. {err}") from None


def _where(p, m) -> str:
    return f"p={p} stages, m={m} micro-batch{'es' if m > 1 else ''}: "
