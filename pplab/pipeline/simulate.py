"""Play a schedule out: check it can run (`validate`), and time it (`simulate`).

Both walk the same way. Each rank runs its actions in order; an action starts when its
rank is free and everything it needs (see schedules.py) has finished, plus `p2p_latency`
when that came from another rank. Ranks are visited in turn and each runs as far as it
can; a rank that must wait is parked until the result it waits for exists. If every
unfinished rank is parked, no order of events can ever unstick them: a deadlock.

Whether a schedule deadlocks does not depend on durations, only on the orders, so
`validate` plays it with unit times. It assumes sends never block (isend, or a buffer),
which is how an executor should post them.

    >>> r = simulate(make_schedule("gpipe", 4, 4), t_f=1, t_b=2)
    >>> r.makespan, r.utilization          # (m + p - 1)(t_f + t_b) = 21, 48 / 84
    (21.0, 0.5714285714285714)
"""
from __future__ import annotations

from dataclasses import dataclass
from numbers import Real
from itertools import accumulate

from ..trace import Event, Timeline
from .actions import KINDS, Action, Schedule, ScheduleError


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


# ----------------------------------------------------------------------------------
# What an action waits for, as (kind, stage) of the same micro-batch: "F" = that
# stage's forward, "B" = that stage's input gradient (made by its B, or by its I).

def _inputs(a: Action, depth: int) -> tuple:
    """depth: stages per replica (num_stages unless the schedule runs two copies of the model)."""
    if a.kind == "F":
        return (("F", a.stage - 1),) if a.stage % depth > 0 else ()
    if a.kind == "W":
        return (("B", a.stage),)
    return (("F", a.stage), ("B", a.stage + 1)) if (a.stage + 1) % depth else (("F", a.stage),)


def _output(a: Action) -> str:
    return "F" if a.kind == "F" else "B" if a.kind in ("B", "I") else "W"


def _play(schedule: Schedule, duration: dict, latency: float = 0.0):
    """Times of every action: start[r][k], end[r][k] of schedule.actions[r][k].

    duration[kind][stage] is how long one such action takes; duration["&"][stage], if given,
    how long an overlapped pair whose F is of that stage takes (else the sum of the two).
    """
    p, S, m = schedule.num_ranks, schedule.num_stages, schedule.num_microbatches
    owner, depth = schedule.stage_to_rank, schedule.stages_per_replica
    hops = None if isinstance(latency, Real) else latency      # [src][dst] seconds: each hop its own
    start = [[0.0] * len(acts) for acts in schedule.actions]
    end = [[0.0] * len(acts) for acts in schedule.actions]
    finished = {k: [[None] * m for _ in range(S)] for k in "FBW"}  # [kind][stage][mb] -> end time
    parked = {}                   # (kind, stage, mb) -> ranks waiting for it
    nxt, free = [0] * p, [0.0] * p
    ready = list(range(p))
    while ready:
        r = ready.pop()
        acts, k = schedule.actions[r], nxt[r]
        while k < len(acts):                        # run rank r as far as it can go
            block = acts[k:k + 2] if acts[k].overlap else acts[k:k + 1]   # an F&B pair runs as one
            t, missing = free[r], None
            for a in block:
                for kind, s in _inputs(a, depth):
                    t_done = finished[kind][s][a.microbatch]
                    if t_done is None:
                        missing = (kind, s, a.microbatch)
                        break
                    if owner[s] != r:         # it has to travel from another rank
                        t_done += latency if hops is None else hops[owner[s]][r]
                    if t_done > t:
                        t = t_done
                if missing is not None:
                    break
            if missing is not None:
                parked.setdefault(missing, []).append(r)
                break
            times = [duration[a.kind][a.stage] for a in block]
            if len(block) == 2:           # drawn one after the other, both done when the block is
                fb = duration["&"][block[0].stage] if duration.get("&") else sum(times)
                times = [fb * x / sum(times) if sum(times) else fb / 2 for x in times]
            for j, a in enumerate(block):
                start[r][k + j] = t + sum(times[:j])
                end[r][k + j] = t + sum(times[:j + 1])
            free[r] = end[r][k + len(block) - 1]
            for a in block:
                kind = _output(a)
                finished[kind][a.stage][a.microbatch] = free[r]
                ready.extend(parked.pop((kind, a.stage, a.microbatch), ()))
            k += len(block)
        nxt[r] = k
    stuck = [r for r in range(p) if nxt[r] < len(schedule.actions[r])]
    if stuck:
        raise ScheduleError(_deadlock_message(schedule, stuck, nxt, finished))
    return start, end


