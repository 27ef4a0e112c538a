"""Two schedules for v chunks per rank (stage = chunk * p + rank): Looped BFS and interleaved zero bubble.

Both place the model like interleaved 1F1B (schedules.interleaved_1f1b): rank r holds the
stages r, r + p, r + 2p, ... They differ in the order a rank walks through its work.

Looped BFS (breadth first; Lamy-Poirier, "Breadth-First Pipeline Parallelism", 2023) is
GPipe run v times round the ring of ranks: every micro-batch goes through chunk 0, then
every micro-batch through chunk 1, ..., and the backwards come back the same way in
reverse. A rank holds all m micro-batches of all v chunks at the peak, as GPipe does, but
its gradients for chunk c are complete as soon as that chunk's backwards are done, so a
data-parallel reduction of that chunk can start while the others still compute.

Interleaved zero bubble (Qi et al., "Zero Bubble Pipeline Parallelism", 2024; the
interleaved form of ZB-H1) is interleaved 1F1B with every backward split into I (the
input's gradient, which the previous stage is waiting for) and W (the weights' gradient,
which only the optimizer needs). Rank r runs one forward fewer of warm-up per hop from
the last rank (1F1B needs two: its backward is twice a forward, I is about one), and puts
off its first r weight gradients to the cool-down, where they fill what would be idle.

Both orders are those of torch.distributed.pipelining's ScheduleLoopedBFS and
ScheduleInterleavedZeroBubble (tests/test_pipeline_looped.py compares every rank's list).
"""
from __future__ import annotations

from .actions import Action, ScheduleError


def looped_bfs(p, m, v):
    """Rank r: F of every micro-batch through its chunk 0, then chunk 1, ...; then B of every
    micro-batch through its last chunk, ..., chunk 0, the micro-batches in reverse order
    (the last one forward is the first one back, as in torch)."""
    ranks = []
    for r in range(p):
        forwards = [Action("F", i, c * p + r, c) for c in range(v) for i in range(m)]
        backwards = [Action("B", i, c * p + r, c) for c in reversed(range(v)) for i in reversed(range(m))]
        ranks.append(forwards + backwards)
    return ranks


def zero_bubble_rounds(p, m):
    """Micro-batches per round of interleaved zero bubble, as torch: max(1, m // p) rounds of
    equal size, so m must be a multiple of the number of rounds (m = 10, p = 4: 2 rounds of 5)."""
    rounds = max(1, m // p)
    if m % rounds:
        raise ScheduleError(
            f"interleaved-zb goes through the chunks in max(1, m // p) = {rounds} rounds of equal size, "
            f"so m = {m} must be a multiple of {rounds} (as torch's ScheduleInterleavedZeroBubble asks): "
            f"try m = {m - m % rounds} or {m - m % rounds + rounds}")
    return m // rounds


def interleaved_zero_bubble(p, m, v):
    """Rank r: (v-1)·g + (p-1-r) warm-up forwards (g micro-batches per round), then F, I and,
    after the first r steps, one W each step; the cool-down runs the last I's, each followed
    by a W once r have been put off; the remaining W's end the step.

    Chunks are visited in rounds of g micro-batches: the k-th forward of a rank is on chunk
    (k // g) % v, its k-th input gradient on chunk v-1 - (k // g) % v, and the W's follow
    the I's in the same order. With v = 1 this is ZB-H1 (schedules.zb_h1)."""
    g = zero_bubble_rounds(p, m)
    order = [(first + i, c) for first in range(0, m, g) for c in range(v) for i in range(g)]
    ranks = []
    for r in range(p):
        forwards = [Action("F", i, c * p + r, c) for i, c in order]
        inputs = [Action("I", i, (v - 1 - c) * p + r, v - 1 - c) for i, c in order]
        weights = [Action("W", a.microbatch, a.stage, a.chunk) for a in inputs]
        warmup = min((v - 1) * g + (p - 1 - r), len(order))
        acts, w = forwards[:warmup], 0
        for j, inp in enumerate(inputs):
            if warmup + j < len(forwards):
                acts.append(forwards[warmup + j])
            acts.append(inp)
            if j >= r:                                  # the first r W's wait for the cool-down
                acts.append(weights[w])
                w += 1
        ranks.append(acts + weights[w:])
    return ranks
