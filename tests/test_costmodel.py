"""pplab.costmodel: the bytes formulas equal the trace exactly, the latency counts equal the
longest chain of messages in the trace, the closed forms are the seeds' (and Thakur's),
pplab.costfit's fitting recovers known parameters from noisy made-up timings (and so the
predictions, within the issue's goal), and fit() measures a model that predicts its own
ping-pong points (within 3x: this is a shared machine, so only a loose factor is asserted;
no wall-clock time is).
"""
import math
import os
import random

import pytest
import torch
import torch.distributed as dist

import pplab
from pplab import collectives as C
from pplab import costfit
from pplab import costmodel as cm
from pplab import trace

pytestmark = pytest.mark.usefixtures("no_leftover_processes")

ALL = [(c, a) for c, algos in cm.COLLECTIVES.items() for a in algos]
SIZES = [(1, torch.float32), (5, torch.float64), (1003, torch.float32)]   # numel: below p, odd, large


def _every_collective():
    """On every rank: each collective and algorithm once per size, each in a trace span.
    N for the piece-wise collectives is p pieces of `numel` elements."""
    p, rank = dist.get_world_size(), dist.get_rank()
    root = p - 1                                        # not 0, so the root offset is exercised
    for numel, dtype in SIZES:
        x = torch.randn(numel).to(dtype)
        es = x.element_size()

        def case(collective, algorithm, n_bytes):
            return trace.span("case", collective=collective, algorithm=algorithm, n_bytes=n_bytes,
                              es=es, numel=numel, root=root)

        for algo in C.ALL_REDUCE_ALGORITHMS:
            with case("all_reduce", algo, numel * es):
                C.all_reduce(x.clone(), algorithm=algo)
        with case("broadcast", "tree", numel * es):
            C.broadcast(x.clone(), src=root)
        with case("reduce", "tree", numel * es):
            C.reduce(x.clone(), dst=root)
        whole = torch.randn(p * numel).to(dtype)
        with case("scatter", "linear", p * numel * es):
            C.scatter(torch.empty_like(x), list(whole.split(numel)) if rank == root else None, src=root)
        with case("gather", "linear", p * numel * es):
            C.gather(x, [torch.empty_like(x) for _ in range(p)] if rank == root else None, dst=root)
        with case("all_gather", "ring", p * numel * es):
            C.all_gather_into_tensor(torch.empty_like(whole), x)
        with case("reduce_scatter", "ring", p * numel * es):
            C.reduce_scatter_tensor(torch.empty_like(x), whole)
        with case("all_to_all", "pairwise", p * numel * es):
            C.all_to_all_single(torch.empty_like(whole), whole)


@pytest.mark.parametrize("p", [2, 3, 4, 8])
def test_bytes_and_messages_equal_the_trace(p):
    timeline = pplab.launch(_every_collective, world_size=p, timeout=120).timeline
    spans = [timeline.select(r, "compute", "case") for r in range(p)]
    assert all(len(s) == len(SIZES) * len(ALL) for s in spans)
    sends = [timeline.select(r, "comm", "send") for r in range(p)]
    pairs = timeline.messages()
    assert len(pairs) == sum(len(s) for s in sends)     # every message sent was received
    for i, meta in enumerate(s.meta for s in spans[0]):
        what = (meta["collective"], meta["algorithm"], p, meta["n_bytes"])
        inside = [[e for e in sends[r] if spans[r][i].start <= e.start <= spans[r][i].end] for r in range(p)]
        measured = [sum(e.bytes_sent for e in inside[r]) for r in range(p)]
        expected = cm.bytes_sent_per_rank(*what, element_size=meta["es"], root=meta["root"])
        assert measured == expected, what
        if meta["numel"] >= p:                          # no empty chunk left unsent
            ids = {id(e) for es in inside for e in es}
            chain = cm.messages_on_critical_path([m for m in pairs if id(m[0]) in ids])
            assert chain == cm.cost(*what).latency_rounds, what


