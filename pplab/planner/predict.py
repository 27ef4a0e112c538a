"""The planner's predictions: a layout's memory per rank and step time (`predict`), every
layout that fits (`enumerate_layouts`, `plan`), and predicted next to measured (`compare`).
What each number is made of is in the package's docstring (pplab/planner/__init__.py).

On a cluster of nodes (chapter 10), predict and plan take `cluster=` and `inter=`, the (α, β) of
the link between nodes: the layout's mesh is laid onto the nodes along `Layout.order`
(pplab.cluster.place), and a collective whose groups span nodes, or a pipeline hop between
stages on different nodes, pays the slow tier on top (pplab.cluster.crossing_time). `step_traffic`
says how many bytes each dimension sends per step, which pplab.cluster.placement_rule orders by."""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from ..cluster import crossing_time, orders, place
from ..hybrid import check_layout, describe_layout
from ..models.gpt import GPTConfig
from ..pipeline import make_schedule, simulate
from ..pipeline.partition import balanced_split
from ..zero import model_state_bytes
from .times import LayerTimes, layer_params, parallel_saved


class PlanError(ValueError):
    """The request cannot be planned; the message says what to change."""


@dataclass(frozen=True)
class Layout:
    dp: int
    tp: int
    pp: int
    m: int = 1                      # micro-batches per step and replica
    zero: int = 0                   # 0 = DDP's all-reduce; 1, 2, 3 = ZeRO stages
    schedule: str = "1f1b"
    sp: bool = False                # Megatron sequence parallelism inside the tp group
    recompute: bool = False         # full recomputation of every block (pplab.recompute): keeps its input only
    order: tuple | None = None      # the mesh's order on a cluster, outermost first (None: pp, dp, tp)

    @property
    def name(self) -> str:
        extra = (f", m={self.m}" if self.pp > 1 else "") + \
            (f", {self.schedule}" if self.pp > 1 and self.schedule != "1f1b" else "") + \
            (f", ZeRO-{self.zero}" if self.zero else "") + \
            (", SP" if self.sp and self.tp > 1 else "") + (", recompute" if self.recompute else "") + \
            (f", order {'>'.join(self.order)}" if self.order else "")
        return describe_layout({"dp": self.dp, "tp": self.tp, "pp": self.pp}) + extra


# ----------------------------------------------------------------------------------
# Memory and step time of one layout


def stages(cfg: GPTConfig, pp: int) -> list:
    """(start, end) pipeline layers of each stage: cut by the dense parameter counts, as pplab.hybrid does."""
    counts = balanced_split(layer_params(cfg, 1), pp)
    ends = [sum(counts[:i + 1]) for i in range(pp)]
    return [(e - c, e) for c, e in zip(counts, ends)]


@dataclass
class Prediction:
    layout: Layout
    memory: dict                    # bytes per rank (the most loaded): params, grads, optimizer, activations, total
    time: dict                      # seconds: compute, tp, bubble, pp_send, dp, optimizer, total
    stages: list = field(default_factory=list)      # memory dict of every pipeline rank (all its stages)
    fits: bool = True


