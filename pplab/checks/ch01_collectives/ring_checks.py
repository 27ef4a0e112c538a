"""What chapter 1's checkers of broadcast, reduce_scatter, ring_all_reduce, predict_time share.

The first two run on 2, 3 and 4 real ranks with random float32 and int64 tensors, some
smaller than p and some that p does not divide, and compare every rank with the sum
computed in one process (exact for int64, to 1e-5 for float32). They also read whom each
rank sent to and how many bytes, from the record the checker's router keeps (all three
run on sealed ranks, sealed.py): a ring sends only to its right neighbour, one chunk of
about 1/p of the data per step. predict_time's answer is called in one sealed rank
(sealed.call_each) on made-up ping-pong timings drawn from hidden α and β (its fit is
compared with them) and random p and sizes (its prediction with pplab.costmodel's ring).

"""
from __future__ import annotations

import math
import random

import torch

from .. import sealed
from ..ch00_start_here.broadcast import _received
from ..core import Fail, first_difference


def _trials(seed: int, world_size: int, cases) -> list:
    """The ordinary cases in random order, then the edge cases: the first failure a student
    sees is on an ordinary tensor, where the message says most."""
    rng = random.Random(seed * 31 + world_size)
    ordinary, edge = list(cases[0]), list(cases[1])
    rng.shuffle(ordinary)
    rng.shuffle(edge)
    return ordinary + edge


def _random(g, dtype: str, shape) -> torch.Tensor:
    if dtype == "int64":
        return torch.randint(-10**6, 10**6, shape, generator=g)
    return torch.randn(shape, generator=g)


def _inputs(seed, world_size, index, dtype, shape) -> list[torch.Tensor]:
    """A different random tensor for every rank (computed here: each rank gets only its own)."""
    g = torch.Generator().manual_seed(seed * 1000 + world_size * 100 + index)
    return [_random(g, dtype, shape) for _ in range(world_size)]


def _tolerance(dtype) -> dict:
    return {} if dtype == torch.int64 else {"atol": 1e-5, "rtol": 1e-5}


def _check_ring_traffic(traffic, rank, p, tensor, steps, what, not_a_ring) -> None:
    """Rank `rank` sent only to its right neighbour, at most `steps` chunks of ceil(numel/p) elements
    in all, and received something (`traffic`: the router's record of every rank)."""
    sends = traffic[rank]["sends"]
    n_bytes = tensor.numel() * tensor.element_size()
    limit = steps * math.ceil(tensor.numel() / p) * tensor.element_size()
    right = (rank + 1) % p
    others = sorted({dst for dst, _ in sends if dst != right})
    if others:
        raise Fail(f"rank {rank} sent to rank{'s' if len(others) > 1 else ''} {', '.join(map(str, others))}: in a "
                   f"ring each rank sends only to its right neighbour, (rank + 1) % p = {right}, and the data "
                   f"reaches the other ranks by being passed along ({not_a_ring}).")
    total = sum(n for _, n in sends)
    if total > limit:
        raise Fail(f"rank {rank} sent {total:,} bytes for a tensor of {n_bytes:,} bytes, more than the {limit:,} "
                   f"bytes of {what}: cut the tensor into p chunks (tensor.tensor_split(p)) and send one chunk "
                   f"per step, not the whole tensor.")
    if not _received(traffic, rank) and n_bytes:
        raise Fail(f"rank {rank} ended with the right values but received no point-to-point message: "
                   f"the data must travel with send/recv (pplab.comm or torch.distributed).")


def _returned_new(name, rank, returned, expected, what="tensor"):
    """Fail if the answer returned the right result as a new tensor (`returned`: None if not)."""
    if returned is not None and returned.shape == expected.shape \
            and first_difference(returned.to(expected.dtype), expected, **_tolerance(expected.dtype)) is None:
        raise Fail(f"{name} returned the result as a new tensor on rank {rank} but left `{what}` unchanged: write "
                   f"into `{what}` itself, in place, as torch.distributed does (recv into it, or "
                   f"{what}.copy_(result)).")


def _same_kind(rank, tensor, expected, what="tensor"):
    if tensor.dtype != expected.dtype or tensor.shape != expected.shape:
        raise Fail(f"rank {rank}'s {what} changed from {expected.dtype}{tuple(expected.shape)} to "
                   f"{tensor.dtype}{tuple(tensor.shape)}: write the values into it, keep its dtype and shape.")


def _describe(trials, what="shape"):
    def describe(world_size, i):
        dtype, shape = trials[world_size][i]
        return f"world_size={world_size}, dtype={dtype}, {what}={shape}"
    return describe


def _run(fn, exercise_id, builds, job, check, cases, seed, timeout, what="shape", shape=lambda p, x: x):
    """Every trial on 2, 3 and 4 sealed ranks; shape(p, case) is the shape of each rank's input tensor."""
    trials = {p: _trials(seed, p, cases) for p in (2, 3, 4)}   # 3: not a power of two
    for p in trials:
        inputs = [_inputs(seed, p, i, dtype, shape(p, x)) for i, (dtype, x) in enumerate(trials[p])]
        sealed.run_sealed(job, fn, inputs, world_size=p, timeout=timeout, exercise=(exercise_id, builds),
                          describe=_describe(trials, what), check=check(fn.__name__, trials, seed))
    return sum(map(len, trials.values()))
