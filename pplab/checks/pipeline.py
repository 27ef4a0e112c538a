"""Checks of chapter 4's exercises: pipeline schedules as data, and the bubble.

    gpipe_order      gpipe_order(num_ranks, num_microbatches, chunks) -> a Schedule (or actions per
                     rank) of GPipe, looped over the chunks when chunks > 1
    1f1b_order       one_f_one_b_order(num_stages, num_microbatches) -> actions per rank
    bubble_fraction  measure_bubble(timeline) -> the idle time per rank and overall, measured on a
                     trace of one step (not the formula)
    zero_bubble      zero_bubble_order(num_stages, num_microbatches) -> actions per rank,
                     scored on how short its step is (0 to 3 points)

A schedule is a list with one list per rank (stage r lives on rank r) of what that rank
computes, in order: ("F", i) or ("B", i) for micro-batch i, the strings "F3" / "B3", or
pplab.pipeline.Action; gpipe_order may also return a pplab.pipeline.Schedule, and with
chunks takes ("F", i, chunk) / "F3.1" (stage = chunk·p + rank). The checks need no ranks:
they play the schedule out with pplab.pipeline.validate (every F and B once, on the right
rank, no deadlock) and simulate (t_f = 1, t_b = 2) for a few seeded (p, m), m < p and m
not a multiple of p among them, and compare the step's length and each rank's peak
activations with the library's GPipe and 1F1B (looped GPipe: the checker's own, below).
bubble_fraction's answer runs on seeded simulated traces (see its section).
"""
from __future__ import annotations

import math
import random
import re

from . import sealed
from .pipeline_rank import (_actions_come_back, _bubble_rank, _gpipe_rank, _refuse_bubble_fraction, _refuse_gpipe,
                            _refuse_zero_bubble)
from .core import Fail, Forbidden, Parts, Scored, allow_type, exercise, require_function

# pplab.pipeline is imported inside the checks: it loads its executor (torch.fx, sympy),
# which would make every `import pplab.checks` slow and every process it forks bigger.

T_F, T_B = 1.0, 2.0


def _cases(seed: int) -> list[tuple[int, int]]:
    """(p, m): m a multiple of p, m > p not a multiple (p >= 3: a middle rank, and more than one
    micro-batch to drain), m < p - 1, and one more at random."""
    rng = random.Random(seed)
    p = [rng.randint(2, 5), rng.randint(3, 5), rng.randint(2, 5), rng.randint(3, 5)]
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


# ----------------------------------------------------------------------------------
# Exercise "gpipe_order": GPipe as data, one stage per rank and looped over v chunks
#
# Looped GPipe (breadth-first pipeline parallelism, Lamy-Poirier 2023): rank r holds v
# stages dealt round-robin, stage = chunk·p + r. Every rank runs all m forwards through its
# chunk 0, then all m through chunk 1, ..., then the backwards, chunks in reverse. A chunk
# takes 1/v of the time, so the fill and drain shrink v-fold, as interleaved 1F1B's do, while
# every rank still holds all m micro-batches, as GPipe does.

GPIPE_PARTS = ("GPipe", "looped GPipe")


def _looped_gpipe(p: int, m: int, v: int):
    """The reference: actions per rank of looped GPipe (GPipe itself when v = 1)."""
    from ..pipeline import Action
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
    from ..pipeline import Action
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
    from ..pipeline import Action, Schedule, ScheduleError, validate
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
    from ..pipeline import Schedule, simulate
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
    from ..pipeline import Action
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


@exercise("one_f_one_b_order", "1F1B's order of forwards and backwards", answer="one_f_one_b_order",
          notebook="04_one_f_one_b_order", sealed=True,
          preload=('pplab.pipeline',))
def check_one_f_one_b_order(fn, seed: int, timeout: float) -> str:
    """one_f_one_b_order(p, m): rank r runs min(p-1-r, m) forwards, then alternates F and B."""
    require_function(fn, "one_f_one_b_order", "num_stages, num_microbatches", 2, 2)
    return _compare(fn, seed, timeout, "1f1b", "1F1B", lambda p, m, r: min(p - r, m),
                    "rank {r} runs min(p - 1 - r, m) = {w} forwards ahead (the warm-up), then one forward, one "
                    "backward, one forward, ..., so it never holds more than min(p - r, m)")


# ----------------------------------------------------------------------------------
# Exercise "bubble_fraction": the bubble measured on a trace, not the formula
#
# The answer gets a pplab.trace.Timeline of one flushed training step and returns where and how
# long each rank sat idle. The traces are simulated here (pplab.pipeline.simulate) with
# seeded schedules, stage times and latency, then dressed as a measured run would be: times
# in seconds from a clock that did not start at the step, a "recv" comm event over every
# wait for another rank's message, and memory events. Sent to the rank as plain tuples and
# rebuilt there as a Timeline (_bubble_rank).

BUBBLE_PARTS = ("per rank", "overall", "fill and drain")
BUBBLE_TOL = 1e-6


