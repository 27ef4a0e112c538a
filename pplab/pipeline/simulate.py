"""Play a schedule out: check it can run (`validate`), and time it (`simulate`).

validate checks the parts (each action on the rank that holds its stage) and the counts
(one F, and one B or one I and one W, per stage and micro-batch), then looks for an order
the ranks can run in. Each rank runs its actions in order, each as soon as everything it
needs (see schedules.py) has been made. Ranks are visited in turn and each runs as far as it
can; a rank that must wait is parked until the result it waits for exists. If every
unfinished rank is parked, no order of events can ever unstick them: a deadlock. Whether a
schedule deadlocks does not depend on durations, only on the orders. It assumes sends never
block (isend, or a buffer), which is how an executor should post them.

simulate walks the order validate found and times it: an action starts when its rank is
free and everything it needs has finished, plus `p2p_latency` when that came from another
rank. In that order whatever an action waits for has been timed before it, so nothing waits.
A schedule remembers that it passed (see _checked_order): make_schedule, validate and
simulate on the same schedule check it once.

    >>> r = simulate(make_schedule("gpipe", 4, 4), t_f=1, t_b=2)
    >>> r.makespan, r.utilization          # (m + p - 1)(t_f + t_b) = 21, 48 / 84
    (21.0, 0.5714285714285714)
"""
from __future__ import annotations

from array import array
from dataclasses import dataclass
from numbers import Real
from itertools import accumulate, compress
from operator import add, attrgetter, sub

from ..trace import Event, Timeline
from .actions import KINDS, Action, Schedule, ScheduleError, gc_paused


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

def _inputs(kind: str, stage: int, depth: int) -> tuple:
    """depth: stages per replica (num_stages unless the schedule runs two copies of the model)."""
    if kind == "F":
        return (("F", stage - 1),) if stage % depth > 0 else ()
    if kind == "W":
        return (("B", stage),)
    return (("F", stage), ("B", stage + 1)) if (stage + 1) % depth else (("F", stage),)


def _output(kind: str) -> str | None:
    """What an action makes that another waits for; None for W (only the optimizer step needs it)."""
    return "F" if kind == "F" else "B" if kind in ("B", "I") else None


# The two walks below take one Python step per action: half a million for 1F1B at p = 64,
# m = 4096. To keep each step short they look things up by number, not by name. The results
# that actions wait for are numbered: the F of (stage s, micro-batch i) is result s*m + i,
# its input gradient (made by B or I) is result (S + s)*m + i, and a list indexed by that
# number says whether, or when, it was made (several times quicker than a dict keyed by
# (kind, stage, micro-batch)). What an action waits for and makes depends only on its kind
# and stage, so _wiring works it out once per (kind, stage), not once per action.

def _wiring(schedule: Schedule) -> dict:
    """wiring[kind][stage] = (inputs, makes): inputs are (first result, the rank that makes it) pairs,
    makes is a first result or None; add the action's micro-batch to a first result to get its result."""
    S, m, owner = schedule.num_stages, schedule.num_microbatches, schedule.stage_to_rank
    first = {"F": 0, "B": S * m}
    return {k: [(tuple((first[kind] + s2 * m, owner[s2])
                       for kind, s2 in _inputs(k, s, schedule.stages_per_replica)),
                 None if _output(k) is None else first[_output(k)] + s * m) for s in range(S)]
            for k in KINDS}


