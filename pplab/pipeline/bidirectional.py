"""Bidirectional and V-shaped schedules: Chimera, DualPipe, DualPipeV.

    from pplab.pipeline import make_schedule
    s = make_schedule("chimera", num_stages=4, num_microbatches=4)
    simulate(s, t_f=1, t_b=1).makespan      # 2m + p - 2 = 10: p-2 idle slots, 1F1B's 2(p-1) = 6

The generators are here; make_schedule (schedules.py) builds them by name, with the sizes each
needs (p even for two copies, enough micro-batches to fill both directions).

Two pipelines over the same ranks (Chimera, DualPipe). The model is cut into p pieces and kept
twice: the "down" copy has piece s on rank s, the "up" copy piece s on rank p-1-s, so every rank
holds two pieces, one per direction (an even p means they are never the same piece). Half the
micro-batches enter at rank 0 and go down, the other half enter at rank p-1 and go up; while one
direction fills or drains its pipeline the other has work for the idle ranks. In pplab's IR the
two copies are `Schedule.replicas = 2`: stages 0..p-1 are the down copy, p..2p-1 the up copy
(piece s of the up copy is stage p + s). After the flush, each piece's two copies add their
gradients (they saw different halves of the batch), so both step to the same weights: twice the
parameter memory, and one more exchange of a stage's gradients per step.

DualPipe (DeepSeek-V3) also overlaps: in its steady state a rank runs the forward of one
micro-batch together with the backward of another (`Action.overlap`), so that one's compute
hides the other's communication (all-to-all of expert parallelism, in DeepSeek-V3). DualPipeV
(Sea AI Lab's "cut-in-half") folds DualPipe onto half the ranks: one copy of the model in 2p
stages placed as a V (ZB-V's placement), rank r holding stages r and 2p-1-r. DualPipe on p ranks
runs, on rank r, DualPipeV's order for rank min(r, p-1-r) of p/2 ranks.

Orders. dualpipe_v follows torch.distributed.pipelining's ScheduleDualPipeV (itself taken from
deepseek-ai/DualPipe), action for action; dualpipe follows deepseek-ai/DualPipe's dualpipe.py.
chimera builds Chimera's basic unit (p micro-batches) by list scheduling with unit F and B:
every time slot, each rank runs a ready backward if it has one, else the ready forward of the
deepest stage; m = k*p micro-batches concatenate k units, as the paper's direct concatenation.
"""
from __future__ import annotations

from .actions import Action


def bidirectional_placement(p: int, v: int = 2) -> list[int]:
    """Stage -> rank for two copies of a p-piece model: down (s on rank s), then up (s on rank p-1-s)."""
    return list(range(p)) + [p - 1 - s for s in range(p)]


# ----------------------------------------------------------------------------------
# DualPipeV: one copy, V placement, stage r and 2p-1-r on rank r.

def _dualpipe_v_steps(p, m, r, F, B, I, W, FB):
    """The order of rank r of DualPipeV (p ranks, m micro-batches) as calls, phase by phase.

    Phase 0 is the way down (chunk 0), phase 1 the way back up (chunk 1). F(c), B(c), I(c): the
    next forward, full backward, input-gradient of chunk c; W(): the oldest deferred weight
    gradient; FB(f, b): the forward of chunk f overlapped with the backward of chunk b.
    """
    for _ in range((p - r - 1) * 2):            # 1. fill the way down
        F(0)
    for _ in range(r + 1):                      # 2. down and up alternate
        F(0)
        F(1)
    for _ in range(p - r - 1):                  # 3. zero bubble: I, W, F of the up chunk
        I(1)
        W()
        F(1)
    for i in range(m - 2 * p + r + 1):          # 4. steady state: F0 with B1, then F1 with B0
        if i == 0 and r == p - 1:               # the turn of the V: not overlapped, less bubble
            F(0)
            B(1)
        else:
            FB(0, 1)
        FB(1, 0)
    for _ in range(p - r - 1):                  # 5. B1, then F1 with B0
        B(1)
        FB(1, 0)
    zero_bubble = False                         # 6. drain: the second half splits B into I + W
    for i in range(r + 1):
        if i == (r + 1) // 2 and r % 2 == 1:
            zero_bubble = True
        (I if zero_bubble else B)(1)
        if i == (r + 1) // 2 and r % 2 == 0:
            zero_bubble = True
        (I if zero_bubble else B)(0)
    for _ in range(p - r - 1):                  # 7. W fills the gaps between the last backwards
        W()
        (I if zero_bubble else B)(0)
    for _ in range(r + 1):                      # 8. the weight gradients left
        W()


def _dualpipe_v_rank(p, m, r, stage_mb):
    """Rank r's actions; stage_mb(chunk, j) -> (stage, micro-batch) of the j-th micro-batch of a chunk."""
    order, f, b, weights = [], [0, 0], [0, 0], []

    def F(c, overlap=False):
        order.append(Action("F", *stage_mb(c, f[c])[::-1], c, overlap=overlap))
        f[c] += 1

    def B(c, kind="B"):
        stage, mb = stage_mb(c, b[c])
        order.append(Action(kind, mb, stage, c))
        if kind == "I":
            weights.append(Action("W", mb, stage, c))
        b[c] += 1

    def W():
        if weights:                             # as torch and DualPipe: nothing deferred, nothing to do
            order.append(weights.pop(0))

    _dualpipe_v_steps(p, m, r, F, B, lambda c: B(c, "I"), W, lambda fc, bc: (F(fc, True), B(bc)))
    return order


