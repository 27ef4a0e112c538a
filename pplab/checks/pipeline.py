"""Checks of chapter 4's exercises: pipeline schedules as data, and the bubble.

    gpipe_order      gpipe_order(num_stages, num_microbatches) -> actions per rank
    1f1b_order       one_f_one_b_order(num_stages, num_microbatches) -> actions per rank
    bubble_fraction  bubble_fraction(p, m, v) -> idle time / useful time
    zero_bubble      zero_bubble_order(num_stages, num_microbatches) -> actions per rank,
                     scored on how short its step is (0 to 3 points)

A schedule is a list with one list per rank (stage r lives on rank r) of what that rank
computes, in order: ("F", i) or ("B", i) for micro-batch i, the strings "F3" / "B3", or
pplab.pipeline.Action. The checks need no ranks: they play the schedule out with
pplab.pipeline.validate (every F and B once, on the right rank, no deadlock) and
simulate (t_f = 1, t_b = 2) for a few seeded (p, m), m < p and m not a multiple of p
among them, and compare the step's length and each rank's peak activations with the
library's GPipe and 1F1B.
"""
from __future__ import annotations

import math
import random
import re

from . import sealed
from .core import Fail, Scored, allow_type, check_number, exercise, refuse_library, require_function

# pplab.pipeline is imported inside the checks: it loads its executor (torch.fx, sympy),
# which would make every `import pplab.checks` slow and every process it forks bigger.

T_F, T_B = 1.0, 2.0


def _cases(seed: int) -> list[tuple[int, int]]:
    """(p, m): m a multiple of p, m > p not a multiple, m < p - 1, and one more at random."""
    rng = random.Random(seed)
    p = [rng.randint(2, 5) for _ in range(3)] + [rng.randint(3, 5)]
    return [(p[0], p[0] * rng.randint(1, 3)), (p[1], p[1] * rng.randint(1, 2) + rng.randint(1, p[1] - 1)),
            (p[3], rng.randint(1, p[3] - 2)), (p[2], rng.randint(1, 10))]


def _action(a, rank: int, where: str, kinds: str = "FB"):
    from ..pipeline import Action
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


def _actions_come_back(fn) -> None:
    """In the sealed rank, before the answer runs: pplab.pipeline.Action may come back as plain data."""
    from ..pipeline import Action
    allow_type(Action)


def _schedule(fn, out, p: int, m: int, where: str, kinds: str = "FB"):
    """Check what the student's generator returned with pplab.pipeline.validate."""
    from ..pipeline import Action, Schedule, ScheduleError, validate
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


def _compare(fn, seed: int, timeout: float, library: str, shown: str, peak_limit, peak_rule: str) -> str:
    from ..pipeline import Action, make_schedule, simulate
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


@exercise("gpipe_order", "GPipe's order of forwards and backwards", answer="gpipe_order", notebook="04a_gpipe_order",
          sealed=True,
          preload=('pplab.pipeline',))
def check_gpipe_order(fn, seed: int, timeout: float) -> str:
    """gpipe_order(p, m): every rank runs all m forwards, then all m backwards."""
    require_function(fn, "gpipe_order", "num_stages, num_microbatches", 2, 2)
    return _compare(fn, seed, timeout, "gpipe", "GPipe", lambda p, m, r: m,
                    "GPipe runs all m = {m} forwards before any backward, so every rank holds all of them")


@exercise("1f1b_order", "1F1B's order of forwards and backwards", answer="one_f_one_b_order",
          notebook="04b_1f1b_order", sealed=True,
          preload=('pplab.pipeline',))
def check_1f1b_order(fn, seed: int, timeout: float) -> str:
    """one_f_one_b_order(p, m): rank r runs min(p-1-r, m) forwards, then alternates F and B."""
    require_function(fn, "1f1b_order", "num_stages, num_microbatches", 2, 2)
    return _compare(fn, seed, timeout, "1f1b", "1F1B", lambda p, m, r: min(p - r, m),
                    "rank {r} runs min(p - 1 - r, m) = {w} forwards ahead (the warm-up), then one forward, one "
                    "backward, one forward, ..., so it never holds more than min(p - r, m)")


# ----------------------------------------------------------------------------------
# Exercise "bubble_fraction"

_BUBBLE_MISTAKES = [
    (lambda p, m, v: (p - 1) / m, "(p-1)/m, which leaves out v: with v chunks per rank the fill and the drain "
                                  "take (p-1) chunk-times of 1/v stage-time each"),
    (lambda p, m, v: p / (v * m), "p/(v·m): filling a pipeline of p stages takes p-1 steps, not p"),
    (lambda p, m, v: p / m, "p/m: filling a pipeline of p stages takes p-1 steps, not p, and v chunks shrink it"),
    (lambda p, m, v: (p - 1) * v / m, "(p-1)·v/m: more chunks per rank make the bubble smaller, not bigger"),
    (lambda p, m, v: (p - 1) / (v * m + p - 1), "idle time / total time; the bubble fraction here is idle time / "
                                                 "useful time, (p-1)(t_f+t_b)/v over m(t_f+t_b)"),
]


