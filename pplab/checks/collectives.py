"""Checks of chapters 0 and 1's exercises: collectives built from point-to-point messages, and their cost.

    broadcast         my_broadcast(tensor, src)                       in place, rank src's tensor everywhere
    reduce_scatter    my_reduce_scatter(output, input)                rank r gets the sum of chunk r
    ring_all_reduce   my_ring_all_reduce(tensor)                      in place, the sum over ranks
    predict_time      predict_ring_all_reduce(timings, p, n_bytes)    (α, β fitted to ping-pong timings,
                                                                      seconds of a ring all-reduce)

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

import inspect
import math
import random
import statistics
from dataclasses import dataclass

import torch

from .. import costmodel
from . import sealed
from .collectives_rank import _all_reduce_rank, _broadcast_rank, _reduce_scatter_rank, _refuse_costmodel
from .core import Fail, Parts, exercise, first_difference, require_function
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


def _check_reduce_scatter(name, trials, seed):
    def check(p, i, observed, traffic):
        dtype, n = trials[p][i]
        inputs = _inputs(seed, p, i, dtype, (p * n,))
        chunk_sums = torch.stack(inputs).double().sum(0).to(inputs[0].dtype).view(p, n)
        for rank, seen in sorted(observed.items()):   # every rank: each ends with its own chunk
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
          notebook="01_reduce_scatter", sealed=True)
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


def _check_all_reduce(name, trials, seed):
    def check(p, i, observed, traffic):
        dtype, shape = trials[p][i]
        inputs = _inputs(seed, p, i, dtype, shape)
        expected = torch.stack(inputs).sum(0) if dtype == "int64" else torch.stack(inputs).double().sum(0).float()
        for rank, seen in sorted(observed.items()):   # every rank: a slip may show on one only
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
          notebook="01_ring_all_reduce", sealed=True)
def check_ring_all_reduce(fn, seed: int, timeout: float) -> str:
    """my_ring_all_reduce(tensor), on every rank: tensor <- the sum of every rank's tensor, in
    place, by a reduce-scatter then an all-gather round a ring of send/recv."""
    require_function(fn, "ring_all_reduce", "tensor", torch.zeros(1))
    n = _run(fn, "ring_all_reduce", "all_reduce", _all_reduce_rank, _check_all_reduce, _CASES, seed, timeout)
    return (f"on world sizes 2, 3, 4 ({n} trials with random float32 and int64 tensors of 1 to 1001 elements; "
            f"sums exact for int64, to 1e-5 for float32; every rank sent only to its right neighbour, "
            f"at most 2(p-1) chunks)")


# ----------------------------------------------------------------------------------
# Exercise "predict_time": α and β fitted to ping-pong timings, then a ring all-reduce's time
#
# The answer is called in one sealed rank on made-up ping-pong timings, {message bytes:
# [one-way seconds of each try]}, drawn from a hidden α and β as a loaded machine gives
# them: most tries within 2% of α + nβ, a few held up by 0.5 to 5 ms (a rank that waited
# for a core), and jitter on the large messages that dwarfs α. It returns (α, β, seconds).
# Two parts: the fit (α and β within 10% of the hidden ones) and the prediction (the ring's
# 2(p-1)·α + 2(p-1)/p·N·β with the answer's own α and β, to 1e-6), so a wrong fit does not
# hide a right formula, nor the other way round. No clock is read: the timings are data.

PREDICT_PARTS = ("fit", "prediction")
FIT_TOLERANCE = 0.10


def _ols(sizes, times):
    """α, β of ordinary least squares: every size weighed by its absolute error."""
    n = len(sizes)
    mean_n, mean_t = sum(sizes) / n, sum(times) / n
    beta = sum((x - mean_n) * (t - mean_t) for x, t in zip(sizes, times)) / sum((x - mean_n) ** 2 for x in sizes)
    return mean_t - beta * mean_n, beta


def _ping_pong_timings(rng):
    """(α, β, {bytes: [seconds per try]}): made-up one-way times of a ping-pong. Drawn again until
    an ordinary least-squares line through the medians misses α by half or more (as the large
    messages' jitter makes it do on a real machine), and the relative fit of the medians is
    within 5% of α and β (the timings say what α and β are, to a fit that reads them well)."""
    from ..costfit import _fit_line
    while True:
        alpha, beta = 10 ** rng.uniform(-5.3, -4.3), 1 / 10 ** rng.uniform(8.7, 9.7)   # 5-50 µs, 0.5-5 GB/s
        first, tries = rng.choice([256, 1024, 4096]), rng.randint(7, 15)
        timings = {}
        for k in range(9):
            n = first * 4 ** k
            if n > 64 * 2 ** 20:
                break
            held = rng.randint(1, (tries - 1) // 2 - 1)            # fewer than half: the median is a quick try
            times = [(alpha + n * beta) * (1 + rng.uniform(-0.02, 0.02)) for _ in range(tries - held)]
            times += [alpha + n * beta + rng.uniform(0.5e-3, 5e-3) for _ in range(held)]
            rng.shuffle(times)
            timings[n] = times
        sizes, medians = list(timings), [statistics.median(t) for t in timings.values()]
        a, b = _fit_line(sizes, medians)
        if abs(_ols(sizes, medians)[0] - alpha) >= alpha / 2 and abs(a - alpha) < 0.05 * alpha \
                and abs(b - beta) < 0.05 * beta:
            return alpha, beta, timings


def _fit_mistakes(timings):
    """(α, β) a common slip would give, and what to say about it."""
    from ..costfit import _fit_line
    sizes = list(timings)
    medians = [statistics.median(t) for t in timings.values()]
    means = [statistics.fmean(t) for t in timings.values()]
    every = [(n, t) for n, ts in timings.items() for t in ts]
    return [
        (_fit_line(sizes, means), "the line through each size's *mean*: the few tries held up by a few ms drag "
                                  "the mean of a small message far above α + nβ. Take each size's median"),
        (_ols(*zip(*every)), "a least-squares line through every try, the held-up ones too: take each size's "
                             "median first"),
        (_ols(sizes, medians), "ordinary least squares through the medians: it weighs each size by its absolute "
                               "error, so the 1-2% jitter of the largest messages (far more than α) decides α. "
                               "Weigh each size by its relative error (1/t² as weights), or fit the smallest "
                               "sizes for α"),
    ]


def _three_numbers(got, name):
    """(α, β, seconds) as floats, or Fail saying what came back."""
    if isinstance(got, (tuple, list)) and len(got) == 3:
        values = [v.item() if isinstance(v, torch.Tensor) and v.numel() == 1 else v for v in got]
        if all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in values):
            return [float(v) for v in values]
    raise Fail(f"{name} must return (alpha, beta, seconds): three numbers, the α and β you fitted and the time "
               f"you predict; got {got!r:.200}.", seed_matters=False)


def _check_fit(a, b, alpha, beta, timings) -> str | None:
    """What is wrong with the fitted (a, b), or None."""
    def near(x, want):
        return abs(x - want) <= FIT_TOLERANCE * want
    if near(a, alpha) and near(b, beta):
        return None
    said = (f"you fitted α = {a * 1e6:.4g} µs and β = {b:.4g} s/B, the timings were drawn from α = "
            f"{alpha * 1e6:.4g} µs and β = {beta:.4g} s/B ({1 / beta / 1e9:.3g} GB/s); each must be within "
            f"{FIT_TOLERANCE:.0%}.")
    if near(a, beta) and near(b, alpha):
        return f"{said} You swapped them: return (alpha, beta), α in seconds and β in seconds per byte."
    if abs(a) <= 1e-3 * alpha:
        return f"{said} α = 0 is a line through the origin: even an empty message costs α, fit α + nβ."
    if near(a, 2 * alpha) and near(b, 2 * beta):
        return f"{said} That is twice both: the timings are already one way (a round trip / 2)."
    for (ma, mb), why in _fit_mistakes(timings):
        if math.isclose(a, ma, rel_tol=1e-3, abs_tol=1e-3 * alpha) and math.isclose(b, mb, rel_tol=1e-3):
            return f"{said} That is {why}."
    return f"{said} The line α + nβ should pass within a few % of each size's median."


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


def _check_prediction(got, a, b, p, n) -> str | None:
    """What is wrong with the predicted time, from the answer's own (a, b), or None."""
    expected = costmodel.cost("all_reduce", "ring", p, n).time(a, b)
    if math.isclose(got, expected, rel_tol=1e-6, abs_tol=0.0):
        return None
    hint = next((why for formula, why in _MISTAKES if math.isclose(got, formula(a, b, p, n), rel_tol=1e-6)), None)
    hint = f" That is {hint}." if hint else " A ring all-reduce takes 2(p-1)·α + 2(p-1)/p·N·β."
    return (f"p={p}, n_bytes={n:,}: you predict {got:.6g} s, but your own α and β give {expected:.6g} s for a "
            f"ring all-reduce (relative tolerance 1e-6).{hint}")


@exercise("predict_time", "Measure α and β with a ping-pong, then predict a ring all-reduce's time",
          answer="predict_ring_all_reduce", notebook="01_predict_time", sealed=True, points=len(PREDICT_PARTS),
          preload=("pplab.costfit",))
def check_predict_time(fn, seed: int, timeout: float) -> str:
    """predict_ring_all_reduce(timings, p, n_bytes) -> (alpha, beta, seconds): α and β fitted to
    ping-pong timings {bytes: [one-way seconds per try]}, and 2(p-1)·α + 2(p-1)/p·N·β with them."""
    require_function(fn, "predict_time", "timings, p, n_bytes", {1024: [1e-5]}, 4, 10**6)
    rng = random.Random(seed)
    drawn = [_ping_pong_timings(rng) for _ in range(3)]
    cases, owner = [], []
    for k, (alpha, beta, timings) in enumerate(drawn):
        for kind in ("latency", "bandwidth", "both"):         # N/p·β below α, far above it, equal to it
            p = rng.randint(3, 64)
            n = {"latency": rng.randint(1, 16) * 256, "bandwidth": rng.randint(1, 999) * 2 ** 20,
                 "both": max(1, round(p * alpha / beta))}[kind]
            cases.append((timings, p, n))
            owner.append(k)

    def where(i):
        alpha, beta, timings = drawn[owner[i]]
        sizes = list(timings)
        return (f"timings {owner[i] + 1} ({len(sizes)} sizes, {sizes[0]:,} to {sizes[-1]:,} bytes, "
                f"{len(timings[sizes[0]])} tries each): ")
    parts = Parts(PREDICT_PARTS)
    outs = sealed.call_each(fn, cases, where=where, timeout=timeout, probe=_refuse_costmodel)
    for i, ((timings, p, n), got) in enumerate(zip(cases, outs)):
        a, b, seconds = _three_numbers(got, fn.__name__)
        alpha, beta, _ = drawn[owner[i]]
        parts.note("fit", _check_fit(a, b, alpha, beta, timings), where(i)[:-2])
        parts.note("prediction", _check_prediction(seconds, a, b, p, n), where(i)[:-2])
    return parts.finish(f"on {len(drawn)} seeded sets of ping-pong timings with held-up tries: α and β within "
                        f"{FIT_TOLERANCE:.0%} of those they were drawn from; {len(cases)} predictions (p from 3 "
                        f"to 64, 256 B to 1 GB) equal to 2(p-1)·α + 2(p-1)/p·N·β with your α and β (1e-6)")
