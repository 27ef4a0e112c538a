"""The α-β-γ model fitted to *this* machine: measure a few cheap things, fit, predict.

pplab.costmodel counts, for each collective, A messages, B bytes and C bytes combined on
the critical path (Thakur, Rabenseifner & Gropp). The classic model prices them with one
α, β and γ. That is right for NCCL on a GPU cluster: one process per GPU, links that send
and receive at full speed at once. On a CPU, where "the network" is the processor copying
memory, four more things cost time. The model here keeps the table and adds them:

    T = δ + s·(A·α' + B·β' + C·γ + F·μ) + A·σ'·w,      s = max(1, b/c),  w = max(0, 1 - c/b)

    δ        once per collective: what a call costs beyond its messages. The ranks never
             start at the same instant (they leave the barrier before it a little apart, and
             a process that paused is slower on its first message), and pplab checks the
             call and splits the tensor before the first step.

    α', β'   a step's start-up time and time per byte. For algorithms whose steps send
             and receive at once (ring, halving/doubling, all-gather, ...) these are
             α₂, β₂ of a simultaneous exchange: a core that sends *and* receives copies
             twice. For one-way steps (trees, the parameter server) α, β of a ping-pong.
             pplab's own per-message overhead (Python, the trace, the call board) is in α.
    γ        seconds per byte combined (a float32 add).
    b, c     b ranks busy at once (p for the ring and halving-doubling; fewer for a tree,
             where each round only some ranks talk) on c cores.
    s        ranks per core. While b > c the ranks take turns, so everything a rank does
             on the CPU (its per-message work, copies, additions, page faults) takes s
             times longer.
    σ', w    a rank whose message has arrived may find its core taken by another rank
             (a share w = 1 - c/b of the busy ranks have no core of their own) and then
             waits for a time slice (up to a scheduler tick). How long depends on the kind
             of step (see `step`): σ' is measured for each kind with tiny steps on 2c ranks.
    F, μ     bytes of fresh memory a collective allocates (receive buffers of 32 MiB or
             more: glibc's malloc hands those out straight from the OS, and every first
             touch of a page is a page fault), μ seconds per byte.

With one rank per core (s = 1, w = 0), no fresh buffers (F = 0), full-duplex links (α' = α,
β' = β) and a negligible start (δ = 0) it is the classic A·α + B·β + C·γ. That is the GPU case: NCCL runs one process per
GPU, so σ never applies; its buffers are reused; NVLink and InfiniBand send and receive
at once at full speed.

`fit()` = `measure()` (a few seconds on this machine: ping-pongs and exchanges from 1 KB to
64 MB, an add, a write to fresh memory, tiny steps of each kind on 2c ranks) then
`fit_timings()` (pure arithmetic on those timings, testable without ranks). Neither looks
at a collective's own time: that is what the predictions are for.

`Fit.predict` is a try that nothing holds up (the parameters count the quick quarter of their
tries). A cell that times a collective shows its median, or one try: `Fit.predict_spread` and
`Fit.predict_median` add, step by step, delays drawn from the spread of the fit's own single
exchanges. `fit_and_time()` times pplab's all-reduces in the fit's own rounds, so that both are
measured under the same load. Appendix A (notebooks/appendix_a_fitting_the_cost_model.ipynb)
shows each measurement.
"""
from __future__ import annotations

import math
import os
import random
import statistics
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from . import collectives, trace
from .runtime import comm
from .costmodel import cost
from .runtime.launcher import device, launch

SIZES = tuple(4 ** k * 1024 for k in range(9))    # 1 KB, 4 KB, ..., 64 MB
FRESH_FROM = 32 * 2 ** 20                          # glibc's malloc takes buffers this large from the OS each time
STEPS = ("one-way", "swap", "ring")
BACK_TO_BACK = 8                                   # ping-pongs per timed try up to 256 KB (the first not counted)


# ----------------------------------------------------------------------------------
# What a collective does beyond the table: its kind of step, ranks busy, fresh memory


