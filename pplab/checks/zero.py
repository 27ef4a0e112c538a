"""Checks of chapter 6's exercises: ZeRO stage 1's step, its memory formula, stage 3's gathered layer.

    zero1_step       make_zero1(flat_param, optimizer_class) -> step(flat_grad)
    zero_bytes       zero_state(params, grads, stage) -> the tensors one rank holds
    stage3_unit      sharded_linear(x, shard, out_features, in_features) -> y

zero1_step runs on 2 and 3 sealed ranks (sealed.py): a random flat float64 parameter vector (the same on
every rank, length a multiple of the world size), a different random gradient on every rank
at each of 3 steps. After every step each rank's flat_param must equal single-process AdamW
on the mean gradient (to 1e-9); the optimizer each rank creates must be given only its shard
(n/p elements); and no all-reduce may run (ZeRO-1 reduce-scatters the gradient: an all-reduce
would send twice the bytes and give every rank the full gradient it does not need).

zero_bytes runs on 2 and 3 sealed ranks, stages 0 (DDP) to 3, on random bf16 models whose Ψ the
world size never divides. Each rank builds what it holds (parameters, gradients, optimizer state:
an fp32 master and Adam's two moments); in the rank, pplab.memory.storage_bytes counts the bytes
of their storages, each once. Checked here, a point per kind: dtypes, values (each shard the
rank's ⌈Ψ/N⌉ elements of the zero-padded flat buffer) and bytes (a slice that keeps the whole
buffer alive is counted as what it keeps).

stage3_unit runs on 2 and 3 ranks: a Linear layer whose flat [weight, bias] (zero-padded to a
multiple of p) is sharded over the ranks; each rank calls sharded_linear on its own input,
then backward. Checked: the output (to 1e-9), that after forward nothing autograd keeps for
backward holds the gathered full parameters (their storage must be freed or not referenced),
the input's gradient, and that each rank's shard gradient is its piece of the global batch's
gradient of [weight, bias] (the mean over ranks), to 1e-9.

A rank job only records: what the answer returned, the optimizer sizes, the bytes kept after
forward; the collectives each rank called are the router's record. Every verdict is reached
here, after the ranks return.
"""
from __future__ import annotations

import math
import random

import torch

from . import sealed
from .zero_rank import LR, WD, STATE_PARTS, _state_rank, _unit_rank, _zero1_rank
from .core import Fail, Forbidden, Parts, exercise, first_difference, require_function
from .core import _fmt

TOL = 1e-9
# ----------------------------------------------------------------------------------
# Exercise "zero1_step"


def _off(a, b, tol=TOL) -> str:
    """' (off by 2.3e-08, 2.9e-09 allowed)' where the two values print alike, else ''."""
    return f" (off by {abs(a - b):.2g}, {tol + tol * abs(b):.2g} allowed)" if _fmt(a) == _fmt(b) else ""


def _zero1_trials(seed, p):
    rng = random.Random(seed * 7 + p)
    return [{"n": p * rng.randint(2, 40), "seed": rng.randrange(2**31)} for _ in range(2)]


def _grad(trial, step, rank, n):
    """About AdamW's eps (1e-8) in size: Adam divides a gradient by its own size, so a gradient
    summed over the ranks instead of averaged moves the parameters almost exactly as far unless
    eps counts. At this size it does, and forgetting the mean changes every element visibly."""
    g = torch.Generator().manual_seed(trial["seed"] + 1000 * step + rank + 1)
    return torch.randn(n, generator=g, dtype=torch.float64) * 1e-8


def _start(trial):
    g = torch.Generator().manual_seed(trial["seed"])
    return torch.randn(trial["n"], generator=g, dtype=torch.float64)


