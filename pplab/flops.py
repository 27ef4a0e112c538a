"""How much arithmetic a GPT does, how much of a machine it uses, and what limits each operation.

    from pplab.models import GPTConfig
    cfg = GPTConfig(vocab=51200, seq=2048, hidden=12288, heads=96, ffn=4 * 12288, layers=96)
    step = step_flops(cfg, batch=1536, recompute="full")   # forward, backward, recomputation
    mfu(step.model, seconds, H100_SXM.peak("bf16"))         # model FLOPs utilization
    roofline(matmul(4096, 4096, 4096), H100_SXM)            # compute- or memory-bound?

    work = count_step(model, x) * ranks                     # any nn.Module: torch's FLOPs, bytes per product
    print(mfu_report(work, seconds, ranks, sent_per_rank(result.timeline, steps)))   # a chapter's run, reported

**Counting.** A matrix product [m, k] @ [k, n] is m·n dot products of length k: 2·m·k·n
floating-point operations (a multiply and an add each). A GPT's arithmetic is almost all such
products, so the count is exact up to the small element-wise work (LayerNorm, GeLU, softmax,
the residual adds), which is left out, as every published count leaves it out. For one block of
the course's GPT (`pplab.models`, chapter 3's TransformerBlock) on T = b·s tokens of width h, a
feed-forward width f and a sequence s:

| product | shapes | FLOPs (forward) |
|---|---|---|
| q, k, v (one fused layer) | [T, h] @ [h, 3h] | 6·T·h² |
| scores q·kᵀ, every head | b·heads × [s, d] @ [d, s] | 2·b·s²·h |
| scores · v | b·heads × [s, s] @ [s, d] | 2·b·s²·h |
| output projection | [T, h] @ [h, h] | 2·T·h² |
| MLP up, down | [T, h] @ [h, f], [T, f] @ [f, h] | 4·T·h·f |

and the output layer [T, h] @ [h, V] adds 2·T·h·V once. The embedding is a table lookup: no
products. The backward pass computes two products for each forward one (the gradient of the
input and of the weight), so it costs twice the forward; training costs 3× the forward. With
f = 4h this is Narayanan et al.'s count: 24·T·h² + 4·b·s²·h a layer forward. Causal attention
could skip half of the scores, but the published counts (and this one) count them all.

**Per token**, training costs 6 FLOPs per weight of the products (2 forward, 4 backward), the
"6N" of Kaplan et al. and Chinchilla, plus the attention term 12·l·s·h that grows with the
sequence. **Recomputation** runs forwards again in the backward pass: "full" re-runs each
block's forward (Megatron-LM's 4 passes instead of 3, the 96 of its formula), "selective" re-runs
attention's scores only. Those FLOPs are real work for the hardware but do not train anything:
**MFU** (model FLOPs utilization) divides the FLOPs the model needs by time × peak; **HFU**
(hardware FLOPs utilization) counts the recomputed ones too, so HFU ≥ MFU.

**A chapter's run, reported.** `mfu_report` takes what a training run measured (seconds per step,
bytes each rank sent) and its FLOPs, and puts its MFU on this machine (all ranks share its cores:
one fitted peak) beside what the same layout would reach on a GPU preset: each rank's share of the
products at their roofline, then its bytes over NVLink. That second figure is predicted, not
measured, and it is optimistic (kernel launches and latency are left out), so for the small models
of the course it shows how little of a GPU they could use, whatever the code.

**Roofline** (Williams, Waterman and Patterson, 2009). An operation that does F FLOPs and must
move Q bytes between memory and the chip has arithmetic intensity I = F / Q. A machine with peak
P FLOP/s and memory bandwidth W B/s can run it at most at min(P, I·W): below the ridge
intensity P / W it waits on memory (memory-bound), above it on arithmetic (compute-bound). Big
matrix products sit far above the ridge; LayerNorm and element-wise ops far below it.
"""
from __future__ import annotations

from dataclasses import dataclass