def _bubble_traces(seed: int) -> list[dict]:
    """Five seeded traces: GPipe with even stages (the formula holds), then 1F1B, interleaved
    1F1B and ZB-H1 with uneven stages, one of them with latency between ranks (it does not)."""
    from ..pipeline import bubble_fraction, make_schedule, simulate
    rng = random.Random(seed)
    unit = rng.choice([1e-3, 2e-3, 5e-3])                            # seconds per t_f

    def uneven(stages):                                              # never all alike
        times = [unit * rng.choice([0.5, 1.0, 1.5, 2.0]) for _ in range(stages)]
        times[rng.randrange(stages)] = unit * 3.0
        return times
    p = [rng.randint(2, 4), rng.randint(3, 5), rng.randint(2, 3), rng.randint(3, 4), rng.randint(3, 5)]
    plans = [("gpipe", p[0], rng.randint(1, 8), None, unit, 0.0),
             ("1f1b", p[1], rng.randint(p[1], 9), None, "uneven", 0.0),
             ("interleaved-1f1b", p[2], p[2] * rng.randint(1, 3), 2, "uneven", 0.0),
             ("zb-h1", p[3], rng.randint(p[3], 8), None, "uneven", 0.0),
             ("1f1b", p[4], rng.randint(2, 8), None, unit, unit * rng.uniform(0.1, 0.5))]
    traces = []
    for name, p_, m, v, t_f, latency in plans:
        schedule = make_schedule(name, p_, m, v)
        t_f = uneven(schedule.num_stages) if t_f == "uneven" else t_f
        t_b = [2 * t for t in t_f] if isinstance(t_f, list) else 2 * t_f
        run = simulate(schedule, t_f=t_f, t_b=t_b, p2p_latency=latency)
        offset, events = rng.uniform(1.0, 100.0), []
        for r, acts in enumerate(schedule.actions):
            free = 0.0
            for a, s, e in zip(acts, run.start[r], run.end[r]):
                if s > free + 1e-12:                                 # waited for a message: a blocking recv
                    events.append((r, "recv", "comm", offset + free, offset + s, "recv", None))
                events.append((r, a.kind, "compute", offset + s, offset + e, a.label(v is not None), None))
                free = e
            events += [(r, "memory", "memory", offset + t, offset + t, a.label(), held)
                       for t, held, a in run.activations(r)]
        rng.shuffle(events)
        traces.append({"name": name, "p": p_, "m": m, "v": v or 1, "latency": latency, "events": events,
                       "formula": bubble_fraction(p_, m, v or 1)})
    return traces


def _bubble_truth(trace) -> dict:
    """What the answer should find, and what the common slips would find instead."""
    p, events = trace["p"], trace["events"]
    compute = [e for e in events if e[2] == "compute"]
    begin, end = min(e[3] for e in compute), max(e[4] for e in compute)
    step = end - begin
    busy = [sum(e[4] - e[3] for e in compute if e[0] == r) for r in range(p)]
    waits = [sum(e[4] - e[3] for e in events if e[0] == r and e[2] == "comm") for r in range(p)]
    first = [min(e[3] for e in compute if e[0] == r) for r in range(p)]
    last = [max(e[4] for e in compute if e[0] == r) for r in range(p)]
    fb = [sum(e[4] - e[3] for e in compute if e[0] == r and e[1] in "FB") for r in range(p)]
    idle = [step - b for b in busy]
    per = [i / b for i, b in zip(idle, busy)]
    return {
        "per": per, "overall": sum(idle) / sum(busy),
        "where": [(first[r] - begin, idle[r] - (first[r] - begin) - (end - last[r]), end - last[r]) for r in range(p)],
        "per mistakes": [
            ([trace["formula"]] * p, f"the formula (p-1)/(v·m) = {trace['formula']:.4g} on every rank, not what the "
                                     f"trace says: measure it from the compute events"),
            ([(last[r] - first[r] - busy[r]) / busy[r] for r in range(p)],
             "each rank's idle time between its own first and last action only: the step runs from the first "
             "compute event of any rank to the last, and a rank waiting for the pipeline to fill or drain is idle"),
            ([(step - busy[r] - waits[r]) / (busy[r] + waits[r]) for r in range(p)],
             "the recv events counted as busy: a rank blocked in a receive computes nothing (count category "
             "'compute' only)"),
            ([(end - busy[r]) / busy[r] for r in range(p)],
             "a step that starts at time 0: this trace's clock did not start at the step; it starts at the first "
             "compute event"),
            ([i / step for i in idle], "idle / total time; the bubble fraction here is idle / useful (busy) time"),
            ([(step - fb[r]) / fb[r] for r in range(p)],
             "only F and B counted as compute: a zero-bubble schedule's I and W are compute too"),
        ],
        "overall mistakes": [
            (sum(per) / p, "the mean of the ranks' fractions: ranks with more work weigh more; take the total idle "
                           "time over the total busy time"),
            (sum(idle) / (p * step), "idle / total time; the bubble fraction here is idle / useful (busy) time"),
            (per[0], "rank 0's fraction alone: add up every rank"),
        ],
    }


