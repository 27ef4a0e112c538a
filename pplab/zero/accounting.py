"""ZeRO's table in bytes: what each rank holds and sends, by the formula and counted from the run.

The table of pplab.zero (its __init__) says, per stage, what a rank holds and sends in units
of Ψ. Two functions give its numbers by formula, two measure the same quantities from a run,
so a notebook or a test can put them side by side:

    model_state_bytes(stage, psi, n)    the memory columns, per rank
    traffic_bytes(stage, model_bytes, n)  the traffic column, per rank
    held_bytes(model, optimizer)        bytes of parameters, gradients, optimizer state this rank holds now
    sent_bytes(timeline, rank)          bytes this rank sent in the traced collectives, as rings

held_bytes counts with pplab.memory.count_state, the one counter of model state: it only
adds what ZeRO keeps beside the model's parameters (stage 3's inner module, the master copies,
the kept gradient shards) and leaves out the optimizer's step counters, which the table does not count.
"""
from __future__ import annotations

import torch

from .. import costmodel
from ..memory import count_state
from .fully_sharded import FullyShardedModule


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
    params = list(model.parameters())
    if isinstance(model, FullyShardedModule):
        params += list(model.module.parameters())
    inner = getattr(optimizer, "inner", optimizer)
    masters = list(getattr(optimizer, "masters", []))
    kept = list(getattr(optimizer, "shard_grads", []))               # stage 1, 2: my shard's mean gradient
    state = [t for st in (inner.state.values() if inner is not None else []) for t in st.values()
             if torch.is_tensor(t) and t.dim() > 0]                 # dim 0: a step counter, not in the table
    held = count_state(params, [p.grad for p in params + masters] + kept, state + masters)
    return {"params": held.parameters, "grads": held.gradients, "optimizer": held.optimizer, "total": held.total}