from .hardware import DTYPE_NAMES, H100_SXM, peak_here
from .split import RING, ring_sends

RECOMPUTE = ("none", "selective", "full")


# ----------------------------------------------------------------------------------
# FLOPs of the course's GPT (any shape given as a pplab.models.GPTConfig)

def _check(cfg, batch, seq):
    seq = cfg.seq if seq is None else seq
    for name, value in (("batch", batch), ("seq", seq), ("layers", cfg.layers), ("hidden", cfg.hidden),
                        ("ffn", cfg.ffn), ("vocab", cfg.vocab)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive whole number, got {value!r}")
    return seq


def forward_flops(cfg, batch: int, seq: int | None = None) -> dict[str, int]:
    """FLOPs of one forward pass over `batch` sequences of `seq` tokens (default cfg.seq), by product.

    Keys: "qkv", "scores", "attend", "proj", "fc1", "fc2" (summed over the cfg.layers blocks) and
    "head" (the output layer). Element-wise work is not counted (see the module's docstring).
    """
    s = _check(cfg, batch, seq)
    t, h, f, l = batch * s, cfg.hidden, cfg.ffn, cfg.layers
    return {
        "qkv": l * 2 * t * h * 3 * h,
        "scores": l * 2 * batch * s * s * h,       # heads x [s, d] @ [d, s], heads x d = h
        "attend": l * 2 * batch * s * s * h,
        "proj": l * 2 * t * h * h,
        "fc1": l * 2 * t * h * f,
        "fc2": l * 2 * t * f * h,
        "head": 2 * t * h * cfg.vocab,
    }


@dataclass(frozen=True)
class StepFlops:
    """FLOPs of one training step: forward, backward (2x forward), and forwards run again."""

    forward: int
    backward: int
    recomputed: int

    @property
    def model(self) -> int:
        """What training needs: forward + backward (the numerator of MFU)."""
        return self.forward + self.backward

    @property
    def hardware(self) -> int:
        """What the hardware runs: recomputation included (the numerator of HFU)."""
        return self.model + self.recomputed


def step_flops(cfg, batch: int, seq: int | None = None, recompute: str = "none") -> StepFlops:
    """FLOPs of one training step on `batch` sequences.

    recompute: "none"; "selective" (attention's scores and their product with v run again in
    backward, Korthikanti et al. 2022); "full" (every block's forward runs again; the output
    layer's does not, as in Megatron-LM).
    """
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute must be one of {RECOMPUTE}, got {recompute!r}")
    parts = forward_flops(cfg, batch, seq)
    forward = sum(parts.values())
    again = {"none": 0,
             "selective": parts["scores"] + parts["attend"],
             "full": forward - parts["head"]}[recompute]
    return StepFlops(forward, 2 * forward, again)


def matmul_parameters(cfg) -> int:
    """Weights that enter a matrix product: l·(4h² + 2hf) + hV (no biases, norms or embeddings)."""
    h = cfg.hidden
    return cfg.layers * (4 * h * h + 2 * h * cfg.ffn) + h * cfg.vocab


def six_n(cfg) -> int:
    """Kaplan et al.'s training FLOPs per token, 6N, with N the weights of the products."""
    return 6 * matmul_parameters(cfg)


def flops_per_token(cfg, seq: int | None = None, causal: bool = False) -> int:
    """Training FLOPs per token: 6N plus attention's 12·l·s·h (forward 4·l·s·h, backward twice it).

    causal=True halves the attention term to 6·l·s·h: under a causal mask a token attends only to
    the keys before it, and a fused kernel (FlashAttention) skips the rest. That is the count of
    chapter 10's planner (`Transformer.step_flops`); the default counts every score, as torch's
    counter sees the math kernel run them and as PaLM's MFU counts them.
    """
    s = _check(cfg, 1, seq)
    return six_n(cfg) + (6 if causal else 12) * cfg.layers * s * cfg.hidden


# ----------------------------------------------------------------------------------
# Narayanan et al. 2021 (Megatron-LM on 3,072 GPUs), section 5.1: their closed forms

def megatron_flops(batch: int, seq: int, layers: int, hidden: int, vocab: int) -> float:
    """FLOPs of one step with full recomputation: 96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h)).

    The same count as `step_flops(..., recompute="full")` for f = 4h: 4 passes over the blocks
    (forward, backward = 2 forwards, forward again), 3 over the output layer.
    """
    b, s, l, h, v = batch, seq, layers, hidden, vocab
    return 96 * b * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))


