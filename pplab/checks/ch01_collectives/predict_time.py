"""Check of exercise predict_time (exercises/01_predict_time.ipynb): Measure α and β with a ping-pong, then predict a ring all-reduce's time.

    predict_time      predict_ring_all_reduce(timings, p, n_bytes)    (α, β fitted to ping-pong timings,
"""
from __future__ import annotations

import math
import random
import statistics
import torch

from ... import costmodel
from .. import sealed
from ..core import Fail, Parts, exercise, require_function
from .predict_time_rank import _refuse_costmodel


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
    from ...costfit import fit_line
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
        a, b = fit_line(sizes, medians)
        if abs(_ols(sizes, medians)[0] - alpha) >= alpha / 2 and abs(a - alpha) < 0.05 * alpha \
                and abs(b - beta) < 0.05 * beta:
            return alpha, beta, timings


def _fit_mistakes(timings):
    """(α, β) a common slip would give, and what to say about it."""
    from ...costfit import fit_line
    sizes = list(timings)
    medians = [statistics.median(t) for t in timings.values()]
    means = [statistics.fmean(t) for t in timings.values()]
    every = [(n, t) for n, ts in timings.items() for t in ts]
    return [
        (fit_line(sizes, means), "the line through each size's *mean*: the few tries held up by a few ms drag "
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