def step(collective: str, algorithm: str | None) -> str:
    """The kind of step an algorithm repeats. "one-way": a rank sends or receives (trees,
    the parameter server, scatter, gather); "swap": two partners send to each other at
    once (recursive doubling, halving-doubling); "ring": a rank sends to one neighbour
    while receiving from another (ring, pairwise all-to-all), so a late rank delays its
    neighbour, which delays the next, all round the ring."""
    if algorithm in ("recursive_doubling", "halving_doubling"):
        return "swap"
    if algorithm in ("ring", "pairwise") or collective in ("all_gather", "reduce_scatter", "all_to_all"):
        return "ring"
    return "one-way"


def busy_ranks(collective: str, algorithm: str | None, p: int) -> float:
    """b: ranks at work in an average step. Every rank in a ring or halving-doubling step;
    in a binomial tree the p-1 messages (2 ranks each) spread over ⌈log p⌉ rounds."""
    algorithm = algorithm or ("tree" if collective in ("broadcast", "reduce") else None)
    if p > 1 and (algorithm == "tree" or collective in ("broadcast", "reduce")):
        return min(p, 2 * (p - 1) / (p - 1).bit_length())
    return p


def fresh_bytes(collective: str, algorithm: str | None, p: int, n_bytes: float) -> float:
    """F: bytes of new receive buffers of FRESH_FROM bytes or more that pplab.collectives
    allocates on the critical path (torch.empty_like(...) in each algorithm)."""
    if p == 1:
        return 0.0
    N, q = float(n_bytes), 1 << (p.bit_length() - 1)
    buffers = {"ring": [N / p], "tree": [N], "naive": [N] * (p - 1), "recursive_doubling": [N],
               "halving_doubling": [N / 2 ** k for k in range(1, q.bit_length())]}.get(algorithm, [])
    if collective == "all_reduce" and algorithm in ("recursive_doubling", "halving_doubling") and q != p:
        buffers = buffers + [N]                    # the folded-in partner's tensor
    if collective == "reduce":
        buffers = [N]
    elif collective == "reduce_scatter":
        buffers = [N, N / p]                       # the copy of the input, the landing chunk
    elif collective != "all_reduce":
        buffers = []
    return sum(b for b in buffers if b >= FRESH_FROM)


# ----------------------------------------------------------------------------------
# The fitted model


