"""pplab.costfit's median: the spread of tries predicted from the spread of single exchanges
(probabilities worked out by hand), the delays the fit keeps, and fit_and_time, whose
all-reduces are timed in the same rounds as the fit's pairs. No wall-clock time is asserted."""
import pytest

from pplab import costfit

MB = 2 ** 20


def _fit(delays, cores=2):
    """A fit with made-up parameters and the given delays (seconds, per exchange size)."""
    return costfit.Fit(alpha=60e-6, beta=0.35e-9, gamma=0.05e-9, sizes=[], times=[], alpha2=150e-6,
                       beta2=0.7e-9, sigma={"one-way": 1e-3, "swap": 3e-3, "ring": 4e-3}, cores=cores,
                       delta=100e-6, delays=delays)


def test_two_steps_that_each_wait_one_time_in_three_wait_more_often_than_not():
    """The ring on 2 ranks has A = 2 steps. A step waits 4 ms one time in three: a try waits in
    neither step with probability (2/3)² = 4/9, in one at most with 8/9. So the quarter of the
    quickest tries waits in none (0.25 < 4/9), the median waits once (0.5 > 4/9) and so does
    the third quartile (0.75 < 8/9): not the sum of the steps' medians, which is no wait."""
    f = _fit({MB: [0.0, 0.0, 4e-3]})
    quick = f.predict("all_reduce", "ring", 2, MB)
    assert f.predict_spread("all_reduce", "ring", 2, MB) == pytest.approx([quick, quick + 4e-3, quick + 4e-3])
    assert f.predict_median("all_reduce", "ring", 2, MB) == pytest.approx(quick + 4e-3)
    # one time in four: no wait in both steps 9/16 > 1/2, so the median waits in none
    f = _fit({MB: [0.0, 0.0, 0.0, 4e-3]})
    assert f.predict_median("all_reduce", "ring", 2, MB) == pytest.approx(quick)
    # a try of 4 ranks' ring (A = 6 steps) on 8 cores, one time in four: (3/4)^6 = 0.18 no wait,
    # 6·(1/4)(3/4)^5 = 0.36 one wait: the median (0.5 < 0.53) waits once, the 3rd quartile twice
    f = _fit({MB: [0.0, 0.0, 0.0, 4e-3]}, cores=8)
    quick = f.predict("all_reduce", "ring", 4, MB)
    assert f.predict_spread("all_reduce", "ring", 4, MB, (0.5, 0.75)) == pytest.approx([quick + 4e-3, quick + 8e-3])


def test_each_step_draws_from_the_exchange_size_nearest_its_own():
    """A ring of 4 MB on 2 ranks sends 2 MB a step: 4 MB is nearer than 256 KB (in factors), and
    a tie (1 MB a step: 256 KB and 4 MB are 4x away either side) goes to the larger size."""
    f = _fit({2 ** 18: [0.0], 4 * MB: [1e-3]})
    assert f.predict_median("all_reduce", "ring", 2, 4 * MB) == pytest.approx(f.predict("all_reduce", "ring", 2, 4 * MB) + 2e-3)
    assert f.predict_median("all_reduce", "ring", 2, 2 * MB) == pytest.approx(f.predict("all_reduce", "ring", 2, 2 * MB) + 2e-3)
    assert f.predict_median("all_reduce", "ring", 2, 2 ** 16) == pytest.approx(f.predict("all_reduce", "ring", 2, 2 ** 16))
    # the tree's steps (one-way) carry N each: 1 MB of a 1 MB tensor, nearer 4 MB than 256 KB? a tie: 4 MB
    assert f.predict_median("all_reduce", "tree", 2, MB) == pytest.approx(f.predict("all_reduce", "tree", 2, MB) + 2e-3)


def test_where_ranks_outnumber_cores_or_nothing_was_measured_the_prediction_is_the_model():
    """p > c: the model already prices the waits (a mean, s and σ'); a fit without delays (a
    GPU's, or Fit(α, β, γ)) has no spread to add; p = 1 has no step."""
    f = _fit({MB: [0.0, 5e-3]})
    for p in (3, 4, 8):
        assert f.predict_spread("all_reduce", "ring", p, MB) == [f.predict("all_reduce", "ring", p, MB)] * 3
    assert f.predict_median("all_reduce", "ring", 2, MB, ranks_busy=4) == f.predict("all_reduce", "ring", 2, MB, ranks_busy=4)
    classic = costfit.Fit(alpha=30e-6, beta=1e-9, gamma=2e-10, sizes=[], times=[])
    assert classic.predict_median("all_reduce", "ring", 2, MB) == classic.predict("all_reduce", "ring", 2, MB)
    assert f.predict_median("all_reduce", "ring", 1, MB) == 0.0


