"""Checks of chapters 0 and 1's exercises: collectives built from point-to-point messages, and their cost.

    broadcast         my_broadcast(tensor, src)                       in place, rank src's tensor everywhere
    reduce_scatter    my_reduce_scatter(output, input)                rank r gets the sum of chunk r
    ring_all_reduce   my_ring_all_reduce(tensor)                      in place, the sum over ranks
    predict_time      predict_ring_all_reduce(alpha, beta, p, n_bytes)   seconds, by the α-β model

The first two run on 2, 3 and 4 real ranks with random float32 and int64 tensors, some
smaller than p and some that p does not divide, and compare every rank with the sum
computed in one process (exact for int64, to 1e-5 for float32). They also read whom each
rank sent to and how many bytes, from the record the checker's router keeps (all three
run on sealed ranks, sealed.py): a ring sends only to its right neighbour, one chunk of
about 1/p of the data per step. predict_time's answer is called in one sealed rank
(sealed.call_each) on random α, β, p and sizes, and compared with pplab.costmodel.
"""
from __future__ import annotations

import inspect
import math
import random
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .. import costmodel
from . import sealed
from .core import Fail, check_number, exercise, first_difference, refuse_library, require_function
from .core import _fmt

# ----------------------------------------------------------------------------------
# Exercise "broadcast": build broadcast from point-to-point operations


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


def _returned_copy(returned, tensor):
    """What the answer returned, if that is a tensor other than the one it was given."""
    return returned.detach().clone() if isinstance(returned, torch.Tensor) and returned is not tensor else None


def _broadcast_rank(fn, trials):
    """Run on every (sealed) rank: call the student's fn on each trial, record what it left in the tensor."""
    for i, trial in enumerate(trials):
        sealed.begin(i)
        tensor = trial["tensor"]
        returned = fn(tensor, trial["src"])
        sealed.observe(i, {"tensor": tensor, "returned": _returned_copy(returned, tensor)})


def _received(traffic, rank) -> int:
    """Bytes the router delivered to `rank` in one trial."""
    return sum(n for _, n in traffic[rank]["received"])


def _check_broadcast(name, trials, seed):
    """check(world_size, trial, observed, traffic), in the checker's process: every rank's tensor is src's."""
    def check(p, i, observed, traffic):
        trial = trials[p][i]
        expected = _broadcast_inputs(seed, p, i, trial)[trial.src]
        n_bytes = expected.numel() * expected.element_size()
        for rank, seen in sorted(observed.items()):
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
                index, got, want = diff
                if rank == trial.src:
                    raise Fail(f"rank {rank} is the src, so its tensor must stay as it was, but it changed at "
                               f"index {index} (got {_fmt(got)}, expected {_fmt(want)}).")
                raise Fail(f"rank {rank}'s result differs from the reference (rank {trial.src}'s tensor, the src) "
                           f"at index {index} (got {_fmt(got)}, expected {_fmt(want)}).")
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


# ----------------------------------------------------------------------------------
# Exercises "reduce_scatter" and "ring_all_reduce": rings from point-to-point messages

# (dtype, shape): p does not divide 13, 2-D, larger, then the edge cases numel < p.
_CASES = ([("float32", (13,)), ("int64", (3, 5)), ("float32", (1001,)), ("int64", (12,))],
          [("float32", (1,)), ("int64", (2,))])


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


def _check_ring_traffic(rank, p, sends, received_any, limit, n_bytes, what, not_a_ring) -> None:
    """Sent only to the right neighbour, at most `limit` bytes in all, and received something."""
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
    if not received_any and n_bytes:
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


# ----------------------------------------------------------------------------------
# Exercise "reduce_scatter"

_RS_CASES = ([("float32", 7), ("int64", 5), ("float32", 250)], [("float32", 1), ("int64", 1)])  # elements per rank


