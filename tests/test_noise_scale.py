"""pplab.data_parallel.noise_scale: the two-batch estimate of McCandlish et al.'s B_simple = tr(Σ)/|G|²,
against hand values and against a linear model whose tr(Σ) and |G|² are known in closed form."""
import math

import pytest
import torch

from pplab.data_parallel.noise_scale import gradient_noise_scale


def test_exact_expectations_give_the_exact_answer():
    # |G|² = 4, tr(Σ) = 12: a mean over b examples has E|G_b|² = 4 + 12/b, so 10 at b = 2 and
    # 6 at b = 6, and B_simple = 12/4 = 3. Uneven numbers of draws average to the same means.
    est = gradient_noise_scale([9.0, 11.0], [5.0, 6.0, 7.0], b_small=2, b_big=6)
    assert est.g_sq == pytest.approx(4.0, rel=1e-12)
    assert est.trace_sigma == pytest.approx(12.0, rel=1e-12)
    assert est.b_simple == pytest.approx(3.0, rel=1e-12)


def test_noise_only_gives_an_infinite_noise_scale():
    # tr(Σ) = 8, |G|² = 0: E|G_b|² = 8/b, so 2 at b = 4 and 1 at b = 8.
    est = gradient_noise_scale([2.0], [1.0], b_small=4, b_big=8)
    assert est.trace_sigma == pytest.approx(8.0) and est.g_sq == pytest.approx(0.0, abs=1e-12)
    assert est.b_simple == math.inf


def test_linear_regression_in_closed_form():
    """Loss ½(x·w - y)² with x ~ N(0, I_d), y = x·w* + σε: an example's gradient is
    g = x(x·δ - σε) with δ = w - w*, so G = δ and E|g|² = (d+2)|δ|² + dσ² (Gaussian fourth
    moments), hence tr(Σ) = (d+1)|δ|² + dσ²."""
    d, sigma, b_small, b_big, draws = 4, 0.5, 2, 16, 20_000
    delta = torch.tensor([1.0, -2.0, 0.5, 0.0], dtype=torch.float64)
    g_sq = delta.square().sum().item()                         # 5.25
    trace_sigma = (d + 1) * g_sq + d * sigma ** 2              # 27.25
    gen = torch.Generator().manual_seed(0)

    def batch_sq_norms(b):                                     # |mean of b example gradients|², per draw
        x = torch.randn(draws, b, d, generator=gen, dtype=torch.float64)
        eps = torch.randn(draws, b, generator=gen, dtype=torch.float64)
        g = x * (x @ delta - sigma * eps)[..., None]
        return g.mean(1).square().sum(1).tolist()

    est = gradient_noise_scale(batch_sq_norms(b_small), batch_sq_norms(b_big), b_small, b_big)
    # Standard errors at 20,000 draws: about 1% for tr(Σ), 2.5% for |G|².
    assert est.trace_sigma == pytest.approx(trace_sigma, rel=0.04)
    assert est.g_sq == pytest.approx(g_sq, rel=0.08)
    assert est.b_simple == pytest.approx(trace_sigma / g_sq, rel=0.1)


@pytest.mark.parametrize("small, big, b_small, b_big, says", [
    ([1.0], [1.0], 8, 8, "larger than b_small"),
    ([1.0], [1.0], 8, 4, "larger than b_small"),
    ([1.0], [1.0], 0, 4, "b_small"),
    ([1.0], [1.0], 2, 4.5, "b_big"),
    ([], [1.0], 2, 4, "at least one"),
])
def test_bad_input_says_what_to_change(small, big, b_small, b_big, says):
    with pytest.raises(ValueError, match=says):
        gradient_noise_scale(small, big, b_small, b_big)