def step_traffic(cfg: GPTConfig, layout: Layout, batch: int, dtype_bytes: int = 4) -> dict:
    """Bytes one rank sends per step along tp, dp and pp, as pplab.hybrid.train sends them with
    pplab's ring collectives (an all-reduce of N bytes over g ranks: each rank sends 2(g-1)/g·N to
    the next; an all-gather or a reduce-scatter half that):

      tp  per micro-batch, all-reduces of one [s, b, h] activation: the embedding's forward, 2 per
          block forward and 2 backward (2 more forward with recomputation), the head's input
          backward; and the vocabulary-parallel loss's max [b, s] and its two sums [2, b, s]
      dp  the gradients of this rank's shard of its stage: DDP's all-reduce (and, without a
          pipeline, its all-gather of each replica's 8-byte count of samples), or ZeRO's
          reduce-scatters and all-gathers as `predict` counts them (its padding left out)
      pp  what a stage sends to the next per step: one activation per micro-batch (the
          gradients come back the same size)

    Rank 0 of the tp group holds the largest shard: where tp does not divide the vocabulary or a
    matrix, the others send a little less."""
    L, mb = layout, batch // (layout.dp * layout.m)
    s, h, t, d = cfg.seq, cfg.hidden, layout.tp, layout.dp
    act = mb * s * h * dtype_bytes

    def ring(n, g):                           # bytes one rank sends in an all-reduce of n over g ranks
        return 2 * (g - 1) / g * n
    per_mb = (4 * cfg.layers + 2 + (2 * cfg.layers if L.recompute else 0)) * ring(act, t) + \
        ring(mb * s * dtype_bytes, t) + ring(2 * mb * s * dtype_bytes, t)
    cuts = stages(cfg, make_schedule(L.schedule, L.pp, L.m).num_stages if L.pp > 1 else 1)
    params = layer_params(cfg, t)
    mine = [make_schedule(L.schedule, L.pp, L.m).stages_of(r) for r in range(L.pp)] if L.pp > 1 else [[0]]
    grads = max(sum(sum(params[a:e]) for a, e in (cuts[c] for c in st)) for st in mine) * dtype_bytes
    half = ring(grads, d) / 2                 # one reduce-scatter or all-gather
    dp = {0: 2 * half, 1: 2 * half, 2: (L.m + 1) * half, 3: L.m * 3 * half}[L.zero] if d > 1 else 0.0
    if d > 1 and L.zero == 0 and L.pp == 1:
        dp += (d - 1) * 8                     # DDP's ring all-gather of every replica's count of samples
    return {"tp": L.m * per_mb if t > 1 else 0.0, "dp": dp, "pp": L.m * act if L.pp > 1 else 0.0}


