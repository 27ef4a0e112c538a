"""Chapter 9's exercise: gradient clipping by the global norm of a model cut over ranks.

    clip_sharded   clip_sharded(shards, max_norm, norm_type, tp_group, dp_group) -> the global norm

The model is split over a tensor-parallel group and its gradients are ZeRO shards over a
data-parallel group. Each rank gets `shards`: one dict per flat bucket, {"grad": this rank's
shard of the bucket's gradient (1-D, float64; its last elements may be padding), "valid": how
many of its first elements belong to parameters (the rest is padding, holding garbage here),
"replicated": True if the bucket holds parameters replicated over tp (the same gradient on
every tp rank), False if split (a different slice on every tp rank)}. The answer returns the
norm of the whole model's gradient, as one process would compute it (every element once), and
scales every shard's valid elements by min(1, max_norm / (norm + 1e-6)) in place, as
torch.nn.utils.clip_grad_norm_ does.

The check runs on 6 real sealed ranks, meshes tp=3 × dp=2, tp=2 × dp=3, tp=6 and dp=6, with
random buckets of random sizes (padding on some ranks, not others), garbage in the padding, and
a max_norm that binds in all trials but one. Graded in 3 parts (partial credit): the 2-norm every
rank returns, the clipped gradients on every rank (2-norm), and norm_type=inf (norm and clip).
"""
from __future__ import annotations

import math
import random
import torch

from .. import sealed
from ..core import Fail, Parts, exercise, first_difference, require_function
from .clip_sharded_rank import _rank_job


WORLD = 6


RTOL = 1e-9


# (tp, dp, norm_type, whether max_norm is below the norm)
TRIALS = [(3, 2, 2.0, True), (2, 3, 2.0, False), (3, 2, math.inf, True), (6, 1, 2.0, True), (1, 6, math.inf, True)]


_PARTS = {"norm": "norm", "clip": "clipped gradients", "inf": "norm_type=inf"}


def _problem(rng, tp, dp, norm_type, binds):
    """The buckets, every rank's shards (padding filled with garbage) and the reference."""
    buckets = []
    for b in range(rng.randint(3, 4)):
        n = rng.randint(dp, 4 * dp + 5) if b else dp * rng.randint(1, 4) + (dp > 1)   # bucket 0: padded
        replicated = b == 0 or rng.random() < 0.4
        g = torch.Generator().manual_seed(rng.randrange(2**31))
        values = torch.randn(1 if replicated else tp, n, generator=g, dtype=torch.float64) * rng.choice([0.1, 1, 3])
        buckets.append({"n": n, "replicated": replicated, "values": values})
    every = torch.cat([bk["values"].flatten() for bk in buckets])                 # each element once
    norm = every.abs().max().item() if norm_type == math.inf else every.norm(norm_type).item()
    max_norm = norm * (rng.uniform(0.2, 0.6) if binds else rng.uniform(1.5, 3))
    coef = min(1.0, max_norm / (norm + 1e-6))
    shards = {}
    for rank in range(tp * dp):
        j, r = divmod(rank, tp)
        mine = []
        for bk in buckets:
            size = math.ceil(bk["n"] / dp)
            flat = torch.full((size * dp,), 1e3, dtype=torch.float64)            # padding: garbage, not zeros
            flat[:bk["n"]] = bk["values"][0 if bk["replicated"] else r]
            valid = max(0, min(size, bk["n"] - j * size))
            mine.append({"grad": flat[j * size:(j + 1) * size].clone(), "valid": valid,
                         "replicated": bk["replicated"]})
        shards[rank] = mine
    return {"tp": tp, "dp": dp, "norm_type": norm_type, "max_norm": max_norm, "norm": norm, "coef": coef,
            "shards": shards, "buckets": buckets}


def _wrong_norms(prob) -> dict:
    """What the mistakes we can name would return (per rank where it depends on the rank)."""
    tp, dp, p = prob["tp"], prob["dp"], prob["norm_type"]

    def combine(parts):                          # parts: |g|^p sums (or maxima for inf)
        return max(parts) if p == math.inf else sum(parts)

    def local(shard, padding=False):
        g = shard["grad"] if padding else shard["grad"][:shard["valid"]]
        if g.numel() == 0:
            return 0.0
        return g.abs().max().item() if p == math.inf else g.abs().pow(p).sum().item()

    def root(x):
        return x if p == math.inf else x ** (1 / p)

    per_rank = {rank: [local(s) for s in shards] for rank, shards in prob["shards"].items()}
    out = {"local": {rank: root(combine(v)) for rank, v in per_rank.items()}}
    every_copy = combine([local(s) for shards in prob["shards"].values() for s in shards])
    out["replicated per rank"] = root(every_copy)
    once = combine([local(s) for rank, shards in prob["shards"].items() for s in shards
                    if not s["replicated"] or rank % tp == 0])
    out["no root"] = once
    out["padding"] = root(combine([local(s, True) for rank, shards in prob["shards"].items() for s in shards
                                   if not s["replicated"] or rank % tp == 0]))
    if p == math.inf:                            # the ranks' maxima added instead of the max taken
        out["sum of maxima"] = sum(max([local(s) for s in prob["shards"][rank] if not s["replicated"] or rank % tp == 0]
                                       or [0.0]) for rank in range(tp * dp))
    return out


