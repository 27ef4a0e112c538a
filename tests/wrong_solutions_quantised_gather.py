"""Plausible wrong answers to chapter 10c's quantised all-gather, as in wrong_solutions.py:
WRONG[exercise_id] lists (answer, regular expressions the check's message must match, timeout or None);
tests/test_checks.py checks that each fails with its message.

`quantised_gather` is a correct answer written apart from the solution notebook's: every rank sends
its int8 numbers and scales to every other rank by point-to-point messages. Each wrong one changes
one step of it.
"""
import math

import torch

from pplab import comm


def _quantise(x, block, whole_shard=False, rounds=True):
    n = x.numel()
    rows = torch.nn.functional.pad(x, (0, math.ceil(n / block) * block - n)).view(-1, block)
    if whole_shard:
        scales = (x.abs().max() / 127).repeat(len(rows))
    else:
        scales = rows.abs().amax(dim=1) / 127
    divisor = torch.where(scales == 0, 1.0, scales)
    ratio = rows / divisor[:, None]
    return (ratio.round() if rounds else ratio).to(torch.int8).view(-1)[:n], scales


def _exchange(q, scales, p, me):
    """Everyone's (q, scales), mine included, by direct sends: p-1 messages of each per rank."""
    qs, ss = [None] * p, [None] * p
    qs[me], ss[me] = q, scales
    for step in range(1, p):
        to, frm = (me + step) % p, (me - step) % p
        q_in, s_in = torch.empty_like(q), torch.empty_like(scales)
        handles = [comm.isend(q, to), comm.isend(scales, to), comm.irecv(q_in, frm), comm.irecv(s_in, frm)]
        for h in handles:
            h.wait()
        qs[frm], ss[frm] = q_in, s_in
    return qs, ss


def _write(output, qs, ss, block, n):
    for r, (q, s) in enumerate(zip(qs, ss)):
        output[r * n:(r + 1) * n] = q.float() * s.repeat_interleave(block)[:n]


def quantised_gather(output, input, block, whole_shard=False, rounds=True):
    p, me, n = comm.world_size(), comm.rank(), input.numel()
    q, scales = _quantise(input, block, whole_shard, rounds)
    qs, ss = _exchange(q, scales, p, me)
    _write(output, qs, ss, block, n)


def one_scale_per_shard(output, input, block):
    quantised_gather(output, input, block, whole_shard=True)


def truncates(output, input, block):
    quantised_gather(output, input, block, rounds=False)    # .to(torch.int8) cuts off the fraction


def keeps_its_own_shard_exact(output, input, block):
    quantised_gather(output, input, block)
    me, n = comm.rank(), input.numel()
    output[me * n:(me + 1) * n] = input                 # "my own numbers need no rounding"


def gathers_float32(output, input, block):
    p, n = comm.world_size(), input.numel()
    everyone = torch.empty(p * n)
    comm.all_gather_into_tensor(everyone, input)        # the full-precision shards travel
    for r in range(p):
        q, s = _quantise(everyone[r * n:(r + 1) * n], block)
        output[r * n:(r + 1) * n] = q.float() * s.repeat_interleave(block)[:n]


def in_arrival_order(output, input, block):
    p, me, n = comm.world_size(), comm.rank(), input.numel()
    q, scales = _quantise(input, block)
    qs, ss = _exchange(q, scales, p, me)
    _write(output, [qs[(me + i) % p] for i in range(p)], [ss[(me + i) % p] for i in range(p)], block, n)
    # piece i is the one from me + i: right on rank 0 only


VALUES = r"rank \d's piece from rank \d differs at index \d+ \(block \d+\): got .*, expected "
WRONG = {"quantised_gather": [
    (one_scale_per_shard, [VALUES, r"one scale for the whole shard: use one scale per block",
                           r"values ✘ · traffic ✔ \(1 of 2\)"], None),
    (truncates, [VALUES, r"values ✘ · traffic ✔ \(1 of 2\)"], None),
    (keeps_its_own_shard_exact, [r"rank (\d)'s piece from rank \1 differs", r"That is the exact input: every rank, its "
                                 r"owner too, must use the dequantised values", r"values ✘ · traffic ✔ \(1 of 2\)"], None),
    (gathers_float32, [r"rank \d put 0 bytes in sends and \d+ into collectives; int8 numbers and fp32 scales are",
                       r"values ✔ · traffic ✘ \(1 of 2\)"], None),
    (in_arrival_order, [r"rank [1-3]'s piece from rank \d differs", r"values ✘ · traffic ✔ \(1 of 2\)"], None),
]}


def scale_over_128(output, input, block):
    """int8 reaches -128, so "divide by 128": the largest number rounds to 128, which int8 wraps to -128."""
    p, me, n = comm.world_size(), comm.rank(), input.numel()
    rows = torch.nn.functional.pad(input, (0, math.ceil(n / block) * block - n)).view(-1, block)
    scales = rows.abs().amax(dim=1) / 128
    q = (rows / torch.where(scales == 0, 1.0, scales)[:, None]).round().to(torch.int8).view(-1)[:n]
    qs, ss = _exchange(q, scales, p, me)
    _write(output, qs, ss, block, n)


def own_scales_for_everyone(output, input, block):
    """Only the int8 numbers travel; each rank dequantises everyone's with its own scales."""
    p, me, n = comm.world_size(), comm.rank(), input.numel()
    q, scales = _quantise(input, block)
    qs, _ = _exchange(q, scales, p, me)
    _write(output, qs, [scales] * p, block, n)


WRONG["quantised_gather"] += [
    (scale_over_128, [VALUES, r"values ✘ · traffic ✔ \(1 of 2\)"], None),
    (own_scales_for_everyone, [r"rank (\d)'s piece from rank (?!\1)\d differs", r"values ✘"], None),
]
