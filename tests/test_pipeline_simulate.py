"""pplab.pipeline's validate and simulate: validate checks a schedule once and remembers it;
simulate walks the order validate found.

What changed for speed (pplab/pipeline/simulate.py) and what must not have: times worked out
by hand, a schedule changed after it passed is checked again, and a deadlocked F&B pair says
which of its two actions waits (it used to fail with a bare StopIteration).
"""
import pickle

import pytest

from pplab.pipeline import Action as A
from pplab.pipeline import Schedule, ScheduleError, make_schedule, simulate, validate


def test_1f1b_times_by_hand_with_latency():
    # rank 0: F0 F1 B0 F2 B1 B2, rank 1: F0 B0 F1 B1 F2 B2; t_f = 1, t_b = 2, 0.5 per hop.
    # Rank 1's F0 waits for rank 0's F0 (1) plus the hop: 1.5. Rank 0's B0 waits for rank 1's
    # B0 (ends 4.5) plus the hop: 5. Rank 1's F2 waits for rank 0's F2 (ends 8): 8.5. Rank 0's
    # last B waits for rank 1's B2 (ends 11.5): 12, and ends the step at 14.
    r = simulate(make_schedule("1f1b", 2, 3), t_f=1, t_b=2, p2p_latency=0.5)
    assert r.start == [[0, 1, 5, 7, 8, 12], [1.5, 2.5, 4.5, 5.5, 8.5, 9.5]]
    assert r.end == [[1, 2, 7, 8, 10, 14], [2.5, 4.5, 5.5, 7.5, 9.5, 11.5]]
    assert r.makespan == 14


def test_overlapped_pair_times_by_hand():
    # Rank 0 runs F1 of stage 0 and B0 of stage 0 as one block of t_fb = 1.5, which starts
    # when B0's input, rank 1's B0 (ends 4), is there; F takes 1/3 of it, B 2/3 (t_f : t_b).
    # Both results count as made when the block ends (5.5): rank 1's F1 starts then.
    s = Schedule("pair", 2, 2, 1, [[A("F", 0, 0), A("F", 1, 0, overlap=True), A("B", 0, 0), A("B", 1, 0)],
                                   [A("F", 0, 1), A("B", 0, 1), A("F", 1, 1), A("B", 1, 1)]], [0, 1])
    r = simulate(s, t_f=1, t_b=2, t_fb=1.5)
    assert r.start == [[0, 4, 4.5, 8.5], [1, 2, 5.5, 6.5]]
    assert r.end == [[1, 4.5, 5.5, 10.5], [2, 4, 6.5, 8.5]]


def test_overlapped_pair_times_by_hand_with_a_latency_per_hop():
    # The same pair, each hop its own send time: 0.5 from rank 0 to rank 1, 0.25 back
    # (p2p_latency[src][dst]). Rank 1's F0 starts at 1 + 0.5; its B0 ends at 4.5, so the
    # block waits for it until 4.5 + 0.25 (the B's input has a hop too) and ends at 6.25;
    # rank 1's F1 starts at 6.25 + 0.5; rank 0's last B waits for 9.75 + 0.25.
    s = Schedule("pair", 2, 2, 1, [[A("F", 0, 0), A("F", 1, 0, overlap=True), A("B", 0, 0), A("B", 1, 0)],
                                   [A("F", 0, 1), A("B", 0, 1), A("F", 1, 1), A("B", 1, 1)]], [0, 1])
    r = simulate(s, t_f=1, t_b=2, t_fb=1.5, p2p_latency=[[0, 0.5], [0.25, 0]])
    assert r.start == [[0, 4.75, 5.25, 10], [1.5, 2.5, 6.75, 7.75]]
    assert r.end == [[1, 5.25, 6.25, 12], [2.5, 4.5, 7.75, 9.75]]


def test_activations_held_rise_at_each_forward_and_fall_when_its_backward_ends():
    # GPipe, p = 2, m = 2, t_f = 1, t_b = 2: rank 1 runs F0 F1 [1, 3], B0 [3, 5], B1 [5, 7]; rank 0
    # runs F0 [0, 1], F1 [1, 2], then B0 [5, 7] and B1 [7, 9]. A micro-batch is held from the start of its F to
    # the end of its B: the backward reads the activations until it is done.
    r = simulate(make_schedule("gpipe", 2, 2), t_f=1, t_b=2)
    assert [(t, held, a.label()) for t, held, a in r.activations(0)] == [
        (0, 1, "F0"), (1, 2, "F1"), (7, 1, "B0"), (9, 0, "B1")]


