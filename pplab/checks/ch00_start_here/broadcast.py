"""Check of exercise broadcast (exercises/00_broadcast.ipynb): Broadcast built from point-to-point messages.

    broadcast         my_broadcast(tensor, src)                       in place, rank src's tensor everywhere
"""
from __future__ import annotations

import inspect
import random
from dataclasses import dataclass
import torch

from .. import sealed
from ..core import Fail, exercise, first_difference
from .broadcast_rank import _broadcast_rank


@dataclass(frozen=True)
class _Trial:
    src: int
    dtype: str
    shape: tuple


_BROADCAST_CASES = [("float32", (17,)), ("int64", (1,)), ("float32", (3, 5)), ("int64", (2, 3, 4)),
                    ("float32", (1,)), ("float32", (1000,))]


def _broadcast_trials(seed: int, world_size: int) -> list[_Trial]:
    """Every src at least once (in random order), every dtype/shape case once."""
    rng = random.Random(seed * 31 + world_size)
    sources = list(range(world_size))
    rng.shuffle(sources)
    cases = list(_BROADCAST_CASES)
    rng.shuffle(cases)
    n = max(world_size, len(cases))
    return [_Trial(sources[i % world_size], *cases[i % len(cases)]) for i in range(n)]


def _broadcast_inputs(seed: int, world_size: int, index: int, trial: _Trial) -> list[torch.Tensor]:
    """A different random tensor for every rank (computed here: each rank gets only its own)."""
    g = torch.Generator().manual_seed(seed * 1000 + world_size * 100 + index)
    if trial.dtype == "int64":
        return [torch.randint(-10**6, 10**6, trial.shape, generator=g) for _ in range(world_size)]
    return [torch.randn(trial.shape, generator=g) for _ in range(world_size)]


def _describe_broadcast(trials):
    def describe(world_size, i):
        t = trials[world_size][i]
        return f"world_size={world_size}, src={t.src}, dtype={t.dtype}, shape={t.shape}"
    return describe


def _received(traffic, rank) -> int:
    """Bytes the router delivered to `rank` in one trial."""
    return sum(n for _, n in traffic[rank]["received"])


def _check_broadcast(name, trials, seed):
    """check(world_size, trial, observed, traffic), in the checker's process: every rank's tensor is src's."""
    def check(p, i, observed, traffic):
        trial = trials[p][i]
        expected = _broadcast_inputs(seed, p, i, trial)[trial.src]
        n_bytes = expected.numel() * expected.element_size()
        for rank, seen in sorted(observed.items()):   # every rank, src or not
            tensor, returned = seen["tensor"], seen["returned"]
            if tensor.dtype != expected.dtype or tensor.shape != expected.shape:
                raise Fail(f"rank {rank}'s tensor changed from {expected.dtype}{tuple(expected.shape)} to "
                           f"{tensor.dtype}{tuple(tensor.shape)}: write the values into it, keep its dtype "
                           f"and shape.")
            diff = first_difference(tensor, expected)
            if diff is not None:
                if returned is not None and returned.shape == expected.shape and \
                        torch.equal(returned, expected.to(returned.dtype)):
                    raise Fail(f"{name} returned the result as a new tensor on rank {rank} but left `tensor` "
                               f"unchanged: write into `tensor` itself, in place, as torch.distributed.broadcast "
                               f"does (recv into it, or tensor.copy_(result)).")
                if rank == trial.src:
                    raise Fail(f"rank {rank} is the src, so its tensor must stay as it was, but it changed {diff}.")
                raise Fail(f"rank {rank}'s result differs from the reference (rank {trial.src}'s tensor, the src) "
                           f"{diff}.")
            if rank != trial.src and _received(traffic, rank) < n_bytes:
                raise Fail(f"rank {rank} ended with the right values but received {_received(traffic, rank):,} "
                           f"bytes by point-to-point messages, less than its tensor's {n_bytes:,}: the data must "
                           f"travel with send/recv (pplab.comm or torch.distributed), not another way.")
    return check


@exercise("broadcast", "Broadcast built from point-to-point messages", answer="my_broadcast",
          notebook="00_broadcast", sealed=True)
def check_broadcast(fn, seed: int, timeout: float) -> str:
    """my_broadcast(tensor, src), called on every rank, leaves every rank's tensor equal to
    rank src's, in place, using only point-to-point operations."""
    if not callable(fn):
        raise Fail(f"pass your function itself: pplab.check('broadcast', my_broadcast), got {type(fn).__name__}.",
                   seed_matters=False)
    try:
        inspect.signature(fn).bind(torch.zeros(1), 0)
    except TypeError:
        raise Fail(f"{fn.__name__} must take (tensor, src); yours takes {inspect.signature(fn)}.",
                   seed_matters=False) from None
    except ValueError:
        pass                                             # no signature to inspect (a builtin)
    sizes = (2, 3, 4)                                    # 3: not a power of two
    trials = {p: _broadcast_trials(seed, p) for p in sizes}
    for p in sizes:
        inputs = [[{"tensor": tensor, "src": t.src} for tensor in _broadcast_inputs(seed, p, i, t)]
                  for i, t in enumerate(trials[p])]
        sealed.run_sealed(_broadcast_rank, fn, inputs, world_size=p, timeout=timeout,
                          exercise=("broadcast", "broadcast"), describe=_describe_broadcast(trials),
                          check=_check_broadcast(fn.__name__, trials, seed))
    n = sum(len(t) for t in trials.values())
    return (f"on world sizes {', '.join(map(str, sizes))} ({n} trials with random data: every src, "
            f"float32 and int64, 1 to 1000 elements, exact match)")
