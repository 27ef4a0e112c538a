"""The planner at scale: which layout trains a big transformer fastest on a GPU cluster, by closed forms.

    llama = Transformer("Llama 3 405B", layers=126, hidden=16384, heads=128, vocab=128256, seq=8192,
                        ffn=53248, kv_heads=8, gated=True, tied=False)
    cluster = GPUCluster(H100_SXM, nodes=1024, gpus_per_node=8)
    plan = search(llama, cluster, batch=2048)            # every layout, ranked: plan.top(5), plan.why_not
    estimate(llama, cluster, 2048, Layout(dp=64, tp=8, pp=16, v=4, zero=2, recompute="none"))

Chapter 7's planner measures a tiny GPT on this machine and simulates its schedule. A cluster
cannot be measured from here, so this one is made of the course's closed forms, each of them
checked on real ranks in an earlier chapter:

* **compute** (chapter 10a): every operation of a layer on the roofline, max(FLOPs / (EFFICIENCY ×
  peak), bytes / HBM bandwidth): matrix products, attention (FlashAttention, fused, skips the masked
  half of a causal mask; "unfused" writes the scores), norms and element-wise ops. Backward = 2 ×
  forward; full recomputation runs the forward again, selective the attention again.
* **tensor parallelism** (chapter 3): 2 all-reduces of [b, s, h] a layer forward, 2 backward (with
  sequence parallelism, chapter 5: all-gathers and reduce-scatters of the same bytes), 2 more when
  recomputing; **context parallelism** (Llama 3's): an all-gather of K and V forward and a
  reduce-scatter backward; every collective by `pplab.cluster.predict_all_reduce`, with NVLink inside
  a node and the network between nodes (chapter 10b), not overlapped with compute.
* **pipeline** (chapter 4), the heaviest rank's work per micro-batch t (its layers, the last stage's
  output layer) times m + (p−1)/v + (v−1)·max(0, p−m)/v: the 1F1B bubble (p−1)·t, shrunk v times by
  interleaving (Narayanan et al. 2021), larger when m < p (`pplab.pipeline.bubble_fraction`).
* **data parallelism and ZeRO** (chapters 2 and 6): the gradients' all-reduce (reduce-scatter +
  all-gather for ZeRO-1/2, the same bytes) once a step; ZeRO-3 also all-gathers the weights twice
  and reduce-scatters each micro-batch; the optimizer step reads and writes its shard once.
* **memory per GPU** (the first pipeline rank: most micro-batches in flight, the embedding):
  parameters, gradients, Adam's state by `pplab.zero.model_state_bytes` over dp × cp ranks;
  activations by Korthikanti et al.'s per-layer count (`layer_activation_bytes`), times the layers
  of a rank, times the micro-batches in flight: min(p, m) for 1F1B, min(m, p + (p−1)/v) interleaved.

Every layout of a cluster is evaluated at once, as numpy arrays (`search`): no schedule is simulated.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, fields

import numpy as np

from ..cluster import Cluster, predict_all_reduce
from ..flops import attention, elementwise, layer_norm, matmul
from ..hardware import Hardware
from ..zero import model_state_bytes

# The one efficiency constant: the fraction of dense peak FLOP/s that a training step's matrix
# products sustain. Not fitted to any row; its justification is in notebooks/10_at_scale.ipynb.
EFFICIENCY = 0.6
RECOMPUTE = ("none", "selective", "full")
ADAM_BYTES_TOUCHED = 28        # optimizer step per owned parameter: read + write fp32 master, m, v; read grad, write weight


class AtScaleError(ValueError):
    """The request cannot be planned; the message says what to change."""


@dataclass(frozen=True)
class Transformer:
    """A decoder-only transformer. ffn defaults to 4·hidden, kv_heads to heads (no GQA).
    gated: a SwiGLU MLP (3 matrices); tied: the output layer shares the embedding's weights;
    flash: attention runs fused (FlashAttention), else its scores are written to memory;
    dropout: masks kept for backward (1 byte an element); experts > 1: a mixture of experts."""

    name: str
    layers: int
    hidden: int
    heads: int
    vocab: int
    seq: int
    ffn: int | None = None
    kv_heads: int | None = None
    gated: bool = False
    tied: bool = True
    flash: bool = True
    dropout: bool = False
    experts: int = 1
    top_k: int = 1

    def __post_init__(self):
        for name in ("layers", "hidden", "heads", "vocab", "seq", "experts", "top_k"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise AtScaleError(f"{name} must be a whole number >= 1, got {v!r}")
        if self.hidden % self.heads:
            raise AtScaleError(f"hidden ({self.hidden}) must be a multiple of heads ({self.heads})")
        if self.heads % self.kv:
            raise AtScaleError(f"heads ({self.heads}) must be a multiple of kv_heads ({self.kv})")

    f = property(lambda self: self.ffn or 4 * self.hidden)
    kv = property(lambda self: self.kv_heads or self.heads)
    head_dim = property(lambda self: self.hidden // self.heads)

    @property
    def attention_weights(self) -> int:
        """q and the output projection: h² each; k and v: h × kv_heads·head_dim each."""
        return 2 * self.hidden ** 2 + 2 * self.hidden * self.kv * self.head_dim

    @property
    def mlp_weights(self) -> int:
        """One expert's MLP: 2 matrices h × f, 3 when gated."""
        return (3 if self.gated else 2) * self.hidden * self.f

    @property
    def parameters(self) -> int:
        """Weights of the matrices, the embedding and (untied) the output layer; norms and biases left out."""
        per_layer = self.attention_weights + self.experts * self.mlp_weights
        return self.layers * per_layer + self.vocab * self.hidden * (1 if self.tied else 2)

    def step_flops(self, sequences: int, causal: bool = True) -> float:
        """Model FLOPs of a training step (forward + backward, no recomputation): per token 6 × the
        weights a token meets (top_k experts, the output layer; not the embedding lookup) plus
        attention's 12·layers·seq·hidden, halved when causal: a token attends to the keys before it
        only, and FlashAttention skips the rest. causal=False is PaLM's count (Chowdhery et al. 2022)
        and pplab.flops', which count every score."""
        met = self.layers * (self.attention_weights + self.top_k * self.mlp_weights) + self.vocab * self.hidden
        return sequences * self.seq * (6 * met + (6 if causal else 12) * self.layers * self.seq * self.hidden)


