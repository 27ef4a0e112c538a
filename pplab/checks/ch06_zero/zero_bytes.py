"""Check of exercise zero_bytes (exercises/06_zero_bytes.ipynb): ZeRO's model state per rank, stage by stage: build the shards and count their bytes.

    zero_bytes       zero_state(params, grads, stage) -> the tensors one rank holds

zero_bytes runs on 2 and 3 sealed ranks, stages 0 (DDP) to 3, on random bf16 models whose Ψ the
world size never divides. Each rank builds what it holds (parameters, gradients, optimizer state:
an fp32 master and Adam's two moments); in the rank, pplab.memory.storage_bytes counts the bytes
of their storages, each once. Checked here, a point per kind: dtypes, values (each shard the
rank's ⌈Ψ/N⌉ elements of the zero-padded flat buffer) and bytes (a slice that keeps the whole
buffer alive is counted as what it keeps).
"""
from __future__ import annotations

import math
import random
import torch

from .. import sealed
from ..core import Parts, exercise, first_difference, require_function
from ..core import _fmt
from .zero_bytes_rank import STATE_PARTS, _state_rank


_DTYPE = {"params": torch.bfloat16, "grads": torch.bfloat16, "optimizer": torch.float32}


_SHARDED_FROM = {"optimizer": 1, "grads": 2, "params": 3}       # the stage that first shards each kind


def _state_trials(seed, p):
    """One random bf16 model per stage 0..3: its parameters and its (already averaged) gradients.
    Ψ is never a multiple of p, so every shard layout needs padding: Ψ mod p is 1 at stages 0, 1
    and 3 and p - 1 at stage 2, so that on 3 ranks both 2 zeros and 1 zero of padding are tried
    (padding with Ψ mod p zeros is right for p = 2 and for Ψ mod 3 = 2 only)."""
    rng = random.Random(seed * 11 + p)
    trials = []
    for stage in range(4):
        shapes = [tuple(rng.randint(1, 6) for _ in range(rng.randint(1, 2))) for _ in range(rng.randint(2, 4))]
        extra = ((p - 1 if stage == 2 else 1) - sum(math.prod(sh) for sh in shapes)) % p
        if extra:
            shapes.append((extra,))                      # a bias: Ψ mod p as wanted
        trials.append({"stage": stage, "shapes": shapes, "seed": rng.randrange(2**31)})
    return trials


def _state_tensors(trial):
    g = torch.Generator().manual_seed(trial["seed"])
    params = [torch.randn(sh, generator=g).to(torch.bfloat16) for sh in trial["shapes"]]
    grads = [torch.randn(sh, generator=g).to(torch.bfloat16) for sh in trial["shapes"]]
    return params, grads