def predict(cfg: GPTConfig, layout: Layout, batch: int, fit, times: LayerTimes, dtype_bytes: int = 4,
            oversubscription: float = 1.0, cluster=None, inter=None) -> Prediction:
    """Memory and step time of one (valid) layout. oversubscription: how many ranks share a core
    (compute runs that much slower: 4 ranks on this 2-core machine = 2). cluster: a
    pplab.cluster.Cluster of dp·tp·pp ranks, and inter, the (α, β) between its nodes: a dimension
    whose groups span nodes pays pplab.cluster.crossing_time on top of `fit` for its collectives,
    and so does a pipeline hop between nodes (the layout's mesh laid out along layout.order)."""
    L, mb = layout, batch // (layout.dp * layout.m)
    s, h, t = cfg.seq, cfg.hidden, layout.tp
    act = mb * s * h * dtype_bytes                                      # one [s, b, h] activation
    world = L.dp * L.tp * L.pp                  # every rank runs at once: on few cores they all share them
    placed = _placed(cluster, inter, L)
    crossing = {d: placed is not None and max(placed.nodes_spanned(d)) > 1 for d in ("tp", "dp")}
    ar = (lambda n: fit.predict("all_reduce", None, t, n, world) +
          (crossing_time("all_reduce", t, n, inter) if crossing["tp"] else 0.0)) if t > 1 else (lambda n: 0.0)
    tp_f = [ar(act)] + [2 * ar(act)] * cfg.layers + [2 * ar(2 * mb * s * 4)]   # embedding g; blocks; loss sums
    tp_b = [0.0] + [2 * ar(act)] * cfg.layers + [ar(act)]                      # head's f; blocks
    saved = times.saved
    if t > 1:                        # the tensor-parallel layers' own, cut over t as counted tensor by tensor
        split, whole = parallel_saved(cfg, t, L.sp, dtype_bytes), parallel_saved(cfg, 1, False, dtype_bytes)
        saved = [n * a / b for n, a, b in zip(times.saved_parallel or times.saved, split, whole)]
    blocks = range(1, cfg.layers + 1)                                  # pipeline layers 1..L are the blocks
    if L.recompute:                  # a block keeps only its input, [s, b, h] (its s/t tokens with SP)
        saved = [h * s / (t if L.sp and t > 1 else 1) if i in blocks else n for i, n in enumerate(saved)]
    params = layer_params(cfg, t)
    sched = make_schedule(L.schedule, L.pp, L.m) if L.pp > 1 else None
    cuts = stages(cfg, sched.num_stages if sched else 1)               # pp stages, or pp·v chunks (interleaved, V)
    mine = [sched.stages_of(r) for r in range(L.pp)] if sched else [[0]]   # the stages each pp rank holds

    def run(fixed, per, i):                                             # one micro-batch through layer i
        return (fixed[i] + per[i] * mb / t) * oversubscription
    f = [sum(run(times.forward_fixed, times.forward_per_sample, i) for i in range(a, b)) for a, b in cuts]
    b = [sum(run(times.backward_fixed, times.backward_per_sample, i) for i in range(a, b)) for a, b in cuts]
    comm_f = [sum(tp_f[a:e]) for a, e in cuts]
    comm_b = [sum(tp_b[a:e]) for a, e in cuts]
    if L.recompute:                  # backward runs each block's forward again first, its all-reduces included
        b = [x + sum(run(times.forward_fixed, times.forward_per_sample, i) for i in range(a, e) if i in blocks)
             for x, (a, e) in zip(b, cuts)]
        comm_b = [x + sum(tp_f[i] for i in range(a, e) if i in blocks) for x, (a, e) in zip(comm_b, cuts)]
    tf, tb = [x + c for x, c in zip(f, comm_f)], [x + c for x, c in zip(b, comm_b)]
    if sched:
        flush = simulate(sched, tf, tb).makespan
        hop = fit.predict("broadcast", None, 2, act, world)   # one message, the ranks sharing the cores
        if placed is not None:                                # a hop between nodes: the slow tier on top
            stage_ranks = placed.groups("pp")
            hop = [[hop + (crossing_time("broadcast", 2, act, inter) if any(
                    cluster.crosses(g[i], g[j]) for g in stage_ranks) else 0.0) for j in range(L.pp)]
                   for i in range(L.pp)]
        sim = simulate(sched, tf, tb, p2p_latency=hop)
        makespan, send = sim.makespan, sim.makespan - flush
    else:
        makespan, send = L.m * (tf[0] + tb[0]), 0.0

    def per_rank(xs, r):                                                # summed over rank r's stages
        return sum(xs[c] for c in mine[r])
    slow = max(range(L.pp), key=lambda r: per_rank(tf, r) + per_rank(tb, r))
    psi = [sum(sum(params[a:e]) for a, e in (cuts[c] for c in mine[r])) for r in range(L.pp)]   # parameters per rank

    def state(k, pb, gb, ob):                                           # chapter 6's formula, one kind at a time
        return model_state_bytes(L.zero, psi[k], L.dp, pb, gb, ob)
    per_microbatch = [mb * sum(saved[i] for i in range(a, e)) * dtype_bytes for a, e in cuts]   # per stage

    def activations(r):                    # walk rank r's actions: F keeps its stage's, B (or W) frees them
        if not sched:                      # no pipeline: the m micro-batches one after another
            return L.m * per_microbatch[0]
        now = peak = 0.0
        for a in sched.actions[r]:
            now += {"F": 1, "B": -1, "W": -1}.get(a.kind, 0) * per_microbatch[a.stage]
            peak = max(peak, now)
        return peak
    memory = []
    for k in range(L.pp):
        acts = activations(k)
        mem = {"params": state(k, dtype_bytes, 0, 0), "grads": state(k, 0, dtype_bytes, 0),
               "optimizer": state(k, 0, 0, 2 * dtype_bytes), "activations": acts}     # Adam: 2 moments
        mem["total"] = sum(mem.values())
        memory.append(mem)
    grads = max(psi) * dtype_bytes
    dp = 0.0
    if L.dp > 1:                     # under a pipeline ZeRO-2's hooks reduce-scatter, and ZeRO-3 gathers
        def dp_collective(kind, n):
            return fit.predict(kind, None, L.dp, n, world) + \
                (crossing_time(kind, L.dp, n, inter) if crossing["dp"] else 0.0)
        rs, ag = (dp_collective(kind, grads) for kind in ("reduce_scatter", "all_gather"))
        dp = {0: dp_collective("all_reduce", grads), 1: rs + ag,      # twice, once per micro-batch
              2: L.m * rs + ag, 3: L.m * (rs + 2 * ag)}[L.zero]
        if L.zero == 0 and L.pp == 1:    # DDP also checks, every step, that all replicas had as many samples
            dp += dp_collective("all_gather", 8 * L.dp)
    owned = max(psi) / (L.dp if L.zero else 1)
    opt = times.optimizer * owned * oversubscription
    t_parts = {"compute": L.m * (per_rank(f, slow) + per_rank(b, slow)),
               "tp": L.m * (per_rank(comm_f, slow) + per_rank(comm_b, slow)),
               "bubble": makespan - send - L.m * (per_rank(tf, slow) + per_rank(tb, slow)), "pp_send": send,
               "dp": dp, "optimizer": opt}
    t_parts["total"] = makespan + dp + opt
    return Prediction(layout, max(memory, key=lambda m: m["total"]), t_parts, memory)