def _reduce_scatter_rank(fn, inputs):
    """Run on every (sealed) rank: call the student's fn on each trial, record output and input."""
    p = dist.get_world_size()
    for i, input in enumerate(inputs):
        sealed.begin(i)
        output = torch.full((input.numel() // p,), -7777, dtype=input.dtype)
        returned = fn(output, input)
        sealed.observe(i, {"output": output, "input": input, "returned": _returned_copy(returned, output)})


def _check_reduce_scatter(name, trials, seed):
    def check(p, i, observed, traffic):
        dtype, n = trials[p][i]
        inputs = _inputs(seed, p, i, dtype, (p * n,))
        chunk_sums = torch.stack(inputs).double().sum(0).to(inputs[0].dtype).view(p, n)
        for rank, seen in sorted(observed.items()):
            output, input, expected = seen["output"], seen["input"], chunk_sums[rank]
            _same_kind(rank, output, expected, "output")
            tol = _tolerance(expected.dtype)
            diff = first_difference(output, expected, **tol)
            if diff is not None:
                _returned_new(name, rank, seen["returned"], expected, "output")
                index, got, want = diff
                message = (f"rank {rank}'s output differs from the sum over ranks of chunk {rank} (input elements "
                           f"{rank * n}..{rank * n + n - 1}) at index {index} (got {_fmt(got)}, expected "
                           f"{_fmt(want)}).")
                other = [j for j in range(p) if j != rank and first_difference(output, chunk_sums[j], **tol) is None]
                alone = [k for k in range(p) if first_difference(output, inputs[k].view(p, n)[rank], **tol) is None]
                if (output == -7777).all():
                    message += " output was never written."
                elif other:
                    message += (f" It holds the sum of chunk {other[0]} instead: rank r must end with chunk r "
                                f"(check which chunk each step sends and which it adds into).")
                elif alone:
                    message += (f" It holds rank {alone[0]}'s chunk {rank} alone: add what each step receives "
                                f"to your partial sum, so that every rank's part gets in.")
                raise Fail(message)
            _same_kind(rank, input, inputs[rank], "input")
            if first_difference(input, inputs[rank]) is not None:
                raise Fail(f"rank {rank}'s input changed at index {first_difference(input, inputs[rank])[0]}: like "
                           f"torch.distributed.reduce_scatter_tensor, leave input as it was (add up partial sums "
                           f"in a copy, input.clone()).")
            n_bytes = input.numel() * input.element_size()
            _check_ring_traffic(rank, p, traffic[rank]["sends"], _received(traffic, rank) > 0,
                                (p - 1) * n * input.element_size(), n_bytes,
                                "a ring reduce-scatter (p-1 steps of one chunk)",
                                "sending each chunk straight to the rank that owns it is not a ring")
    return check


@exercise("reduce_scatter", "Ring reduce-scatter from point-to-point messages", answer="my_reduce_scatter",
          notebook="01a_reduce_scatter", sealed=True)
def check_reduce_scatter(fn, seed: int, timeout: float) -> str:
    """my_reduce_scatter(output, input), on every rank: output <- the sum over ranks of chunk
    `rank` of input (p equal chunks), by a ring of send/recv; input unchanged."""
    require_function(fn, "reduce_scatter", "output, input", torch.zeros(1), torch.zeros(2))
    n = _run(fn, "reduce_scatter", "reduce_scatter", _reduce_scatter_rank, _check_reduce_scatter, _RS_CASES, seed,
             timeout, what="elements per rank", shape=lambda p, n: (p * n,))
    return (f"on world sizes 2, 3, 4 ({n} trials with random float32 and int64 inputs of 1 to 250 elements per "
            f"rank; sums exact for int64, to 1e-5 for float32; every rank sent only to its right neighbour, "
            f"p-1 chunks)")


# ----------------------------------------------------------------------------------
# Exercise "ring_all_reduce"


def _all_reduce_rank(fn, inputs):
    """Run on every (sealed) rank: call the student's fn on each trial, record the tensor."""
    for i, tensor in enumerate(inputs):
        sealed.begin(i)
        returned = fn(tensor)
        sealed.observe(i, {"tensor": tensor, "returned": _returned_copy(returned, tensor)})


def _check_all_reduce(name, trials, seed):
    def check(p, i, observed, traffic):
        dtype, shape = trials[p][i]
        inputs = _inputs(seed, p, i, dtype, shape)
        expected = torch.stack(inputs).sum(0) if dtype == "int64" else torch.stack(inputs).double().sum(0).float()
        for rank, seen in sorted(observed.items()):
            tensor = seen["tensor"]
            _same_kind(rank, tensor, expected)
            diff = first_difference(tensor, expected, **_tolerance(expected.dtype))
            if diff is not None:
                _returned_new(name, rank, seen["returned"], expected)
                index, got, want = diff
                message = (f"rank {rank}'s result differs from the sum over all ranks at index {index} "
                           f"(got {_fmt(got)}, expected {_fmt(want)}).")
                pieces = list(zip(tensor.view(-1).tensor_split(p), expected.view(-1).tensor_split(p)))
                right = [j for j, (a, b) in enumerate(pieces)
                         if a.numel() and first_difference(a, b, **_tolerance(b.dtype)) is None]
                if torch.equal(tensor, inputs[rank]):
                    message += " Its tensor is unchanged: nothing was added to it."
                elif len(right) == 1 and sum(a.numel() > 0 for a, _ in pieces) > 1:
                    message += (f" Only chunk {right[0]} of tensor.tensor_split({p}) is right: that is what a "
                                f"reduce-scatter leaves. The all-gather must then pass each complete chunk "
                                f"round the ring ({p - 1} more step{'s' if p > 2 else ''}) so that every rank gets "
                                f"all of them.")
                elif right and len(right) < sum(a.numel() > 0 for a, _ in pieces):
                    wrong = [j for j, (a, _) in enumerate(pieces) if a.numel() and j not in right]
                    message += (f" Chunk{'s' if len(wrong) > 1 else ''} {', '.join(map(str, wrong))} of "
                                f"tensor.tensor_split({p}) {'are' if len(wrong) > 1 else 'is'} wrong on this rank: "
                                f"every rank must take part in all {p - 1} steps of the all-gather.")
                raise Fail(message)
            n_bytes = tensor.numel() * tensor.element_size()
            limit = 2 * (p - 1) * math.ceil(tensor.numel() / p) * tensor.element_size()
            _check_ring_traffic(rank, p, traffic[rank]["sends"], _received(traffic, rank) > 0, limit, n_bytes,
                                "a ring all-reduce (2(p-1) steps of one chunk of at most ceil(numel/p) elements)",
                                "sending everything to one rank and back is a parameter server, not a ring")
    return check


@exercise("ring_all_reduce", "Ring all-reduce from point-to-point messages", answer="my_ring_all_reduce",
          notebook="01b_ring_all_reduce", sealed=True)
def check_ring_all_reduce(fn, seed: int, timeout: float) -> str:
    """my_ring_all_reduce(tensor), on every rank: tensor <- the sum of every rank's tensor, in
    place, by a reduce-scatter then an all-gather round a ring of send/recv."""
    require_function(fn, "ring_all_reduce", "tensor", torch.zeros(1))
    n = _run(fn, "ring_all_reduce", "all_reduce", _all_reduce_rank, _check_all_reduce, _CASES, seed, timeout)
    return (f"on world sizes 2, 3, 4 ({n} trials with random float32 and int64 tensors of 1 to 1001 elements; "
            f"sums exact for int64, to 1e-5 for float32; every rank sent only to its right neighbour, "
            f"at most 2(p-1) chunks)")


# ----------------------------------------------------------------------------------
# Exercise "predict_time": the α-β model, no ranks


_MISTAKES = [       # (what a common slip computes, what to say about it)
    (lambda a, b, p, n: (p - 1) * a + (p - 1) / p * n * b,
     "half the right time: a ring all-reduce is a reduce-scatter *and then* an all-gather, p-1 steps each, "
     "so both the α and the β term carry a factor 2"),
    (lambda a, b, p, n: 2 * p * a + 2 * n * b,
     "p where p-1 belongs: a ring of p ranks takes p-1 steps per phase, and each rank sends (p-1)/p of the data"),
    (lambda a, b, p, n: 2 * p * a + 2 * (p - 1) / p * n * b,
     "2p·α: a ring of p ranks takes p-1 steps per phase, 2(p-1) messages in all"),
    (lambda a, b, p, n: 2 * (p - 1) * a + 2 * n * b,
     "2N·β: each step sends one chunk of N/p bytes, 2(p-1) of them: 2(p-1)/p·N bytes"),
    (lambda a, b, p, n: 2 * (p - 1) * (a + n * b),
     "2(p-1)(α + Nβ): each step sends one chunk of N/p bytes, not the whole tensor"),
    (lambda a, b, p, n: 2 * a + 2 * p * n * b,
     "the parameter server's time (2α + 2pNβ), not the ring's"),
]


def _refuse_costmodel(fn) -> None:
    """In the sealed rank: Forbidden if the answer asks pplab.costmodel for the time."""
    refuse_library(fn, "predict_time", "the time", {"costmodel": costmodel, "predict": costmodel.predict,
                                                    "cost": costmodel.cost}, "pplab.costmodel")


@exercise("predict_time", "Predict a ring all-reduce's time with the α-β model", answer="predict_ring_all_reduce",
          notebook="01c_predict_time", sealed=True)
def check_predict_time(fn, seed: int, timeout: float) -> str:
    """predict_ring_all_reduce(alpha, beta, p, n_bytes) -> seconds, = pplab.costmodel.predict(
    "all_reduce", "ring", ...): 2(p-1)·α + 2(p-1)/p·N·β."""
    require_function(fn, "predict_time", "alpha, beta, p, n_bytes", 1e-5, 1e-9, 4, 10**6)
    rng = random.Random(seed)
    cases = []
    for kind in ("latency only", "bandwidth only", "both", "both", "both", "both"):
        alpha = 10 ** rng.uniform(-6, -4) if kind != "bandwidth only" else 0.0     # 1 to 100 µs
        beta = 1 / 10 ** rng.uniform(9, 11) if kind != "latency only" else 0.0     # 1 to 100 GB/s
        cases.append((alpha, beta, rng.randint(3, 64), rng.choice([rng.randint(1, 999) * 4096, 10**9])))
    def where_of(alpha, beta, p, n):
        return f"alpha={alpha:.3g} s, beta={beta:.3g} s/B, p={p}, n_bytes={n:,}: "
    outs = sealed.call_each(fn, cases, where=lambda i: where_of(*cases[i]), timeout=timeout, probe=_refuse_costmodel)
    for (alpha, beta, p, n), got in zip(cases, outs):
        where = where_of(alpha, beta, p, n)
        expected = costmodel.predict("all_reduce", "ring", p, n, alpha, beta)
        try:
            check_number(got, expected, what=f"{fn.__name__}(...)", rel_tol=1e-6, abs_tol=0.0)
        except Fail as failure:
            if not failure.seed_matters:              # not a number at all
                raise
            hint = next((why for formula, why in _MISTAKES
                         if math.isclose(got, formula(alpha, beta, p, n), rel_tol=1e-6)), None)
            hint = f" That is {hint}." if hint else " A ring all-reduce takes 2(p-1)·α + 2(p-1)/p·N·β."
            raise Fail(f"{where}{failure}{hint}") from None
    return f"on {len(cases)} random cases (α alone, β alone, both; p from 3 to 64; relative tolerance 1e-6)"