def test_unchecked_skips_only_the_argument_exchange():
    def f():
        rank, calls = dist.get_rank(), []
        real = dist.all_gather_object

        def counted(*args, **kwargs):                   # this rank's process only
            calls.append(1)
            return real(*args, **kwargs)
        dist.all_gather_object = counted
        x, results = torch.arange(10.0) * (rank + 1), []
        with C.unchecked():
            for algo in C.ALL_REDUCE_ALGORITHMS:
                y = x.clone()
                C.all_reduce(y, algorithm=algo)
                results.append(y.tolist())
        inside = len(calls)
        try:
            with C.unchecked():
                raise KeyError
        except KeyError:
            pass
        C.all_reduce(x.clone())                         # checked again, even after an error
        return inside, len(calls) - inside, results

    for inside, after, results in pplab.launch(f, world_size=3, timeout=60):
        assert (inside, after) == (0, 1)
        assert results == [[6.0 * i for i in range(10)]] * len(C.ALL_REDUCE_ALGORITHMS)


N = 4 * 720720                                          # float32, divisible by every p up to 16


@pytest.mark.parametrize("p", [2, 3, 4, 5, 8, 16])
def test_ring_is_the_seeds_formula_and_reduce_scatter_plus_all_gather(p):
    a, b, g = 30e-6, 1e-9, 2e-10
    assert cm.predict("all_reduce", "ring", p, N, a, b, g) == pytest.approx(
        2 * (p - 1) * a + 2 * (p - 1) / p * N * b + (p - 1) / p * N * g)
    ring = cm.cost("all_reduce", "ring", p, N)
    assert ring == cm.cost("reduce_scatter", "ring", p, N) + cm.cost("all_gather", "ring", p, N)
    assert cm.bytes_sent_per_rank("all_reduce", "ring", p, N) == [ring.bytes] * p   # p divides N
    assert cm.cost("all_reduce", None, p, N) == ring                                # the default