# ----------------------------------------------------------------------------------
# Which layouts exist, which are valid, which fit, which is fastest


def _placed(cluster, inter, L: Layout):
    """The layout's mesh on the cluster's nodes, or None without a cluster; PlanError on a mismatch."""
    if cluster is None:
        if inter is not None or L.order is not None:
            raise PlanError("inter= and a layout's order place the mesh on a cluster's nodes: pass cluster= too")
        return None
    if not (isinstance(inter, (tuple, list)) and len(inter) == 2 and all(x >= 0 for x in inter)):
        raise PlanError(f"with a cluster, inter is the (α seconds, β seconds per byte) between nodes, got {inter!r}")
    try:
        return place(cluster, order=L.order, dp=L.dp, tp=L.tp, pp=L.pp)
    except ValueError as err:
        raise PlanError(str(err)) from None


def _divisors(n: int) -> list:
    return [d for d in range(1, n + 1) if n % d == 0]


def why_not(cfg: GPTConfig, L: Layout, batch: int):
    """Why this layout cannot run this model and batch, or None: pplab.hybrid.check_layout's
    answer first (so every layout listed as valid is one pplab.hybrid.train runs), then the
    planner's own (equal micro-batches)."""
    try:
        check_layout(cfg, {"dp": L.dp, "tp": L.tp, "pp": L.pp}, batch, L.m, L.zero, L.sp, schedule=L.schedule)
    except ValueError as err:
        return str(err)
    if cfg.hidden % L.tp:
        return f"tp={L.tp} does not divide the hidden size {cfg.hidden}"
    if batch % (L.dp * L.m):
        return f"a batch of {batch} does not split into dp·m = {L.dp}·{L.m} equal micro-batches"
    return None


