"""pplab.stand_in.durations: what compute_time means, by hand values (the one parser of it: chapter 2's
stand-in compute and chapter 4's pipeline executor both read it)."""
import pytest

from pplab.pipeline.partition import PipelineError
from pplab.stand_in import durations

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