def _find_order(schedule: Schedule) -> tuple[array, array]:
    """An order the ranks can run in, or ScheduleError saying why there is none (a deadlock).
    Durations play no part, only what has been made yet.

    Each rank runs as far as it can; a rank that must wait is parked until the result it waits
    for is made. If every unfinished rank is parked, nothing can ever unstick them. The order
    is a list of runs: in run j, rank ranks[j] goes on up to step stops[j]. (Arrays of machine
    integers: 8 bytes a run, where a list of (rank, step) tuples takes about 100.)
    """
    p = schedule.num_ranks
    wiring = _wiring(schedule)
    made = bytearray(2 * schedule.num_stages * schedule.num_microbatches)   # made[result]: 1 once it is
    parked = {}                   # result -> ranks waiting for it
    nxt, ready, ranks, stops = [0] * p, list(range(p)), array("i"), array("i")
    while ready:
        r = ready.pop()
        acts, k, n = schedule.actions[r], nxt[r], len(schedule.actions[r])
        while k < n:                                # run rank r as far as it can go
            kind, i, s, _, overlap = acts[k]
            inputs, result = wiring[kind][s]
            waiting_for = None
            for first, _ in inputs:
                if not made[first + i]:
                    waiting_for = first + i
                    break
            if overlap and waiting_for is None:     # an F&B pair runs as one: the B's inputs too
                b = acts[k + 1]
                waiting_for = next((first + b.microbatch for first, _ in wiring[b.kind][b.stage][0]
                                    if not made[first + b.microbatch]), None)
            if waiting_for is not None:
                parked.setdefault(waiting_for, []).append(r)
                break
            if result is not None:
                result += i
                made[result] = 1
                if result in parked:
                    ready.extend(parked.pop(result))
            k += 1
        if k > nxt[r]:
            ranks.append(r)
            stops.append(k)
        nxt[r] = k
    stuck = [r for r in range(p) if nxt[r] < len(schedule.actions[r])]
    if stuck:
        raise ScheduleError(_deadlock_message(schedule, stuck, nxt, made))
    return ranks, stops


