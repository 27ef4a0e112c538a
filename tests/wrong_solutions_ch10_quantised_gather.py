"""Plausible wrong answers to chapter 10c's quantised all-gather, as in wrong_solutions_ch00_broadcast.py:
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


# ----------------------------------------------------------------------------------
# Near misses (issue 38): right at p = 2 but not at 3, wrong on a rank other than 0, a 2-byte wire,
# a dequantisation just outside the values' tolerance. Each changes one step of quantised_gather.


def exchanges_with_xor_partners(output, input, block):
    """Pairwise exchange with partner me ^ step, skipping partners past the last rank: every pair
    meets when p is a power of two (2, 4), but at p = 3 ranks 1 and 2 never meet (rank 0 is right)."""
    p, me, n = comm.world_size(), comm.rank(), input.numel()
    q, scales = _quantise(input, block)
    qs, ss = [None] * p, [None] * p
    qs[me], ss[me] = q, scales
    for step in range(1, p):
        partner = me ^ step
        if partner >= p:
            continue
        q_in, s_in = torch.empty_like(q), torch.empty_like(scales)
        handles = [comm.isend(q, partner), comm.isend(scales, partner), comm.irecv(q_in, partner),
                   comm.irecv(s_in, partner)]
        for h in handles:
            h.wait()
        qs[partner], ss[partner] = q_in, s_in
    for r in range(p):
        if qs[r] is not None:
            output[r * n:(r + 1) * n] = qs[r].float() * ss[r].repeat_interleave(block)[:n]


def sends_int8_as_float16(output, input, block):
    """Right values, but the integers travel as float16 (exact for -127..127): 2 bytes a number, not 1."""
    p, me, n = comm.world_size(), comm.rank(), input.numel()
    q, scales = _quantise(input, block)
    qs, ss = _exchange(q.half(), scales, p, me)
    _write(output, [x.to(torch.int8) for x in qs], ss, block, n)


def dequantises_with_a_margin(output, input, block):
    """A "safety margin" on the scale the receivers multiply by: every number 2e-4 (20 times the values'
    relative tolerance, 1e-5) larger than its int8 rounding."""
    p, me, n = comm.world_size(), comm.rank(), input.numel()
    q, scales = _quantise(input, block)
    qs, ss = _exchange(q, scales, p, me)
    _write(output, qs, [s * (1 + 2e-4) for s in ss], block, n)


def dequantises_by_the_inverse_scale(output, input, block):
    """Correct: q / (1 / scale) rounds differently from q * scale, within float32's 1e-7 (the values'
    tolerance is 1e-5). tests/test_checks_zero_plus_plus_near.py checks it passes."""
    p, me, n = comm.world_size(), comm.rank(), input.numel()
    q, scales = _quantise(input, block)
    qs, ss = _exchange(q, scales, p, me)
    for r, (qr, s) in enumerate(zip(qs, ss)):
        inverse = torch.where(s > 0, 1 / s, torch.zeros_like(s))
        per = inverse.repeat_interleave(block)[:n]
        output[r * n:(r + 1) * n] = torch.where(per > 0, qr.float() / per, torch.zeros_like(per))


WRONG["quantised_gather"] += [
    (exchanges_with_xor_partners, [r"^world_size=3, .*, rank [12]'s piece from rank [12] differs at index \d+ "
                                   r"\(block \d+\): got nan", r"A NaN: the output was not written there",
                                   r"values ✘ · traffic ✔ \(1 of 2\)"], None),
    (sends_int8_as_float16, [r"^world_size=2, .*, rank \d put \d+ bytes in sends and 0 into collectives; int8 "
                             r"numbers and fp32 scales are \d+ \+ 4 × \d+ = \d+ bytes per shard",
                             r"That is 2 bytes per number beside fp32 scales, not 1", r"values ✔ · traffic ✘ \(1 of 2\)"], None),
    (dequantises_with_a_margin, [r"^world_size=2, .*, rank 0's piece from rank 0 differs at index \d+",
                                 r"values ✘ · traffic ✔ \(1 of 2\)"], None),
]