def _deadlock_message(schedule, stuck, nxt, finished) -> str:
    chunked = schedule.chunks > 1
    where = {}                    # what stuck ranks still have to make: key -> (rank, step)
    for r in stuck:
        for k in range(nxt[r], len(schedule.actions[r])):
            a = schedule.actions[r][k]
            where.setdefault((_output(a), a.stage, a.microbatch), (r, k))
    names = {"F": "F{2} of stage {1}", "B": "B{2} (or I{2}) of stage {1}"}
    lines = [f"deadlock in {schedule.name!r}: rank(s) {stuck} can never go on"]
    for r in stuck[:8]:
        a = schedule.actions[r][nxt[r]]
        kind, s = next((k, s) for k, s in _inputs(a, schedule.stages_per_replica)
                       if finished[k][s][a.microbatch] is None)
        owner, step = where[(kind, s, a.microbatch)]
        later = ("which it runs itself later, at step {1}: move that earlier" if owner == r else
                 "which rank {0} runs at step {1}, behind its own stuck step {2}")
        lines.append(f"  rank {r} is stuck at step {nxt[r]} ({a.label(chunked)} of stage {a.stage}), "
                     f"waiting for {names[kind].format(kind, s, a.microbatch)}, "
                     + later.format(owner, step, nxt[owner]))
    if len(stuck) > 8:
        lines.append(f"  ... and {len(stuck) - 8} more ranks")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------
# validate: is it the whole job, on the right ranks, and can it run?

def _check_parts(schedule: Schedule) -> None:
    p, v, m, S = schedule.num_ranks, schedule.chunks, schedule.num_microbatches, schedule.num_stages
    for what in ("num_ranks", "num_microbatches", "chunks"):
        value = getattr(schedule, what)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ScheduleError(f"schedule.{what} must be a positive integer, got {value!r}")
    if sorted(schedule.stage_to_rank) != sorted(list(range(p)) * v):
        raise ScheduleError(f"stage_to_rank must give each of the {p} ranks exactly {v} stage(s), "
                            f"got {schedule.stage_to_rank}")
    if len(schedule.actions) != p:
        raise ScheduleError(f"actions must hold one list per rank: {p} ranks, got {len(schedule.actions)} lists")
    k = schedule.replicas
    if isinstance(k, bool) or not isinstance(k, int) or k not in (1, 2) or S % k or m % k:
        raise ScheduleError(f"schedule.replicas must be 1, or 2 with an even number of stages and of "
                            f"micro-batches (each copy of the model takes half of them), got replicas={k!r}, "
                            f"{S} stages, {m} micro-batches")
    chunk_of = {s: c for r in range(p) for c, s in enumerate(schedule.stages_of(r))}

    def problem(r, a):            # what is wrong with action a on rank r, if anything
        if not isinstance(a, Action):
            return f"expected an Action, got {a!r}"
        if a.kind not in KINDS:
            return f"unknown action kind {a.kind!r}; kinds are {', '.join(KINDS)}"
        if not 0 <= a.microbatch < m:
            return f"micro-batch {a.microbatch} out of range 0..{m - 1}"
        if not 0 <= a.stage < S:
            return f"stage {a.stage} out of range 0..{S - 1}"
        if schedule.stage_to_rank[a.stage] != r:
            return (f"{a.kind}{a.microbatch} of stage {a.stage} is on rank {r}, "
                    f"but stage {a.stage} lives on rank {schedule.stage_to_rank[a.stage]}")
        if a.chunk != chunk_of[a.stage]:
            return f"stage {a.stage} is chunk {chunk_of[a.stage]} of rank {r}, but the action says chunk {a.chunk}"

    for r, acts in enumerate(schedule.actions):
        for j, a in enumerate(acts):
            if (why := problem(r, a)) is not None:
                raise ScheduleError(f"rank {r}, step {j}: {why}")
            if a.overlap and (a.kind != "F" or j + 1 == len(acts) or acts[j + 1].kind not in "BI"
                              or acts[j + 1].overlap):
                raise ScheduleError(f"rank {r}, step {j}: overlap=True pairs an F with the rank's next action, "
                                    f"which must be a B or I (not overlapped itself); got {a} then "
                                    f"{acts[j + 1] if j + 1 < len(acts) else 'nothing'}")


