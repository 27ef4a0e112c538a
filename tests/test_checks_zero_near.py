"""Answers of chapters 6 and 10c that are right up to rounding, each a near miss's right twin
(issue 38): a check whose tolerance is right lets them through, while their wrong twins in
tests/wrong_solutions_ch06_zero.py, wrong_solutions_ch06_sharded_optimizer.py, wrong_solutions_ch06_fsdp.py
and wrong_solutions_ch10_quantised_gather.py, a little farther off, fail (tests/test_checks.py).
Together they pin each tolerance from both sides: tools/mutants/checks_zero.py widens or narrows
it, and one side or the other notices."""

import pytest

from pplab import checks
from wrong_solutions_ch06_fsdp import GradMeanToNineDigits
from wrong_solutions_ch06_sharded_optimizer import MeanByMultiplying
from wrong_solutions_ch10_quantised_gather import dequantises_by_the_inverse_scale
from wrong_solutions_ch06_zero import linear_within_tolerance, zero1_within_tolerance

pytestmark = pytest.mark.usefixtures("no_leftover_processes")


@pytest.mark.parametrize("exercise_id, fn", [
    ("zero1_step", zero1_within_tolerance),                  # 1e-11 of each parameter; the check allows 1e-9
    ("stage3_unit", linear_within_tolerance),                # 1e-11 of each output and gradient; 1e-9 allowed
    ("quantised_gather", dequantises_by_the_inverse_scale),  # float32's 1e-7; 1e-5 allowed
    ("sharded_optimizer", MeanByMultiplying),                # float32's 1e-7 in the mean; 1e-6 + 1e-5·|x| allowed
    ("fsdp", GradMeanToNineDigits),                          # 1/N to 9 digits; fp32 gradients to 1e-6
], ids=lambda x: x if isinstance(x, str) else x.__name__)
def test_answers_right_up_to_rounding_pass(exercise_id, fn):
    result = checks.run_check(exercise_id, fn)
    assert result.passed, result.message