def test_a_schedule_changed_after_it_passed_is_checked_again():
    s = make_schedule("1f1b", 2, 2)                  # validated, and remembered as valid
    assert validate(s) is s
    rank1 = s.actions[1]
    rank1[0], rank1[1] = rank1[1], rank1[0]          # B0 before its own F0
    with pytest.raises(ScheduleError, match="rank 1 is stuck at step 0 \\(B0 of stage 1\\)"):
        validate(s)
    with pytest.raises(ScheduleError, match="deadlock"):
        simulate(s)
    rank1[0], rank1[1] = rank1[1], rank1[0]          # put back: valid again
    assert simulate(s).makespan == 9                 # (m + p - 1)(t_f + t_b)
    s.actions[1] = s.actions[1][:-1]                 # a rank's list replaced by a shorter one
    with pytest.raises(ScheduleError, match="backward 1 of stage 1 appears as 0 B, 0 I, 0 W"):
        simulate(s)
    s = make_schedule("gpipe", 2, 2)
    s.stage_to_rank[:] = [1, 0]                      # the placement changed, the actions did not
    with pytest.raises(ScheduleError, match="rank 0, step 0: F0 of stage 0 is on rank 0, but stage 0 lives on rank 1"):
        validate(s)


def test_a_split_backward_needs_its_w_and_only_one():
    # Every I needs its W: the optimizer step reads the weights' gradient, and a schedule
    # without one (or with two) is not one training step, however well it runs.
    s = make_schedule("zb-h1", 2, 3)
    s.actions[0].remove(A("W", 2, 0))
    with pytest.raises(ScheduleError, match="backward 2 of stage 0 appears as 0 B, 1 I, 0 W"):
        validate(s)
    s = make_schedule("zb-h1", 2, 3)
    s.actions[1].append(A("W", 0, 1))
    with pytest.raises(ScheduleError, match="backward 0 of stage 1 appears as 0 B, 1 I, 2 W"):
        validate(s)


def test_a_pickled_schedule_leaves_the_check_behind_and_still_passes():
    s = make_schedule("zb-h1", 3, 4)
    copy = pickle.loads(pickle.dumps(s))             # as a schedule is sent to ranks
    assert copy == s and "_passed" not in copy.__dict__
    assert simulate(copy).start == simulate(s).start


def test_a_deadlocked_pair_says_which_of_its_actions_waits():
    # Rank 0 pairs F1 with B0, whose input (rank 1's B0) comes after rank 1's F1, which
    # waits for rank 0's F1: each waits for the other.
    s = Schedule("pairs", 2, 2, 1, [[A("F", 0, 0), A("F", 1, 0, overlap=True), A("B", 0, 0), A("B", 1, 0)],
                                    [A("F", 1, 1), A("F", 0, 1), A("B", 0, 1), A("B", 1, 1)]], [0, 1])
    with pytest.raises(ScheduleError) as err:
        validate(s)
    assert str(err.value) == (
        "deadlock in 'pairs': rank(s) [0, 1] can never go on\n"
        "  rank 0 is stuck at step 2 (B0 of stage 0, run as one block with the F1 before it), waiting for "
        "B0 (or I0) of stage 1, which rank 1 runs at step 2, behind its own stuck step 0\n"
        "  rank 1 is stuck at step 0 (F1 of stage 1), waiting for F1 of stage 0, which rank 0 runs at step 1, "
        "behind its own stuck step 1")
    s.actions[0][1:3] = [A("F", 1, 0, overlap=True), A("B", 1, 0)]   # paired with its own backward
    s.actions[0][3] = A("B", 0, 0)
    s.actions[1] = [A("F", 0, 1), A("B", 0, 1), A("F", 1, 1), A("B", 1, 1)]
    with pytest.raises(ScheduleError, match="rank 0 is stuck at step 2 \\(B1 of stage 0, run as one block with the F1 "
                                            "before it\\), waiting for F1 of stage 0, which is the F it is paired with"):
        validate(s)


def test_actions_compare_and_hash_by_value_and_do_not_change():
    assert A("F", 3, 1) == A("F", 3, 1, chunk=0, overlap=False) and len({A("F", 3, 1), A("F", 3, 1)}) == 1
    assert A("F", 3, 1) != A("B", 3, 1)
    with pytest.raises(AttributeError):
        A("F", 3, 1).stage = 2