def _play(schedule: Schedule, order, duration: dict, latency=0.0):
    """Times of every action: start[r][k], end[r][k] of schedule.actions[r][k].

    Walks the ranks in the order _find_order found (`order`), so whatever an action waits for
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
    wiring = {k: [(tuple((first, delay(src, owner[s])) for first, src in inputs), makes)
                  for s, (inputs, makes) in enumerate(rows)] for k, rows in _wiring(schedule).items()}
    finished = [0.0] * (2 * S * m)                  # finished[result]: when it was made
    pair_time = duration.get("&")
    start = [[0.0] * len(acts) for acts in schedule.actions]
    end = [[0.0] * len(acts) for acts in schedule.actions]
    nxt, free = [0] * p, [0.0] * p
    for r, stop in zip(*order):
        acts, k, t, starts, ends = schedule.actions[r], nxt[r], free[r], start[r], end[r]
        while k < stop:
            kind, i, s, _, overlap = acts[k]
            inputs, result = wiring[kind][s]
            for first, hop in inputs:
                arrives = finished[first + i] + hop
                if arrives > t:
                    t = arrives
            if not overlap:
                starts[k] = t
                t = ends[k] = t + duration[kind][s]
            else:                     # an F&B pair: it starts when the B's inputs are there too
                b = acts[k + 1]
                b_inputs, b_result = wiring[b.kind][b.stage]
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


def _deadlock_message(schedule, stuck, nxt, made) -> str:
    chunked, S, m = schedule.chunks > 1, schedule.num_stages, schedule.num_microbatches
    first = {"F": 0, "B": S * m}
    where = {}                    # what stuck ranks still have to make: key -> (rank, step)
    for r in stuck:
        for k in range(nxt[r], len(schedule.actions[r])):
            a = schedule.actions[r][k]
            where.setdefault((_output(a.kind), a.stage, a.microbatch), (r, k))
    names = {"F": "F{2} of stage {1}", "B": "B{2} (or I{2}) of stage {1}"}
    lines = [f"deadlock in {schedule.name!r}: rank(s) {stuck} can never go on"]
    for r in stuck[:8]:
        acts, k = schedule.actions[r], nxt[r]
        block = acts[k:k + 2] if acts[k].overlap else acts[k:k + 1]    # an F&B pair waits for both inputs
        j, a, kind, s = next((j, a, kind, s) for j, a in enumerate(block)
                             for kind, s in _inputs(a.kind, a.stage, schedule.stages_per_replica)
                             if not made[first[kind] + s * m + a.microbatch])
        paired = f", run as one block with the {block[0].label(chunked)} before it" if j else ""
        owner, step = where[(kind, s, a.microbatch)]
        later = ("which it runs itself later, at step {1}: move that earlier" if owner == r and step > k else
                 "which is the F it is paired with: pair that F with another micro-batch's backward"
                 if owner == r else "which rank {0} runs at step {1}, behind its own stuck step {2}")
        lines.append(f"  rank {r} is stuck at step {k + j} ({a.label(chunked)} of stage {a.stage}{paired}), "
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
    stages = [[] for _ in range(p)]     # each rank's stages, in model order (from the list itself, not
    for s, r in enumerate(schedule.stage_to_rank):   # stages_of's cache: it may have changed in place)
        stages[r].append(s)
    chunk_of = {s: c for mine in stages for c, s in enumerate(mine)}

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
        if _plain_and_in_place(acts, {(s, c) for c, s in enumerate(stages[r])}, m):
            continue
        for j, a in enumerate(acts):              # action by action, to say what is wrong and where
            if (why := problem(r, a)) is not None:
                raise ScheduleError(f"rank {r}, step {j}: {why}")
            if a.overlap and (a.kind != "F" or j + 1 == len(acts) or acts[j + 1].kind not in "BI"
                              or acts[j + 1].overlap):
                raise ScheduleError(f"rank {r}, step {j}: overlap=True pairs an F with the rank's next action, "
                                    f"which must be a B or I (not overlapped itself); got {a} then "
                                    f"{acts[j + 1] if j + 1 < len(acts) else 'nothing'}")


def _plain_and_in_place(acts, stage_chunks: set, m: int) -> bool:
    """The quick test of one rank's list, all at once: Actions of known kinds, micro-batches in
    0..m-1, on (stage, chunk)s of this rank, each overlapped F followed by a B or I that is not.
    zip(*acts) turns the list into columns and set/min/max/compress go through them in C,
    several times quicker than a Python step per action; only when this says no are the
    actions checked one by one, which finds the first wrong one and says what is wrong."""
    if not acts:
        return True
    if set(map(type, acts)) != {Action}:
        return False
    kinds, microbatches, stages, chunks, overlaps = zip(*acts)
    paired = list(compress(range(len(acts)), overlaps))      # where the F&B pairs start
    return (set(kinds) <= set(KINDS) and min(microbatches) >= 0 and max(microbatches) < m
            and set(zip(stages, chunks)) <= stage_chunks
            and all(kinds[j] == "F" and j + 1 < len(acts) and kinds[j + 1] in ("B", "I") and not overlaps[j + 1]
                    for j in paired))


def _check_counts(schedule: Schedule) -> None:
    """Every (stage, micro-batch): one F, and one B or else one I and one W."""
    S, m = schedule.num_stages, schedule.num_microbatches
    count = {k: [[0] * m for _ in range(S)] for k in KINDS}      # [kind][stage][mb]
    for acts in schedule.actions:
        for kind, i, s, _, _ in acts:
            count[kind][s][i] += 1
    problems = []
    for s in range(S):
        mine = schedule.replica_microbatches(s // schedule.stages_per_replica)
        once = [1 if i in mine else 0 for i in range(m)] if schedule.replicas > 1 else [1] * m
        F, B, I, W = (count[k][s] for k in KINDS)
        if F == once and list(map(add, B, I)) == once and I == W:
            continue              # the whole stage at once, compared in C: one F, and one B or one I and one W
        for i, (f, b, i_, w) in enumerate(zip(F, B, I, W)):
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
    _checked_order(schedule)
    return schedule


def _checked_order(schedule: Schedule) -> tuple[array, array]:
    """validate's checks, then the order _find_order found: done once per content of the schedule.

    make_schedule validates, and a learner then calls validate and simulate on the same
    schedule: checking half a million actions three times would cost more than playing them
    out. So the schedule keeps a copy of what it held when it passed (tuples of the same
    Action objects) with the order found. Comparing with that copy is cheap (the same objects
    compare by identity first), and any change since, an action replaced, moved or removed,
    a rank's list swapped, makes them differ, so the checks run again.
    """
    try:
        content = (schedule.num_ranks, schedule.num_microbatches, schedule.chunks, schedule.replicas,
                   tuple(schedule.stage_to_rank), tuple(map(tuple, schedule.actions)))
    except TypeError:             # not even lists: the checks say what is wrong
        content = None
    passed = schedule.__dict__.get("_passed")
    if content is not None and passed is not None and passed[0] == content:
        return passed[1]
    with gc_paused():
        _check_parts(schedule)
        _check_counts(schedule)
        order = _find_order(schedule)
    schedule.__dict__["_passed"] = (content, order)
    return order


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
    order = _checked_order(schedule)       # validated once, also when simulated again
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
