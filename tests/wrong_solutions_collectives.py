"""Near-miss wrong answers to chapters 0 and 1's collectives (issue 38): right at p = 2 and wrong at
p = 3, wrong on a rank other than 0, just outside the checker's tolerance, or wrong in what travels
(dtype, bytes) though the values come out right. Each is a correct answer with one thing changed;
tools/mutants/checks_collectives_dp_clip.py loosens the checker the matching way, and only these
answers catch it. As in wrong_solutions_ch00_broadcast.py: WRONG[exercise_id] lists (answer, regular expressions
the check's message must match, timeout or None).

CLOSE_BUT_RIGHT lists answers whose results differ from the reference by far less than the
tolerance: they must pass (tests/test_checks_near_miss.py).
"""
import math

import torch

from pplab import comm
from wrong_solutions_chapters import AR_TRIAL, PREDICTION, RS_TRIAL, _fit

# ----------------------------------------------------------------------------------
# broadcast


def broadcast_tree_rounds_rounded_down(tensor, src):
    """A binomial tree over int(math.log2(p)) rounds: the ceiling is needed. Right on 2 and 4 ranks;
    on 3 ranks one round is missing and relative rank 2 never receives."""
    rank, p = comm.rank(), comm.world_size()
    me = (rank - src) % p
    for k in range(int(math.log2(p))):
        mask = 1 << k
        if me < mask and me + mask < p:
            comm.send(tensor, (me + mask + src) % p)
        elif mask <= me < 2 * mask:
            comm.recv(tensor, (me - mask + src) % p)


# ----------------------------------------------------------------------------------
# reduce_scatter and ring_all_reduce


def _ring():
    rank, p = comm.rank(), comm.world_size()
    return rank, p, (rank + 1) % p, (rank - 1) % p


def reduce_scatter_sends_half_precision(output, input):
    """A right ring that sends float32 partial sums as float16 to halve the bytes: each partial sum
    is rounded to 11 bits on the way, an error near 1e-4 to 1e-3, not float32's 1e-7."""
    rank, p, right, left = _ring()
    chunks = input.clone().view(-1).split(output.numel())
    wire = torch.float16 if input.is_floating_point() else input.dtype
    for s in range(p - 1):
        send, add = chunks[(rank - s - 1) % p], chunks[(rank - s - 2) % p]
        incoming = torch.empty_like(add, dtype=wire)
        comm.exchange(send.to(wire), right, incoming, left)
        add.add_(incoming.to(add.dtype))
    output.copy_(chunks[rank])


def reduce_scatter_passes_whole_input(output, input):
    """Right values, but each step passes a whole input round the ring (p-1 steps of p chunks):
    p times the bytes of a ring reduce-scatter."""
    rank, p, right, left = _ring()
    outgoing, incoming, total = input.clone(), torch.empty_like(input), input.clone()
    for _ in range(p - 1):
        comm.exchange(outgoing, right, incoming, left)
        total += incoming
        outgoing, incoming = incoming, outgoing
    output.copy_(total.view(-1).split(output.numel())[rank])


def all_reduce_bitmask_ring(tensor):
    """A right ring whose neighbours wrap with & (p - 1), the modulo of power-of-two code: right on
    2 and 4 ranks; on 3, (0 + 1) & 2 = 0 makes rank 0 its own right neighbour."""
    rank, p = comm.rank(), comm.world_size()
    right, left = (rank + 1) & (p - 1), (rank - 1) & (p - 1)
    chunks = tensor.view(-1).tensor_split(p)
    for s in range(p - 1):
        send, add = chunks[(rank - s) % p], chunks[(rank - s - 1) % p]
        incoming = torch.empty_like(add)
        comm.exchange(send, right, incoming, left)
        add.add_(incoming)
    for s in range(p - 1):
        comm.exchange(chunks[(rank - s + 1) % p], right, chunks[(rank - s) % p], left)