@dataclass(frozen=True)
class GPUCluster:
    hardware: Hardware
    nodes: int
    gpus_per_node: int = 8

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node


@dataclass(frozen=True)
class Layout:
    dp: int
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    zero: int = 1
    recompute: str = "selective"
    micro_batch: int = 1
    v: int = 1                   # interleaved chunks per pipeline rank (1: plain 1F1B)
    sp: bool = True              # Megatron sequence parallelism inside the tp group

    @property
    def name(self) -> str:
        parts = [f"{k.upper()} {getattr(self, k)}" for k in ("dp", "tp", "pp", "cp", "ep") if getattr(self, k) > 1]
        extra = [f"v={self.v}"] if self.v > 1 else []
        return " × ".join(parts or ["1 GPU"]) + f" (ZeRO-{self.zero}, recompute {self.recompute}, mb {self.micro_batch}" + \
            "".join(", " + e for e in extra) + (", SP" if self.sp and self.tp > 1 else "") + ")"


# ----------------------------------------------------------------------------------
# Closed forms; every argument may be a numpy array (one entry per layout)

def layer_activation_bytes(model: Transformer, micro_batch, tp=1, cp=1, sp=True, recompute="none"):
    """Bytes one layer keeps for backward, Korthikanti et al. 2022 (Table 2) for any transformer:
    16-bit activations, 1-byte dropout masks. Per token, with t = tp and sequence parallelism
    dividing the norms' and dropouts' share by t too:
        norms' inputs 2·2h; attention: its input 2h, q 2h/t, k and v 2·2·kv·d/t, its output 2h/t,
        (dropout mask h); scores: 5·a·s/t (softmax 2, its dropout mask 1 and output 2) unless
        fused or recomputed (selective); MLP: its input 2h, 2f/t (GeLU: its input and fc2's) or
        3f/t (SwiGLU: gate, up and their product) × 2 bytes, (dropout mask h).
    For f = 4h and a·d = h that is s·b·h·(10 + 24/t + 5·a·s/(h·t)), or 34·s·b·h/t with sequence
    parallelism (pplab.memory.activation_bytes_formula). Full recomputation keeps the input only.
    cp splits the sequence: s/cp tokens a GPU, each attending to all s keys."""
    m, h, d = model, model.hidden, model.head_dim
    tp, cp, mb = np.asarray(tp), np.asarray(cp), np.asarray(micro_batch)
    shared = np.where(np.asarray(sp) & (tp > 1), tp, 1)          # what SP cuts: norms, dropouts, layer inputs
    tokens = mb * m.seq / cp
    drop = 1.0 if m.dropout else 0.0
    norms = 2 * 2 * h / shared
    attn = 2 * h / shared + (2 * h + 4 * m.kv * d + 2 * h) / tp + drop * h / shared
    mlp = 2 * h / shared + 2 * (3 if m.gated else 2) * m.f / tp + drop * h / shared
    scores = 0.0 if m.flash else (4 + drop) * m.heads * m.seq / tp    # per query token: a·s of each
    rec = np.asarray(recompute)
    per_token = norms + attn + mlp + np.where(rec == "none", scores, 0.0)
    return tokens * np.where(rec == "full", 2 * h / shared, per_token)


