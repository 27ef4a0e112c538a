"""ZeRO from scratch: data parallelism without N copies of the model state.

Plain data parallelism (chapter 2) keeps, on every one of N ranks, all Ψ parameters, all Ψ
gradients and the whole optimizer state: with b bytes per parameter, b per gradient and K
per parameter of optimizer state, (b + b + K)Ψ bytes per rank, N times over. ZeRO cuts the
redundant copies, one kind of tensor per stage, while each rank still trains on its own
share of the batch:

    what each rank holds            parameters   gradients   optimizer state   traffic/rank
    DDP                              bΨ           bΨ          KΨ                2Ψ all-reduce
    stage 1  ZeroOptimizer(stage=1)  bΨ           bΨ          KΨ/N              2Ψ RS + AG
    stage 2  ZeroOptimizer(stage=2)  bΨ           bΨ/N        KΨ/N              2Ψ RS + AG
    stage 3  FullyShardedModule      bΨ/N         bΨ/N        KΨ/N              3Ψ AG + AG + RS

Mixed-precision Adam is b = 2 (bf16) and K = 12 (fp32 master copy, momentum, variance:
ZeroOptimizer(..., master_dtype=torch.float32) on a bf16 model); plain fp32 AdamW is b = 4, K = 8. "Traffic" is bytes sent per rank in
units of the model's bytes, as the ring algorithms send them ((N-1)/N of it per pass, taken
as 1 in the formula's round numbers).

    ZeroOptimizer       optimizer.py       stages 1 and 2, master_dtype, reduce_dtype, offload="cpu"; stage 3's optimizer
    FullyShardedModule  fully_sharded.py   stage 3: per-unit gather, compute, free, prefetch; compute_dtype, reduce_dtype
    FlatBucket          flat.py            parameters end to end, padded, cut in N shards

And to measure what the table promises, from the run itself:

    held_bytes(model, optimizer)        bytes of parameters, gradients, optimizer state this rank holds
    sent_bytes(timeline, rank)          bytes this rank sent in the traced collectives (ring algorithms)
    model_state_bytes(stage, ...)       the table's formula, per rank
"""
from __future__ import annotations

import torch

from .. import costmodel
from ..memory import storage_bytes
from .flat import FlatBucket
from .fully_sharded import FullyShardedModule
from .optimizer import ZeroOptimizer

__all__ = ["ZeroOptimizer", "FullyShardedModule", "FlatBucket", "held_bytes", "sent_bytes",
           "model_state_bytes", "traffic_bytes"]


def model_state_bytes(stage: int, psi: int, n: int, param_bytes: int = 2, grad_bytes: int = 2,
                      state_bytes: int = 12) -> float:
    """Bytes of model state per rank by the formula (stage 0 = DDP): Ψ parameters, N ranks.

    The defaults are mixed-precision Adam, (2 + 2 + 12)Ψ; fp32 AdamW is 4, 4, 8.
    """
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be 0 (DDP), 1, 2 or 3, got {stage!r}")
    if not (isinstance(n, int) and n >= 1):
        raise ValueError(f"n is a number of ranks >= 1, got {n!r}")
    p = param_bytes * psi / (n if stage >= 3 else 1)
    g = grad_bytes * psi / (n if stage >= 2 else 1)
    k = state_bytes * psi / (n if stage >= 1 else 1)
    return p + g + k


def traffic_bytes(stage: int, model_bytes: float, n: int) -> float:
    """Bytes each rank sends per step by the ring formulas: 2(N-1)/N of the model's bytes, 3(N-1)/N at stage 3."""
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be 0 (DDP), 1, 2 or 3, got {stage!r}")
    return (3 if stage == 3 else 2) * (n - 1) / n * model_bytes


def sent_bytes(timeline, rank: int, kinds=("all_reduce", "reduce_scatter", "all_gather"),
               element_size: int = 1) -> int:
    """Bytes `rank` sent in the traced collectives of `timeline`, had each run as a ring.

    The trace records each collective's payload (the backend's own algorithm is invisible);
    pplab.costmodel.bytes_sent_per_rank turns it into what the ring algorithm of chapter 1
    sends from this rank: (N-1)/N of all N pieces for reduce-scatter and all-gather.
    """
    total = 0
    for e in timeline.select(rank, "comm", kinds):
        p = len(e.group)
        n_bytes = e.meta["payload"] * (p if e.kind == "all_gather" else 1)   # N = all p pieces
        total += costmodel.bytes_sent_per_rank(e.kind, "ring", p, n_bytes, element_size)[e.group.index(rank)]
    return total


def held_bytes(model, optimizer=None) -> dict:
    """Bytes of model state this rank holds now, counted from the tensors themselves.

    Returns {"params", "grads", "optimizer", "total"}: every storage counted once, padding
    included; freed storages (stage 3's gathered units between uses) count 0. Optimizer state
    is every per-element tensor in the optimizer's state (the step counters, one number per
    tensor, are left out), plus the CPU master copies of an offloading ZeroOptimizer.
    """
    seen: set = set()
    params = list(model.parameters())
    if isinstance(model, FullyShardedModule):
        params += list(model.module.parameters())
    inner = getattr(optimizer, "inner", optimizer)
    out = {"params": storage_bytes(params, seen)}
    masters = list(getattr(optimizer, "masters", []))
    kept = list(getattr(optimizer, "shard_grads", []))               # stage 1, 2: my shard's mean gradient
    out["grads"] = storage_bytes([p.grad for p in params + masters] + kept, seen)
    state = [t for st in (inner.state.values() if inner is not None else []) for t in st.values()
             if torch.is_tensor(t) and t.dim() > 0]
    out["optimizer"] = storage_bytes(state + masters, seen)
    out["total"] = out["params"] + out["grads"] + out["optimizer"]
    return out