def all_reduce_gathers_half_precision(tensor):
    """A right ring whose all-gather passes the complete chunks as float16 (the reduce-scatter in
    float32): every rank but a chunk's owner gets it rounded to 11 bits, off by up to 5e-4."""
    rank, p, right, left = _ring()
    chunks = tensor.view(-1).tensor_split(p)
    wire = torch.float16 if tensor.is_floating_point() else tensor.dtype
    for s in range(p - 1):
        send, add = chunks[(rank - s) % p], chunks[(rank - s - 1) % p]
        incoming = torch.empty_like(add)
        comm.exchange(send, right, incoming, left)
        add.add_(incoming)
    for s in range(p - 1):
        incoming = torch.empty_like(chunks[(rank - s) % p], dtype=wire)
        comm.exchange(chunks[(rank - s + 1) % p].to(wire), right, incoming, left)
        chunks[(rank - s) % p].copy_(incoming)


def all_reduce_adds_in_float64(tensor):
    """A right ring that adds each incoming chunk in float64: a different rounding, well inside 1e-5."""
    rank, p, right, left = _ring()
    chunks = tensor.view(-1).tensor_split(p)
    for s in range(p - 1):
        send, add = chunks[(rank - s) % p], chunks[(rank - s - 1) % p]
        incoming = torch.empty_like(add)
        comm.exchange(send, right, incoming, left)
        add.copy_((add.double() + incoming.double()).to(add.dtype))
    for s in range(p - 1):
        comm.exchange(chunks[(rank - s + 1) % p], right, chunks[(rank - s) % p], left)


# ----------------------------------------------------------------------------------
# predict_time


def _ring_time(alpha, beta, p, n_bytes):
    return 2 * (p - 1) * alpha + 2 * (p - 1) / p * n_bytes * beta


def predict_rounded_to_five_digits(timings, p, n_bytes):
    """The right fit and formula, but the time rounded to 5 significant digits for the printout:
    off by up to 5e-5, more than the 1e-6 asked."""
    alpha, beta = _fit(timings)
    return alpha, beta, float(f"{_ring_time(alpha, beta, p, n_bytes):.5g}")


def predict_rounded_to_nine_digits(timings, p, n_bytes):
    """The same rounded to 9 digits: off by 5e-9 at most, well inside 1e-6."""
    alpha, beta = _fit(timings)
    return alpha, beta, float(f"{_ring_time(alpha, beta, p, n_bytes):.9g}")


CLOSE_BUT_RIGHT = {"ring_all_reduce": [all_reduce_adds_in_float64], "predict_time": [predict_rounded_to_nine_digits]}

WRONG = {
    "broadcast": [
        (broadcast_tree_rounds_rounded_down,
         [r"^world_size=3, src=\d, dtype=(float32|int64), shape=\([\d, ]*\): rank \d's result differs from the "
          r"reference \(rank \d's tensor, the src\)"], None),
    ],
    "reduce_scatter": [
        (reduce_scatter_sends_half_precision,
         [r"^world_size=\d, dtype=float32, elements per rank=\d+: ", r"rank \d's output differs from the sum over "
          r"ranks of chunk \d"], None),
        (reduce_scatter_passes_whole_input,
         [RS_TRIAL, r"rank \d sent [\d,]+ bytes for a tensor of [\d,]+ bytes, more than the [\d,]+ bytes of a ring "
          r"reduce-scatter \(p-1 steps of one chunk\)", r"send one chunk per step"], None),
    ],
    "ring_all_reduce": [
        (all_reduce_bitmask_ring, [r"^world_size=3, ", r"rank \d raised ValueError: (dst|src)=\d is this rank itself"],
         None),
        (all_reduce_gathers_half_precision,
         [r"^world_size=\d, dtype=float32, shape=\([\d, ]*\): ", r"rank \d's result differs from the sum over all "
          r"ranks", r"(Chunks? [\d, ]+ of tensor\.tensor_split\([34]\) (is|are) wrong on this rank|Only chunk \d of "
          r"tensor\.tensor_split\(2\) is right)"], None),
    ],
    "predict_time": [
        (predict_rounded_to_five_digits, [PREDICTION, r"\(relative tolerance 1e-6\)",
                                          r"Parts: fit ✔ · prediction ✘ \(1 of 2\)"], None),
    ],
}
