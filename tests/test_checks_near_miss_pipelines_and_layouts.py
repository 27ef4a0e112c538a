"""The other side of the near misses in tests/wrong_solutions_near_*.py (issue 38): a right answer
with noise well under a check's tolerance passes, and another right order passes, so that the
tolerances and the orders the checks accept are pinned from both sides."""
import pytest

from notebook_answers import solution
from pplab import checks
from wrong_solutions_ch07_pp_dp_train_step import _step
from wrong_solutions_ch04_near_misses import executor_scaled

pytestmark = pytest.mark.usefixtures("no_leftover_processes")


def _noisy(exercise_id, noise):
    """The solution, its numbers times (1 + noise) (dicts and lists of numbers followed through)."""
    right = solution(exercise_id)

    def scale(x):
        if isinstance(x, dict):
            return {k: scale(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return type(x)(scale(v) for v in x)
        return x * (1 + noise) if isinstance(x, float) or (isinstance(x, int) and not isinstance(x, bool)) else x

    def answer(*args):
        return scale(right(*args))
    answer.__name__ = right.__name__
    return answer


@pytest.mark.parametrize("exercise_id, noise", [
    ("bubble_fraction", 1e-9),          # the check: 1e-6 relative; a float32 slip or rounding to 5 decimals fails
    ("find_layout", 1e-8),              # 1e-6; a tenth of a percent fails
    ("place_layout", 1e-12),            # 1e-9 of whole bytes
])
def test_noise_well_under_the_tolerance_passes(exercise_id, noise):
    result = checks.run_check(exercise_id, _noisy(exercise_id, noise))
    assert result, result.message


def run_actions(actions, stage, microbatches, loss_fn, prev_rank, next_rank):
    """1/m off by 1e-12 relative, in float64: well inside the executor check's 1e-9."""
    executor_scaled(actions, stage, microbatches, loss_fn, prev_rank, next_rank, lambda m: (1 / m) * (1 + 1e-12))


def pp_dp_train_step(stage, inputs, targets, loss_fn, m, pp_group, dp_group):
    """1/m off by 1e-12 relative, in float64: well inside the PP×DP check's 1e-9."""
    return _step(stage, inputs, targets, loss_fn, m, pp_group, dp_group, one_over_m=lambda m: (1 / m) * (1 + 1e-12))


@pytest.mark.parametrize("exercise_id, fn", [("pipeline_executor", run_actions), ("pp_dp_train_step", pp_dp_train_step)])
def test_float64_noise_well_under_the_tolerance_passes(exercise_id, fn):
    result = checks.run_check(exercise_id, fn)
    assert result, result.message


def gpipe_order(num_ranks, num_microbatches, chunks):
    """Looped GPipe with every chunk's backwards newest first: as short as oldest first (each
    backward's input arrives in that order too), so right."""
    p, m, v = num_ranks, num_microbatches, chunks
    return [[("F", i, c) for c in range(v) for i in range(m)]
            + [("B", i, c) for c in reversed(range(v)) for i in reversed(range(m))] for _ in range(p)]


def test_gpipe_with_backwards_newest_first_passes():
    result = checks.run_check("gpipe_order", gpipe_order)
    assert result, result.message