def megatron_parameters(layers: int, hidden: int, vocab: int, seq: int) -> float:
    """Parameters of their GPT: 12·l·h²·(1 + 13/(12h) + (V + s)/(12·l·h)) (output tied to the embedding)."""
    l, h = layers, hidden
    return 12 * l * h * h * (1 + 13 / (12 * h) + (vocab + seq) / (12 * l * h))


def training_seconds(tokens: float, parameters: float, gpus: int, flops_per_gpu: float) -> float:
    """Their estimate of end-to-end training time, 8·T·P / (n·X): 8 FLOPs per token per parameter
    (6 for training, 2 for the recomputed forward), over n GPUs at X FLOP/s each."""
    if gpus < 1 or flops_per_gpu <= 0:
        raise ValueError(f"need at least one GPU and a positive FLOP/s, got {gpus} GPUs at {flops_per_gpu}")
    return 8 * tokens * parameters / (gpus * flops_per_gpu)


# ----------------------------------------------------------------------------------
# Utilization

def _utilization(flops: float, seconds: float, peak: float) -> float:
    if seconds <= 0 or peak <= 0:
        raise ValueError(f"seconds and peak FLOP/s must be positive, got {seconds} s and {peak} FLOP/s")
    return flops / (seconds * peak)


def mfu(step: StepFlops, seconds: float, peak: float, devices: int = 1) -> float:
    """Model FLOPs utilization: the FLOPs training needs / (step time × peak FLOP/s × devices)."""
    return _utilization(step.model, seconds, peak * devices)


def hfu(step: StepFlops, seconds: float, peak: float, devices: int = 1) -> float:
    """Hardware FLOPs utilization: as MFU, recomputed FLOPs included."""
    return _utilization(step.hardware, seconds, peak * devices)


# ----------------------------------------------------------------------------------
# Roofline

@dataclass(frozen=True)
class Op:
    """One operation: the FLOPs it does and the bytes it must read and write at least once."""

    name: str
    flops: float
    bytes: float

    @property
    def intensity(self) -> float:
        """Arithmetic intensity, FLOPs per byte moved."""
        return self.flops / self.bytes


def matmul(m: int, k: int, n: int, dtype_bytes: int = 2, name: str = "matmul") -> Op:
    """[m, k] @ [k, n]: 2mkn FLOPs; read both operands, write the result once."""
    return Op(name, 2 * m * k * n, dtype_bytes * (m * k + k * n + m * n))


def attention(batch: int, heads: int, seq: int, head_dim: int, dtype_bytes: int = 2,
              fused: bool = True, name: str = "attention") -> Op:
    """softmax(q·kᵀ)·v over `heads` heads: 4·b·heads·s²·d FLOPs (softmax not counted).

    fused (FlashAttention, Dao et al. 2022): q, k, v read once and the output written once, the
    [s, s] scores never leave the chip. Not fused: the scores are also written, read by the
    softmax, written again and read by the second product (4 trips of b·heads·s² elements).
    """
    qkvo = 4 * batch * heads * seq * head_dim
    scores = 0 if fused else 4 * batch * heads * seq * seq
    return Op(name, 4 * batch * heads * seq * seq * head_dim, dtype_bytes * (qkvo + scores))


def layer_norm(tokens: int, hidden: int, dtype_bytes: int = 2, name: str = "layer_norm") -> Op:
    """LayerNorm of [tokens, hidden]: about 7 FLOPs an element (mean: 1; subtract: 1; square and
    sum: 2; scale by 1/σ: 1; γ, β: 2); reads x and writes y once (γ, β are negligible)."""
    n = tokens * hidden
    return Op(name, 7 * n, dtype_bytes * 2 * n)