def test_the_fit_keeps_each_exchange_beyond_its_quick_quarter():
    """delays = every try less the lower quartile of its size: worked out here by hand."""
    t = costfit.Timings(cores=2, sizes=[1024, MB], one_way=[1e-4, 5e-4], exchange=[2e-4, 1e-3],
                        add_per_byte=1e-11, fresh_per_byte=0.0, tiny_ranks=0, tiny_steps={},
                        exchange_tries=[[2e-4, 3e-4, 1.9e-4, 6e-3], [1e-3, 1.1e-3, 4e-3, 1e-3]])
    f = costfit.fit_timings(t)
    assert f.delays[1024] == pytest.approx([-0.1e-4, 0.0, 1e-4, 5.8e-3])
    assert f.delays[MB] == pytest.approx([0.0, 0.0, 1e-4, 3e-3])
    assert costfit.fit_timings(costfit.Timings(2, [1024, MB], [1e-4, 5e-4], [2e-4, 1e-3], 1e-11, 0.0, 0, {})).delays == {}


@pytest.mark.parametrize("call, match", [
    (lambda: _fit({MB: [0.0]}).predict_spread("all_reduce", "ring", 2, MB, (0.5, 1.5)), "between 0 and 1"),
    (lambda: costfit.fit_and_time((MB + 4,)), "multiples of 8 bytes"),
    (lambda: costfit.fit_and_time(()), "multiples of 8 bytes"),
    (lambda: costfit.fit_and_time((MB,), ("butterfly",)), "no algorithm 'butterfly'"),
    (lambda: costfit.fit_and_time((MB,), repeats=0), "repeats must be a whole number"),
])
def test_bad_input_says_what_to_change(call, match):
    with pytest.raises(ValueError, match=match):
        call()