def microbatches_in_flight(pp, m, v):
    """Micro-batches whose activations the first pipeline rank holds at its peak, in units of one
    micro-batch through all of its layers: 1F1B min(p, m); interleaved (v > 1) min(m, p + (p−1)/v)
    (Narayanan et al. 2021: the warm-up runs (v−1)·p + 2(p−1) chunk-forwards before the first backward)."""
    pp, m, v = np.asarray(pp), np.asarray(m), np.asarray(v)
    return np.where(v == 1, np.minimum(pp, m), np.minimum(m, pp + (pp - 1) / v))


def pipeline_steps(pp, m, v):
    """The step's length in units of the heaviest rank's work for one micro-batch (forward + backward):
    m + (p−1)/v, plus (v−1)·(p−m)/v when m < p (pplab.pipeline.bubble_fraction's cases)."""
    pp, m, v = np.asarray(pp), np.asarray(m), np.asarray(v)
    return m + (pp - 1) / v + (v - 1) * np.maximum(0, pp - m) / v


def _span(cluster, sizes, dims):
    """(nodes, GPUs per node) of a group over `dims`, ranks placed in the order tp, cp, pp, dp, ep
    innermost first (Llama 3's order): a dimension has min(size, g / stride) members in a node."""
    g, stride, per_node, total = cluster.gpus_per_node, 1, 1, 1
    for name in ("tp", "cp", "pp", "dp", "ep"):
        size = sizes[name]
        if name in dims:
            per_node = per_node * np.minimum(size, np.maximum(1, g // stride))
            total = total * size
        stride = stride * size
    return total // per_node, per_node


def _all_reduce(cluster, nbytes, nodes, per_node):
    """predict_all_reduce (hierarchical: ring in the node, ring across) for each layout's group."""
    hw = cluster.hardware
    intra, inter = (0.0, 1 / hw.nvlink), (0.0, 1 / hw.network)    # α left out: messages of MBs to GBs
    nbytes, nodes, per_node = np.broadcast_arrays(np.asarray(nbytes, float), nodes, per_node)
    out = np.zeros(nbytes.shape)
    for n, r in set(zip(nodes.ravel().tolist(), per_node.ravel().tolist())):
        if n * r > 1:
            sel = (nodes == n) & (per_node == r)
            out[sel] = predict_all_reduce(nbytes[sel], Cluster(int(n), int(r)), intra, inter, "hierarchical")
    return out


def _heaviest_rank(t_layer, t_head, layers, pp):
    """Work of the slowest pipeline rank: whole layers, the last rank also the output layer, cut so
    that the slowest is as fast as it can be (k layers on the last rank, the rest spread evenly)."""
    best = np.where(pp == 1, layers * t_layer + t_head, np.inf)
    for k in range(0, -(-layers // int(np.min(pp))) + 1):
        rest = np.ceil((layers - k) / np.maximum(pp - 1, 1))
        ok = (pp > 1) & (k <= np.ceil(layers / pp))
        best = np.where(ok, np.minimum(best, np.maximum(k * t_layer + t_head, rest * t_layer)), best)
    return best


def evaluate(model: Transformer, cluster: GPUCluster, batch: int, x: dict) -> dict:
    """Memory (bytes per GPU) and time (seconds per step) of every layout in x (arrays of equal length)."""
    hw, M = cluster.hardware, model
    dp, tp, pp, cp, ep, zero, mb, v = (np.asarray(x[k]) for k in ("dp", "tp", "pp", "cp", "ep", "zero", "micro_batch", "v"))
    rec, sp = np.asarray(x["recompute"]), np.asarray(x["sp"]) & (tp > 1)
    peak, bandwidth = hw.peak("bf16") * EFFICIENCY, hw.memory_bandwidth
    h, f, V, L = M.hidden, M.f, M.vocab, M.layers
    m = batch / (dp * mb)                                  # micro-batches per step
    T = mb * M.seq / cp                                    # tokens a GPU holds in one micro-batch
    shared = np.where(sp, tp, 1)
    up = 2 if M.gated else 1

    def seconds(op):                                       # the roofline: compute- or memory-bound
        return np.maximum(op.flops / peak, op.bytes / bandwidth)
    att = attention(mb, M.heads / tp, M.seq, M.head_dim, fused=M.flash)
    t_att = seconds(att) / cp * (0.5 if M.flash else 1.0)     # FlashAttention skips the masked half
    t_fwd = (seconds(matmul(T, h, (M.heads + 2 * M.kv) * M.head_dim / tp)) + t_att
             + seconds(matmul(T, h, h / tp)) + M.top_k * (seconds(matmul(T, h, up * f / tp)) + seconds(matmul(T, f / tp, h)))
             + 2 * seconds(layer_norm(T / shared, h)) + 2 * seconds(elementwise(T * h / shared, 2))
             + M.top_k * seconds(elementwise(T * f / tp, up, 8)))
    t_layer = 3 * t_fwd + np.where(rec == "full", t_fwd, np.where(rec == "selective", t_att, 0.0))
    sizes = {"tp": tp, "cp": cp, "pp": pp, "dp": dp, "ep": ep}
    tp_ar = _all_reduce(cluster, mb * M.seq / cp * h * 2, *_span(cluster, sizes, {"tp"}))
    t_layer = t_layer + (4 + 2 * (rec == "full")) * tp_ar
    kv_gather = _all_reduce(cluster, mb * M.seq * 2 * M.kv * M.head_dim * 2 / tp, *_span(cluster, sizes, {"cp"})) / 2
    t_layer = t_layer + (2 + (rec == "full")) * kv_gather
    if M.experts > 1:                                      # dispatch and combine, forward and backward
        t_layer = t_layer + 2 * _all_reduce(cluster, T * M.top_k * h * 2, *_span(cluster, sizes, {"ep"}))
    t_head = 3 * seconds(matmul(T, h, V / tp))
    hop = np.where(pp > 1, 2 * v * T * h * 2 / tp / hw.network, 0.0)   # scatter/gather: 1/tp of [b, s, h] a hop
    t_micro = _heaviest_rank(t_layer, t_head, L, pp) + hop
    t_pipeline = t_micro * pipeline_steps(pp, m, v)

    layers_first = np.ceil(L / pp)
    layer_params = (M.attention_weights + M.experts / ep * M.mlp_weights) / tp
    psi = layers_first * layer_params + V * h / tp                 # the first rank: its layers + embedding
    zero_group = dp * cp
    state = np.zeros(psi.shape)
    for stage, n in set(zip(zero.ravel().tolist(), zero_group.ravel().tolist())):
        sel = (zero == stage) & (zero_group == n)
        state[sel] = psi[sel] * model_state_bytes(int(stage), 1, int(n))    # linear in Ψ: bytes per parameter
    params = psi * 2 / np.where(zero == 3, zero_group, 1)
    grads = psi * 2 / np.where(zero >= 2, zero_group, 1)
    acts = layers_first * layer_activation_bytes(M, mb, tp, cp, sp, rec) * microbatches_in_flight(pp, m, v)
    acts = acts + np.where(rec == "none", 0.0, layer_activation_bytes(M, mb, tp, cp, sp, "none"))   # a layer recomputed
    grad_ar = _all_reduce(cluster, psi * 2, *_span(cluster, sizes, {"dp", "cp"}))
    t_dp = np.where(zero == 3, 1.5 * m, 1.0) * grad_ar
    t_opt = psi * ADAM_BYTES_TOUCHED / np.where(zero >= 1, zero_group, 1) / bandwidth
    total = t_pipeline + t_dp + t_opt
    return {"params": params, "grads": grads, "optimizer": state - params - grads, "activations": acts,
            "memory": state + acts, "compute": t_micro * m, "bubble": t_micro * (pipeline_steps(pp, m, v) - m),
            "tp": tp_ar * (4 + 2 * (rec == "full")) * L / pp * m, "dp": t_dp, "optimizer_step": t_opt, "step": total}


# ----------------------------------------------------------------------------------
# One layout, and every layout of a cluster

@dataclass
class Estimate:
    layout: Layout
    memory: dict          # bytes per GPU: params, grads, optimizer, activations, memory (their sum)
    time: dict            # seconds per step: compute (the heaviest rank's work), bubble, dp, optimizer_step, step
    flops: float          # model FLOPs of the step (Transformer.step_flops)
    gpus: int
    peak: float
    capacity: float

    fits = property(lambda self: self.memory["memory"] <= self.capacity)
    tflops_per_gpu = property(lambda self: self.flops / self.time["step"] / self.gpus / 1e12)
    mfu = property(lambda self: self.flops / (self.time["step"] * self.gpus * self.peak))

    def why_not(self) -> str:
        """'' when it fits, else what fills the GPU."""
        mem, cap = self.memory, self.capacity / 1e9
        if self.fits:
            return ""
        state = (mem["memory"] - mem["activations"]) / 1e9
        if state > cap:
            return f"model state alone is {state:.1f} GB > {cap:.0f} GB: more tp, pp or a higher ZeRO stage"
        return (f"activations {mem['activations'] / 1e9:.1f} GB on top of {state:.1f} GB of model state exceed "
                f"{cap:.0f} GB: recompute, a smaller micro-batch, more tp, cp or pp")

    def __repr__(self):
        return (f"{self.layout.name}: {self.memory['memory'] / 1e9:.1f} GB/GPU, step {self.time['step']:.2f} s, "
                f"{self.tflops_per_gpu:.0f} TFLOP/s/GPU, MFU {self.mfu:.1%}" + ("" if self.fits else " — does not fit"))


def _check(model, cluster, batch, layout):
    n = layout.dp * layout.tp * layout.pp * layout.cp * layout.ep
    problems = []
    if n != cluster.gpus:
        problems.append(f"dp × tp × pp × cp × ep = {n}, but the cluster has {cluster.gpus} GPUs")
    if layout.recompute not in RECOMPUTE:
        problems.append(f"recompute must be one of {RECOMPUTE}, got {layout.recompute!r}")
    if layout.zero not in (0, 1, 2, 3):
        problems.append(f"zero must be 0 (DDP), 1, 2 or 3, got {layout.zero!r}")
    if batch % (layout.dp * layout.micro_batch):
        problems.append(f"the batch of {batch} sequences is not a whole number of micro-batches of "
                        f"{layout.micro_batch} on each of {layout.dp} replicas")
    if model.heads % layout.tp or model.seq % layout.cp or model.experts % layout.ep or layout.pp > model.layers:
        problems.append(f"tp must divide heads ({model.heads}), cp the sequence ({model.seq}), ep the experts "
                        f"({model.experts}), and pp be at most the layers ({model.layers})")
    if math.ceil(model.layers / layout.pp) % layout.v:
        problems.append(f"v = {layout.v} chunks must divide the {math.ceil(model.layers / layout.pp)} layers of a rank")
    if problems:
        raise AtScaleError(f"{layout.name}: " + "; ".join(problems))


def _estimate(model, cluster, batch, layout, row) -> Estimate:
    keys = ("params", "grads", "optimizer", "activations", "memory")
    return Estimate(layout, {k: float(row[k]) for k in keys},
                    {k: float(row[k]) for k in ("compute", "bubble", "tp", "dp", "optimizer_step", "step")},
                    model.step_flops(batch), cluster.gpus, cluster.hardware.peak("bf16"), cluster.hardware.memory)


def estimate(model: Transformer, cluster: GPUCluster, batch: int, layout: Layout) -> Estimate:
    """Memory per GPU and step time of one layout, `batch` sequences a step."""
    _check(model, cluster, batch, layout)
    x = {f.name: np.array([getattr(layout, f.name)]) for f in fields(Layout)}
    row = {k: v[0] for k, v in evaluate(model, cluster, batch, x).items()}
    return _estimate(model, cluster, batch, layout, row)


def _divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(model: Transformer, cluster: GPUCluster, batch: int, max_micro_batch: int = 16, max_v: int = 8,
               sp: bool = True) -> dict:
    """Every valid layout as arrays: dp·tp·pp·cp·ep = GPUs, tp | heads, cp | seq, ep | experts,
    dp·micro-batch | batch, v | layers of a rank; ZeRO 0-3; recomputation none/selective/full;
    sequence parallelism whenever tp > 1 unless sp=False (same bytes as tp's all-reduces, less memory)."""
    n, rows = cluster.gpus, []
    for tp, cp, ep in itertools.product(_divisors(model.heads), _divisors(model.seq), _divisors(model.experts)):
        if n % (tp * cp * ep):
            continue
        for pp in _divisors(n // (tp * cp * ep)):
            dp = n // (tp * cp * ep * pp)
            if pp > model.layers or batch % dp:
                continue
            per_rank = math.ceil(model.layers / pp)
            for mb in (b for b in _divisors(batch // dp) if b <= max_micro_batch):
                for v in (c for c in _divisors(per_rank) if c <= max_v and (c == 1 or pp > 1)):
                    rows.append((dp, tp, pp, cp, ep, mb, v))
    if not rows:
        raise AtScaleError(f"no layout splits {n} GPUs for {model.name} with a batch of {batch}: "
                           f"the batch must be divisible by some data-parallel size")
    base = np.array(rows).T
    k = base.shape[1]
    grid = {name: np.tile(col, 12) for name, col in zip(("dp", "tp", "pp", "cp", "ep", "micro_batch", "v"), base)}
    grid["zero"] = np.repeat(np.arange(4), 3 * k)
    grid["recompute"] = np.tile(np.repeat(np.array(RECOMPUTE), k), 4)
    grid["sp"] = (grid["tp"] > 1) & sp
    return grid


@dataclass
class Plan:
    model: Transformer
    cluster: GPUCluster
    batch: int
    x: dict               # every layout, as arrays
    result: dict          # evaluate's arrays
    order: np.ndarray     # indices of the layouts that fit, fastest first

    def layout(self, i) -> Layout:
        return Layout(**{f.name: (self.x[f.name][i].item()) for f in fields(Layout)})

    def best(self, **fixed) -> Estimate | None:
        """The fastest layout that fits with these fields fixed (e.g. dp=64, tp=8, pp=16, recompute="none")."""
        for i in self.order:
            if all(self.x[k][i].item() == want for k, want in fixed.items()):
                return self.top_at(i)
        return None

    def top_at(self, i) -> Estimate:
        return _estimate(self.model, self.cluster, self.batch, self.layout(i), {n: a[i] for n, a in self.result.items()})

    def top(self, k: int = 5) -> list[Estimate]:
        return [self.top_at(i) for i in self.order[:k]]

    def rank(self, **shape) -> int:
        """1-based rank of the best layout with this shape (e.g. dp=64, tp=8, pp=16) among the distinct
        shapes (dp, tp, pp, cp, ep), each shape counted once, by its fastest variant that fits; 0 if none fits."""
        seen, r = set(), 0
        for i in self.order:
            key = tuple(int(self.x[d][i]) for d in ("dp", "tp", "pp", "cp", "ep"))
            if key in seen:
                continue
            seen.add(key)
            r += 1
            if all(int(self.x[d][i]) == want for d, want in shape.items()):
                return r
        return 0

    @property
    def why_not(self) -> dict:
        """How many layouts do not fit, by reason."""
        mem, cap = self.result["memory"], self.cluster.hardware.memory
        state = mem - self.result["activations"]
        return {"model state alone exceeds memory": int(np.sum(state > cap)),
                "activations exceed what model state leaves": int(np.sum((state <= cap) & (mem > cap))),
                "fit": int(np.sum(mem <= cap))}


def search(model: Transformer, cluster: GPUCluster, batch: int, **limits) -> Plan:
    """Every layout of `cluster` for `batch` sequences a step, evaluated at once; those that fit ranked
    by step time (then memory)."""
    x = candidates(model, cluster, batch, **limits)
    result = evaluate(model, cluster, batch, x)
    fit = np.flatnonzero(result["memory"] <= cluster.hardware.memory)
    order = fit[np.lexsort((result["memory"][fit], result["step"][fit]))]
    return Plan(model, cluster, batch, x, result, order)
