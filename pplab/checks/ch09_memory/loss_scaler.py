"""Check of chapter 9b's exercise: a dynamic loss scaler whose decision every rank shares.

    loss_scaler      LossScaler(init_scale, growth_interval) with .scale and .step(optimizer) -> bool

Runs on 2 and 3 sealed ranks, as after ZeRO's reduce-scatter: each rank holds its own shard of a
flat fp32 parameter vector and an SGD optimizer over it, and at every step the check puts this
rank's shard of the mean gradient, times the scaler's current scale, into the shard's .grad (the
gradient of the scaled loss), then calls scaler.step(optimizer). At two steps an inf (or a NaN) sits
in the shard of one rank other than 0 only, so only an agreement between the ranks (an all-reduce
of an overflow flag) can make every rank skip. Graded in three parts, each against one process
running the same schedule (halve on overflow, double after growth_interval good steps in a row):

    agreement   what step() returned, on every rank, at every step (skip iff some rank overflowed)
    update      each rank's shard after every step (SGD on the unscaled gradient, or unchanged)
    scale       scaler.scale after every step

SGD rather than Adam, since Adam is blind to a gradient's scale: a scaler that forgets to unscale
would pass. Scales are powers of two, so unscaling is exact: compared to 1e-6 relative.
"""
from __future__ import annotations

import math
import random
import torch

from .. import sealed
from ..core import Fail, Parts, exercise, require_function
from ..core import _fmt
from .loss_scaler_rank import LR, _rank_job


RTOL = 1e-6


PARTS = ("agreement", "update", "scale")


def _trials(seed, p):
    """Two runs of 8 steps; overflows at two steps, each in the shard of a rank other than 0."""
    rng = random.Random(seed * 11 + p)
    trials = []
    for _ in range(2):
        steps, interval = 8, rng.choice([2, 3])
        first = rng.randint(1, 2)
        second = rng.randint(first + interval + 1, steps - 1)        # after the scale has grown once
        bad = {first: (rng.randint(1, p - 1), math.inf), second: (rng.randint(1, p - 1), rng.choice([-math.inf, math.nan]))}
        trials.append({"shard": rng.randint(2, 6), "steps": steps, "interval": interval,
                       "init": 2.0 ** rng.randint(8, 16), "bad": bad, "seed": rng.randrange(2**31)})
    return trials


def _inputs(trial, p):
    """Per rank: its shard's start and its shard of the (unscaled) mean gradient at each step."""
    g = torch.Generator().manual_seed(trial["seed"])
    n = trial["shard"]
    start = torch.randn(p, n, generator=g)
    grads = torch.randn(trial["steps"], p, n, generator=g)
    for s, (rank, value) in trial["bad"].items():
        grads[s, rank, torch.randint(n, (1,), generator=g)] = value
    return [{"start": start[r].clone(), "grads": grads[:, r].clone(), "init": trial["init"],
             "interval": trial["interval"]} for r in range(p)]


def _reference(trial, inputs):
    """One process: per step, whether it ran, the scale after it, and every rank's shard after it."""
    scale, good = trial["init"], 0
    shards = [x["start"].clone() for x in inputs]
    stepped, scales, history = [], [], []
    for s in range(trial["steps"]):
        grads = [x["grads"][s] for x in inputs]
        overflow = any(not bool(torch.isfinite(g).all()) for g in grads)
        if not overflow:
            shards = [w - LR * g for w, g in zip(shards, grads)]
        scale, good = (scale * 0.5, 0) if overflow else (scale * 2.0, 0) if good + 1 == trial["interval"] \
            else (scale, good + 1)
        stepped.append(not overflow)
        scales.append(scale)
        history.append([w.clone() for w in shards])
    return stepped, scales, history


def _num(x: float) -> str:
    """A scale as it is: 16384, not 1.638e+04 (scales are powers of two)."""
    return f"{x:.0f}" if float(x).is_integer() and abs(x) < 1e15 else f"{x:g}"


def _vec(t) -> str:
    return "[" + ", ".join(f"{v:.4g}" for v in t.tolist()) + "]" if torch.is_tensor(t) else _fmt(t)


def _close(a, b) -> bool:
    return a.shape == b.shape and bool(torch.allclose(a, b, rtol=RTOL, atol=RTOL, equal_nan=False))


