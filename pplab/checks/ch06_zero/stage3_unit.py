"""Check of exercise stage3_unit (exercises/06_stage3_unit.ipynb): ZeRO stage 3: gather, compute, free one layer; reduce-scatter its gradient.

    stage3_unit      sharded_linear(x, shard, out_features, in_features) -> y

stage3_unit runs on 2 and 3 ranks: a Linear layer whose flat [weight, bias] (zero-padded to a
multiple of p) is sharded over the ranks; each rank calls sharded_linear on its own input,
then backward. Checked: the output (to 1e-9), that after forward nothing autograd keeps for
backward holds the gathered full parameters (their storage must be freed or not referenced),
the input's gradient, and that each rank's shard gradient is its piece of the global batch's
gradient of [weight, bias] (the mean over ranks), to 1e-9.
"""
from __future__ import annotations

import math
import random
import torch

from .. import sealed
from ..core import Fail, exercise, first_difference, known_mistake, require_function
from ..core import _fmt
from .stage3_unit_rank import _unit_rank
from .tolerance import TOL, _off


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
            hint = "" if name != "shard.grad" else known_mistake(value, [
                (want * p, f"It is {p} times that: the reduce-scatter sums the ranks' gradients; divide by the world "
                           f"size for the mean."),
                (full_grad[:size] if rank else None,
                 "It is rank 0's piece: each rank keeps the piece of the gradient of its own shard.")],
                atol=TOL, rtol=TOL)
            raise Fail(f"{where}rank {rank}'s {name} at {j} is {_fmt(a)}, expected {_fmt(w)}{_off(a, w)}"
                       + (" (its piece of the mean over ranks of the [weight, bias] gradient, padding 0)"
                          if name == "shard.grad" else "") + f".{hint}")
