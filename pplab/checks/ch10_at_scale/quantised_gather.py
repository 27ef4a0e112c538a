"""Check of chapter 10c's exercise: ZeRO++'s quantised weight all-gather (qwZ).

    quantised_gather    quantised_all_gather(output, input, block)   in place: every rank's input,
                                                                     each dequantised from int8

Runs on 2, 3 and 4 sealed ranks. Each rank holds a different fp32 shard (sizes that `block`
does not divide, numbers of very different sizes from block to block, and in one trial a
block of zeros). Graded in two parts:

    values    every rank's output against the reference: each rank's input quantised block by
              block (symmetric int8, scale = max|x| / 127, a block of zeros has scale 0),
              dequantised, concatenated in rank order. A number that sits on a rounding tie
              (x/scale = k + ½ up to float rounding) may round either way.
    traffic   what each rank put on the wire, from the router's record: at most what int8 and
              one fp32 scale per block cost, (p-1)(n + 4⌈n/block⌉) bytes sent by point-to-point,
              or n + 4⌈n/block⌉ bytes put into all-gathers, so the full-precision shard never travels.
"""
from __future__ import annotations

import math
import random
import torch

from .. import sealed
from ..core import Fail, Parts, exercise, require_function
from .quantised_gather_rank import _rank_job, _refuse_plusplus


PARTS = ("values", "traffic")


def _trials(seed, p):
    rng = random.Random(seed * 13 + p)
    trials = [{"n": rng.randint(5, 40), "block": rng.choice([4, 6, 8]), "zeros": False} for _ in range(2)]
    trials.append({"n": rng.randint(41, 300), "block": rng.choice([16, 32]), "zeros": True})
    for t in trials:
        t["seed"] = rng.randrange(2**31)
    return trials


def _inputs(trial, p):
    """Per rank its own shard: Gaussian numbers scaled block by block over five orders of magnitude."""
    g = torch.Generator().manual_seed(trial["seed"])
    n, block = trial["n"], trial["block"]
    shards = []
    for _ in range(p):
        x = torch.randn(n, generator=g)
        sizes = 10.0 ** (torch.rand(math.ceil(n / block), generator=g) * 5 - 3)
        x = x * sizes.repeat_interleave(block)[:n]
        if trial["zeros"]:
            x[:block] = 0.0                           # an all-zero block: scale 0, no division by it
        shards.append(x)
    return shards


def _reference(x, block):
    """Dequantised x and each number's step (its block's scale), worked out here by hand."""
    n = x.numel()
    rows = torch.zeros(math.ceil(n / block) * block)
    rows[:n] = x
    rows = rows.view(-1, block)
    scales = rows.abs().amax(1) / 127
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(rows / safe[:, None]).clamp(-127, 127)
    per_number = scales.repeat_interleave(block)[:n]
    return (q * scales[:, None]).reshape(-1)[:n], per_number, (rows / safe[:, None]).reshape(-1)[:n]


def _judge_values(trial, shards, observed, parts, where):
    block, n = trial["block"], trial["n"]
    for rank in sorted(observed):
        got = observed[rank]["output"]
        if not isinstance(got, torch.Tensor) or got.shape != (len(shards) * n,):
            parts.note("values", f"rank {rank}'s output is not the {len(shards) * n} numbers it was given.", where)
            return
        for src, x in enumerate(shards):
            want, step, ratio = _reference(x, block)
            mine = got[src * n:(src + 1) * n]
            tie = ((ratio.abs().frac() - 0.5).abs() < 1e-4) & ((mine - want).abs() <= step * 1.001)
            bad = ~(torch.isclose(mine, want, rtol=1e-5, atol=1e-30) | tie)
            if not bool(bad.any()):
                continue
            k = int(bad.nonzero()[0])
            b = k // block
            hint = ""
            if torch.isnan(mine[k]):
                hint = (" A NaN: a block of zeros has scale 0; dividing by it gives NaN. Give such a block "
                        "integers 0 (e.g. divide by 1 where the scale is 0).") if x[b * block:(b + 1) * block].abs().max() == 0 \
                    else " A NaN: the output was not written there."
            elif torch.equal(mine, x):
                hint = (" That is the exact input: every rank, its owner too, must use the dequantised "
                        "values, so that all ranks compute with the same weights.")
            elif torch.isclose(mine[k], x[k], rtol=1e-6, atol=0):
                hint = " That is the exact number, not its int8 rounding: quantise before sending, dequantise after."
            else:
                whole = x.abs().max() / 127
                if whole > 0 and torch.isclose(mine[k], torch.round(x[k] / whole) * whole, rtol=1e-5, atol=1e-30):
                    hint = " That is one scale for the whole shard: use one scale per block of `block` numbers."
            parts.note("values", f"rank {rank}'s piece from rank {src} differs at index {k} (block {b}): got "
                       f"{float(mine[k]):.6g}, expected {float(want[k]):.6g} (input {float(x[k]):.6g}, "
                       f"scale {float(step[k]):.4g}).{hint}", where)
            return


