"""Who waits for what: the one rule every part of the pipeline obeys.

A rank runs its actions in order (actions.py), and an action can start only once what it
needs has been made. What it needs depends on its kind and stage, never on the schedule:

    F of stage s, micro-batch i        needs F of stage s-1, i        (its input)
    B or I of stage s, micro-batch i   needs F of stage s, i          (its saved activations)
                                       and B or I of stage s+1, i     (its output's gradient)
    W of stage s, micro-batch i        needs I of stage s, i          (the graph I walked)

A result is named by what made it: "F" of a stage is its output, "B" of a stage the
gradient of its input, made by its B or by its I; W makes nothing anyone waits for (only
the optimizer step, after the flush). At the ends of the model the rule stops: stage 0's F
reads the micro-batch, the last stage's B starts from the loss. With two copies of the model
(bidirectional schedules, `Schedule.replicas = 2`) each copy is its own model of `depth`
stages, so a copy's first and last stage are ends too.

Everything below reads the rule from `needs`:
  - validation.py finds an order the ranks can run in (no deadlock), and says who is stuck;
  - simulate.py times each action from when what it needs was made;
  - executor.py and asynchronous.py post each receive in the order the sender sends
    (`messages`): a message is a result another rank waits for.

    >>> needs("B", stage=1, depth=4)
    (('F', 1), ('B', 2))
"""
from __future__ import annotations

from collections import deque

from .actions import KINDS, Schedule

# what a rank sends when another waits for a result: a stage's output, or its input's gradient
MESSAGE = {"F": "act", "B": "grad"}


def needs(kind: str, stage: int, depth: int) -> tuple:
    """What an action waits for, as (result, stage) of the same micro-batch; depth: stages per copy
    of the model (the schedule's stages_per_replica: num_stages unless there are two replicas)."""
    first, last = stage % depth == 0, (stage + 1) % depth == 0
    if kind == "F":
        return () if first else (("F", stage - 1),)
    if kind == "W":
        return (("B", stage),)
    return (("F", stage),) if last else (("F", stage), ("B", stage + 1))     # B or I


def makes(kind: str) -> str | None:
    """The result an action makes for others: "F" (an output), "B" (an input gradient, by B or I), or
    None for W."""
    return "F" if kind == "F" else "B" if kind in ("B", "I") else None


def waiting_for(result: str, stage: int, num_stages: int, depth: int) -> tuple:
    """Who waits for `result` of `stage`, as (kind, stage) of the same micro-batch: `needs` read
    backwards (only stages next to it can need it), so the rule is written once."""
    return tuple((kind, s) for s in (stage - 1, stage, stage + 1) if 0 <= s < num_stages
                 for kind in KINDS if (result, stage) in needs(kind, s, depth))


# ----------------------------------------------------------------------------------
# The rule, numbered. validation and simulate walk every action in one Python step each
# (half a million for 1F1B at p = 64, m = 4096), so they look results up by number, not by
# name: the F of (stage s, micro-batch i) is result s*m + i, its input gradient (made by B or
# I) is result (S + s)*m + i, and a list indexed by that number says whether, or when, it was
# made (several times quicker than a dict keyed by (kind, stage, micro-batch)).

def result_number(result: str, stage: int, schedule: Schedule) -> int:
    """The number of `result` of `stage` for micro-batch 0: add the micro-batch to it."""
    S, m = schedule.num_stages, schedule.num_microbatches
    return (stage if result == "F" else S + stage) * m


def wiring(schedule: Schedule) -> dict:
    """wiring[kind][stage] = (inputs, makes): inputs are (result number, the rank that makes it) pairs,
    makes a result number or None; add the action's micro-batch to either. Worked out once per (kind,
    stage), since what an action needs depends only on those."""
    owner, depth = schedule.stage_to_rank, schedule.stages_per_replica
    return {k: [(tuple((result_number(res, s2, schedule), owner[s2]) for res, s2 in needs(k, s, depth)),
                 None if makes(k) is None else result_number(makes(k), s, schedule))
                for s in range(schedule.num_stages)]
            for k in KINDS}


# ----------------------------------------------------------------------------------
# The rule, as messages between ranks.

def messages(schedule: Schedule, rank: int) -> dict[int, deque]:
    """For each peer: the messages it will send to `rank`, in the order it sends them.

    A message is ("act", s, i), the output of stage s for micro-batch i, or ("grad", s, i), the
    gradient of stage s's input: a result that an action on `rank` waits for, made on another
    rank. Two ranks match their messages in the order they post them (NCCL ignores tags
    altogether), so a receiver posts its receives in the sender's order: in ZB-V, rank 0 sends its
    two streams to rank 1 in another order than rank 1 uses them.
    """
    owner, S, depth = schedule.stage_to_rank, schedule.num_stages, schedule.stages_per_replica
    here = {}                     # (kind, stage) -> does its result go to `rank` from elsewhere?
    order: dict[int, deque] = {}
    for src, actions in enumerate(schedule.actions):
        if src == rank:
            continue
        for a in actions:
            key = (a.kind, a.stage)
            if key not in here:
                result = makes(a.kind)
                here[key] = result is not None and any(
                    owner[s] == rank for _, s in waiting_for(result, a.stage, S, depth))
            if here[key]:
                order.setdefault(src, deque()).append((MESSAGE[makes(a.kind)], a.stage, a.microbatch))
    return order