def _check_counts(schedule: Schedule) -> None:
    """Every (stage, micro-batch): one F, and one B or else one I and one W."""
    S, m = schedule.num_stages, schedule.num_microbatches
    count = {k: [[0] * m for _ in range(S)] for k in KINDS}      # [kind][stage][mb]
    for acts in schedule.actions:
        for a in acts:
            count[a.kind][a.stage][a.microbatch] += 1
    problems = []
    for s in range(S):
        mine = schedule.replica_microbatches(s // schedule.stages_per_replica)
        for i, (f, b, i_, w) in enumerate(zip(*(count[k][s] for k in KINDS))):
            if i not in mine:             # the other copy of the model runs this micro-batch
                if f or b or i_ or w:
                    problems.append(f"micro-batch {i} runs on stage {s}, but it belongs to the other replica "
                                    f"(stage {s} runs micro-batches {mine.start}..{mine.stop - 1})")
                continue
            if f != 1:
                problems.append(f"F{i} of stage {s} appears {f} times, not once")
            if (b, i_, w) not in ((1, 0, 0), (0, 1, 1)):
                problems.append(f"backward {i} of stage {s} appears as {b} B, {i_} I, {w} W: "
                                f"it needs one B, or one I and one W")
    if problems:
        more = f"\n  ... and {len(problems) - 8} more" if len(problems) > 8 else ""
        raise ScheduleError(f"schedule {schedule.name!r} is not one full training step:\n  "
                            + "\n  ".join(problems[:8]) + more)


def validate(schedule: Schedule) -> Schedule:
    """Raise ScheduleError saying what is wrong, unless `schedule` runs a whole step.

    Checks: each action is on the rank holding its stage; every (stage, micro-batch)
    has one F and one B (or one I and one W); the ranks' orders admit an execution
    that respects every dependency (no deadlock, so nothing runs before its inputs).
    """
    _check_parts(schedule)
    _check_counts(schedule)
    unit = {k: [1.0] * schedule.num_stages for k in KINDS}
    _play(schedule, unit)
    return schedule


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
    _check_parts(schedule)
    _check_counts(schedule)
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
    start, end = _play(schedule, duration, p2p_latency)

    p = schedule.num_ranks
    makespan = max((e[-1] for e in end if e), default=0.0)
    busy = [sum(e - s for s, e in zip(start[r], end[r])) for r in range(p)]
    share = _chunk_share(schedule)
    peaks = [max(accumulate(_HOLD[a.kind] for a in acts), default=0) for acts in schedule.actions]
    peaks = [x * share for x in peaks] if share != 1 else peaks
    return SimResult(schedule, start, end, makespan,
                     utilization=sum(busy) / (p * makespan) if makespan > 0 else 0.0,
                     bubble=[makespan - x for x in busy], peak_activations=peaks,
                     unit="t_f" if isinstance(t_f, Real) and t_f == 1 else "time units")
