"""Check of exercise bubble_fraction (exercises/04_bubble_fraction.ipynb): Measure the bubble of a pipeline step from its trace.

    bubble_fraction  measure_bubble(timeline) -> the idle time per rank and overall, measured on a
"""
from __future__ import annotations

import math
import random

from .. import sealed
from ..core import Fail, Parts, exercise, require_function
from .bubble_fraction_rank import _bubble_rank, _refuse_bubble_fraction


BUBBLE_PARTS = ("per rank", "overall", "fill and drain")


BUBBLE_TOL = 1e-6


def _bubble_traces(seed: int) -> list[dict]:
    """Five seeded traces: GPipe with even stages (the formula holds), then 1F1B, interleaved
    1F1B and ZB-H1 with uneven stages, one of them with latency between ranks (it does not)."""
    from ...pipeline import bubble_fraction, make_schedule, simulate
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