_HINTS = {
    "local": "it is the norm of this rank's own shards only: add |g|^p over what the rank holds, then all-reduce that "
             "one number over the tp group and over the dp group (each rank holds a different part), then take "
             "the p-th root",
    "replicated per rank": "it counts each replicated bucket once per tp rank: those gradients are the same on every "
                           "tp rank, so count them on one tp rank only (tp rank 0), as Megatron-LM does",
    "no root": "it is the sum of |g|^p over the model, the norm to the power p: take the p-th root (the square root "
               "for p = 2) after the all-reduce",
    "padding": "it counts the padding: only the first `valid` elements of a shard belong to parameters (the rest "
               "pads the bucket to a multiple of the dp size and holds anything)",
    "sum of maxima": "it is the sum of the ranks' maxima: the inf-norm is the largest |g_i| over the model, so "
                     "all-reduce with op max (and take no root)",
}


def _close(a, b):
    return abs(a - b) <= RTOL * max(abs(b), 1e-30)


def _judge_norm(prob, observed, parts, part, where):
    wrong = _wrong_norms(prob)
    for rank in sorted(observed):                  # every rank returns the norm
        got = observed[rank]["norm"]
        if not isinstance(got, float) or not math.isfinite(got):
            parts.note(part, f"rank {rank} returned {got!r}: return the global norm as a number (a float).", where)
            return
        if _close(got, prob["norm"]):
            continue
        hint = next((h for k, h in _HINTS.items() if k in wrong and _close(
            got, wrong[k][rank] if isinstance(wrong[k], dict) else wrong[k])), "")
        if not hint and any(_close(observed[r]["norm"], prob["norm"]) for r in observed if r != rank):
            hint = ("other ranks have it right: every rank must end with the same total (an all-reduce, not a reduce "
                    "to one rank)")
        parts.note(part, f"rank {rank} returned the norm {got:.10g}, expected {prob['norm']:.10g}"
                         f"{': ' + hint if hint else ''}.", where)
        return


def _judge_clip(prob, observed, parts, part, where):
    coef = prob["coef"]
    for rank in sorted(observed):                  # every rank scales its own shards
        for b, (given, got) in enumerate(zip(prob["shards"][rank], observed[rank]["grads"])):
            v = given["valid"]
            if not torch.is_tensor(got) or got.shape != given["grad"].shape:
                parts.note(part, f"rank {rank}'s shard {b} came back as {type(got).__name__}: scale the shards' "
                                 f"'grad' tensors in place.", where)
                return
            expect = given["grad"][:v] * coef
            diff = first_difference(got[:v], expect, rtol=RTOL, atol=1e-300)
            if diff is None:
                continue
            index, a, e = diff
            kind = "replicated" if given["replicated"] else "split"
            hint = ""
            if torch.equal(got[:v], given["grad"][:v]):
                hint = (f" It was not scaled at all on rank {rank}: every rank scales what it holds (replicated "
                        f"buckets too), by the same factor.")
            elif coef == 1.0:
                hint = (f" The norm {prob['norm']:.6g} is below max_norm {prob['max_norm']:.6g}: the factor is "
                        f"min(1, max_norm / (norm + 1e-6)) = 1, gradients are never scaled up.")
            elif torch.allclose(got[:v], given["grad"][:v] * prob["max_norm"] / prob["norm"], rtol=1e-12, atol=0):
                hint = " It was scaled by max_norm / norm: torch's factor is max_norm / (norm + 1e-6)."
            parts.note(part, f"rank {rank}'s shard {b} ({kind} bucket) at [{index}] is {a:.10g}, expected {e:.10g} "
                             f"(scaled by {coef:.6g}).{hint}", where)
            return


@exercise("clip_sharded", "Gradient clipping by the global norm across TP and ZeRO shards", answer="clip_sharded",
          notebook="09c_clip_sharded", sealed=True, points=len(_PARTS))
def check_clip_sharded(fn, seed: int, timeout: float) -> str:
    """clip_sharded(shards, max_norm, norm_type, tp_group, dp_group): the global norm, every element once,
    and the shards clipped like torch.nn.utils.clip_grad_norm_ on one process."""
    require_function(fn, "clip_sharded", "shards, max_norm, norm_type, tp_group, dp_group",
                     [], 1.0, 2.0, None, None)
    rng = random.Random(seed)
    problems = [_problem(rng, *t) for t in TRIALS]
    parts = Parts(list(_PARTS.values()))

    def describe(p, i):
        t = problems[i]
        return (f"world_size={p}, tp={t['tp']} × dp={t['dp']}, norm_type={t['norm_type']}, "
                f"{len(t['buckets'])} buckets")

    def check(p, i, observed, traffic):
        if len(observed) < p:
            return
        prob, where = problems[i], describe(p, i)
        if prob["norm_type"] == math.inf:
            _judge_norm(prob, observed, parts, _PARTS["inf"], where)
            _judge_clip(prob, observed, parts, _PARTS["inf"], where)
        else:
            _judge_norm(prob, observed, parts, _PARTS["norm"], where)
            _judge_clip(prob, observed, parts, _PARTS["clip"], where)

    inputs = [[{"tp": t["tp"], "dp": t["dp"], "max_norm": t["max_norm"], "norm_type": t["norm_type"],
                "shards": t["shards"][r]} for r in range(WORLD)] for t in problems]
    try:
        sealed.run_sealed(_rank_job, fn, inputs, world_size=WORLD, timeout=timeout,
                          exercise=("clip_sharded", "global-norm clipping"), forbidden=(), describe=describe,
                          check=check)
    except Fail as failure:
        raise parts.aborted(failure) from None
    return parts.finish(f"on {WORLD} ranks (meshes tp=3 × dp=2, tp=2 × dp=3, tp=6, dp=6; replicated and split "
                        f"buckets, padding holding garbage): the norm on every rank and every clipped shard equal "
                        f"one process's to {RTOL:g}, for norm_type 2 and inf")
