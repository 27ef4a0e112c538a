"""Check of exercise zero1_step (exercises/06_zero1_step.ipynb): ZeRO stage 1: reduce-scatter, step my shard, all-gather.

    zero1_step       make_zero1(flat_param, optimizer_class) -> step(flat_grad)

zero1_step runs on 2 and 3 sealed ranks (sealed.py): a random flat float64 parameter vector (the same on
every rank, length a multiple of the world size), a different random gradient on every rank
at each of 3 steps. After every step each rank's flat_param must equal single-process AdamW
on the mean gradient (to 1e-9); the optimizer each rank creates must be given only its shard
(n/p elements); and no all-reduce may run (ZeRO-1 reduce-scatters the gradient: an all-reduce
would send twice the bytes and give every rank the full gradient it does not need).
"""
from __future__ import annotations

import random
import torch

from .. import sealed
from ..core import Fail, Forbidden, exercise, first_difference, require_function
from ..core import _fmt
from .tolerance import TOL, _off
from .zero1_step_rank import LR, WD, _zero1_rank


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