@pytest.mark.usefixtures("no_leftover_processes")
def test_fit_and_time_times_each_all_reduce_in_the_fits_rounds():
    """Two rounds: 4 tries a round of each all-reduce up to 16 MB and of each exchange, as
    many delays as tries, and a quarter of them at or below 0 (the quick quarter itself)."""
    f, tries = costfit.fit_and_time((4096, 2 * MB), ("ring", "tree"), sizes=[1024, MB, 32 * MB], repeats=2)
    assert sorted(tries) == [("ring", 4096), ("ring", 2 * MB), ("tree", 4096), ("tree", 2 * MB)]
    assert all(len(ts) == 8 and min(ts) > 0 for ts in tries.values())
    assert sorted(f.delays) == [1024, MB, 32 * MB]
    assert [len(f.delays[n]) for n in f.sizes] == [8, 8, 2]          # 32 MB: one exchange a round
    for n in f.sizes:
        assert f.delays[n][(len(f.delays[n]) - 1) // 4] == 0.0       # the quick quarter is the 0 of its delays
        assert f.round_trip_delays[n][(len(f.round_trip_delays[n]) - 1) // 4] == 0.0
        assert f.pair_delays[n][(len(f.pair_delays[n]) - 1) // 4] == 0.0
    # up to 256 KB, 8 round trips a try, the first not counted: 7 x 4 a round; above, one a try
    assert [len(f.round_trip_delays[n]) for n in f.sizes] == [7 * 8, 8, 2]
    assert [len(f.pair_delays[n]) for n in f.sizes] == [8, 8, 2]
    assert f.predict_median("all_reduce", "ring", 2, 2 * MB) >= f.predict_spread("all_reduce", "ring", 2, 2 * MB, (0.25,))[0]


def test_one_way_steps_draw_a_round_trips_delay_for_every_two_steps():
    """A tree all-reduce on 2 ranks is a reduce and a broadcast: one message each way, a ping-pong's
    round trip. With round trips that wait one time in three, its single draw waits one time in
    three: the median does not wait (the ring, two exchange draws from the same sample, does). On
    4 ranks (4 one-way steps, 2 draws) the median waits once."""
    f = _fit({MB: [0.0, 0.0, 4e-3]})
    f.round_trip_delays = {MB: [0.0, 0.0, 4e-3]}
    assert f.predict_median("all_reduce", "tree", 2, MB) == pytest.approx(f.predict("all_reduce", "tree", 2, MB))
    assert f.predict_median("all_reduce", "ring", 2, MB) == pytest.approx(f.predict("all_reduce", "ring", 2, MB) + 4e-3)
    f.cores = 8
    assert f.predict_median("all_reduce", "tree", 4, MB) == pytest.approx(f.predict("all_reduce", "tree", 4, MB) + 4e-3)
    f.round_trip_delays = {}                       # none measured: the exchanges' delays, one a step
    assert f.predict_median("all_reduce", "tree", 2, MB) == pytest.approx(f.predict("all_reduce", "tree", 2, MB) + 4e-3)


def test_the_fit_keeps_each_round_trip_beyond_its_quick_quarter():
    t = costfit.Timings(cores=2, sizes=[1024, MB], one_way=[1e-4, 5e-4], exchange=[2e-4, 1e-3],
                        add_per_byte=1e-11, fresh_per_byte=0.0, tiny_ranks=0, tiny_steps={},
                        exchange_tries=[[2e-4], [1e-3]], round_trips=[[2e-4, 9e-3, 1.8e-4], [1e-3, 3e-3]])
    f = costfit.fit_timings(t)
    assert f.round_trip_delays[1024] == pytest.approx([-0.2e-4, 0.0, 8.8e-3])
    assert f.round_trip_delays[MB] == pytest.approx([0.0, 2e-3])


def test_exchange_steps_draw_a_pairs_delay_for_every_two_steps():
    """Measured pairs of exchanges replace two single draws. Singles that wait one time in four
    leave a 2-step ring's median unheld ((3/4)² = 9/16 > 1/2); pairs that wait two times in
    three hold it up. Recursive doubling on 8 ranks has 3 steps: one pair and one single."""
    f = _fit({MB: [0.0, 0.0, 0.0, 4e-3]})
    quick = f.predict("all_reduce", "ring", 2, MB)
    assert f.predict_median("all_reduce", "ring", 2, MB) == pytest.approx(quick)
    f.pair_delays = {MB: [0.0, 4e-3, 4e-3]}
    assert f.predict_median("all_reduce", "ring", 2, MB) == pytest.approx(quick + 4e-3)
    assert f.predict_spread("all_reduce", "ring", 2, MB, (0.0, 1.0)) == pytest.approx([quick, quick + 4e-3])
    f = _fit({8 * MB: [5e-3]}, cores=8)                       # 3 steps of the whole 8 MB each
    f.pair_delays = {8 * MB: [0.0]}
    assert f.predict_median("all_reduce", "recursive_doubling", 8, 8 * MB) == \
        pytest.approx(f.predict("all_reduce", "recursive_doubling", 8, 8 * MB) + 5e-3)
    f.pair_delays = {8 * MB: [1e-3]}
    assert f.predict_median("all_reduce", "recursive_doubling", 8, 8 * MB) == \
        pytest.approx(f.predict("all_reduce", "recursive_doubling", 8, 8 * MB) + 6e-3)


def test_the_fit_keeps_each_pair_beyond_the_pairs_quick_quarter():
    t = costfit.Timings(cores=2, sizes=[1024, MB], one_way=[1e-4, 5e-4], exchange=[2e-4, 1e-3],
                        add_per_byte=1e-11, fresh_per_byte=0.0, tiny_ranks=0, tiny_steps={},
                        exchange_tries=[[2e-4], [1e-3]], round_trips=[[2e-4], [1e-3]],
                        pair_tries=[[5e-4, 4e-4, 9e-3, 4.5e-4], [3e-3]])
    f = costfit.fit_timings(t)
    assert f.pair_delays[1024] == pytest.approx([0.0, 0.5e-4, 1e-4, 8.6e-3])   # quick quarter: 4e-4
    assert f.pair_delays[MB] == pytest.approx([0.0])
    t.pair_tries = []                                          # timings from before pairs were measured
    assert costfit.fit_timings(t).pair_delays == {}


def test_a_step_draws_the_delays_of_its_own_size_not_the_collectives():
    """A 2 MB ring on 2 ranks sends 1 MB a step: the 1 MB exchanges' delays (none), not those of
    4 MB, which a step of 2 MB (the whole B) would tie with and take."""
    f = _fit({MB: [0.0], 4 * MB: [1e-3]})
    assert f.predict_median("all_reduce", "ring", 2, 2 * MB) == pytest.approx(f.predict("all_reduce", "ring", 2, 2 * MB))
