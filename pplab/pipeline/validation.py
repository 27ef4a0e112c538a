"""Can a schedule run? `validate` checks it is a whole training step, then looks for an order
the ranks can run it in.

The parts: each action is an Action of a known kind, on the rank that holds its stage, with
its rank's chunk number. The counts: every (stage, micro-batch) has one F, and one B or else
one I and one W (with two replicas, each copy runs only its half of the micro-batches).

The order. Each rank runs its actions in order, each as soon as everything it needs (the
rule of dependencies.py) has been made. Ranks are visited in turn and each runs as far as it
can; a rank that must wait is parked until the result it waits for exists. If every
unfinished rank is parked, no order of events can ever unstick them: a deadlock, and the
error says which rank waits for what, and where that is made. Whether a schedule deadlocks
does not depend on durations, only on the orders. It assumes sends never block (isend, or a
buffer), which is how an executor should post them.

The order found is what simulate.py times (`run_order`). A schedule remembers that it passed:
make_schedule, validate and simulate on the same schedule check it once.
"""
from __future__ import annotations

from array import array
from itertools import compress
from operator import add

from .actions import KINDS, Action, Schedule, ScheduleError, gc_paused
from .dependencies import makes, needs, result_number, wiring

# ----------------------------------------------------------------------------------
# The parts and the counts: is it the whole job, on the right ranks?

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
    run_order(schedule)
    return schedule


def run_order(schedule: Schedule) -> tuple[array, array]:
    """validate's checks, then the order _find_order found, which simulate times: done once per
    content of the schedule.

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
# The order: can every rank get to its end?

def _find_order(schedule: Schedule) -> tuple[array, array]:
    """An order the ranks can run in, or ScheduleError saying why there is none (a deadlock).
    Durations play no part, only what has been made yet.

    Each rank runs as far as it can; a rank that must wait is parked until the result it waits
    for is made. If every unfinished rank is parked, nothing can ever unstick them. The order
    is a list of runs: in run j, rank ranks[j] goes on up to step stops[j]. (Arrays of machine
    integers: 8 bytes a run, where a list of (rank, step) tuples takes about 100.)
    """
    p = schedule.num_ranks
    wires = wiring(schedule)
    made = bytearray(2 * schedule.num_stages * schedule.num_microbatches)   # made[result]: 1 once it is
    parked = {}                   # result -> ranks waiting for it
    nxt, ready, ranks, stops = [0] * p, list(range(p)), array("i"), array("i")
    while ready:
        r = ready.pop()
        acts, k, n = schedule.actions[r], nxt[r], len(schedule.actions[r])
        while k < n:                                # run rank r as far as it can go
            kind, i, s, _, overlap = acts[k]
            inputs, result = wires[kind][s]
            waiting_for = None
            for first, _ in inputs:
                if not made[first + i]:
                    waiting_for = first + i
                    break
            if overlap and waiting_for is None:     # an F&B pair runs as one: the B's inputs too
                b = acts[k + 1]
                waiting_for = next((first + b.microbatch for first, _ in wires[b.kind][b.stage][0]
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



def _deadlock_message(schedule, stuck, nxt, made) -> str:
    chunked = schedule.chunks > 1
    where = {}                    # what stuck ranks still have to make: key -> (rank, step)
    for r in stuck:
        for k in range(nxt[r], len(schedule.actions[r])):
            a = schedule.actions[r][k]
            where.setdefault((makes(a.kind), a.stage, a.microbatch), (r, k))
    names = {"F": "F{2} of stage {1}", "B": "B{2} (or I{2}) of stage {1}"}
    lines = [f"deadlock in {schedule.name!r}: rank(s) {stuck} can never go on"]
    for r in stuck[:8]:
        acts, k = schedule.actions[r], nxt[r]
        block = acts[k:k + 2] if acts[k].overlap else acts[k:k + 1]    # an F&B pair waits for both inputs
        j, a, kind, s = next((j, a, kind, s) for j, a in enumerate(block)
                             for kind, s in needs(a.kind, a.stage, schedule.stages_per_replica)
                             if not made[result_number(kind, s, schedule) + a.microbatch])
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