@pytest.mark.parametrize("p", [2, 4, 8, 16])
def test_rabenseifner_and_recursive_doubling_closed_forms(p):
    log = p.bit_length() - 1
    a, b, g = 30e-6, 1e-9, 2e-10
    assert cm.predict("all_reduce", "halving_doubling", p, N, a, b, g) == pytest.approx(
        2 * log * a + 2 * (p - 1) / p * N * b + (p - 1) / p * N * g)
    assert cm.predict("all_reduce", "recursive_doubling", p, N, a, b, g) == pytest.approx(log * (a + N * b + N * g))
    assert cm.bytes_sent_per_rank("all_reduce", "halving_doubling", p, N) == [2 * (p - 1) * N // p] * p


@pytest.mark.parametrize("p", [2, 3, 5, 9])
def test_naive_all_reduce_is_the_seeds_parameter_server_with_p_minus_1_workers(p):
    """Seeds: a server apart from P workers costs β·2Pd, α·2 (two rounds). pplab's rank 0 is
    the server of P = p-1 workers: the same 2Pd bytes on its link, sent one message at a time."""
    workers, d = p - 1, N
    ps = cm.cost("all_reduce", "naive", p, d)
    assert ps.bytes == 2 * workers * d and ps.latency_rounds == 2 * workers
    sent = cm.bytes_sent_per_rank("all_reduce", "naive", p, d)
    into_server, out_of_server = sum(sent[1:]), sent[0]
    assert into_server == out_of_server == workers * d and into_server + out_of_server == ps.bytes


def test_a_numeric_prediction():
    # 4 ranks, 64 MiB, α = 50 µs, β = 1 ns/B: 6 messages and 1.5 x 64 MiB on the critical path
    assert cm.predict("all_reduce", "ring", 4, 64 * 2 ** 20, 50e-6, 1e-9) == pytest.approx(0.100963296)
    assert cm.predict("broadcast", "tree", 8, 1000, 1e-5, 1e-9) == pytest.approx(3 * (1e-5 + 1e-6))


def test_monotonic_in_size_and_in_powers_of_two_ranks():
    a, b, g = 30e-6, 1e-9, 2e-10
    for c, algo in ALL:
        by_size = [cm.predict(c, algo, 4, 4 ** k * 1024, a, b, g) for k in range(9)]
        assert all(x < y for x, y in zip(by_size, by_size[1:])), (c, algo)
        by_p = [cm.predict(c, algo, 2 ** k, N, a, b, g) for k in range(7)]
        assert all(x <= y for x, y in zip(by_p, by_p[1:])), (c, algo)
    ring = [cm.cost("all_reduce", "ring", p, N) for p in range(2, 65)]
    assert all(x.latency_rounds < y.latency_rounds and x.bytes < y.bytes < 2 * N for x, y in zip(ring, ring[1:]))
    # folding the extra ranks in costs: 5 ranks take longer than 8
    for algo in ("recursive_doubling", "halving_doubling"):
        assert cm.predict("all_reduce", algo, 5, N, a, b) > cm.predict("all_reduce", algo, 8, N, a, b)


@pytest.mark.parametrize("call, match", [
    (lambda: cm.cost("allreduce", "ring", 4, 100), "unknown collective 'allreduce'.*all_reduce"),
    (lambda: cm.cost("all_reduce", "butterfly", 4, 100), "no algorithm 'butterfly'.*'halving_doubling'"),
    (lambda: cm.cost("broadcast", "ring", 4, 100), "no algorithm 'ring'.*'tree'"),
    (lambda: cm.cost("all_reduce", "ring", 0, 100), "p is a number of ranks.*got 0"),
    (lambda: cm.cost("all_reduce", "ring", 2.5, 100), "got 2.5"),
    (lambda: cm.predict("all_reduce", "ring", 4, -1, 1e-5, 1e-9), "n_bytes.*>= 0: got -1"),
    (lambda: cm.predict("all_reduce", "ring", 4, 100, -1e-5, 1e-9), "alpha.*>= 0"),
    (lambda: cm.bytes_sent_per_rank("all_reduce", "ring", 4, 10), "not a whole number of 4-byte"),
    (lambda: cm.bytes_sent_per_rank("all_gather", "ring", 3, 16), "multiple of p x element_size = 12"),
    (lambda: cm.bytes_sent_per_rank("broadcast", "tree", 3, 16, root=3), "root=3.*0..2"),
    (lambda: costfit.fit(world_size=1), "world_size must be >= 2"),
    (lambda: costfit.fit(sizes=[1024]), "at least two different message sizes"),
    (lambda: costfit.fit(world_size=3), "world_size must be even, got 3"),
])
def test_bad_input_says_what_to_change(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_fit_line_recovers_a_known_line():
    sizes = [4 ** k * 1024 for k in range(9)]
    assert costfit.fit_line(sizes, [40e-6 + 0.5e-9 * n for n in sizes]) == pytest.approx((40e-6, 0.5e-9))


def _misses(f):
    """What a fit measured on this machine gets wrong about its own points: a parameter that noise
    pushed to 0 (fit_line clips below 0), a ping-pong point more than 3x off its line."""
    misses = [name for name in ("alpha", "beta", "gamma", "alpha2", "beta2") if not getattr(f, name) > 0]
    return misses + [f"{n} B: line {f.message_time(n):.3g} s, measured {t:.3g} s"
                     for n, t in zip(f.sizes, f.times) if not t / 3 < f.message_time(n) < 3 * t]


def test_fit_measures_a_model_that_predicts_its_own_points():
    # Other programs on a shared machine can slow one size's every try, or the smallest ones
    # only (which pushes α to 0): measure again, up to 3 times, before calling a miss a
    # failure. A line that never fits still fails, saying what it missed.
    for _ in range(3):
        f = costfit.fit(sizes=[1024, 16 * 1024, 256 * 1024, 4 * 2 ** 20], repeats=5)
        if not _misses(f):
            break
    assert not _misses(f), f"{_misses(f)}; {f}"
    assert (f.alpha, f.beta) == costfit.fit_line(f.sizes, f.times)
    assert (f.alpha2, f.beta2) == costfit.fit_line(f.sizes, f.exchange_times)
    assert f.bandwidth == pytest.approx(1 / f.beta / 1e9)
    assert f.cores == len(os.sched_getaffinity(0))
    assert set(f.sigma) == (set(costfit.STEPS) if f.cores <= 8 else set())   # tiny steps on 2c ranks
    assert f.predict("all_reduce", "ring", 4, 2 ** 20) > 0 and "GB/s" in str(f)


# ----------------------------------------------------------------------------------
# The fitted model on made-up timings: known parameters in, the same predictions out.
# Machine-independent: no ranks, no clock.

KNOWN = costfit.Fit(alpha=60e-6, beta=0.35e-9, gamma=0.05e-9, sizes=[], times=[], alpha2=150e-6, beta2=0.7e-9,
                    sigma={"one-way": 1e-3, "swap": 3e-3, "ring": 4e-3}, mu=0.5e-9, cores=2, delta=100e-6)


def _timings_from(known, noise, seed):
    """What measure() would read on a machine with `known`'s parameters, each timing off
    by a random factor within 1 ± noise. The formulas are written here, from the docstring."""
    rng = random.Random(seed)

    def off(t):
        return t * rng.uniform(1 - noise, 1 + noise)
    sizes = list(costfit.SIZES)
    ranks = 2 * known.cores                             # tiny steps on 2c ranks: s = 2, a share 1 - c/2c waits
    tiny = {"one-way": known.alpha, "swap": known.alpha2, "ring": known.alpha2}   # + 4 bytes: negligible
    return costfit.Timings(
        cores=known.cores, sizes=sizes,
        one_way=[off(known.alpha + known.beta * n) for n in sizes],
        exchange=[off(known.alpha2 + known.beta2 * n) for n in sizes],
        add_per_byte=off(known.gamma), fresh_per_byte=off(known.mu), tiny_ranks=ranks,
        tiny_steps={k: off(known.delta / (2 * (ranks - 1)) + ranks / known.cores * tiny[k]
                           + known.sigma[k] * (1 - known.cores / ranks)) for k in costfit.STEPS},
        start=off(known.delta))


@pytest.mark.parametrize("seed", range(5))
def test_fitting_recovers_known_parameters_from_noisy_timings(seed):
    fit = costfit.fit_timings(_timings_from(KNOWN, noise=0.1, seed=seed))
    for name in ("alpha", "beta", "alpha2", "beta2", "gamma", "mu", "delta"):
        assert getattr(fit, name) == pytest.approx(getattr(KNOWN, name), rel=0.25), name
    for kind in costfit.STEPS:
        assert fit.sigma[kind] == pytest.approx(KNOWN.sigma[kind], rel=0.35), kind
    assert fit.cores == KNOWN.cores


@pytest.mark.parametrize("seed", range(5))
def test_predictions_from_noisy_timings_are_within_the_goal(seed):
    """The issue's goal (1.5x at p <= c, 2x beyond) and a tighter 1.25x, which ±10% noise allows."""
    fit = costfit.fit_timings(_timings_from(KNOWN, noise=0.1, seed=seed))
    for p in (2, 3, 4, 5, 8):
        for algorithm in ("ring", "tree", "halving_doubling", "recursive_doubling", "naive"):
            for n in (2 ** 10, 2 ** 14, 2 ** 18, 2 ** 22, 2 ** 26):
                ratio = fit.predict("all_reduce", algorithm, p, n) / KNOWN.predict("all_reduce", algorithm, p, n)
                assert 1 / 1.25 < ratio < 1.25, (p, algorithm, n, ratio)


def test_noise_beyond_the_goal_is_caught():
    """The check above can fail: timings 3x off give predictions outside 1.5x."""
    t = _timings_from(KNOWN, noise=0.0, seed=0)
    t.exchange = [3 * x for x in t.exchange]
    fit = costfit.fit_timings(t)
    assert fit.predict("all_reduce", "ring", 2, 2 ** 26) / KNOWN.predict("all_reduce", "ring", 2, 2 ** 26) > 1.5


def test_the_formula_by_hand():
    """T = δ + s·(A·α' + B·β' + C·γ + F·μ) + A·σ'·w, s = max(1, b/c), w = max(0, 1 - c/b), with
    the table's A, B, C, counted here again."""
    k, N = KNOWN, 4 * 2 ** 20
    # ring, p = 4 on 2 cores: 6 exchange steps, 1.5 N bytes, 0.75 N added; b = 4: s = 2, w = 1/2;
    # its one receive buffer (N/4 = 1 MB) is below 32 MiB: F = 0
    assert k.predict("all_reduce", "ring", 4, N) == pytest.approx(
        k.delta + 2 * (6 * k.alpha2 + 1.5 * N * k.beta2 + 0.75 * N * k.gamma) + 6 * k.sigma["ring"] / 2)
    # tree, p = 8, 64 MB: 6 one-way steps, 6 N bytes, 3 N added; b = 2·7 messages' ranks / 3
    # rounds = 14/3; the 64 MB receive buffer is fresh
    N = 64 * 2 ** 20
    b = 14 / 3
    assert k.predict("all_reduce", "tree", 8, N) == pytest.approx(
        k.delta + b / 2 * (6 * k.alpha + 6 * N * k.beta + 3 * N * k.gamma + N * k.mu)
        + 6 * k.sigma["one-way"] * (1 - 2 / b))
    # halving-doubling, p = 2, one rank per core: s = 1, w = 0; a 32 MB half is fresh
    assert k.predict("all_reduce", "halving_doubling", 2, N) == pytest.approx(
        k.delta + 2 * k.alpha2 + N * k.beta2 + N / 2 * k.gamma + N / 2 * k.mu)
    assert sum(k.terms("all_reduce", "ring", 8, N).values()) == k.predict("all_reduce", "ring", 8, N)


def test_other_busy_ranks_share_the_cores():
    """ranks_busy: a 2-rank ring while 4 ranks work on 2 cores (a tp pair in a 4-rank layout)
    pays s = 4/2 and a share w = 1/2 of σ' per step; never less than its own ranks; and with
    one GPU per rank (no cores given) nothing changes."""
    k, N = KNOWN, 2 ** 20
    alone = k.predict("all_reduce", "ring", 2, N)
    assert alone == pytest.approx(k.delta + 2 * k.alpha2 + N * k.beta2 + N / 2 * k.gamma)
    assert k.predict("all_reduce", "ring", 2, N, ranks_busy=4) == pytest.approx(
        k.delta + 2 * (2 * k.alpha2 + N * k.beta2 + N / 2 * k.gamma) + 2 * k.sigma["ring"] / 2)
    assert k.predict("all_reduce", "ring", 4, N, ranks_busy=2) == k.predict("all_reduce", "ring", 4, N)
    gpu = costfit.Fit(alpha=30e-6, beta=1e-9, gamma=2e-10, sizes=[], times=[])
    assert gpu.predict("all_reduce", "ring", 2, N, ranks_busy=8) == gpu.predict("all_reduce", "ring", 2, N)


@pytest.mark.parametrize("algorithm, p, fresh", [
    ("ring", 2, 32), ("ring", 4, 0), ("tree", 3, 64), ("halving_doubling", 8, 32),
    ("halving_doubling", 5, 32 + 64), ("recursive_doubling", 4, 64), ("naive", 3, 128)])
def test_fresh_buffers_are_the_algorithms_allocations_of_32_mib_or_more(algorithm, p, fresh):
    assert costfit.fresh_bytes("all_reduce", algorithm, p, 64 * 2 ** 20) == fresh * 2 ** 20
    assert costfit.fresh_bytes("all_reduce", algorithm, p, 16 * 2 ** 20) == 0


def test_one_rank_per_core_is_the_classic_model():
    """On a GPU cluster (one process per GPU, full duplex, buffers reused) the classic
    A·α + B·β + C·γ: a Fit of α, β, γ alone, with no cores given, is exactly that."""
    classic = costfit.Fit(alpha=30e-6, beta=1e-9, gamma=2e-10, sizes=[], times=[])
    for c, algo in ALL:
        for p in (2, 3, 8):
            n = 4 * 2 ** 20                              # below 32 MiB: no fresh buffers
            assert classic.predict(c, algo, p, n) == pytest.approx(cm.predict(c, algo, p, n, 30e-6, 1e-9, 2e-10))
    assert not hasattr(cm, "fit") and not hasattr(cm, "Fit")     # the formulas only: fitting lives in costfit


def test_more_ranks_than_cores_costs_more_per_step():
    for algorithm in ("ring", "tree", "halving_doubling"):
        per_step = [KNOWN.predict("all_reduce", algorithm, p, 1024) / cm.cost("all_reduce", algorithm, p, 1024)
                    .latency_rounds for p in (2, 4, 8)]
        assert per_step[0] < per_step[1] < per_step[2], algorithm


# ----------------------------------------------------------------------------------
# Every row of the table, A, B and C, against closed forms counted from the algorithms
# themselves (written here, not read from pplab.costmodel), then against a real run.

def _closed_form(collective, algorithm, p, N):
    """(A, B, C): messages, bytes and bytes combined on the critical path, step by step."""
    rounds = math.ceil(math.log2(p))                    # binomial tree: the ranks reached double each round
    q = 2 ** math.floor(math.log2(p))                   # recursive doubling/halving run on q ranks
    k = round(math.log2(q))
    piece = N / p
    if collective == "broadcast":                       # the root sends N, once a round
        return rounds, rounds * N, 0
    if collective == "reduce":                          # the root receives N and adds it, once a round
        return rounds, rounds * N, rounds * N
    if collective in ("scatter", "gather"):             # the root's link: p-1 pieces, one after another
        return p - 1, (p - 1) * piece, 0
    if collective in ("all_gather", "all_to_all"):      # p-1 steps of one piece
        return p - 1, sum(piece for _ in range(p - 1)), 0
    if collective == "reduce_scatter":                  # p-1 steps of one piece, each added on arrival
        return p - 1, sum(piece for _ in range(p - 1)), sum(piece for _ in range(p - 1))
    if algorithm == "naive":                            # rank 0 receives p-1 tensors, adds them, sends p-1
        return 2 * (p - 1), (p - 1) * N + (p - 1) * N, (p - 1) * N
    if algorithm == "tree":                             # reduce, then broadcast
        return 2 * rounds, 2 * rounds * N, rounds * N
    if algorithm == "ring":                             # reduce-scatter, then all-gather
        return 2 * (p - 1), 2 * (p - 1) * piece, (p - 1) * piece
    if algorithm == "recursive_doubling":               # k swaps of the whole tensor, each added
        a, b, c = k, k * N, k * N
    else:                                               # halving N/2, N/4, .. N/q (added), then doubling back
        halves = [N / 2 ** i for i in range(1, k + 1)]
        a, b, c = 2 * k, 2 * sum(halves), sum(halves)
    if p != q:                                          # fold in: hand N over (added), get N back
        a, b, c = a + 2, b + 2 * N, c + N
    return a, b, c


@pytest.mark.parametrize("p", [2, 3, 4, 5, 8])
@pytest.mark.parametrize("collective, algorithm", ALL)
def test_every_row_of_the_table_is_its_closed_form(collective, algorithm, p):
    N = 4 * 840                                         # 840 float32: p and q divide it
    got = cm.cost(collective, algorithm, p, N)
    a, b, c = _closed_form(collective, algorithm, p, N)
    assert (got.latency_rounds, got.bytes, got.reduce_bytes) == (a, pytest.approx(b), pytest.approx(c))


def test_the_table_has_no_row_without_a_closed_form():
    assert sorted(ALL) == sorted([
        ("broadcast", "tree"), ("reduce", "tree"), ("scatter", "linear"), ("gather", "linear"),
        ("all_gather", "ring"), ("reduce_scatter", "ring"), ("all_to_all", "pairwise"),
        ("all_reduce", "ring"), ("all_reduce", "naive"), ("all_reduce", "tree"),
        ("all_reduce", "recursive_doubling"), ("all_reduce", "halving_doubling")])


def test_some_rows_by_hand():
    """p = 5 and 3, N = 1: numbers counted on paper from the swimlanes, not from any formula."""
    by_hand = {("broadcast", "tree", 5): (3, 3, 0),        # 0→1 | 0→2 | 0→4: the root sends 3 times
               ("reduce", "tree", 5): (3, 3, 3),           # 4→0 | 2→0 (3→1) | 1→0
               ("all_reduce", "naive", 3): (4, 4, 2),      # 1→0 2→0 | adds 2 | 0→1 0→2
               ("all_reduce", "ring", 5): (8, 1.6, 0.8),   # 4 + 4 steps of 1/5
               ("all_reduce", "recursive_doubling", 3): (3, 3, 2),  # 0→1 (+) | 1↔2 (+) | 1→0
               ("all_reduce", "halving_doubling", 5): (6, 3.5, 1.75),  # fold, 1/2, 1/4, 1/4, 1/2, unfold
               ("all_reduce", "tree", 3): (4, 4, 2),
               ("reduce_scatter", "ring", 3): (2, 2 / 3, 2 / 3)}
    for (collective, algorithm, p), (a, b, c) in by_hand.items():
        got = cm.cost(collective, algorithm, p, 1)
        assert (got.latency_rounds, got.bytes, got.reduce_bytes) == (a, pytest.approx(b), pytest.approx(c))


def _heaviest_chain(pairs):
    """B read off a trace: the most bytes along one chain of messages that had to follow one
    another (the same waiting rules as messages_on_critical_path, written again here)."""
    before = []
    for s, r in pairs:
        got = [j for j, (_, r2) in enumerate(pairs) if r2.rank == s.rank and r2.end <= s.start]
        sent = [j for j, (s2, _) in enumerate(pairs) if s2.rank == s.rank and s2.start < s.start]
        into = [j for j, (_, r2) in enumerate(pairs) if r2.rank == r.rank and r2.start < r.start]
        waits = set(got)
        if sent:                                        # my previous send
            waits.add(max(sent, key=lambda j: pairs[j][0].start))
        if into:                                        # the receiver's previous receive
            waits.add(max(into, key=lambda j: pairs[j][1].start))
        before.append(waits)
    memo = {}

    def heaviest(i):
        if i not in memo:
            memo[i] = pairs[i][0].bytes_sent + max((heaviest(j) for j in before[i]), default=0)
        return memo[i]
    return max((heaviest(i) for i in range(len(pairs))), default=0)


def _every_collective_counting_additions(numel):
    """On every rank: each collective once, in a trace span; returns the bytes this rank
    combined in each (counted by wrapping collectives.combine, the one line of arithmetic)."""
    p, rank = dist.get_world_size(), dist.get_rank()
    combined, real = {}, C.combine

    def counting(acc, incoming, op):
        combined[current] = combined.get(current, 0) + incoming.numel() * incoming.element_size()
        real(acc, incoming, op)
    C.combine = counting
    x, root = torch.randn(numel), 1 % p
    cases = [("all_reduce", a, lambda a=a: C.all_reduce(x.clone(), algorithm=a)) for a in C.ALL_REDUCE_ALGORITHMS]
    cases += [("broadcast", "tree", lambda: C.broadcast(x.clone(), src=root)),
              ("reduce", "tree", lambda: C.reduce(x.clone(), dst=root)),
              ("scatter", "linear", lambda: C.scatter(torch.empty(numel // p), list(x.split(numel // p))
                                                      if rank == root else None, src=root)),
              ("gather", "linear", lambda: C.gather(x[:numel // p].clone(), list(torch.empty(numel).split(
                  numel // p)) if rank == root else None, dst=root)),
              ("all_gather", "ring", lambda: C.all_gather_into_tensor(torch.empty(numel), x[:numel // p].clone())),
              ("reduce_scatter", "ring", lambda: C.reduce_scatter_tensor(torch.empty(numel // p), x.clone())),
              ("all_to_all", "pairwise", lambda: C.all_to_all_single(torch.empty(numel), x.clone()))]
    for current, algorithm, run in cases:               # `current` is read by counting()
        current = (current, algorithm)
        with trace.span("case", collective=current[0], algorithm=algorithm):
            run()
    C.combine = real
    return combined


@pytest.mark.parametrize("p", [2, 3, 4, 5, 8])
def test_the_table_equals_a_real_run(p):
    """A from the longest chain of messages, B from the heaviest, C from the additions the
    ranks made (the rank that adds most: its additions follow one another, and in these
    algorithms it is on the critical path). N = 840 float32 for every collective."""
    numel = 840
    out = pplab.launch(_every_collective_counting_additions, numel, world_size=p, timeout=120)
    tl, pairs = out.timeline, out.timeline.messages()
    spans = [tl.select(r, "compute", "case") for r in range(p)]
    assert len(spans[0]) == len(ALL)
    for i, meta in enumerate(s.meta for s in spans[0]):
        what = (meta["collective"], meta["algorithm"])
        inside = [m for m in pairs if spans[m[0].rank][i].start <= m[0].start <= spans[m[0].rank][i].end]
        expected = cm.cost(*what, p, 4 * numel)
        assert cm.messages_on_critical_path(inside) == expected.latency_rounds, what
        assert _heaviest_chain(inside) == pytest.approx(expected.bytes), what
        assert max(r.get(what, 0) for r in out) == pytest.approx(expected.reduce_bytes), what


def test_fitting_noise_free_timings_recovers_every_parameter():
    """With no noise the fit inverts the formulas exactly, σ (which first takes off δ's share of
    a tiny step, then s·α') included."""
    fit = costfit.fit_timings(_timings_from(KNOWN, noise=0.0, seed=0))
    for name in ("alpha", "beta", "alpha2", "beta2", "gamma", "mu", "delta"):
        assert getattr(fit, name) == pytest.approx(getattr(KNOWN, name), rel=1e-6), name
    assert fit.sigma == pytest.approx(KNOWN.sigma, rel=1e-6)


def test_fit_line_falls_back_to_one_parameter_fitted_by_least_squares():
    """Noise can put the best line's α or β below 0: the other is then fitted alone, by the same
    relative error, min Σ(x·k/t - 1)² over rows k = n (through 0) or k = 1 (flat); torch's
    least squares is the reference."""
    def least_squares(rows, times):
        a = torch.tensor([[k / t] for k, t in zip(rows, times)], dtype=torch.float64)
        return torch.linalg.lstsq(a, torch.ones(len(times), 1, dtype=torch.float64)).solution.item()
    sizes = [1000, 2000, 4000]
    through_zero = [0.5e-6, 1.5e-6, 3.5e-6]             # 1e-9·n - 0.5e-6: α < 0
    assert costfit.fit_line(sizes, through_zero) == (0.0, pytest.approx(least_squares(sizes, through_zero)))
    flat = [3e-6, 2e-6, 1.9e-6]                         # slower for fewer bytes: β < 0
    assert costfit.fit_line(sizes, flat) == (pytest.approx(least_squares([1, 1, 1], flat)), 0.0)