def _describe_trace(trace) -> str:
    v = f", v={trace['v']}" if trace["v"] > 1 else ""
    late = f", {trace['latency'] * 1e3:.2g} ms between ranks" if trace["latency"] else ""
    return f"{trace['name']} trace, p={trace['p']}, m={trace['m']}{v}{late}"


def _same(got, want) -> bool:
    return isinstance(got, (int, float)) and not isinstance(got, bool) and \
        math.isclose(got, want, rel_tol=BUBBLE_TOL, abs_tol=BUBBLE_TOL * 1e-3)


def _judge_bubble(got, trace, parts: Parts, name: str) -> None:
    where, truth, p = _describe_trace(trace), _bubble_truth(trace), trace["p"]
    if not isinstance(got, dict) or not {"per_rank", "overall", "idle"} <= set(got):
        raise Fail(f"{name} must return a dict with 'per_rank', 'overall' and 'idle'; got {got!r:.200}.",
                   seed_matters=False)
    per, overall, idle = got["per_rank"], got["overall"], got["idle"]
    if not isinstance(per, (list, tuple)) or len(per) != p:
        parts.note("per rank", f"'per_rank' should hold one fraction per rank, {p} of them (rank 0 first), "
                               f"got {per!r:.120}.", where)
    elif not all(_same(g, w) for g, w in zip(per, truth["per"])):
        r = next(r for r, (g, w) in enumerate(zip(per, truth["per"])) if not _same(g, w))
        hint = next((why for values, why in truth["per mistakes"]
                     if all(_same(g, w) for g, w in zip(per, values))), "idle time / busy time within the step")
        parts.note("per rank", f"rank {r}'s bubble fraction is {per[r]!r:.8}, the trace says {truth['per'][r]:.6g}. "
                               f"That is {hint}.", where)
    if not _same(overall, truth["overall"]):
        hint = next((why for value, why in truth["overall mistakes"] if _same(overall, value)),
                    "the total idle time over the total busy time, every rank counted")
        parts.note("overall", f"the overall bubble fraction is {overall!r:.8}, the trace says "
                              f"{truth['overall']:.6g}. That is {hint}.", where)
    if not isinstance(idle, (list, tuple)) or len(idle) != p or \
            not all(isinstance(x, (list, tuple)) and len(x) == 3 for x in idle):
        parts.note("fill and drain", f"'idle' should hold (before, between, after) in seconds for each of the "
                                     f"{p} ranks, got {idle!r:.120}.", where)
        return
    names = ("before its first action (the fill)", "between its actions", "after its last action (the drain)")
    for r, (g, w) in enumerate(zip(idle, truth["where"])):
        for k in range(3):
            right = isinstance(g[k], (int, float)) and not isinstance(g[k], bool) and \
                math.isclose(g[k], w[k], rel_tol=BUBBLE_TOL, abs_tol=1e-9)
            if not right:
                parts.note("fill and drain", f"rank {r} idles {g[k]!r:.8} s {names[k]}, the trace says "
                                             f"{w[k]:.6g} s.", where)
                return


@exercise("bubble_fraction", "Measure the bubble of a pipeline step from its trace", answer="measure_bubble",
          notebook="04_bubble_fraction", sealed=True, points=len(BUBBLE_PARTS),
          preload=('pplab.pipeline',))
def check_bubble_fraction(fn, seed: int, timeout: float) -> str:
    """measure_bubble(timeline) -> {"per_rank": [idle / busy of each rank], "overall": total idle /
    total busy, "idle": [(before, between, after) seconds of each rank]}, within the step from the
    first compute event to the last, on seeded simulated traces dressed as measured ones."""
    require_function(fn, "bubble_fraction", "timeline", None)
    traces = _bubble_traces(seed)
    outs = sealed.call_each(fn, [(t["events"], t["p"]) for t in traces], where=lambda i: _describe_trace(traces[i]) + ": ",
                            timeout=timeout, probe=_refuse_bubble_fraction, job=_bubble_rank)
    parts = Parts(BUBBLE_PARTS)
    for trace, got in zip(traces, outs):
        _judge_bubble(got, trace, parts, fn.__name__)
    formula = next(t for t in traces if t["name"] == "gpipe")
    return parts.finish(f"on {len(traces)} seeded traces ({', '.join(_describe_trace(t) for t in traces)}); "
                        f"on the even GPipe one it agrees with (p-1)/m = {formula['formula']:.4g}, on the uneven "
                        f"ones the formula is off and the check wants the trace's numbers (relative 1e-6)")


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


@exercise("zero_bubble", "A zero-bubble schedule: as short as the pipeline allows, in 1F1B's memory",
          answer="zero_bubble_order", notebook="04_zero_bubble", sealed=True, points=ZB_POINTS,
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