def elementwise(elements: int, inputs: int = 1, flops_per_element: int = 1, dtype_bytes: int = 2,
                name: str = "elementwise") -> Op:
    """An element-wise op on `inputs` tensors of `elements` each (a residual add: 2 inputs, 1 FLOP)."""
    return Op(name, flops_per_element * elements, dtype_bytes * (inputs + 1) * elements)


def block_ops(cfg, batch: int, seq: int | None = None, dtype_bytes: int = 2) -> list[Op]:
    """The forward operations of one block of the course's GPT, in order, for a roofline chart."""
    s = _check(cfg, batch, seq)
    t, h, f = batch * s, cfg.hidden, cfg.ffn
    return [
        layer_norm(t, h, dtype_bytes, "ln1"),
        matmul(t, h, 3 * h, dtype_bytes, "qkv"),
        attention(batch, cfg.heads, s, h // cfg.heads, dtype_bytes, name="attention"),
        matmul(t, h, h, dtype_bytes, "proj"),
        elementwise(t * h, 2, 1, dtype_bytes, "residual add"),
        layer_norm(t, h, dtype_bytes, "ln2"),
        matmul(t, h, f, dtype_bytes, "fc1"),
        elementwise(t * f, 1, 8, dtype_bytes, "gelu"),    # tanh form: about 8 FLOPs an element
        matmul(t, f, h, dtype_bytes, "fc2"),
        elementwise(t * h, 2, 1, dtype_bytes, "residual add"),
    ]


def gpt_ops(cfg, batch: int, seq: int | None = None, dtype_bytes: int = 2) -> list[Op]:
    """Every forward operation of the model: cfg.layers blocks, the final LayerNorm, the output layer."""
    s = _check(cfg, batch, seq)
    ops = [op for _ in range(cfg.layers) for op in block_ops(cfg, batch, s, dtype_bytes)]
    return ops + [layer_norm(batch * s, cfg.hidden, dtype_bytes, "ln_f"),
                  matmul(batch * s, cfg.hidden, cfg.vocab, dtype_bytes, "head")]


@dataclass(frozen=True)
class RooflinePoint:
    op: Op
    attainable: float      # FLOP/s: min(peak, intensity × bandwidth)
    ridge: float           # FLOPs per byte where the two limits meet
    bound: str             # "memory" or "compute"


def roofline(op: Op, machine, dtype: str = "bf16") -> RooflinePoint:
    """Where `op` sits on `machine`'s roofline (a pplab.hardware.Hardware, or anything with
    .peak(dtype) and .memory_bandwidth)."""
    peak, bandwidth = machine.peak(dtype), machine.memory_bandwidth
    ridge = peak / bandwidth
    return RooflinePoint(op, min(peak, op.intensity * bandwidth), ridge,
                         "memory" if op.intensity < ridge else "compute")


def roofline_seconds(ops, machine, dtype: str = "bf16") -> float:
    """The least time `ops` can take on `machine`, one after another: Σ max(F / peak, Q / bandwidth).

    A lower bound: no kernel beats its roof, and none overlaps the next. For a training step,
    3 × the forward's bound is a fair estimate (backward: two products per forward one, each
    moving about as many bytes).
    """
    peak, bandwidth = machine.peak(dtype), machine.memory_bandwidth
    return sum(max(op.flops / peak, op.bytes / bandwidth) for op in ops)


# ----------------------------------------------------------------------------------
# A chapter's training run: its MFU here, beside what the same layout would reach on a GPU

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4, "tf32": 4, "fp64": 8}
_SHORT_DTYPE = {torch_name: name for name, torch_name in DTYPE_NAMES.items()}      # "float32" -> "fp32"


