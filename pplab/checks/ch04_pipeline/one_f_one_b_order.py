"""Check of exercise one_f_one_b_order (exercises/04_one_f_one_b_order.ipynb): 1F1B's order of forwards and backwards.
"""
from __future__ import annotations

import math

from .. import sealed
from ..core import Fail, allow_type, exercise, require_function
from .one_f_one_b_order_rank import _actions_come_back
from .schedule_cases import T_B, T_F, _cases, _schedule, _where


def _compare(fn, seed: int, timeout: float, library: str, shown: str, peak_limit, peak_rule: str) -> str:
    from ...pipeline import Action, make_schedule, simulate
    allow_type(Action)                                   # before the first answer comes back, here too
    cases = _cases(seed)
    outs = sealed.call_each(fn, cases, where=lambda i: _where(*cases[i]), timeout=timeout, probe=_actions_come_back)
    for (p, m), out in zip(cases, outs):
        where = _where(p, m)
        mine = simulate(_schedule(fn, out, p, m, where), t_f=T_F, t_b=T_B)
        ref = simulate(make_schedule(library, p, m), t_f=T_F, t_b=T_B)
        peaks = [(r, peak, peak_limit(p, m, r)) for r, peak in enumerate(mine.peak_activations)]

        def wrong_peak(r, peak, limit):
            raise Fail(f"{where}rank {r} holds {peak:g} micro-batches' activations at its peak, "
                       f"{'more' if peak > limit else 'fewer'} than {shown}'s {limit:g}: "
                       f"{peak_rule.format(p=p, m=m, r=r, w=min(p - 1 - r, m))}.")
        for r, peak, limit in peaks:                     # too much memory first: that is 1F1B's point
            if peak > limit:
                wrong_peak(r, peak, limit)
        if not math.isclose(mine.makespan, ref.makespan):
            r = max(range(p), key=lambda r: mine.bubble[r] - ref.bubble[r])
            raise Fail(f"{where}your schedule takes {mine.makespan:g} time units (t_f = 1, t_b = 2), {shown} "
                       f"takes (m + p - 1)(t_f + t_b) = {ref.makespan:g}. Rank {r} sits idle for "
                       f"{mine.bubble[r]:g} of them ({shown}: {ref.bubble[r]:g}): somewhere a rank waits for an "
                       f"input that is not there yet, when another action it could run would be ready.")
        for r, peak, limit in peaks:
            if peak != limit:
                wrong_peak(r, peak, limit)
    return (f"on {len(cases)} seeded (p, m): {', '.join(f'({p}, {m})' for p, m in cases)}; valid (every F and B "
            f"once, no deadlock), {shown}'s step length and peak activations on every rank")


@exercise("one_f_one_b_order", "1F1B's order of forwards and backwards", answer="one_f_one_b_order",
          notebook="04_one_f_one_b_order", sealed=True,
          preload=('pplab.pipeline',))
def check_one_f_one_b_order(fn, seed: int, timeout: float) -> str:
    """one_f_one_b_order(p, m): rank r runs min(p-1-r, m) forwards, then alternates F and B."""
    require_function(fn, "one_f_one_b_order", "num_stages, num_microbatches", 2, 2)
    return _compare(fn, seed, timeout, "1f1b", "1F1B", lambda p, m, r: min(p - r, m),
                    "rank {r} runs min(p - 1 - r, m) = {w} forwards ahead (the warm-up), then one forward, one "
                    "backward, one forward, ..., so it never holds more than min(p - r, m)")
