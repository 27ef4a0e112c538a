"""Time a schedule: when every action starts and ends (`simulate`), and the bubble's formula.

simulate walks the order validation.py found (`run_order`) and times it: an action starts
when its rank is free and everything it needs (dependencies.py) has finished, plus
`p2p_latency` when that came from another rank. In that order whatever an action waits for
has been timed before it, so nothing waits. A schedule that cannot run (a deadlock, a missing
backward) raises validate's error here.

    >>> r = simulate(make_schedule("gpipe", 4, 4), t_f=1, t_b=2)
    >>> r.makespan, r.utilization          # (m + p - 1)(t_f + t_b) = 21, 48 / 84
    (21.0, 0.5714285714285714)
"""
from __future__ import annotations

from dataclasses import dataclass
from numbers import Real
from itertools import accumulate
from operator import attrgetter, sub

from ..trace import Event, Timeline
from .actions import Action, Schedule, ScheduleError, gc_paused
from .dependencies import wiring
from .validation import run_order


def bubble_fraction(p: int, m: int, v: int = 1) -> float:
    """Idle time / useful time of a flushed pipeline: (p-1)/(v*m) when m >= p.

    p stages, m micro-batches, v chunks per rank. The fill and drain cost (p-1)(t_f+t_b)/v
    per rank, against m(t_f+t_b) of work: GPipe and 1F1B have v = 1. Interleaved 1F1B
    with fewer micro-batches than ranks (m < p) pays more: at each of the v-1 turns from
    one chunk to the next, rank 0 has sent all m micro-batches on before the first one
    comes back from rank p-1, and waits p-m chunk-times, forward and backward (see
    schedules.interleaved_1f1b). So, as simulate measures:

        ((p-1) + (v-1) * max(0, p-m)) / (v*m)
    """
    if min(p, m, v) < 1:
        raise ValueError(f"bubble_fraction needs p, m, v >= 1, got p={p}, m={m}, v={v}")
    return ((p - 1) + (v - 1) * max(0, p - m)) / (v * m)




def _play(schedule: Schedule, order, duration: dict, latency=0.0):
    """Times of every action: start[r][k], end[r][k] of schedule.actions[r][k].

    Walks the ranks in the order validation found (`order`), so whatever an action waits for
    has its time already: it starts when its rank is free and its inputs have arrived (plus
    `latency` from another rank: one number, or latency[src][dst] for each hop).
    duration[kind][stage] is how long one such action takes; duration["&"][stage], if given, how
    long an overlapped pair whose F is of that stage takes (else the sum of the two).
    """
    p, S, m = schedule.num_ranks, schedule.num_stages, schedule.num_microbatches
    owner = schedule.stage_to_rank

    def delay(src, dst):          # what an input made on rank src takes to reach rank dst
        return 0.0 if src == dst else latency if isinstance(latency, Real) else latency[src][dst]
    # each input with the delay of its hop to this stage's rank, worked out once per (kind, stage)
    wires = {k: [(tuple((first, delay(src, owner[s])) for first, src in inputs), made)
                 for s, (inputs, made) in enumerate(rows)] for k, rows in wiring(schedule).items()}
    finished = [0.0] * (2 * S * m)                  # finished[result]: when it was made
    pair_time = duration.get("&")
    start = [[0.0] * len(acts) for acts in schedule.actions]
    end = [[0.0] * len(acts) for acts in schedule.actions]
    nxt, free = [0] * p, [0.0] * p
    for r, stop in zip(*order):
        acts, k, t, starts, ends = schedule.actions[r], nxt[r], free[r], start[r], end[r]
        while k < stop:
            kind, i, s, _, overlap = acts[k]
            inputs, result = wires[kind][s]
            for first, hop in inputs:
                arrives = finished[first + i] + hop
                if arrives > t:
                    t = arrives
            if not overlap:
                starts[k] = t
                t = ends[k] = t + duration[kind][s]
            else:                     # an F&B pair: it starts when the B's inputs are there too
                b = acts[k + 1]
                b_inputs, b_result = wires[b.kind][b.stage]
                for first, hop in b_inputs:
                    t = max(t, finished[first + b.microbatch] + hop)
                f_time, b_time = duration[kind][s], duration[b.kind][b.stage]
                both = pair_time[s] if pair_time else f_time + b_time
                # drawn one after the other, F then B, in proportion; both are done when the block is
                f_part = both * f_time / (f_time + b_time) if f_time + b_time else both / 2
                b_part = both * b_time / (f_time + b_time) if f_time + b_time else both / 2
                starts[k], ends[k] = t, t + f_part
                starts[k + 1], ends[k + 1] = t + f_part, t + (f_part + b_part)
                t = ends[k + 1]
                if b_result is not None:
                    finished[b_result + b.microbatch] = t
                k += 1
            if result is not None:
                finished[result + i] = t
            k += 1
        nxt[r], free[r] = k, t
    return start, end