@dataclass(frozen=True)
class StepCount:
    """The products of one training step (forward and backward) as Ops, and the dtype they ran in."""

    ops: tuple
    dtype: str

    @property
    def flops(self) -> int:
        return sum(op.flops for op in self.ops)

    def __mul__(self, times: int) -> "StepCount":
        """The same products run `times` times: one micro-batch's (or one rank's) count x how many there are."""
        if isinstance(times, bool) or not isinstance(times, int) or times < 1:
            raise ValueError(f"a step count repeats a positive whole number of times, got {times!r}")
        return StepCount(self.ops * times, self.dtype)


def count_step(model, *inputs, loss=None) -> StepCount:
    """Run one forward and backward pass of `model` (any nn.Module) on `inputs`, and record every
    product torch runs (matmuls, convolutions): its FLOPs by torch's own formulas (those
    FlopCounterMode uses) and the bytes of the tensors it reads and writes.

    loss: output -> the scalar to differentiate (default: the sum of the output's floating-point
    tensors; a loss is element-wise work, so the products are the same whichever it is). The pass
    runs on a copy of the model, with the random state restored and gradients taken by
    torch.autograd.grad: `model`, its .grad and the next random numbers are left as they were.
    Attention runs as explicit products (the math kernel) so that it is counted too.
    """
    import copy

    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves
    from torch.utils.flop_counter import flop_registry

    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"count_step takes an nn.Module and its inputs, got {type(model).__name__}")
    products = []

    class Products(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            formula = flop_registry.get(func._overloadpacket)
            if formula is not None:
                tensors = [t for t in tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)]
                products.append((Op(func._overloadpacket.__name__, formula(*args, **kwargs, out_val=out),
                                    sum(t.numel() * t.element_size() for t in tensors)), tensors[-1].dtype))
            return out

    # a tensor kept from an earlier forward (an auxiliary loss, say) is no leaf and cannot be deep-copied: detach it
    kept = {id(t): t.detach() for m in model.modules() for t in vars(m).values()
            if isinstance(t, torch.Tensor) and not t.is_leaf}
    copied = copy.deepcopy(model, kept)
    weights = [w for w in copied.parameters() if w.requires_grad]
    if not weights:
        raise ValueError("the model has no parameter that requires grad: there is no training step to count")
    with torch.random.fork_rng(devices=[]), sdpa_kernel(SDPBackend.MATH), Products():
        out = copied(*inputs)
        value = loss(out) if loss is not None else \
            sum(t.sum() for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point())
        torch.autograd.grad(value, weights, allow_unused=True)
    if not products:
        raise ValueError("no matrix product ran in the model's forward and backward: nothing for MFU to count")
    by_dtype = {}
    for op, dtype in products:
        by_dtype[dtype] = by_dtype.get(dtype, 0) + op.flops
    dtype = str(max(by_dtype, key=by_dtype.get)).removeprefix("torch.")
    if dtype not in _SHORT_DTYPE:
        raise ValueError(f"the products ran in {dtype}; MFU is reported for {sorted(_SHORT_DTYPE)}")
    return StepCount(tuple(op for op, _ in products), _SHORT_DTYPE[dtype])


# Bytes a rank sends for the payload it hands a collective that the backend runs (pplab.comm traces
# that payload, not the backend's bytes on the wire): the rings' (pplab.split.ring_sends, exact for
# equal pieces, to a byte or so for an all-reduce the ranks do not divide), the least any algorithm
# sends, and NCCL's inside a GPU node; the rest as NCCL's rings and chains send them.
_OTHER_SENDS = {"scatter": lambda p: p - 1,        # the payload is one rank's piece
                "broadcast": lambda p: 1, "reduce": lambda p: 1, "gather": lambda p: 1, "barrier": lambda p: 0}


def _collective_sends(kind: str, payload: int, group, rank: int) -> float:
    p = len(group)
    if kind in RING:
        whole = payload * p if kind == "all_gather" else payload      # an all-gather's payload: one piece
        return ring_sends(kind, whole, p, group.index(rank))
    return _OTHER_SENDS[kind](p) * payload


