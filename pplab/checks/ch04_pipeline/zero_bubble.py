"""Check of exercise zero_bubble (exercises/04_zero_bubble.ipynb): A zero-bubble schedule: as short as the pipeline allows, in 1F1B's memory.

    zero_bubble      zero_bubble_order(num_stages, num_microbatches) -> actions per rank,
"""
from __future__ import annotations

import random

from .. import sealed
from ..core import Fail, Scored, allow_type, exercise, require_function
from .schedule_cases import _schedule, _where
from .zero_bubble_rank import _refuse_zero_bubble


ZB_POINTS = 3


def _zb_cases(seed: int) -> list[tuple[int, int]]:
    """(4, 8), then p = 3 to 6 with m >= p (at p = 2 only the bound lies below 1F1B's half bubble)."""
    rng = random.Random(seed)
    p = rng.randint(3, 6)
    return [(4, 8), (3, 3), (5, rng.randint(5, 9)), (p, rng.randint(p, 2 * p + 3))]


@exercise("zero_bubble", "A zero-bubble schedule: as short as the pipeline allows, in 1F1B's memory",
          answer="zero_bubble_order", notebook="04_zero_bubble", sealed=True, points=ZB_POINTS,
          preload=('pplab.pipeline',))
def check_zero_bubble(fn, seed: int, timeout: float):
    """Valid, at most p micro-batches held on every rank (else 0 points); then 1 point for a
    step no longer than 1F1B's 3(m + p - 1), 2 for at most half of 1F1B's bubble, 3 for the
    bound 3m + p - 1, on every (p, m) tried (m >= p): the score is the worst case's."""
    from ...pipeline import Action, simulate
    allow_type(Action)                                   # before the first answer comes back, here too
    require_function(fn, "zero_bubble", "num_stages, num_microbatches", 2, 2)
    cases = _zb_cases(seed)
    outs = sealed.call_each(fn, cases, where=lambda i: _where(*cases[i]), timeout=timeout, probe=_refuse_zero_bubble)
    results = []
    for (p, m), out in zip(cases, outs):
        where = _where(p, m)
        mine = simulate(_schedule(fn, out, p, m, where, kinds="FBIW"), t_f=1.0, t_b=2.0, t_w=1.0)
        for r, peak in enumerate(mine.peak_activations):
            if peak > p:
                raise Fail(f"{where}rank {r} holds {peak:g} micro-batches' activations at its peak, more than the "
                           f"p = {p} that 1F1B's busiest rank holds: start backwards sooner (a micro-batch's "
                           f"activations are held from its F until its W, or its B).")
        one_f_one_b, bound = 3 * (m + p - 1), 3 * m + p - 1
        earned = (3 if mine.makespan <= bound else 2 if mine.makespan - 3 * m <= (p - 1) * 3 / 2
                  else 1 if mine.makespan <= one_f_one_b else 0)
        results.append((earned, p, m, mine.makespan, one_f_one_b, bound))
    earned, p, m, took, one_f_one_b, bound = min(results)
    hint = {3: "", 0: " Slower than 1F1B: some rank waits while an action it could run is ready.",
            1: " A rank's weight gradient W needs nothing from any other rank: split each B into I (which "
               "the previous stage waits for) and W, and put Ws off into the slots where the rank would idle.",
            2: " Closer: which ranks still idle at the end of the step? Each can defer more of its Ws."}[earned]
    return Scored(f"on (p, m) = {', '.join(f'({p}, {m})' for _, p, m, *_ in results)}: valid and within 1F1B's "
                  f"memory; the worst case, p={p}, m={m}: {took:g} time units (t_f = t_i = "
                  f"t_w = 1) against 1F1B's {one_f_one_b} and the bound 3m + p - 1 = {bound}.{hint}", earned)