# ----------------------------------------------------------------------------------
# simulate: time it.

# Activations held. A rank holds a micro-batch for a stage from the start of its F to the
# end of its B, or of its W when the backward is split: W reads the same stored inputs.
# (The zero-bubble paper frees most of it at I already; we count whole micro-batches.)
# One chunk counts 1/v: the unit is one micro-batch through a rank's whole share. The schedule
# knows only this count; bytes per micro-batch come from pplab.memory (saved_activations
# measures them, activation_bytes_formula predicts them), as the planner multiplies them.
_HOLD = {"F": +1, "B": -1, "I": 0, "W": -1}


def _chunk_share(schedule: Schedule) -> float:
    """What one stage is of a rank's share of one copy of the model: 1/v, or 2/v with two replicas
    (a bidirectional rank's two stages are each a whole 1/p of the model)."""
    return schedule.replicas / schedule.chunks


def _activation_steps(schedule: Schedule, start, end, rank: int) -> list:
    """(time, micro-batches held from then on, action), each time `rank`'s count changes."""
    share, held, steps = _chunk_share(schedule), 0, []
    for a, s, e in zip(schedule.actions[rank], start, end):
        if _HOLD[a.kind]:
            held += _HOLD[a.kind]
            steps.append((s if a.kind == "F" else e, held * share if share != 1 else held, a))
    return steps


@dataclass
class SimResult:
    schedule: Schedule
    start: list[list[float]]         # start[r][k]: when schedule.actions[r][k] starts
    end: list[list[float]]
    makespan: float                  # the step's length
    utilization: float               # busy / (ranks x makespan)
    bubble: list[float]              # per rank: idle time within the makespan
    peak_activations: list[float]    # per rank: most micro-batches' activations held at once
    unit: str = "t_f"

    def activations(self, rank: int) -> list[tuple[float, float, Action]]:
        """(time, activations held from then on, action) each time `rank`'s count changes."""
        return _activation_steps(self.schedule, self.start[rank], self.end[rank], rank)

    def timeline(self) -> Timeline:
        """The run as a Timeline (source "simulated"), for the swimlane renderer and summaries.

        One compute event per action (kind F/B/I/W, meta microbatch/stage/chunk) and one
        memory event per change of activations held; meant for runs small enough to draw.
        """
        sched, chunked, events = self.schedule, self.schedule.chunks > 1, []
        for r, acts in enumerate(sched.actions):
            for a, s, e in zip(acts, self.start[r], self.end[r]):
                events.append(Event(r, a.kind, "compute", s, e, a.label(chunked),
                                    meta={"microbatch": a.microbatch, "stage": a.stage, "chunk": a.chunk}))
            for t, held, a in self.activations(r):
                events.append(Event(r, "memory", "memory", t, t, a.label(chunked), value=held))
        return Timeline(events, world_size=sched.num_ranks, source="simulated", t0=0.0,
                        unit=self.unit, memory_unit="micro-batches")

    def __repr__(self) -> str:
        return (f"SimResult({self.schedule.name!r}, makespan {self.makespan:.4g} {self.unit}, "
                f"utilisation {self.utilization:.1%}, peak activations {self.peak_activations})")


