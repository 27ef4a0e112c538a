"""The planner at scale: which layout trains a big transformer fastest on a GPU cluster, by closed forms.

    llama = Transformer("Llama 3 405B", layers=126, hidden=16384, heads=128, vocab=128256, seq=8192,
                        ffn=53248, kv_heads=8, gated=True, tied=False)
    cluster = GPUCluster(H100_SXM, nodes=1024, gpus_per_node=8)
    plan = search(llama, cluster, batch=2048)            # every layout, ranked: plan.top(5), plan.why_not
    estimate(llama, cluster, 2048, Layout(dp=64, tp=8, pp=16, v=8, zero=2, recompute="none", balanced=True))

Chapter 7's planner measures a tiny GPT on this machine and simulates its schedule. A cluster
cannot be measured from here, so this one puts together the course's closed forms, each checked on
real ranks in an earlier chapter (they are listed, with their sources, in closed_forms.py): the
roofline of every operation of a layer (chapter 10a) at EFFICIENCY × peak, tensor, context and data
parallel collectives by the two-tier α-β cost (chapter 10b), the pipeline's bubble (chapter 4),
ZeRO's model state (chapter 6) and Korthikanti et al.'s activations (chapters 5 and 9).

Every layout of a cluster is evaluated at once, as numpy arrays (`search`): no schedule is simulated,
so 16,384 GPUs take a fraction of a second; pplab.pipeline's simulator checks the closed forms in
tests/test_planner_at_scale.py.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, fields

import numpy as np

from ..hardware import Hardware
from .closed_forms import (EFFICIENCY, FLASH_UTILIZATION, NETWORK_LATENCY, evaluate,  # noqa: F401
                           layer_activation_bytes, layers_in_flight, microbatches_in_flight, pipeline_steps,
                           stage_layers)

RECOMPUTE = ("none", "selective", "full")
TOP_CHOICE = 0.05        # layouts within 5% of the fastest predicted step are the planner's top choices


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


# What a GPU's memory holds, in MiB, as its driver reports it (nvidia-smi's memory.total). The
# datasheets' "80GB" of HBM are binary gigabytes: an A100 80GB has 81,920 MiB = 80 GiB, an H100 80GB
# HBM3 shows 81,559 MiB, an H200 143,771 MiB. The presets' `memory` is the datasheet number in
# decimal bytes (80e9), 7% less than the GPU holds.
DRIVER_MIB = {"A100 80GB SXM": 81920, "H100 SXM": 81559, "H200 SXM": 143771}


@dataclass(frozen=True)
class GPUCluster:
    """nodes × gpus_per_node GPUs of one preset (pplab.hardware), NVLink inside a node, the network between."""

    hardware: Hardware
    nodes: int
    gpus_per_node: int = 8

    def __post_init__(self):
        for name in ("nodes", "gpus_per_node"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise AtScaleError(f"{name} must be a whole number >= 1, got {v!r}")
        if not (self.hardware.nvlink and self.hardware.network):
            raise AtScaleError(f"{self.hardware.name} has no NVLink or network bandwidth: use a GPU preset "
                               f"(pplab.hardware.A100_80GB, H100_SXM, H200)")

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def capacity(self) -> float:
        """Bytes a GPU holds (DRIVER_MIB; the preset's `memory` for others). The planner's count
        leaves out the CUDA context, NCCL's buffers and short-lived tensors: a layout within a few GB
        of it is tight."""
        mib = DRIVER_MIB.get(self.hardware.name)
        return mib * 2 ** 20 if mib else self.hardware.memory


@dataclass(frozen=True)
class Layout:
    dp: int
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1                  # expert parallelism: ep ranks hold different experts, read different data
    zero: int = 1
    recompute: str = "selective"
    micro_batch: int = 1
    v: int = 1                   # interleaved chunks per pipeline rank (1: plain 1F1B)
    sp: bool = True              # Megatron sequence parallelism inside the tp group
    balanced: bool = False       # Llama 3's split: embedding and output layer each in place of a layer (pp > 2)

    @property
    def name(self) -> str:
        parts = [f"{k.upper()} {getattr(self, k)}" for k in ("dp", "tp", "pp", "cp", "ep") if getattr(self, k) > 1]
        extra = ([f"v={self.v}"] if self.v > 1 else []) + (["balanced"] if self.balanced and self.pp > 2 else [])
        return " × ".join(parts or ["1 GPU"]) + f" (ZeRO-{self.zero}, recompute {self.recompute}, mb {self.micro_batch}" + \
            "".join(", " + e for e in extra) + (", SP" if self.sp and self.tp > 1 else "") + ")"


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
        mem, cap, gib = self.memory, self.capacity / 2 ** 30, 2 ** 30
        if self.fits:
            return ""
        state = (mem["memory"] - mem["activations"]) / gib
        if state > cap:
            return f"model state alone is {state:.1f} GiB > {cap:.1f} GiB: more tp, pp or a higher ZeRO stage"
        return (f"activations {mem['activations'] / gib:.1f} GiB on top of {state:.1f} GiB of model state exceed "
                f"{cap:.1f} GiB: recompute, a smaller micro-batch, more tp, cp or pp")

    def __repr__(self):
        return (f"{self.layout.name}: {self.memory['memory'] / 2 ** 30:.1f} GiB/GPU, step {self.time['step']:.2f} s, "
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
    replicas = layout.dp * layout.ep                 # ep ranks hold different experts and read different data
    if batch % (replicas * layout.micro_batch):
        problems.append(f"the batch of {batch} sequences is not a whole number of micro-batches of "
                        f"{layout.micro_batch} on each of dp × ep = {replicas} replicas")
    if model.heads % layout.tp:
        problems.append(f"tp = {layout.tp} must divide the {model.heads} attention heads")
    elif not _kv_splits(model, layout.tp):
        problems.append(f"tp = {layout.tp} must divide the {model.kv} key/value heads, or be a multiple of them "
                        f"(each rank then holds a copy of one)")
    if model.seq % layout.cp:
        problems.append(f"cp = {layout.cp} must divide the sequence of {model.seq} tokens")
    if layout.ep > 1 and model.experts == 1:
        problems.append(f"ep = {layout.ep} needs a mixture of experts: {model.name} has one MLP a layer (experts=1)")
    elif model.experts % layout.ep:
        problems.append(f"ep = {layout.ep} must divide the {model.experts} experts")
    if layout.pp > model.layers:
        problems.append(f"pp = {layout.pp} stages for {model.layers} layers: at most one stage a layer")
    if layout.balanced and layout.pp > 2 and (model.layers + 2) % layout.pp:
        problems.append(f"balanced: the {model.layers} layers + embedding + output layer must split evenly "
                        f"into pp = {layout.pp} stages; pick pp dividing {model.layers + 2}")
    slots = _slots(model.layers, layout.pp, layout.balanced)
    if slots % layout.v:
        problems.append(f"v = {layout.v} chunks must divide the {slots} layer slots of a rank")
    if problems:
        raise AtScaleError(f"{layout.name}: " + "; ".join(problems))


def _estimate(model, cluster, batch, layout, row) -> Estimate:
    keys = ("params", "grads", "optimizer", "activations", "memory")
    return Estimate(layout, {k: float(row[k]) for k in keys},
                    {k: float(row[k]) for k in ("compute", "bubble", "tp", "dp", "optimizer_step", "step")},
                    model.step_flops(batch), cluster.gpus, cluster.hardware.peak("bf16"), cluster.capacity)


def estimate(model: Transformer, cluster: GPUCluster, batch: int, layout: Layout) -> Estimate:
    """Memory per GPU and step time of one layout, `batch` sequences a step."""
    _check(model, cluster, batch, layout)
    x = {f.name: np.array([getattr(layout, f.name)]) for f in fields(Layout)}
    row = {k: v[0] for k, v in evaluate(model, cluster, batch, x).items()}
    return _estimate(model, cluster, batch, layout, row)


def _slots(layers, pp, balanced):
    """Layer slots of a pipeline rank: ceil(L/p); balanced (pp > 2): ceil((L+2)/p), the embedding and
    the output layer each taking one."""
    return math.ceil((layers + 2) / pp) if balanced and pp > 2 else math.ceil(layers / pp)


def _kv_splits(model, tp):
    """Whether tp ranks can share the key/value heads: whole heads each (tp divides kv), or one copy
    of one head each (tp a multiple of kv, as when tp = 8 exceeds a GQA model's kv heads)."""
    return model.kv % tp == 0 or tp % model.kv == 0


def _divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(model: Transformer, cluster: GPUCluster, batch: int, max_micro_batch: int = 16, max_v: int = 8,
               sp: bool = True) -> dict:
    """Every valid layout as arrays: dp·tp·pp·cp·ep = GPUs, tp | heads (and tp | kv heads or kv | tp),
    cp | seq, ep | experts, dp·micro-batch | batch, v | layer slots of a rank; with pp > 2 both stage splits (even, and
    Llama 3's balanced where pp divides layers + 2); ZeRO 0-3; recomputation none/selective/full;
    sequence parallelism whenever tp > 1 unless sp=False (same bytes as tp's all-reduces, less memory)."""
    n, rows = cluster.gpus, []
    for tp, cp, ep in itertools.product(_divisors(model.heads), _divisors(model.seq), _divisors(model.experts)):
        if n % (tp * cp * ep) or not _kv_splits(model, tp):
            continue
        for pp in _divisors(n // (tp * cp * ep)):
            dp = n // (tp * cp * ep * pp)
            if pp > model.layers or batch % (dp * ep):
                continue
            for mb in (b for b in _divisors(batch // (dp * ep)) if b <= max_micro_batch):
                for bal in ((False, True) if pp > 2 and (model.layers + 2) % pp == 0 else (False,)):
                    per_rank = _slots(model.layers, pp, bal)
                    for v in (c for c in _divisors(per_rank) if c <= max_v and (c == 1 or pp > 1)):
                        rows.append((dp, tp, pp, cp, ep, mb, v, bal))
    if not rows:
        raise AtScaleError(f"no layout splits {n} GPUs for {model.name} with a batch of {batch}: "
                           f"the batch must be divisible by some data-parallel size")
    base = np.array(rows).T
    k = base.shape[1]
    grid = {name: np.tile(col, 12) for name, col in zip(("dp", "tp", "pp", "cp", "ep", "micro_batch", "v", "balanced"), base)}
    grid["balanced"] = grid["balanced"].astype(bool)
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

    def rank(self, among: dict | None = None, **shape) -> int:
        """1-based rank of the best layout with this shape (e.g. dp=64, tp=8, pp=16) among the distinct
        shapes (dp, tp, pp, cp, ep), each counted once by its fastest variant that fits; among: only
        shapes with these fields (e.g. {"cp": 1}) compete. 0 if none fits."""
        seen, among = set(), among or {}
        for i in self.order:
            if any(self.x[k][i].item() != want for k, want in among.items()):
                continue
            seen.add(tuple(int(self.x[d][i]) for d in ("dp", "tp", "pp", "cp", "ep")))
            if all(self.x[d][i].item() == want for d, want in shape.items()):
                return len(seen)
        return 0

    def distance(self, among: dict | None = None, **shape) -> float:
        """How much longer the best fitting layout with this shape steps than the fastest layout that
        fits (among: only layouts with these fields compete): 0.0 for the planner's first choice,
        0.05 for 5% slower. The planner's closed forms are good to several percent (the Megatron-LM
        rows), so layouts within TOP_CHOICE of the fastest are, to it, equally good: its top choices."""
        among = among or {}
        best = self.best(**{**among, **shape})
        first = self.best(**among)
        if best is None:
            raise AtScaleError(f"no layout with {shape} fits: see why_not")
        return best.time["step"] / first.time["step"] - 1

    @property
    def why_not(self) -> dict:
        """How many layouts do not fit, by reason."""
        mem, cap = self.result["memory"], self.cluster.capacity
        state = mem - self.result["activations"]
        return {"model state alone exceeds memory": int(np.sum(state > cap)),
                "activations exceed what model state leaves": int(np.sum((state <= cap) & (mem > cap))),
                "fit": int(np.sum(mem <= cap))}


def search(model: Transformer, cluster: GPUCluster, batch: int, **limits) -> Plan:
    """Every layout of `cluster` for `batch` sequences a step, evaluated at once; those that fit ranked
    by step time (then memory)."""
    x = candidates(model, cluster, batch, **limits)
    result = evaluate(model, cluster, batch, x)
    fit = np.flatnonzero(result["memory"] <= cluster.capacity)
    order = fit[np.lexsort((result["memory"][fit], result["step"][fit]))]
    return Plan(model, cluster, batch, x, result, order)