def _judge(trial, inputs, observed, parts, where):
    want_stepped, want_scales, want_shards = _reference(trial, inputs)
    ranks = sorted(observed)
    scale_before = [trial["init"]] + want_scales[:-1]
    for s in range(trial["steps"]):                                   # agreement, step by step
        said = {r: observed[r]["stepped"][s] for r in ranks}
        culprit = trial["bad"].get(s, (None,))[0]
        if len(set(said.values())) > 1:
            skipped = [r for r in ranks if not said[r]]
            went = [r for r in ranks if said[r]]
            parts.note("agreement", f"at step {s + 1} rank(s) {skipped} skipped and rank(s) {went} stepped: the ranks "
                       f"decided apart. Only rank {culprit}'s shard held the overflow; all-reduce a flag (max) "
                       f"so that one rank's inf skips every rank's step." if culprit is not None else
                       f"at step {s + 1} rank(s) {skipped} skipped and rank(s) {went} stepped: the ranks decided apart.",
                       where)
            break
        if said[ranks[0]] != want_stepped[s]:
            parts.note("agreement", f"at step {s + 1} every rank {'stepped' if said[ranks[0]] else 'skipped'}, but "
                       + (f"rank {culprit}'s gradient held an inf or NaN (in its shard only): every rank must skip. "
                          f"Check every rank's gradients, not only rank 0's: all-reduce the flag (max)."
                          if culprit is not None else "no rank's gradient overflowed: step unless some rank saw an "
                          "inf or NaN."), where)
            break
    for s in range(trial["steps"]):                                   # the shards
        bad = [r for r in ranks if not _close(observed[r]["shards"][s], want_shards[s][r])]
        if not bad:
            continue
        r = bad[0]
        got, want = observed[r]["shards"][s], want_shards[s][r]
        before = want_shards[s - 1][r] if s else inputs[r]["start"]
        grad = inputs[r]["grads"][s]
        hint = ""
        if not want_stepped[s]:
            hint = (f" The step was to be skipped (rank {trial['bad'][s][0]}'s gradient overflowed), but the shard "
                    f"changed: when you skip, do not call optimizer.step().")
        elif got.shape == want.shape and _close(got, before - LR * grad * scale_before[s]):
            hint = (f" That is SGD on the gradient still multiplied by the scale {_num(scale_before[s])}: divide the "
                    f"gradients by the scale (unscale) before optimizer.step().")
        elif got.shape == want.shape and _close(got, before):
            hint = " The shard did not move: this step should have run."
        parts.note("update", f"after step {s + 1}, rank {r}'s shard is {_vec(got)}, expected {_vec(want)}.{hint}",
                   where)
        break
    for s in range(trial["steps"]):                                   # the scale
        bad = [r for r in ranks if observed[r]["scales"][s] != want_scales[s]]
        if not bad:
            continue
        r = bad[0]
        got = observed[r]["scales"][s]
        if want_scales[s] > scale_before[s]:
            hint = (f" {trial['interval']} steps in a row without overflow: the scale doubles (growth) and the "
                    f"count starts again.")
        elif want_scales[s] < scale_before[s]:
            hint = " This step overflowed on some rank: the scale halves."
        else:
            hint = " The scale changes only after an overflow (halve) or after growth_interval good steps (double)."
        parts.note("scale", f"after step {s + 1}, rank {r}'s scale is {_num(got)}, expected {_num(want_scales[s])}."
                   f"{hint}", where)
        break


@exercise("loss_scaler", "A dynamic loss scaler every rank agrees with", answer="LossScaler",
          notebook="09b_loss_scaler", sealed=True, points=len(PARTS))
def check_loss_scaler(fn, seed: int, timeout: float) -> str:
    """LossScaler(init_scale, growth_interval): .scale, and .step(optimizer) -> whether it stepped."""
    require_function(fn, "loss_scaler", "init_scale, growth_interval", 2.0**16, 2000)
    parts = Parts(PARTS)
    for p in (2, 3):
        trials = _trials(seed, p)
        inputs = [_inputs(t, p) for t in trials]

        def describe(world_size, i, trials=trials):
            t = trials[i]
            return (f"world_size={world_size}, init_scale={_num(t['init'])}, growth_interval={t['interval']}, "
                    f"overflow at steps {sorted(s + 1 for s in t['bad'])}")

        def check(world_size, i, observed, traffic, trials=trials, inputs=inputs):
            if len(observed) < world_size:
                return
            try:
                _judge(trials[i], inputs[i], observed, parts, describe(world_size, i))
            except (KeyError, IndexError, TypeError, AttributeError) as e:
                raise Fail(f"what the ranks recorded could not be read ({type(e).__name__}: {e}).")

        try:
            sealed.run_sealed(_rank_job, fn, [[x[r] for r in range(p)] for x in inputs], world_size=p,
                              timeout=timeout, exercise=("loss_scaler", "a loss scaler"), forbidden=(),
                              describe=describe, check=check)
        except Fail as failure:
            if parts.earned() < len(PARTS):
                raise Fail(f"{failure} Before that: {next(v for v in parts.problems.values() if v)} "
                           f"{parts.breakdown()}.", failure.seed_matters, earned=parts.earned()) from None
            raise
    return parts.finish("on world sizes 2 and 3 (2 runs each, 8 steps, an inf or NaN at two steps in the shard of "
                        "one rank other than 0; every rank's decision, shard and scale = one process, to 1e-6)")