def sent_per_rank(timeline, steps: int = 1, skip=()) -> float:
    """The most bytes any rank of a measured `timeline` sent per step, over `steps` steps: its
    point-to-point sends as traced, plus, for each collective the backend ran, the bytes a ring
    algorithm sends for its payload (counted on every rank of the group, roots included). A
    collective run over point-to-point sends (pplab.cluster.two_tier, ZeRO++) is counted by its sends.
    skip: kinds of comm events that are no messages (chapter 9's "disk_read", "disk_write")."""
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a positive whole number, got {steps!r}")
    known = sorted(RING + tuple(_OTHER_SENDS))
    most = 0.0
    for rank in range(timeline.world_size):
        sent = 0.0
        for e in timeline.select(rank, "comm"):
            if e.kind in skip or e.meta.get("via") == "p2p":        # the latter's sends are in the trace
                continue
            if e.bytes_sent or e.kind in ("send", "recv"):
                sent += e.bytes_sent
            elif e.kind in known:
                sent += _collective_sends(e.kind, e.meta.get("payload", 0), list(e.group), rank)
            else:
                raise ValueError(f"rank {rank} traced a {e.kind!r} whose bytes sent_per_rank cannot tell; "
                                 f"it knows {known} and point-to-point sends")
        most = max(most, sent)
    return most / steps


@dataclass(frozen=True)
class MFUReport:
    """A training run's MFU on this machine, beside what the same layout would reach on a preset GPU."""

    flops: float                 # model FLOPs of one step, every rank's together
    seconds: float               # measured seconds per step
    ranks: int
    dtype: str                   # the run's dtype, in which this machine's peak is fitted
    peak_here: float             # FLOP/s of this machine, one device that every rank shares
    preset: object               # a pplab.hardware.Hardware
    preset_dtype: str
    compute_seconds: float       # per rank, on the preset: the least its share of the products can take
    memory_bound: float | None   # the share of compute_seconds spent waiting on memory (None: no op list)
    sent_bytes: float | None     # per rank and step, in preset_dtype (None: not traced)
    link_bandwidth: float        # B/s, one direction

    @property
    def mfu_here(self) -> float:
        return self.flops / (self.seconds * self.peak_here)

    @property
    def comm_seconds(self) -> float:
        return 0.0 if self.sent_bytes is None else self.sent_bytes / self.link_bandwidth

    @property
    def preset_seconds(self) -> float:
        """The predicted step: compute at its roofline, then the sends at the link's bandwidth (no overlap)."""
        return self.compute_seconds + self.comm_seconds

    @property
    def mfu_preset(self) -> float:
        return self.flops / (self.ranks * self.preset_seconds * self.preset.peak(self.preset_dtype))

    def __str__(self):
        here = (f"this machine: MFU {100 * self.mfu_here:.3g}% ({_si(self.flops, 'FLOP')} a step in {_si(self.seconds, 's')}; "
                f"{self.ranks} rank{'s' * (self.ranks > 1)} sharing one {self.dtype} peak of "
                f"{_si(self.peak_here, 'FLOP/s')}, fitted here)")
        how = ("its FLOPs at peak: no op list, so memory is not counted" if self.memory_bound is None else
               f"its products at their roofline, {self.memory_bound:.0%} of that time memory-bound")
        sends = ("sends not traced" if self.sent_bytes is None else
                 f"{_si(self.comm_seconds, 's')} sending {_si(self.sent_bytes, 'B')} per rank at "
                 f"{_si(self.link_bandwidth, 'B/s')}")
        there = (f"{self.ranks} x {self.preset.name} in {self.preset_dtype}, predicted from the roofline, not measured: "
                 f"{_si(self.compute_seconds, 's')} of compute per rank ({how}) + {sends}; MFU at most "
                 f"{100 * self.mfu_preset:.3g}% if they do not overlap (kernel launches and latency left out)")
        return f"{here}\n{there}"


