"""Check of exercise gpipe_order (exercises/04_gpipe_order.ipynb): GPipe as data: one stage per rank, then looped over v chunks.

    gpipe_order      gpipe_order(num_ranks, num_microbatches, chunks) -> a Schedule (or actions per
"""
from __future__ import annotations

import random
import re

from .. import sealed
from ..core import Fail, Forbidden, Parts, allow_type, exercise, require_function
from .gpipe_order_rank import _gpipe_rank, _refuse_gpipe
from .schedule_cases import T_B, T_F, _cases, _where


GPIPE_PARTS = ("GPipe", "looped GPipe")


def _looped_gpipe(p: int, m: int, v: int):
    """The reference: actions per rank of looped GPipe (GPipe itself when v = 1)."""
    from ...pipeline import Action
    return [[Action("F", i, c * p + r, c) for c in range(v) for i in range(m)]
            + [Action("B", i, c * p + r, c) for c in reversed(range(v)) for i in range(m)] for r in range(p)]


def _gpipe_cases(seed: int) -> list[tuple[int, int, int]]:
    """(p, m, v): the four (p, m) of _cases with v = 1, then m a multiple of p, m > p not a
    multiple (v = 3), and 2 <= m < p, with chunks."""
    rng = random.Random(seed + 1)
    p = [rng.randint(3, 4), rng.randint(2, 4)]
    return [(q, m, 1) for q, m in _cases(seed)] + \
        [(p[0], p[0] * rng.randint(1, 2), 2), (p[1], p[1] + rng.randint(1, p[1] - 1) if p[1] > 2 else 3, 3),
         (4, rng.randint(2, 3), 2)]


def _chunked_action(a, rank: int, p: int, where: str):
    """An Action from what a rank's list holds: an Action, (kind, i), (kind, i, chunk), "F3" or "F3.1"."""
    from ...pipeline import Action
    if isinstance(a, Action) and a.kind in "FB":
        return a
    if isinstance(a, str) and (found := re.fullmatch(r"([FB])(\d+)(?:\.(\d+))?", a.strip())):
        a = (found[1], int(found[2])) + ((int(found[3]),) if found[3] else ())
    if isinstance(a, (tuple, list)) and len(a) in (2, 3) and a[0] in ("F", "B") and \
            all(isinstance(x, int) and not isinstance(x, bool) for x in a[1:]):
        chunk = a[2] if len(a) == 3 else 0
        return Action(a[0], a[1], chunk * p + rank, chunk)
    raise Fail(f"{where}{a!r} is not an action: write ('F', i) or ('F', i, chunk) for micro-batch i (or "
               f"pplab.pipeline.Action, or return a pplab.pipeline.Schedule).", seed_matters=False)


def _gpipe_schedule(fn, out, p: int, m: int, v: int, where: str):
    """The answer's schedule, validated: a Schedule (as _gpipe_rank sends it) or one list per rank."""
    from ...pipeline import Action, Schedule, ScheduleError, validate
    if isinstance(out, dict):
        said = (out.get("num_ranks"), out.get("num_microbatches"), out.get("chunks"))
        if said != (p, m, v):
            raise Fail(f"{where}your Schedule says num_ranks={said[0]}, num_microbatches={said[1]}, chunks="
                       f"{said[2]}; it was asked for {p}, {m}, {v}.")
        placement = out.get("stage_to_rank")
        acts = [[Action(*a) if isinstance(a, tuple) and len(a) == 4 else _chunked_action(a, r, p, where)
                 for a in row] for r, row in enumerate(out.get("actions") or [])]
    elif isinstance(out, (list, tuple)) and len(out) == p and all(isinstance(r, (list, tuple)) for r in out):
        placement = [s % p for s in range(p * v)]
        acts = [[_chunked_action(a, r, p, f"{where}rank {r}, step {k}: ") for k, a in enumerate(row)]
                for r, row in enumerate(out)]
    else:
        got = f"{len(out)} items" if isinstance(out, (list, tuple)) else type(out).__name__
        raise Fail(f"{where}{fn.__name__} must return a pplab.pipeline.Schedule, or one list of actions per rank "
                   f"({p} lists, rank r's at index r); got {got}.")
    try:
        return validate(Schedule(fn.__name__, p, m, v, acts, placement))
    except ScheduleError as err:
        raise Fail(f"{where}this schedule cannot run as a training step. {err}") from None