@dataclass
class Fit:
    """α, β (one-way), α₂, β₂ (exchange), γ, σ, μ measured here on c cores; see the module."""

    alpha: float                 # seconds per one-way message (pplab's own overhead included)
    beta: float                  # seconds per byte, one way
    gamma: float                 # seconds per byte combined (a float32 add)
    sizes: list                  # message sizes measured (bytes)
    times: list                  # the one-way time of each (seconds)
    alpha2: float | None = None  # seconds per step that sends and receives at once (None: α)
    beta2: float | None = None   # seconds per byte of such a step (None: β)
    sigma: dict = field(default_factory=dict)   # {kind of step: seconds it waits for a core, when it waits}
    mu: float = 0.0              # seconds per byte of fresh memory first touched
    cores: int | None = None     # c: the cores the ranks share (None: one core per rank, as on GPUs)
    exchange_times: list = field(default_factory=list)   # the exchange time of each size
    delta: float = 0.0           # seconds, once per collective: waiting for the last rank to start
    delays: dict = field(default_factory=dict)   # {size: seconds each single exchange took beyond the quick quarter}
    round_trip_delays: dict = field(default_factory=dict)   # {size: the same for each ping-pong round trip}
    pair_delays: dict = field(default_factory=dict)   # {size: the same for each two exchanges back to back}

    def __post_init__(self):                      # Fit(α, β, γ, ...) alone is the classic model
        self.alpha2 = self.alpha if self.alpha2 is None else self.alpha2
        self.beta2 = self.beta if self.beta2 is None else self.beta2

    @property
    def bandwidth(self) -> float:
        """GB/s, 1/β."""
        return 1 / self.beta / 1e9 if self.beta > 0 else float("inf")

    def message_time(self, n_bytes: float) -> float:
        """A one-way message of n bytes: α + nβ."""
        return self.alpha + self.beta * n_bytes

    def terms(self, collective: str, algorithm: str | None, p: int, n_bytes: float,
              ranks_busy: float | None = None) -> dict:
        """Seconds in each term of T, by name: which one matters where. ranks_busy: ranks at work
        on the machine while it runs, if more than its own (several groups at once, each with
        its collectives and compute, as in a hybrid layout): they share the cores too."""
        c = cost(collective, algorithm, p, n_bytes)
        kind = step(collective, algorithm)
        a, b = (self.alpha, self.beta) if kind == "one-way" else (self.alpha2, self.beta2)
        sigma = self.sigma.get(kind, 0.0)
        busy = max(busy_ranks(collective, algorithm, p), ranks_busy or 0)
        cores = self.cores or busy
        s, w = max(1.0, busy / cores), max(0.0, 1 - cores / busy)
        return {"start δ": self.delta if c.latency_rounds else 0.0,
                "latency s·A·α'": s * c.latency_rounds * a,
                "scheduling A·σ'·w": c.latency_rounds * sigma * w,
                "bytes s·B·β'": s * c.bytes * b,
                "combining s·C·γ": s * c.reduce_bytes * self.gamma,
                "fresh memory s·F·μ": s * fresh_bytes(collective, algorithm, p, n_bytes) * self.mu}

    def predict(self, collective: str, algorithm: str | None, p: int, n_bytes: float,
                ranks_busy: float | None = None) -> float:
        """Seconds `collective` by `algorithm` should take on p ranks here (N = n_bytes), with
        ranks_busy ranks at work on the machine meanwhile (default: its own)."""
        return sum(self.terms(collective, algorithm, p, n_bytes, ranks_busy).values())

    def predict_median(self, collective: str, algorithm: str | None, p: int, n_bytes: float,
                       ranks_busy: float | None = None) -> float:
        """The median time over many tries: what one run of a cell most often shows (see
        `predict_spread`)."""
        return self.predict_spread(collective, algorithm, p, n_bytes, (0.5,), ranks_busy)[0]

    def predict_spread(self, collective: str, algorithm: str | None, p: int, n_bytes: float,
                       quantiles=(0.25, 0.5, 0.75), ranks_busy: float | None = None) -> list:
        """Seconds below which a share q of the tries should fall, for each q in quantiles.

        `predict` is a try that nothing holds up. Where every rank has a core, a try is that,
        plus, at each of its A steps, a delay: a wait for a core (a scheduler tick, now and
        then), another program's burst. The fit keeps, for each size, how much longer than its
        quick quarter every single exchange took (`delays`), and every ping-pong round trip
        (`round_trip_delays`), and every two exchanges timed back to back (`pair_delays`). Steps
        that send and receive at once draw, for each two of them, the delay of one such pair of
        the size nearest their own (and a single exchange's for an odd last step): the second of
        two steps waits for a core more often than a lone exchange does, so drawing each step's
        delay apart would predict too few slow tries. One-way steps (a tree's), which wake one
        rank, not two, draw a round trip's delay for every two steps. The quantiles of 4001 such tries
        (a fixed seed: the same answer every call) are added to `predict`. A median of a
        collective is not the sum of its steps' medians: if a step waits one time in three, a
        try of two steps waits more often than not. Where ranks outnumber cores, `predict` is
        already a mean that prices the waiting (s, σ'), and is returned for every q."""
        if not all(isinstance(q, (int, float)) and 0 <= q <= 1 for q in quantiles):
            raise ValueError(f"quantiles are shares of the tries, between 0 and 1: got {quantiles!r}")
        quick = self.predict(collective, algorithm, p, n_bytes, ranks_busy)
        c = cost(collective, algorithm, p, n_bytes)
        busy = max(busy_ranks(collective, algorithm, p), ranks_busy or 0)
        steps = c.latency_rounds
        if step(collective, algorithm) == "one-way" and self.round_trip_delays:
            kinds = [(self.round_trip_delays, (steps + 1) // 2)]          # a round trip: two one-way steps
        elif self.pair_delays:
            kinds = [(self.pair_delays, steps // 2), (self.delays, steps % 2)]   # pairs, and a last lone step
        else:
            kinds = [(self.delays, steps)]
        kinds = [(delays, draws) for delays, draws in kinds if draws]
        if not steps or not all(delays for delays, _ in kinds) or (self.cores and busy > self.cores):
            return [quick for _ in quantiles]
        size = max(1.0, c.bytes / steps)                       # bytes a step, on average
        rng, tries = random.Random(0), []
        samples = [(delays[min(delays, key=lambda n: (abs(math.log2(n / size)), -n))], draws)   # ties: the larger
                   for delays, draws in kinds]
        tries = sorted(sum(rng.choice(sample) for sample, draws in samples for _ in range(draws)) for _ in range(4001))
        return [quick + tries[round(q * (len(tries) - 1))] for q in quantiles]

    def __str__(self):
        sigma = ", ".join(f"{self.sigma.get(k, 0) * 1e6:.0f} µs ({k})" for k in STEPS)
        return (f"α = {self.alpha * 1e6:.1f} µs, β = {self.beta * 1e9:.3f} ns/B ({self.bandwidth:.2f} GB/s) one way; "
                f"α₂ = {self.alpha2 * 1e6:.1f} µs, β₂ = {self.beta2 * 1e9:.3f} ns/B exchanging; "
                f"γ = {self.gamma * 1e9:.3f} ns/B; δ = {self.delta * 1e6:.0f} µs once; σ = {sigma} per step waiting for a core (c = {self.cores}); "
                f"μ = {self.mu * 1e9:.3f} ns/B fresh; "
                f"from {len(self.sizes)} sizes, {self.sizes[0]:,} to {self.sizes[-1]:,} bytes")


# ----------------------------------------------------------------------------------
# Fitting: pure arithmetic on timings


@dataclass
class Timings:
    """What measure() measured: the only input fit_timings() needs."""

    cores: int | None            # c (None: one GPU per rank, nothing shared)
    sizes: list                  # message sizes (bytes)
    one_way: list                # seconds, a ping-pong's round trip / 2, per size
    exchange: list               # seconds, two ranks sending to each other at once, per size
    add_per_byte: float          # γ: seconds per byte of a float32 add
    fresh_per_byte: float        # μ: seconds per byte of writing new memory, less writing old
    tiny_ranks: int              # ranks of the tiny steps below (2c), 0 if not measured
    tiny_steps: dict             # {kind of step: seconds per tiny step on tiny_ranks}
    start: float = 0.0           # δ: a 4-byte all-gather on 2 ranks (one swap), less exchange[0]
    exchange_tries: list = field(default_factory=list)   # per size, every single exchange's time (seconds)
    round_trips: list = field(default_factory=list)      # per size, every counted round trip of the ping-pong
    pair_tries: list = field(default_factory=list)       # per size, every try of two exchanges back to back


def fit_line(sizes, times):
    """α, β minimising the *relative* error Σ((α + βn - t)/t)²: small and large sizes count alike."""
    w = [1 / t ** 2 for t in times]
    sw, sn = sum(w), sum(wi * n for wi, n in zip(w, sizes))
    snn = sum(wi * n * n for wi, n in zip(w, sizes))
    st, snt = sum(wi * t for wi, t in zip(w, times)), sum(wi * n * t for wi, n, t in zip(w, sizes, times))
    det = sw * snn - sn * sn
    alpha, beta = (st * snn - sn * snt) / det, (sw * snt - sn * st) / det
    if alpha <= 0:                                # noise can push one below 0: fit the other alone
        alpha, beta = 0.0, snt / snn
    elif beta <= 0:
        alpha, beta = st / sw, 0.0
    return alpha, beta


def fit_timings(t: Timings) -> Fit:
    """Fit the model's parameters to measured (or made-up) timings. No ranks, no clock."""
    alpha, beta = fit_line(t.sizes, t.one_way)
    alpha2, beta2 = fit_line(t.sizes, t.exchange)
    delta, sigma = max(0.0, t.start), {}
    if t.cores and t.tiny_ranks > t.cores:      # a tiny step on b = 2c ranks takes s·α' + σ'·w (+ its share of δ)
        s, w, steps = t.tiny_ranks / t.cores, 1 - t.cores / t.tiny_ranks, 2 * (t.tiny_ranks - 1)
        sigma = {kind: max(0.0, (seconds - delta / steps - s * (alpha if kind == "one-way" else alpha2)) / w)
                 for kind, seconds in t.tiny_steps.items()}
    delays = {n: sorted(x - quick for x in tries) for n, quick, tries in zip(t.sizes, t.exchange, t.exchange_tries)}
    round_trip_delays = {n: sorted(x - 2 * half for x in tries) for n, half, tries in zip(t.sizes, t.one_way, t.round_trips)}
    pair_delays = {n: sorted(x - _quick(tries) for x in tries) for n, tries in zip(t.sizes, t.pair_tries) if tries}
    return Fit(alpha, beta, t.add_per_byte, list(t.sizes), list(t.one_way), alpha2, beta2, sigma,
               max(0.0, t.fresh_per_byte), t.cores, list(t.exchange), delta, delays, round_trip_delays,
               pair_delays)


# ----------------------------------------------------------------------------------
# Measuring: a few seconds on this machine


def _tries(fn, tries):
    """This rank's times of `tries` calls of fn, each started together on every rank."""
    times = []
    for _ in range(tries):
        dist.barrier()
        start = time.perf_counter()
        fn()
        _wait_for_gpu()
        times.append(time.perf_counter() - start)
    return times


def _wait_for_gpu():
    """Under NCCL a call returns before the GPU has finished: wait for it before reading the clock."""
    if device().type == "cuda":
        torch.cuda.synchronize()


def _slowest(times):
    """Each try's time on its slowest rank (every rank passes its own times of the same tries)."""
    slowest = torch.tensor(times, dtype=torch.float64, device=device())
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return slowest.tolist()


def _trimmed_mean(times):
    """The mean, not the median or the best, where ranks outnumber cores: a step then often
    waits a whole scheduler tick for its core, and only means add up step by step into a
    collective's mean time. The slowest tenth is left out: a rare burst from another
    program on a shared machine is not what the model is about."""
    return statistics.fmean(sorted(times)[:len(times) - len(times) // 10])


def _quick(times):
    """The lower quartile, where every rank has a core of its own: the time the algorithm
    takes when nothing gets in its way. A try is then either quick or, now and then, held up
    by a few milliseconds (a thread woken on a core that another thread holds, such as gloo's
    own I/O threads, waits for the next scheduler tick: 4 ms here). How often that happens
    changes from second to second, so a mean or even a median swings from run to run (2-3x
    on this machine); the quick quarter of tries does not."""
    return sorted(times)[(len(times) - 1) // 4]


def _measure_on_ranks(sizes, repeats, all_reduces=()):
    """On 2 ranks, alone on the machine as a 2-rank collective is: ping-pong and exchange,
    then an add and a write to fresh memory (rank 0). pplab.comm's own calls, as pplab.collectives
    makes them. all_reduces: (algorithm, bytes) of pplab all-reduces to time in the same rounds,
    for a comparison that a change of load between the fit and the clock cannot spoil."""
    rank = dist.get_rank()
    bufs = {n: [torch.zeros(n, dtype=torch.uint8, device=device()) for _ in range(2)] for n in sizes}

    def back_to_back(n):                           # several per try where they are short, so that the
        return BACK_TO_BACK if n <= 2 ** 18 else 1  # start (δ, measured apart) is not counted as α

    round_trips = {n: [] for n in sizes}           # on rank 0's clock, each round trip of each try

    def ping_pong(n):                              # 0 → 1, then 1 → 0
        for k in range(back_to_back(n)):
            start = time.perf_counter()
            (comm.send, comm.recv)[rank](bufs[n][0], 1 - rank)
            (comm.recv, comm.send)[rank](bufs[n][0], 1 - rank)
            if k or back_to_back(n) == 1:          # the first of several waited for the partner to start
                round_trips[n].append(time.perf_counter() - start)

    def swap(n):                                   # 0 → 1 and 1 → 0 at once, one per try: inside a
        # collective the partners reach each step a little apart (each has just sliced or added),
        # which costs more than the 8th of 8 swaps in a row
        collectives.sendrecv(bufs[n][0], 1 - rank, bufs[n][1], 1 - rank, None)

    def two_swaps(n):                              # two exchanges back to back, as a collective's steps
        # come (here with the reduce-scatter's add between): the second is held up more often
        # than a lone one (a third of the tries at 1 MB here, against one in eight), so a
        # collective's delays are drawn a pair of steps at a time
        swap(n)
        collectives.combine(bufs[n][0].view(torch.float32), bufs[n][1].view(torch.float32), "sum")
        swap(n)

    def lone_call(n):                              # δ: the smallest collective, one swap (all-gather on 2)
        collectives.all_gather_into_tensor(bufs[n][1], bufs[n][0])

    xs = {n: torch.ones(n // 4, device=device()) for _, n in all_reduces}

    def all_reduce(key):
        collectives.all_reduce(xs[key[1]], algorithm=key[0])
    bufs[4] = [torch.zeros(4, dtype=torch.uint8, device=device()), torch.zeros(8, dtype=torch.uint8, device=device())]
    # 4 tries a round of what is cheap: the ping-pongs, exchanges and all-reduces up to 16 MB,
    # whose medians and spread count (predict_median), not only their quick quarter
    tries = [(ping_pong, n) for n in sizes for _ in range(4 if n <= 2 ** 24 else 1)]
    tries += [(swap, n) for n in sizes for _ in range(4 if n <= 2 ** 24 else 1)] + [(lone_call, 4)] * 8
    tries += [(two_swaps, n) for n in sizes for _ in range(4 if n <= 2 ** 24 else 1)]
    tries += [(all_reduce, tuple(key)) for key in all_reduces for _ in range(4 if key[1] <= 2 ** 24 else 1)]
    with trace.paused(), collectives.unchecked():
        for run, n in tries:                       # a warm-up
            run(n)
        for kept in round_trips.values():
            kept.clear()
        # a new order each round (the same on every rank): a burst of load falls on all sizes,
        # and no size always follows the 64 MB ones while the kernel is still freeing them
        order = [key for r in range(repeats) for key in random.Random(r).sample(tries, len(tries))]
        mine = [t for run, n in order for t in _tries(lambda: run(n), 1)]
        times = {key: [] for key in tries}
        for key, t in zip(order, _slowest(mine)):
            times[key].append(t)
        # one message: half a round trip. Each is timed alone: one held up by a wait for a core
        # is then one slow round trip among quick ones, not a slow try of eight
        one_way = [_quick(round_trips[n]) / 2 for n in sizes]
        exchange = [_quick(times[swap, n]) for n in sizes]
        start = _quick(times[lone_call, 4]) - exchange[0]
        timed = {key: times[all_reduce, tuple(key)] for key in all_reduces}
    if rank:
        return None
    n = max(sizes) // 4                           # γ: a float32 add of the largest size, in place
    a, b = torch.rand(n, device=device()), torch.rand(n, device=device())
    add = min(_timed(lambda: a.add_(b)) for _ in range(repeats))
    n = FRESH_FROM // 4                           # μ: writing new memory (page faults), less writing memory in use
    old = torch.ones(n, device=device())
    new = min(_timed(lambda: torch.empty(n, device=device()).fill_(1.0)) for _ in range(3))
    old = min(_timed(lambda: old.fill_(1.0)) for _ in range(3))
    exchange_tries = [times[swap, n] for n in sizes]
    pair_tries = [times[two_swaps, n] for n in sizes]
    return one_way, exchange, add / (4 * a.numel()), (new - old) / (4 * n), start, device().type, \
        exchange_tries, [round_trips[n] for n in sizes], timed, pair_tries


def _tiny_steps_on_ranks(repeats):
    with trace.paused(), collectives.unchecked():
        steps = _tiny_steps(dist.get_rank(), dist.get_world_size(), repeats)
    return steps if dist.get_rank() == 0 else None


def _tiny_steps(rank, p, repeats):
    """{kind: seconds per step on all p ranks}, 4-byte messages, as many steps as a ring
    all-reduce on p; the kinds take turns, so a burst of load falls on all three."""
    tiny, got, steps = torch.zeros(1, device=device()), torch.zeros(1, device=device()), 2 * (p - 1)
    masks = [1 << k for k in range((p & -p).bit_length() - 1)]   # r ^ 1, r ^ 2, ... (p even: at least 1)

    def one_way():                                 # ranks 2i, 2i+1 pass a message back and forth
        for k in range(steps):
            (comm.send(tiny, rank ^ 1) if (rank + k) % 2 else comm.recv(got, rank ^ 1))

    def swap():                                    # partners r ^ 1, r ^ 2, r ^ 4, ... as in halving-doubling
        for k in range(steps):
            collectives.sendrecv(tiny, rank ^ masks[k % len(masks)], got, rank ^ masks[k % len(masks)], None)

    def ring():                                    # every rank sends right while receiving from the left
        for _ in range(steps):
            collectives.sendrecv(tiny, (rank + 1) % p, got, (rank - 1) % p, None)
    kinds = {"one-way": one_way, "swap": swap, "ring": ring}
    for run in kinds.values():                     # a warm-up
        run()
    mine = [t for _ in range(6 * repeats) for run in kinds.values() for t in _tries(run, 1)]
    slowest = _slowest(mine)
    return {kind: _trimmed_mean(slowest[i::len(kinds)]) / steps for i, kind in enumerate(kinds)}


def _timed(fn):
    start = time.perf_counter()
    fn()
    _wait_for_gpu()
    return time.perf_counter() - start


def measure(sizes=SIZES, repeats: int = 15, world_size: int | None = None, timeout: float = 300.0) -> Timings:
    """Time, on this machine: a ping-pong and a two-way exchange at each size, a float32 add,
    a write to fresh memory, and tiny steps of each kind (one-way, swap, ring) on 2c ranks
    (c = the cores we may use; skipped above 8 cores, where 2c processes would take longer
    than the rest together, and under NCCL, where each rank has a GPU of its own)."""
    return _measure(sizes, repeats, world_size, timeout)[0]


def _measure(sizes, repeats, world_size, timeout, all_reduces=()):
    """measure(), and the tries of all_reduces timed on the 2 ranks of the pairs, in their rounds."""
    cores = len(os.sched_getaffinity(0))
    if world_size is None:
        world_size = 2 * cores if cores <= 8 else 2
    # the pairs run on 2 ranks only: more processes would share the cores and slow every step,
    # which is the σ term's business, measured apart by the tiny steps on 2c ranks
    one_way, exchange, add, fresh, start, where, exchange_tries, round_trips, timed, pair_tries = launch(
        _measure_on_ranks, sizes, repeats, list(all_reduces), world_size=2, timeout=timeout)[0]
    tiny_steps = {}
    if where == "cuda":                           # NCCL, one process per GPU: no core is shared
        cores = None
    elif world_size > 2:
        tiny_steps = launch(_tiny_steps_on_ranks, repeats, world_size=world_size, timeout=timeout)[0]
    return Timings(cores, list(sizes), one_way, exchange, add, fresh, world_size if tiny_steps else 0, tiny_steps,
                   start, exchange_tries, round_trips, pair_tries), timed


def _time_on_ranks(sizes, algorithms, repeats):
    """Every (algorithm, size) takes turns, try by try, in a new order each round, so that a
    second of bad luck on the machine, or the kernel still freeing a 64 MB buffer, falls
    on all of them, not on one."""
    statistic = _quick if dist.get_world_size() <= len(os.sched_getaffinity(0)) or device().type == "cuda" \
        else _trimmed_mean
    with trace.paused(), collectives.unchecked():
        xs = {n: torch.ones(n // 4, device=device()) for n in sizes}
        keys = [(a, n) for n in sizes for a in algorithms for _ in range(4 if n <= 2 ** 18 else 1)]
        for a, n in keys:                          # a warm-up
            collectives.all_reduce(xs[n], algorithm=a)
        order = [key for r in range(repeats) for key in random.Random(r).sample(keys, len(keys))]
        mine = [t for a, n in order for t in _tries(lambda: collectives.all_reduce(xs[n], algorithm=a), 1)]
        times = {}
        for key, t in zip(order, _slowest(mine)):        # shuffled (the same on every rank): no
            times.setdefault(key, []).append(t)          # size always follows the 64 MB ones
        return {key: statistic(ts) for key, ts in times.items()}


def time_all_reduces(p: int, sizes, algorithms=("ring", "tree", "halving_doubling"), repeats: int = 5,
                     timeout: float = 600.0) -> dict:
    """{(algorithm, n_bytes): seconds} for pplab's all-reduces of float32 tensors on p ranks,
    measured as the model predicts them: over tries (4x as many up to 256 KB) of the slowest
    rank's time, the lower quartile where every rank has a core (see _quick), the mean
    (slowest tenth left out) where ranks outnumber cores (see _trimmed_mean); checks and
    tracing off. What a prediction is compared with."""
    return launch(_time_on_ranks, list(sizes), tuple(algorithms), repeats, world_size=p, timeout=timeout)[0]


def fit(world_size: int | None = None, sizes=SIZES, repeats: int = 15, timeout: float = 300.0) -> Fit:
    """measure() then fit_timings(): the model's parameters on this machine, in a few seconds.

    world_size: the ranks launched (default 2c, for the tiny ring that measures σ);
    sizes: the message sizes (bytes) of the ping-pong and the exchange; repeats: timed
    tries of each (their lower quartile counts; the tiny steps' mean)."""
    sizes = _checked(world_size, sizes, repeats)
    return fit_timings(measure(sizes, repeats, world_size, timeout))


def fit_and_time(n_bytes=(2 ** 20, 2 ** 22, 2 ** 24), algorithms=("ring",), world_size: int | None = None,
                 sizes=SIZES, repeats: int = 15, timeout: float = 300.0) -> tuple[Fit, dict]:
    """fit(), and pplab's all-reduces of float32 tensors of n_bytes on 2 ranks timed in the same
    rounds as the pairs the fit is made of, each try in a shuffled turn with theirs: a change of
    load on a shared machine then falls on both, not on the prediction only or the clock only.
    The fit never looks at these times. Returns (the fit, {(algorithm, n): every try's time,
    seconds, as long as its slowest rank}); checks and tracing off."""
    sizes = _checked(world_size, sizes, repeats)
    bad = [n for n in n_bytes if isinstance(n, bool) or not isinstance(n, int) or n < 8 or n % 8]
    if bad or not n_bytes:
        raise ValueError(f"n_bytes must be sizes of float32 tensors that 2 ranks split evenly (multiples of 8 bytes): got {bad or n_bytes}")
    for a in algorithms:
        cost("all_reduce", a, 2, 8)                # an unknown algorithm says which there are
    keys = [(a, n) for n in n_bytes for a in algorithms]
    timings, timed = _measure(sizes, repeats, world_size, timeout, keys)
    return fit_timings(timings), timed


def _checked(world_size, sizes, repeats):
    """The sizes, sorted, or a ValueError saying what to change."""
    sizes = sorted(int(n) for n in sizes)
    if world_size is not None and (isinstance(world_size, bool) or not isinstance(world_size, int)
                                   or world_size < 2):
        raise ValueError(f"a ping-pong needs two ranks: world_size must be >= 2, got {world_size!r}")
    if world_size is not None and world_size % 2:
        raise ValueError(f"the tiny steps pair the ranks up: world_size must be even, got {world_size}")
    if len(sizes) < 2 or sizes[0] < 4 or len(set(sizes)) < len(sizes):
        raise ValueError(f"fit needs at least two different message sizes of 4 bytes or more, got {sizes}")
    if not (isinstance(repeats, int) and repeats >= 1):
        raise ValueError(f"repeats must be a whole number >= 1, got {repeats!r}")
    return sizes