def _si(value: float, unit: str) -> str:
    """3 significant digits and an SI prefix: 0.00468e-6 s -> '4.68 ns'."""
    for factor, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k"), (1, ""), (1e-3, "m"), (1e-6, "µ")):
        if abs(value) >= factor:
            return f"{value / factor:.3g} {prefix}{unit}"
    return f"{value / 1e-9:.3g} n{unit}"


def mfu_report(work, seconds: float, ranks: int = 1, sent_bytes: float | None = None, *,
               dtype: str | None = None, peak: float | None = None, preset=None, preset_dtype: str = "bf16",
               link_bandwidth: float | None = None) -> MFUReport:
    """A training run's MFU on this machine, and what the same layout would reach on `preset`.

    work: the step's model FLOPs, every rank's together: a StepCount (`count_step`: FLOPs and the
      op list), a StepFlops (`step_flops`) or a number of FLOPs (no op list: the preset's compute
      is then the FLOPs at its peak).
    seconds: measured seconds per step. ranks: how many ranks ran it.
    sent_bytes: the most bytes a rank sent per step, in the run's dtype (`sent_per_rank`).
    dtype: the run's dtype (default: the StepCount's, else "fp32"); peak: this machine's FLOP/s in
      it (default: `pplab.hardware.peak_here(dtype)`, fitted once per process).
    preset: a pplab.hardware.Hardware (default H100 SXM), run in `preset_dtype`, its ranks in one
      node (NVLink; pass link_bandwidth for another link).

    On this machine every rank shares the same cores, so MFU divides by one peak. On the preset
    each rank is a GPU doing 1/ranks of the products: their roofline time over ranks is the least
    the slowest rank can take (cutting a product into pieces never moves fewer bytes), and the
    bytes (converted to preset_dtype) cross the link at its bandwidth. Kernel launches, the
    element-wise ops and message latency are left out: a real GPU would be slower still.
    """
    preset = H100_SXM if preset is None else preset
    dtype = dtype or (work.dtype if isinstance(work, StepCount) else "fp32")
    for name, value in (("dtype", dtype), ("preset_dtype", preset_dtype)):
        if value not in DTYPE_BYTES:
            raise ValueError(f"{name} must be one of {sorted(DTYPE_BYTES)}, got {value!r}")
    flops = work.flops if isinstance(work, StepCount) else work.model if isinstance(work, StepFlops) else work
    if isinstance(flops, bool) or not isinstance(flops, (int, float)) or not flops > 0:
        raise ValueError(f"work must be a StepCount, a StepFlops or a positive number of FLOPs, got {work!r}")
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds > 0:
        raise ValueError(f"seconds must be the measured seconds per step (> 0), got {seconds!r}")
    if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
        raise ValueError(f"ranks must be a positive whole number, got {ranks!r}")
    if sent_bytes is not None and not sent_bytes >= 0:
        raise ValueError(f"sent_bytes must be the bytes a rank sent per step (>= 0) or None, got {sent_bytes!r}")
    if link_bandwidth is None:
        if ranks > 8:
            raise ValueError(f"{ranks} ranks do not fit one node of 8 GPUs: pass link_bandwidth (e.g. "
                             f"preset.network, {preset.network:.3g} B/s) for the link between nodes")
        link_bandwidth = preset.nvlink
    scale = DTYPE_BYTES[preset_dtype] / DTYPE_BYTES[dtype]      # the same numbers, in the preset's dtype
    if isinstance(work, StepCount):
        ops = [Op(op.name, op.flops, op.bytes * scale) for op in work.ops]
        compute = roofline_seconds(ops, preset, preset_dtype) / ranks
        memory_bound = roofline_seconds([op for op in ops if roofline(op, preset, preset_dtype).bound == "memory"],
                                        preset, preset_dtype) / ranks / compute
    else:
        compute, memory_bound = flops / ranks / preset.peak(preset_dtype), None
    return MFUReport(float(flops), float(seconds), ranks, dtype, peak_here(dtype) if peak is None else float(peak),
                     preset, preset_dtype, compute, memory_bound,
                     None if sent_bytes is None else sent_bytes * scale, link_bandwidth)
