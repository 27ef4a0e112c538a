"""The gradient noise scale: up to which batch size does a bigger batch still help?

    est = gradient_noise_scale(small_sq_norms, big_sq_norms, b_small=8, b_big=32)
    est.b_simple, est.trace_sigma, est.g_sq

McCandlish, Kaplan, Amodei and the OpenAI Dota team ("An Empirical Model of Large-Batch
Training", 2018) call G the true gradient (over all the data) and Σ the covariance of one
example's gradient. A batch of B examples gives G plus noise of total variance tr(Σ)/B, so

    B_simple = tr(Σ) / |G|²

is the batch at which noise and signal are the same size. Far below it, each step is
mostly noise and doubling the batch nearly halves the steps (the same samples); far above
it, the batch gradient is already close to G and doubling the batch buys little. The paper
finds the bend of the steps-versus-samples trade-off near this noise scale.

Data-parallel training gets an estimate almost for free: a rank's local gradient is the
mean over b_small examples, the all-reduced one the mean over b_big = p·b_small. Since

    E|G_b|² = |G|² + tr(Σ)/b        for the mean gradient G_b of b independent examples,

two batch sizes give two equations, solved for the unbiased estimates (the paper's
appendix A):

    |G|²  ≈ (b_big·|G_big|² - b_small·|G_small|²) / (b_big - b_small)
    tr(Σ) ≈ (|G_small|² - |G_big|²) / (1/b_small - 1/b_big)

Each is averaged over many draws before the ratio is taken: a ratio of two noisy numbers
is biased, a ratio of two averages much less.
"""
from __future__ import annotations

import math
from typing import NamedTuple


class NoiseScale(NamedTuple):
    b_simple: float       # tr(Σ) / |G|²; inf when the draws could not tell |G|² from zero
    trace_sigma: float    # estimate of tr(Σ), the summed variance of one example's gradient
    g_sq: float           # estimate of |G|², the squared norm of the true gradient


def gradient_noise_scale(small_sq_norms, big_sq_norms, b_small: int, b_big: int) -> NoiseScale:
    """B_simple = tr(Σ)/|G|² from squared norms of gradients averaged over b_small examples
    and over b_big examples (the examples of each draw independent, with replacement).

    small_sq_norms, big_sq_norms: one |G_b|² per draw (any iterables of numbers; in
    data-parallel training, each rank's local gradient and the all-reduced one).
    """
    for name, b in (("b_small", b_small), ("b_big", b_big)):
        if isinstance(b, bool) or not isinstance(b, int) or b < 1:
            raise ValueError(f"gradient_noise_scale: {name} is a number of examples, a whole number >= 1; got {b!r}")
    if b_big <= b_small:
        raise ValueError(f"gradient_noise_scale: b_big must be larger than b_small (two batch sizes give two "
                         f"equations), got b_small={b_small}, b_big={b_big}")
    small, big = [float(v) for v in small_sq_norms], [float(v) for v in big_sq_norms]
    if not small or not big:
        raise ValueError("gradient_noise_scale: give at least one squared norm for each batch size")
    mean_small, mean_big = sum(small) / len(small), sum(big) / len(big)
    g_sq = (b_big * mean_big - b_small * mean_small) / (b_big - b_small)
    trace_sigma = (mean_small - mean_big) / (1 / b_small - 1 / b_big)
    return NoiseScale(trace_sigma / g_sq if g_sq > 0 else math.inf, trace_sigma, g_sq)
