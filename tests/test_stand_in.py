"""pplab.stand_in.durations: what compute_time means, by hand values; and the same answers as the
pipeline executor's own parser, which chapter 4 still holds until it reads this one (issue 39)."""
import pytest

from pplab.pipeline.executor import compute_durations
from pplab.pipeline.partition import PipelineError
from pplab.stand_in import durations

CASES = [0.004, 0, 3, {"F": 1.0}, {"F": 1.0, "B": 3.0}, {"F": 1.0, "B": 3.0, "W": 1.0}, {"F": 2, "W": 0}]


def test_a_number_is_the_forward_and_backward_is_twice_it_by_hand():
    assert durations(0.004) == {"F": 0.004, "B": 0.008, "I": 0.004, "W": 0.004}
    assert durations({"F": 1, "B": 3}, v=2) == {"F": 0.5, "B": 1.5, "I": 0.75, "W": 0.75}
    assert durations({"F": 1, "B": 3, "W": 1}) == {"F": 1, "B": 3, "I": 2, "W": 1}
    assert durations(None) is None


@pytest.mark.parametrize("bad", [-1, "fast", True, [0.1], {"B": 1}, {"F": 1, "X": 2}, {"F": 1, "B": 1, "W": 2}, {"F": -0.1}])
def test_a_bad_compute_time_says_what_to_give_in_the_caller_s_error(bad):
    with pytest.raises(ValueError, match="compute_time"):
        durations(bad)
    with pytest.raises(PipelineError, match="compute_time"):
        durations(bad, error=PipelineError)


@pytest.mark.parametrize("v", [1, 2, 3])
def test_the_pipeline_executor_reads_compute_time_alike(v):
    for case in CASES:
        assert durations(case, v) == compute_durations(case, v), case