def enumerate_layouts(cfg: GPTConfig, batch: int, world_size: int, zero_stages=(0, 1, 2, 3),
                      schedule: str = "1f1b", recompute=(False,)) -> tuple:
    """(valid layouts, [(invalid layout, reason)]): every dp·tp·pp = world_size; m from the divisors
    of the batch (1 without a pipeline); ZeRO stages only with dp > 1 (with dp = 1 they change nothing).
    recompute=(False, True) lists each layout with full recomputation too (pplab.recompute's
    recompute_layers runs it under chapter 4's executor; pplab.hybrid.train does not)."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise PlanError(f"world_size is a number of ranks, a whole number >= 1: got {world_size!r}")
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise PlanError(f"batch is a number of sequences per step, a whole number >= 1: got {batch!r}")
    valid, rejected = [], []
    for pp in _divisors(world_size):
        for tp in _divisors(world_size // pp):
            dp = world_size // (pp * tp)
            for m in (_divisors(batch) if pp > 1 else [1]):
                for z in (zero_stages if dp > 1 else [0]):
                    for rc in recompute:
                        L = Layout(dp, tp, pp, m, z, schedule, recompute=rc)
                        why = why_not(cfg, L, batch)
                        (rejected.append((L, why)) if why else valid.append(L))
    return valid, rejected


def _gb(n: float) -> str:
    return f"{n / 1e9:.3g} GB" if n >= 1e8 else f"{n / 1e6:.3g} MB"


@dataclass
class Plan:
    ranked: list                    # Predictions that fit, fastest first
    too_big: list                   # Predictions over the memory budget, smallest first
    rejected: list                  # (Layout, reason) that cannot run at all
    budget: float
    notes: list = field(default_factory=list)

    @property
    def best(self) -> Prediction:
        return self.ranked[0]

    def table(self, rows=None) -> str:
        rows = self.ranked if rows is None else rows
        w = max([28] + [len(p.layout.name) for p in rows])
        head = f"{'layout':{w}s} {'step ms':>8s} {'compute':>8s} {'tp':>6s} {'bubble':>7s} {'pp':>6s} {'dp':>6s} " \
               f"{'memory':>9s} {'(act.)':>9s}"
        lines = [head]
        for p in rows:
            t, m = p.time, p.memory
            lines.append(f"{p.layout.name:{w}s} {t['total'] * 1e3:8.2f} {t['compute'] * 1e3:8.2f} {t['tp'] * 1e3:6.2f} "
                         f"{t['bubble'] * 1e3:7.2f} {t['pp_send'] * 1e3:6.2f} {t['dp'] * 1e3:6.2f} "
                         f"{_gb(m['total']):>9s} {_gb(m['activations']):>9s}")
        return "\n".join(lines)

    def __str__(self):
        return (f"{len(self.ranked)} layouts fit {_gb(self.budget)} per rank ({len(self.too_big)} too big, "
                f"{len(self.rejected)} impossible):\n" + self.table())


def plan(cfg: GPTConfig, batch: int, world_size: int, memory_per_rank: float, fit, times: LayerTimes,
         zero_stages=(0, 1, 2, 3), schedule: str = "1f1b", dtype_bytes: int = 4,
         oversubscription: float = 1.0, recompute=(False,), cluster=None, inter=None) -> Plan:
    """Every valid layout that fits `memory_per_rank` bytes, fastest predicted step first;
    recompute=(False, True): each layout also with full recomputation (a third more compute).
    cluster, inter (see `predict`): each layout in every order of its dimensions on the nodes."""
    valid, rejected = enumerate_layouts(cfg, batch, world_size, zero_stages, schedule, recompute)
    if cluster is not None:
        _placed(cluster, inter, Layout(world_size, 1, 1))        # the cluster and the link, checked once
        valid = [replace(L, order=o) for L in valid for o in orders(dp=L.dp, tp=L.tp, pp=L.pp)]
    if not valid:
        reasons = sorted({why for _, why in rejected})
        raise PlanError(f"no layout of {world_size} ranks can run this model with a batch of {batch}: "
                        + "; ".join(reasons[:4]) + ". Change the world size, the batch or the model.")
    preds = [predict(cfg, L, batch, fit, times, dtype_bytes, oversubscription, cluster, inter) for L in valid]
    for p in preds:
        p.fits = p.memory["total"] <= memory_per_rank
    ranked = sorted((p for p in preds if p.fits), key=lambda p: (p.time["total"], p.memory["total"]))
    too_big = sorted((p for p in preds if not p.fits), key=lambda p: p.memory["total"])
    if not ranked:
        s = too_big[0]
        raise PlanError(f"no layout fits {_gb(memory_per_rank)}: the smallest needs {_gb(s.memory['total'])} per "
                        f"rank at {s.layout.name}; give each rank more memory, or use more ranks")
    return Plan(ranked, too_big, rejected, memory_per_rank)


def compare(plan_or_predictions, measured: dict) -> str:
    """Predicted next to measured: measured maps a layout name as pplab.hybrid.describe_layout writes it
    ("dp=2×tp=2") to seconds per step; the first prediction of that dp×tp×pp is used."""
    preds = plan_or_predictions.ranked + plan_or_predictions.too_big \
        if isinstance(plan_or_predictions, Plan) else list(plan_or_predictions)
    lines = [f"{'layout':28s} {'predicted ms':>13s} {'measured ms':>12s} {'ratio':>6s}"]
    for name, seconds in measured.items():
        p = next((p for p in preds if describe_layout(vars(p.layout)) == name), None)
        if p is None:
            lines.append(f"{name:28s} {'(not planned)':>13s} {seconds * 1e3:12.2f}")
            continue
        lines.append(f"{p.layout.name:28s} {p.time['total'] * 1e3:13.2f} {seconds * 1e3:12.2f} "
                     f"{p.time['total'] / seconds:6.2f}")
    return "\n".join(lines)