def _expected_state(trial, p, rank):
    """{kind: (values as float64, bytes)} that rank holds: Ψ elements, or its ⌈Ψ/p⌉-element shard of
    the flat buffer padded with zeros to a multiple of p."""
    params, grads = _state_tensors(trial)
    flat = {"params": torch.cat([x.flatten() for x in params]).double(),
            "grads": torch.cat([x.flatten() for x in grads]).double()}
    psi, c = flat["params"].numel(), -(-flat["params"].numel() // p)

    def shard(v):
        padded = torch.zeros(c * p, dtype=torch.float64)
        padded[:psi] = v
        return padded[rank * c:(rank + 1) * c]
    held = {kind: shard(v) if trial["stage"] >= _SHARDED_FROM[kind] else v for kind, v in flat.items()}
    master = shard(flat["params"]) if trial["stage"] >= 1 else flat["params"]
    held["optimizer"] = torch.cat([master, torch.zeros_like(master), torch.zeros_like(master)])
    return {kind: (v, v.numel() * (2 if kind != "optimizer" else 4)) for kind, v in held.items()}


def _state_problem(kind, got, want, want_bytes, trial, p, rank):
    """What is wrong with one kind of one rank's state, or None."""
    stage, sharded = trial["stage"], trial["stage"] >= _SHARDED_FROM[kind]
    params, _ = _state_tensors(trial)
    psi = sum(x.numel() for x in params)
    c, per = -(-psi // p), 3 if kind == "optimizer" else 1
    which = {"params": "parameters", "grads": "gradients", "optimizer": "optimizer state"}[kind]
    rule = (f" Stage {stage}: " + ("stage 1 splits the optimizer state over the ranks, stage 2 the gradients too, "
                                   "stage 3 the parameters too."))
    if isinstance(got, str):
        return (f"zero_state must return a dict {{'params': [...], 'grads': [...], 'optimizer': [...]}} of lists of "
                f"tensors, got {got}.")
    wrong_dtype = [d for d in got["dtypes"] if d != str(_DTYPE[kind])]
    if wrong_dtype:
        hint = (" The master weights and Adam's two moments are fp32, 4 bytes each: K = 12 bytes per parameter "
                "(in bf16 the small updates would round away)." if kind == "optimizer" else
                " The model's parameters and gradients stay bf16 (2 bytes each).")
        return f"the {which} include a {wrong_dtype[0]} tensor, expected {_DTYPE[kind]}.{hint}"
    values = got["values"]
    if values.numel() != want.numel():
        n = values.numel() // per
        if sharded and n == psi:
            hint = f" That is all of them: at stage {stage} each rank keeps only its shard, ⌈Ψ/N⌉ = {c} elements." + rule
        elif not sharded and n == c:
            hint = f" That is one shard: at stage {stage} the {which} are not split yet, every rank holds all Ψ." + rule
        elif sharded and n in (psi // p, psi - (p - 1) * (psi // p), psi - (p - 1) * c):
            hint = (f" Pad: Ψ = {psi} is not a multiple of N = {p}, so the flat buffer is padded with zeros to "
                    f"N·⌈Ψ/N⌉ = {p * c} elements and every rank's shard holds ⌈Ψ/N⌉ = {c} of them (the last rank's "
                    f"ending in padding).")
        else:
            hint = rule
        return (f"the {which} hold {values.numel()} elements, expected {want.numel()}"
                + (f" ({per} × {want.numel() // per})" if per > 1 else "") + f".{hint}")
    diff = first_difference(values, want)
    if diff is not None:
        j, a, b = diff
        hint = ""
        if sharded and rank and torch.equal(values[:c], _expected_state(trial, p, 0)[kind][0][:c]):
            hint = (f" It is rank 0's shard: rank {rank} holds elements {rank}·⌈Ψ/N⌉ .. {rank + 1}·⌈Ψ/N⌉ - 1 "
                    f"({rank * c}..{(rank + 1) * c - 1}) of the flat buffer.")
        elif kind == "optimizer":
            hint = (" The optimizer state is [master weights (an fp32 copy of the parameters it covers), exp_avg, "
                    "exp_avg_sq (zeros before Adam's first step)], each flattened, in that order.")
        return (f"the {which}, flattened and concatenated, differ at element {j} (got {_fmt(a)}, expected {_fmt(b)})."
                f"{hint}")
    if got["bytes"] != want_bytes:
        if got["bytes"] > want_bytes and any(got["views"]):
            hint = (" A tensor returned is a view (a slice) of a larger tensor, and a view keeps its whole storage "
                    "alive: the shard of a flat buffer still holds the whole buffer. .clone() the shard.")
        elif got["bytes"] < want_bytes:
            hint = (" Some tensors returned share one storage (torch.zeros_like twice, not the same tensor twice: "
                    "exp_avg and exp_avg_sq are two moments).")
        else:
            hint = ""
        return (f"the {which} occupy {got['bytes']:,} bytes of storage (pplab.memory.storage_bytes), expected "
                f"{want_bytes:,}.{hint}")
    return None


@exercise("zero_bytes", "ZeRO's model state per rank, stage by stage: build the shards and count their bytes",
          answer="zero_state", notebook="06_zero_bytes", sealed=True, points=len(STATE_PARTS))
def check_zero_bytes(fn, seed: int, timeout: float) -> str:
    """zero_state(params, grads, stage) -> {"params": [...], "grads": [...], "optimizer": [...]}: the
    tensors this rank holds at ZeRO stage `stage` (0 = DDP), mixed-precision Adam, shards padded."""
    require_function(fn, "zero_bytes", "params, grads, stage", [torch.zeros(1)], [torch.zeros(1)], 0)
    parts = Parts(STATE_PARTS)
    for p in (2, 3):                        # 3: padding of 1 and of 2 zeros (at 2 it is always 1)
        trials = _state_trials(seed, p)

        def describe(world_size, i, trials=trials):
            t = trials[i]
            psi = sum(math.prod(sh) for sh in t["shapes"])
            return f"world_size={world_size}, stage {t['stage']}, Ψ = {psi} parameters {t['shapes']}"

        def check(world_size, i, observed, traffic, trials=trials):
            for rank in sorted(observed):
                want = _expected_state(trials[i], world_size, rank)
                for kind in STATE_PARTS:
                    got = observed[rank][kind]
                    problem = _state_problem(kind, got, *want[kind], trials[i], world_size, rank)
                    parts.note(kind, problem, where=f"{describe(world_size, i)}: rank {rank}")
        inputs = [[{"params": params, "grads": grads, "stage": t["stage"]} for _ in range(p)]
                  for t in trials for params, grads in [_state_tensors(t)]]
        sealed.run_sealed(_state_rank, fn, inputs, world_size=p, timeout=timeout, exercise=("zero_bytes", "ZeRO"),
                          forbidden=(), describe=describe, check=check)
    return parts.finish("on world sizes 2 and 3, stages 0-3 (8 random bf16 models, Ψ never a multiple of N: "
                        "every rank's parameters, gradients and optimizer state, their values, dtypes and bytes of "
                        "storage, shards padded)")