def _check_zero1(trials, steps):
    """check(p, i, observed, traffic), here: no all-reduce, one shard per optimizer, AdamW's values."""
    def check(p, i, observed, traffic):
        trial = trials[i]
        n = trial["n"]
        for rank in sorted(observed):
            if any(c["kind"] == "all_reduce" for c in traffic[rank]["collectives"]):
                raise Forbidden(f"exercise 'zero1_step' asks for ZeRO stage 1 without an all-reduce: rank "
                                f"{rank} called one. Reduce-scatter the gradient instead "
                                f"(comm.reduce_scatter_tensor): each rank receives the sum of its own shard only, "
                                f"half the bytes of an all-reduce, and all it needs for its step.")
            if observed[rank]["sizes"] != [n // p]:
                raise Fail(f"rank {rank} gave its optimizer {observed[rank]['sizes'] or 'nothing'} element(s) "
                           f"(per optimizer created); ZeRO-1 gives each rank's optimizer only its own shard, "
                           f"{n // p} = {n}/{p} elements (flat_param[rank*{n // p}:(rank+1)*{n // p}]), so the "
                           f"optimizer state is split over the ranks.")
        want = _zero1_reference(trial, p, steps)
        for rank in sorted(observed):
            for s, (mine, ref) in enumerate(zip(observed[rank]["history"], want)):
                diff = first_difference(mine, ref, atol=TOL, rtol=TOL)
                if diff is None:
                    continue
                j, a, b = diff
                owner = j // (n // p)
                hint = ""
                if owner != rank and any(first_difference(observed[q]["history"][s], ref, atol=TOL, rtol=TOL)
                                         is None for q in observed if q != rank):
                    hint = (f" Other ranks are right: rank {rank} did not receive the other ranks' updated "
                            f"shards. All-gather the shards into flat_param on every rank.")
                elif owner == rank:
                    hint = (" That is this rank's own shard: step it with the mean of the ranks' gradients "
                            "(reduce-scatter sums them: divide by the world size).")
                raise Fail(f"after step {s + 1}, rank {rank}'s flat_param[{j}] (in rank {owner}'s shard) "
                           f"is {_fmt(a)}, expected {_fmt(b)}{_off(a, b)} (single-process AdamW on the mean gradient).{hint}")
    return check


def _zero1_reference(trial, p, steps):
    x = _start(trial).requires_grad_(False)
    param = torch.nn.Parameter(x.clone())
    opt = torch.optim.AdamW([param], lr=LR, weight_decay=WD)
    history = []
    for s in range(steps):
        param.grad = sum(_grad(trial, s, r, trial["n"]) for r in range(p)) / p
        opt.step()
        history.append(param.detach().clone())
    return history


@exercise("zero1_step", "ZeRO stage 1: reduce-scatter, step my shard, all-gather", answer="make_zero1",
          notebook="06_zero1_step", sealed=True)
def check_zero1_step(fn, seed: int, timeout: float) -> str:
    """make_zero1(flat_param, optimizer_class) -> step(flat_grad): after each step, flat_param on
    every rank = single-process AdamW on the mean gradient; each optimizer holds one shard."""
    require_function(fn, "zero1_step", "flat_param, optimizer_class", torch.zeros(2), torch.optim.AdamW)
    steps = 3
    for p in (2, 3):                        # 3: no power of two, a rank in the middle (gathers tried at 2 only)
        trials = _zero1_trials(seed, p)

        def describe(world_size, i, trials=trials):
            return f"world_size={world_size}, flat_param of {trials[i]['n']} elements"
        inputs = [[{"flat": _start(t), "grads": [_grad(t, s, r, t["n"]) for s in range(steps)]} for r in range(p)]
                  for t in trials]
        sealed.run_sealed(_zero1_rank, fn, inputs, world_size=p, timeout=timeout, exercise=("zero1_step", "ZeRO-1"),
                          forbidden=(), describe=describe, check=_check_zero1(trials, steps))
    return ("on world sizes 2 and 3 (4 random flat parameters, 3 steps each: flat_param = single-process AdamW on "
            "the mean gradient to 1e-9, each optimizer given only its shard, no all-reduce)")


# ----------------------------------------------------------------------------------
# Exercise "zero_bytes": build what one rank holds at each stage, and count its bytes

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


# ----------------------------------------------------------------------------------
# Exercise "stage3_unit"


def _unit_trials(seed, p):
    rng = random.Random(seed * 13 + p)
    trials = []
    for _ in range(2):
        out_f, in_f = rng.randint(2, 9), rng.randint(2, 9)
        trials.append({"out": out_f, "in": in_f, "batch": rng.randint(1, 4), "seed": rng.randrange(2**31)})
    return trials


def _unit_data(trial, p):
    """The layer's flat [weight, bias] padded to a multiple of p, and every rank's input."""
    g = torch.Generator().manual_seed(trial["seed"])
    numel = trial["out"] * trial["in"] + trial["out"]
    padded = math.ceil(numel / p) * p
    flat = torch.zeros(padded, dtype=torch.float64)
    flat[:numel] = torch.randn(numel, generator=g, dtype=torch.float64)
    xs = [torch.randn(trial["batch"], trial["in"], generator=g, dtype=torch.float64) for _ in range(p)]
    return flat, xs


@exercise("stage3_unit", "ZeRO stage 3: gather, compute, free one layer; reduce-scatter its gradient",
          answer="sharded_linear", notebook="06_stage3_unit", sealed=True)
def check_stage3_unit(fn, seed: int, timeout: float) -> str:
    """sharded_linear(x, shard, out_features, in_features) -> x @ W.T + b, where [W, b] is gathered
    from every rank's shard for the forward, not kept after it, and gathered again for backward."""
    require_function(fn, "stage3_unit", "x, shard, out_features, in_features", torch.zeros(1, 1), torch.zeros(2), 1, 1)
    for p in (2, 3):                        # 3: a mean written as the sum / 2 is right at 2
        trials = _unit_trials(seed, p)

        def describe(world_size, i, trials=trials):
            t = trials[i]
            return f"world_size={world_size}, Linear({t['in']}, {t['out']}), local batch {t['batch']}"
        inputs = []
        for t in trials:
            flat, xs = _unit_data(t, p)
            size = flat.numel() // p
            inputs.append([{"shard": flat[r * size:(r + 1) * size].clone(), "x": xs[r].clone(), "out": t["out"],
                            "in": t["in"]} for r in range(p)])

        def check(world_size, i, observed, traffic, trials=trials):
            _check_unit_trial(fn, trials[i], world_size, observed)
        sealed.run_sealed(_unit_rank, fn, inputs, world_size=p, timeout=timeout, exercise=("stage3_unit", "ZeRO-3"),
                          forbidden=(), describe=describe, check=check)
    return ("on world sizes 2 and 3 (4 random Linear layers: output and gradients to 1e-9, the gathered "
            "parameters not kept for backward, each shard's gradient the mean over ranks)")


def _check_unit_trial(fn, trial, p, got, where=""):
    flat, xs = _unit_data(trial, p)
    o, i = trial["out"], trial["in"]
    W = flat[:o * i].view(o, i).clone().requires_grad_(True)
    b = flat[o * i:o * i + o].clone().requires_grad_(True)
    X = torch.cat([x.clone() for x in xs]).requires_grad_(True)
    Y = X @ W.T + b
    Y.sum().backward()                      # the sum of every rank's loss y.sum(): the mean over ranks is W.grad / p
    size = flat.numel() // p
    full_grad = torch.zeros_like(flat)
    full_grad[:o * i], full_grad[o * i:o * i + o] = W.grad.flatten() / p, b.grad / p
    for rank, r in sorted(got.items()):
        if not isinstance(r["y"], torch.Tensor):
            raise Fail(f"{where}{fn.__name__} must return a tensor (x @ W.T + b), got {r['y']}.", seed_matters=False)
        want_y = Y[rank * trial["batch"]:(rank + 1) * trial["batch"]].detach()
        if tuple(r["y"].shape) != tuple(want_y.shape):
            raise Fail(f"{where}rank {rank}'s output has shape {tuple(r['y'].shape)}, expected "
                       f"{tuple(want_y.shape)} = (batch, out_features).")
        diff = first_difference(r["y"], want_y, atol=TOL, rtol=TOL)
        if diff is not None:
            j, a, w = diff
            raise Fail(f"{where}rank {rank}'s output at {j} is {_fmt(a)}, expected {_fmt(w)}{_off(a, w)} (x @ W.T + b "
                       f"with W, b the first out*in and next out elements of the gathered flat buffer).")
        if r["gathers_in_forward"] == 0:
            raise Fail(f"{where}rank {rank} ran no all-gather in forward: gather the full [weight, bias] from "
                       f"every rank's shard (comm.all_gather_into_tensor) before computing.")
        if r["kept"]:
            raise Fail(f"{where}rank {rank}: after forward, autograd still holds {r['kept']} bytes of the gathered "
                       f"full parameters for backward. Stage 3 frees them after forward: save only x and the "
                       f"shard (a torch.autograd.Function with ctx.save_for_backward(x, shard)) and all-gather "
                       f"again in backward.")
        if not r["requires_grad"]:
            raise Fail(f"{where}rank {rank}'s output does not require grad: backward cannot reach the shard.")
        for name, value, want in (("x.grad", r["x_grad"], X.grad[rank * trial["batch"]:(rank + 1) * trial["batch"]]),
                                  ("shard.grad", r["shard_grad"], full_grad[rank * size:(rank + 1) * size])):
            if value is None:
                raise Fail(f"{where}rank {rank}'s {name} is None after backward: backward must return a gradient "
                           f"for x and for shard.")
            if tuple(value.shape) != tuple(want.shape):
                raise Fail(f"{where}rank {rank}'s {name} has shape {tuple(value.shape)}, expected {tuple(want.shape)}.")
            diff = first_difference(value, want, atol=TOL, rtol=TOL)
            if diff is None:
                continue
            j, a, w = diff
            hint = ""
            if name == "shard.grad":
                if torch.allclose(value, want * p, atol=TOL, rtol=TOL):
                    hint = (f" It is {p} times that: the reduce-scatter sums the ranks' gradients; divide by the "
                            f"world size for the mean.")
                elif torch.allclose(value, full_grad[:size], atol=TOL, rtol=TOL) and rank:
                    hint = " It is rank 0's piece: each rank keeps the piece of the gradient of its own shard."
            raise Fail(f"{where}rank {rank}'s {name} at {j} is {_fmt(a)}, expected {_fmt(w)}{_off(a, w)}"
                       + (" (its piece of the mean over ranks of the [weight, bias] gradient, padding 0)"
                          if name == "shard.grad" else "") + f".{hint}")