def _per_stage(value, what: str, schedule: Schedule) -> list[float]:
    """A number is one rank's whole share (split evenly over its chunks); a list, one per stage."""
    S, share = schedule.num_stages, _chunk_share(schedule)
    if isinstance(value, Real):
        values = [value * share] * S
    else:
        values = list(value)
        if len(values) != S:
            raise ScheduleError(f"{what} has {len(values)} values, but {schedule.name!r} has {S} stages: "
                                f"give one per stage, or a single number")
    if any(not isinstance(x, Real) or x < 0 for x in values):
        raise ScheduleError(f"{what} must be non-negative numbers, got {value!r}")
    return [float(x) for x in values]


def simulate(schedule: Schedule, t_f=1.0, t_b=2.0, t_w=None, p2p_latency: float = 0.0, t_fb=None) -> SimResult:
    """Time `schedule`: every action starts as soon as its rank and its inputs allow.

    t_f, t_b: forward and backward time of one micro-batch through one rank's share of
        the model (the lecture's t_f, t_b); with v chunks each chunk takes t/v (with two replicas,
        each of a rank's two stages is a whole share: t). A list
        gives one time per stage instead (imbalanced stages), used as is.
    t_w: for schedules that split B into I and W, the W part; I takes t_b - t_w. Default
        t_b / 2. Ignored by schedules that do not split.
    p2p_latency: added whenever an input comes from another rank; a p × p list of lists gives
        each hop its own, p2p_latency[src][dst] (a link between nodes slower than one inside).
    t_fb: for schedules with overlapped F&B pairs (DualPipe), how long one pair takes, in the
        units of t_f and t_b. Default: the F's time plus the B's (nothing gained by overlapping).
    """
    order = run_order(schedule)       # validated once, also when simulated again
    p = schedule.num_ranks

    def seconds(x):
        return isinstance(x, Real) and x >= 0
    per_hop = isinstance(p2p_latency, (list, tuple)) and len(p2p_latency) == p and all(
        isinstance(row, (list, tuple)) and len(row) == p and all(map(seconds, row)) for row in p2p_latency)
    if not (seconds(p2p_latency) or per_hop):
        raise ScheduleError(f"p2p_latency must be a number >= 0, got {p2p_latency!r} (or a {p} × {p} list of "
                            f"them, [src][dst]: each hop its own)")
    f, b = _per_stage(t_f, "t_f", schedule), _per_stage(t_b, "t_b", schedule)
    w = [x / 2 for x in b] if t_w is None else _per_stage(t_w, "t_w", schedule)
    if t_w is not None and any(ws > bs for ws, bs in zip(w, b)):
        raise ScheduleError(f"t_w is the weight-gradient part of t_b, so it must be <= t_b: got t_w={t_w}, t_b={t_b}")
    duration = {"F": f, "B": b, "I": [bs - ws for ws, bs in zip(w, b)], "W": w,
                "&": None if t_fb is None else _per_stage(t_fb, "t_fb", schedule)}
    with gc_paused():
        start, end = _play(schedule, order, duration, p2p_latency)

    makespan = max((e[-1] for e in end if e), default=0.0)
    busy = [sum(map(sub, end[r], start[r])) for r in range(p)]
    share = _chunk_share(schedule)
    peaks = [max(accumulate(map(_HOLD.get, map(attrgetter("kind"), acts))), default=0) for acts in schedule.actions]
    peaks = [x * share for x in peaks] if share != 1 else peaks
    return SimResult(schedule, start, end, makespan,
                     utilization=sum(busy) / (p * makespan) if makespan > 0 else 0.0,
                     bubble=[makespan - x for x in busy], peak_activations=peaks,
                     unit="t_f" if isinstance(t_f, Real) and t_f == 1 else "time units")