def dualpipe_v(p, m):
    """DualPipeV: p ranks, 2p stages in a V, m >= 2p micro-batches (as torch requires)."""
    return [_dualpipe_v_rank(p, m, r, lambda c, j, r=r: ((r, 2 * p - 1 - r)[c], j)) for r in range(p)]


def dualpipe(p, m):
    """DualPipe: p ranks (even), two copies, m/2 micro-batches each way, m/2 >= p.

    Rank r runs DualPipeV's order for rank h = min(r, p-1-r) of p/2 ranks. Its phase 0 is the
    direction in which it sits in the first half of the pipeline (the down copy for r < p/2, the
    up copy otherwise), stage h of that direction; phase 1 is the other direction, where it is
    stage p-1-h.
    """
    half = m // 2
    ranks = []
    for r in range(p):
        h = min(r, p - 1 - r)
        first = 0 if r < p // 2 else 1          # the copy in which rank r is one of the first p/2 stages

        def stage_mb(c, j, first=first, h=h):
            replica = first if c == 0 else 1 - first
            piece = h if c == 0 else p - 1 - h
            chunk_stage = replica * p + piece
            return chunk_stage, replica * half + j
        acts = _dualpipe_v_rank(p // 2, half, h, stage_mb)
        stages = sorted({a.stage for a in acts})                 # chunk = index among the rank's stages
        ranks.append([Action(a.kind, a.microbatch, a.stage, stages.index(a.stage), a.overlap) for a in acts])
    return ranks


# ----------------------------------------------------------------------------------
# Chimera: two copies, basic units of p micro-batches.

def _chimera_unit(p, n):
    """One basic unit: n micro-batches (n/2 each way), by list scheduling with unit times.

    Returns order[rank] of (kind, replica, piece, j), j the micro-batch's index in its direction.
    Each slot, a rank runs a ready backward (the deepest piece first), else the ready forward of
    the deepest piece: the down and up pipelines then interleave as in the paper's figure, and
    a rank idles p-2 slots in all (checked by the tests for every even p up to 12).
    """
    def rank_of(replica, piece):
        return piece if replica == 0 else p - 1 - piece
    todo = {r: [] for r in range(p)}
    for replica in (0, 1):
        for piece in range(p):
            for j in range(n // 2):
                todo[rank_of(replica, piece)] += [("F", replica, piece, j), ("B", replica, piece, j)]
    done, order, t = {}, {r: [] for r in range(p)}, 0
    never = float("inf")
    while any(todo.values()):
        picks = {}
        for r in range(p):
            def ready(a):
                kind, replica, piece, j = a
                if kind == "F":
                    return piece == 0 or done.get(("F", replica, piece - 1, j), never) <= t
                return done.get(("F", replica, piece, j), never) <= t and \
                    (piece == p - 1 or done.get(("B", replica, piece + 1, j), never) <= t)
            runnable = [a for a in todo[r] if ready(a)]
            if runnable:
                picks[r] = min(runnable, key=lambda a: (a[0] != "B", -a[2], a[3]))
        for r, a in picks.items():
            todo[r].remove(a)
            order[r].append(a)
            done[a] = t + 1
        t += 1
    return order


def chimera(p, m):
    """Chimera: p ranks (even), two copies, m a multiple of p: m/p basic units one after another."""
    unit, per_unit = _chimera_unit(p, p), p // 2
    half = m // 2
    ranks = []
    for r in range(p):
        acts = []
        for u in range(m // p):
            for kind, replica, piece, j in unit[r]:
                stage = replica * p + piece
                mb = replica * half + u * per_unit + j
                acts.append((kind, mb, stage))
        stages = sorted({s for _, _, s in acts})
        ranks.append([Action(kind, mb, s, stages.index(s)) for kind, mb, s in acts])
    return ranks


# ----------------------------------------------------------------------------------
# The DualPipe repository's table, as formulas (README of deepseek-ai/DualPipe).

def dualpipe_table(pp, F, B, W, FB):
    """Bubble, parameter memory (× one stage's) and activation memory (micro-batches × one stage)
    per device, for 1F1B, ZB1P and DualPipe on pp stages, as the DualPipe README gives them.
    F, B, W: a forward, full backward and weight-gradient chunk; FB: an overlapped F&B pair."""
    return {"1F1B": ((pp - 1) * (F + B), 1, pp),
            "ZB1P": ((pp - 1) * (F + B - 2 * W), 1, pp),
            "DualPipe": ((pp // 2 - 1) * (FB + B - 3 * W), 2, pp + 1)}


def chimera_bubble_ratio(p: int, m: int) -> float:
    """Chimera's bubble ratio (Li & Hoefler 2021, table 2): (D-2)/(2N+D-2), D = p stages, N = m
    micro-batches, a forward and a backward taking the same time; idle / (idle + work) per rank."""
    return (p - 2) / (2 * m + p - 2)