def _refuse_bubble_fraction(fn) -> None:
    """In the sealed rank: Forbidden if the answer calls the library's bubble_fraction."""
    from ..pipeline import bubble_fraction
    refuse_library(fn, "bubble_fraction", "the bubble fraction", {"bubble_fraction": bubble_fraction},
                   "pplab.pipeline.bubble_fraction")


@exercise("bubble_fraction", "The bubble fraction of a flushed pipeline", answer="bubble_fraction",
          notebook="04c_bubble_fraction", sealed=True,
          preload=('pplab.pipeline',))
def check_bubble_fraction(fn, seed: int, timeout: float) -> str:
    """bubble_fraction(p, m, v) = (p-1)/(v·m), as pplab.pipeline.bubble_fraction (m >= p when v > 1)."""
    from ..pipeline import bubble_fraction as reference
    require_function(fn, "bubble_fraction", "p, m, v", 4, 8, 1)
    rng = random.Random(seed)
    # With chunks (v > 1) the exercise's formula needs m >= p: interleaving with fewer
    # micro-batches than ranks idles more (pplab.pipeline.bubble_fraction, chapter 4).
    cases = [(p, rng.randint(1 if v == 1 else p, 64), v)
             for p, v in ((rng.randint(3, 16), v) for v in (1, 1, 2, 3, 4, rng.randint(2, 8)))]
    outs = sealed.call_each(fn, cases, where=lambda i: "p={}, m={}, v={}: ".format(*cases[i]), timeout=timeout,
                            probe=_refuse_bubble_fraction)
    for (p, m, v), got in zip(cases, outs):
        where, expected = f"p={p}, m={m}, v={v}: ", reference(p, m, v)
        try:
            check_number(got, expected, what=f"{fn.__name__}({p}, {m}, {v})", rel_tol=1e-9, abs_tol=0.0)
        except Fail as failure:
            if not failure.seed_matters:
                raise
            hint = next((why for formula, why in _BUBBLE_MISTAKES
                         if math.isclose(got, formula(p, m, v), rel_tol=1e-9)), None)
            hint = f" That is {hint}." if hint else \
                " The fill and the drain cost (p-1)(t_f+t_b)/v; the work is m(t_f+t_b)."
            raise Fail(f"{where}{failure}{hint}") from None
    return f"on {len(cases)} seeded (p, m, v), v = 1 to 8, m >= p when v > 1 (relative tolerance 1e-9)"


# ----------------------------------------------------------------------------------
# Exercise "zero_bubble": scored on how short the step is, within 1F1B's memory
#
# Times: t_f = t_i = t_w = 1 (a fused B = I + W takes 2). With one stage per rank, the last
# rank cannot start before the first p - 1 forwards have passed, and then has 3m units of
# work: no schedule's step is shorter than 3m + p - 1 (ZB-H1 reaches it when m >= p).

ZB_POINTS = 3


def _zb_cases(seed: int) -> list[tuple[int, int]]:
    """(4, 8), then p = 3 to 6 with m >= p (at p = 2 only the bound lies below 1F1B's half bubble)."""
    rng = random.Random(seed)
    p = rng.randint(3, 6)
    return [(4, 8), (3, 3), (5, rng.randint(5, 9)), (p, rng.randint(p, 2 * p + 3))]


def _refuse_zero_bubble(fn) -> None:
    """In the sealed rank: Forbidden if the answer calls the library's schedules."""
    from ..pipeline import Action, make_schedule, schedules
    allow_type(Action)
    refuse_library(fn, "zero_bubble", "a zero-bubble schedule",
                   {"make_schedule": make_schedule, "zb_h1": schedules.zb_h1, "zb_v": schedules.zb_v},
                   "pplab.pipeline's schedules")


@exercise("zero_bubble", "A zero-bubble schedule: as short as the pipeline allows, in 1F1B's memory",
          answer="zero_bubble_order", notebook="04e_zero_bubble", sealed=True, points=ZB_POINTS,
          preload=('pplab.pipeline',))
def check_zero_bubble(fn, seed: int, timeout: float):
    """Valid, at most p micro-batches held on every rank (else 0 points); then 1 point for a
    step no longer than 1F1B's 3(m + p - 1), 2 for at most half of 1F1B's bubble, 3 for the
    bound 3m + p - 1, on every (p, m) tried (m >= p): the score is the worst case's."""
    from ..pipeline import Action, simulate
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