def _judge_gpipe(schedule, p: int, m: int, v: int) -> str | None:
    """What is wrong with a valid schedule as (looped) GPipe, or None."""
    from ...pipeline import Schedule, simulate
    chunked = v > 1
    for r, acts in enumerate(schedule.actions):
        first_b = next((k for k, a in enumerate(acts) if a.kind == "B"), len(acts))
        late_f = next((a for a in acts[first_b:] if a.kind == "F"), None)
        if late_f is not None:
            return (f"rank {r} runs {acts[first_b].label(chunked)} before {late_f.label(chunked)}: GPipe runs every "
                    f"forward of the step before any backward, which is why each rank holds all m = {m} "
                    f"micro-batches' activations at its peak (that is 1F1B's order, next exercise).")
    mine = simulate(schedule, t_f=T_F, t_b=T_B)
    ref = simulate(Schedule("looped GPipe", p, m, v, _looped_gpipe(p, m, v), [s % p for s in range(p * v)]),
                   t_f=T_F, t_b=T_B)
    if mine.makespan <= ref.makespan * (1 + 1e-9):
        return None
    formula = "(m + p - 1)(t_f + t_b)" if v == 1 else "(v·m + p - 1 + (v-1)·max(0, p-m))·(t_f + t_b)/v"
    said = (f"your schedule takes {mine.makespan:g} time units (t_f = 1, t_b = 2, a chunk 1/v of them), "
            f"{'GPipe' if v == 1 else 'looped GPipe'} takes {formula} = {ref.makespan:g}.")
    if chunked and list(schedule.stage_to_rank) == [s // v for s in range(p * v)]:
        return (f"{said} Rank 0 holds stages 0 to {v - 1}, one after another: a micro-batch goes through all of "
                f"them before rank 1 gets anything, so nothing overlaps more than with one stage per rank. Deal "
                f"the stages round-robin: stage = chunk·p + rank.")
    firsts = [a for a in schedule.actions[0] if a.kind == "F"][:2]
    if chunked and len(firsts) == 2 and firsts[1].chunk != firsts[0].chunk:
        return (f"{said} Rank 0 sends micro-batch {firsts[0].microbatch} through its next chunk before the other "
                f"micro-batches have gone through its first; that chunk waits for the micro-batch to come back "
                f"round all p ranks. Breadth first: all m micro-batches through chunk 0, then all through chunk 1.")
    r = max(range(p), key=lambda r: mine.bubble[r] - ref.bubble[r])
    return (f"{said} Rank {r} sits idle for {mine.bubble[r]:g} of them (the reference: {ref.bubble[r]:g}): "
            f"somewhere a rank waits for an input that is not there yet, when another action it could run would "
            f"be ready.")


@exercise("gpipe_order", "GPipe as data: one stage per rank, then looped over v chunks", answer="gpipe_order",
          notebook="04_gpipe_order", sealed=True, points=len(GPIPE_PARTS),
          preload=('pplab.pipeline',))
def check_gpipe_order(fn, seed: int, timeout: float) -> str:
    """gpipe_order(num_ranks, num_microbatches, chunks) -> a Schedule (or one list of actions per
    rank): every rank runs all its forwards, chunk by chunk, then all its backwards, chunks in
    reverse; valid, and as short as looped GPipe (GPipe when chunks = 1)."""
    require_function(fn, "gpipe_order", "num_ranks, num_microbatches, chunks", 2, 2, 1)
    from ...pipeline import Action
    allow_type(Action)                                   # before the first answer comes back
    cases = _gpipe_cases(seed)

    def where(i):
        p, m, v = cases[i]
        return f"{_where(p, m)[:-2]}{f', v={v} chunks per rank' if v > 1 else ''}: "
    parts, judged = Parts(GPIPE_PARTS), 0
    try:
        for i, out in enumerate(sealed.call_each(fn, cases, where=where, timeout=timeout, probe=_refuse_gpipe,
                                                 job=_gpipe_rank)):
            p, m, v = cases[i]
            try:
                problem = _judge_gpipe(_gpipe_schedule(fn, out, p, m, v, where(i)), p, m, v)
            except Fail as failure:
                if not failure.seed_matters:
                    raise
                problem = str(failure)[len(where(i)):]
            parts.note(GPIPE_PARTS[v > 1], problem, where(i)[:-2])
            judged += 1
    except Fail as failure:                  # the answer raised or hung on case `judged`
        if isinstance(failure, Forbidden) or (not failure.seed_matters and judged == 0):
            raise                            # a refused call, or nothing written yet: no part earned
        for p, m, v in cases[judged:]:       # that case's part, and any part never reached, is not earned
            parts.note(GPIPE_PARTS[v > 1], str(failure).rstrip(".") + ".")
    return parts.finish(f"on {len(cases)} seeded (p, m, v): {', '.join(f'({p}, {m}, {v})' for p, m, v in cases)}; "
                        f"valid, every forward before any backward, and as short as "
                        f"(v·m + p - 1 + (v-1)·max(0, p-m))·(t_f + t_b)/v")
