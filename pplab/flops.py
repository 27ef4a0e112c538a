"""How much arithmetic a GPT does, how much of a machine it uses, and what limits each operation.

    from pplab.models import GPTConfig
    cfg = GPTConfig(vocab=51200, seq=2048, hidden=12288, heads=96, ffn=4 * 12288, layers=96)
    step = step_flops(cfg, batch=1536, recompute="full")   # forward, backward, recomputation
    mfu(step.model, seconds, H100_SXM.peak("bf16"))         # model FLOPs utilization
    roofline(matmul(4096, 4096, 4096), H100_SXM)            # compute- or memory-bound?

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

**Roofline** (Williams, Waterman and Patterson, 2009). An operation that does F FLOPs and must
move Q bytes between memory and the chip has arithmetic intensity I = F / Q. A machine with peak
P FLOP/s and memory bandwidth W B/s can run it at most at min(P, I·W): below the ridge
intensity P / W it waits on memory (memory-bound), above it on arithmetic (compute-bound). Big
matrix products sit far above the ridge; LayerNorm and element-wise ops far below it.
"""
from __future__ import annotations

from dataclasses import dataclass

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


def flops_per_token(cfg, seq: int | None = None) -> int:
    """Training FLOPs per token: 6N plus attention's 12·l·s·h (forward 4·l·s·h, backward twice it)."""
    s = _check(cfg, 1, seq)
    return six_n(cfg) + 12 * cfg.layers * s * cfg.hidden


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