def _judge_traffic(trial, p, traffic, parts, where):
    n, block = trial["n"], trial["block"]
    wire = n + 4 * math.ceil(n / block)
    for rank in range(p):
        record = traffic.get(rank, {"sends": [], "collectives": []})
        sent = sum(b for _, b in record["sends"])
        gathered = sum(c["bytes"] for c in record["collectives"])
        if sent > (p - 1) * wire or gathered > wire or (sent and gathered and sent / (p - 1) + gathered > wire):
            shard = sent / (p - 1) + gathered                      # bytes that carried one shard
            numbers = shard - 4 * math.ceil(n / block)             # what is left beside fp32 scales
            looks = (f" That is {numbers / n:g} bytes per number beside fp32 scales, not 1." if numbers % n == 0
                     else f" That is {shard / n:g} bytes per number, not 1." if shard % n == 0 else "")
            parts.note("traffic", f"rank {rank} put {sent:,} bytes in sends and {gathered:,} into collectives; "
                       f"int8 numbers and fp32 scales are {n} + 4 × {math.ceil(n / block)} = {wire} bytes per shard, "
                       f"(p-1) × {wire} = {(p - 1) * wire} by sends.{looks} Send the int8 integers themselves "
                       f"(torch.int8) and the scales (float32), not float32 or 16-bit numbers.", where)
            return
        if sent + gathered == 0:
            parts.note("traffic", f"rank {rank} sent nothing: the shards must travel between the ranks.", where)
            return


@exercise("quantised_gather", "ZeRO++'s quantised weight all-gather", answer="quantised_all_gather",
          notebook="10c_quantised_gather", sealed=True, points=len(PARTS))
def check_quantised_gather(fn, seed: int, timeout: float) -> str:
    """quantised_all_gather(output, input, block): output = every rank's input, int8 on the wire, dequantised."""
    require_function(fn, "quantised_gather", "output, input, block", torch.zeros(2), torch.zeros(1), 4)
    parts = Parts(PARTS)
    for p in (2, 3, 4):
        trials = _trials(seed, p)
        shards = [_inputs(t, p) for t in trials]
        inputs = [[{"p": p, "input": s[r], "block": t["block"]} for r in range(p)] for t, s in zip(trials, shards)]

        def describe(world_size, i, trials=trials):
            t = trials[i]
            return f"world_size={world_size}, {t['n']} numbers per rank, block={t['block']}" + \
                   (", a block of zeros" if t["zeros"] else "")

        def check(world_size, i, observed, traffic, trials=trials, shards=shards):
            try:
                _judge_values(trials[i], shards[i], observed, parts, describe(world_size, i))
                if len(observed) == world_size:
                    _judge_traffic(trials[i], world_size, traffic, parts, describe(world_size, i))
            except (KeyError, IndexError, TypeError, AttributeError) as e:
                raise Fail(f"what the ranks recorded could not be read ({type(e).__name__}: {e}).")

        try:
            sealed.run_sealed(_rank_job, fn, inputs, world_size=p, timeout=timeout,
                              exercise=("quantised_gather", "a quantised all-gather"), forbidden=(),
                              probe=_refuse_plusplus, describe=describe, check=check)
        except Fail as failure:
            raise parts.aborted(failure) from None
    return parts.finish("on world sizes 2, 3, 4 (3 trials each: random sizes that the block does not divide, "
                        "blocks of numbers five orders of magnitude apart, a block of zeros)")
