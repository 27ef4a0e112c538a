"""pplab's ring all-reduce against torch.distributed.all_reduce (gloo): same tensors, same launch.

For each number of ranks and each tensor size (1 KB to 64 MB, x4 steps), every rank runs
pplab.collectives.all_reduce(algorithm="ring") and dist.all_reduce on copies of the same
float32 data, one after the other (which goes first alternates), each after a barrier.
A try takes as long as its slowest rank; we report the median and the best of --repeats
tries after a warm-up, and the ratio ours / gloo (goal: below 2 from 1 MB up).
On a loaded machine the median carries other programs' noise, and ours more than gloo's:
our ring is 2(p-1) separate sends and receives, and a rank that waits on each one may
wait for the CPU each time, where gloo's all-reduce is one call. The best try is closer
to what the algorithms themselves cost.

Ours runs inside collectives.unchecked() (no argument exchange before each call) and
trace.paused() (nothing recorded): the algorithm and its messages only, as gloo's are.

Then the cost model against the clock: pplab.costfit fits its parameters from a few cheap
measurements (ping-pong, exchange, an add, a tiny ring; no all-reduce), and we time
pplab's ring, tree and halving_doubling all-reduces at p = 2, 4, 8 from 1 KB to 64 MB
(--repeats tries, 4x as many up to 256 KB, each as long as its slowest rank, in a new
order each round) and print measured / predicted. Measured is the lower quartile of the
tries where p <= cores (a try is quick or, at random, held up a scheduler tick; how often
changes from second to second, so a median swings 2-3x between runs) and the mean, slowest
tenth left out, beyond (where waiting for a core is part of every try, and means add up). Goal: within 1.5x where p <= cores, within 2x beyond. Run it at normal
priority; the load average printed with it says how busy the machine was.

Last, what a learner's cell shows: the median of the tries, at p = 2, 1 to 16 MB, against the
model's predicted median (Fit.predict_median: a delay per two steps drawn from the spread of the
fit's own pairs of exchanges timed back to back). costfit.fit_and_time times these all-reduces in the fit's own shuffled
rounds, 60 tries each, so a change of load falls on the prediction and the clock alike. Goal:
median / predicted median within 1.5x.

    python benchmarks/collectives.py [--ranks 2 4] [--max-size-mb 64] [--repeats 9]
                                     [--model-ranks 2 4 8] [--only-model] [--only-median]
"""
import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

import pplab
from pplab import collectives as C
from pplab import costfit, trace

MODEL_ALGORITHMS = ("ring", "tree", "halving_doubling")


def time_both(sizes, repeats):
    """On every rank: [(our times, gloo's times) per size], seconds, warm-up dropped."""
    rank, out = dist.get_rank(), []
    with trace.paused(), C.unchecked():
        for n in sizes:
            x = torch.randn(n // 4, generator=torch.Generator().manual_seed(rank))
            t = {"ours": torch.empty_like(x), "gloo": torch.empty_like(x)}
            runs = {"ours": lambda: C.all_reduce(t["ours"], algorithm="ring"),
                    "gloo": lambda: dist.all_reduce(t["gloo"])}
            times = {"ours": [], "gloo": []}
            for i in range(repeats + 1):
                for name in (("ours", "gloo") if i % 2 else ("gloo", "ours")):
                    t[name].copy_(x)
                    dist.barrier()
                    start = time.perf_counter()
                    runs[name]()
                    times[name].append(time.perf_counter() - start)
            if not torch.allclose(t["ours"], t["gloo"], rtol=1e-5, atol=1e-5):   # sums in another order
                raise AssertionError(f"{n} bytes: pplab's ring and gloo disagree")
            out.append((times["ours"][1:], times["gloo"][1:]))
    return out


def model_against_clock(ranks, sizes, repeats):
    """Fit (timed), then measure and print measured / predicted with the goal for each."""
    start = time.perf_counter()
    fit = costfit.fit()
    print(f"cost model fit in {time.perf_counter() - start:.1f} s: {fit}")
    print(f"goal: measured / predicted within 1.5x for p <= {fit.cores} cores, 2x beyond; "
          f"load average before: {os.getloadavg()[0]:.2f}")
    print(f"{'p':>3} {'size':>6} | " + " | ".join(f"{a:^27}" for a in MODEL_ALGORITHMS))
    print(f"{'':>10} | " + " | ".join(f"{'measured':>9} {'model':>8} {'ratio':>8}" for _ in MODEL_ALGORITHMS))
    inside = total = 0
    for p in ranks:
        measured = costfit.time_all_reduces(p, sizes, MODEL_ALGORITHMS, repeats)
        goal = 1.5 if p <= fit.cores else 2.0
        cells = {}
        for (algorithm, n), t in measured.items():
            ratio = t / fit.predict("all_reduce", algorithm, p, n)
            ok = 1 / goal <= ratio <= goal
            inside, total = inside + ok, total + 1
            cells[algorithm, n] = f"{t * 1e3:>9.2f} {t / ratio * 1e3:>8.2f} {ratio:>7.2f}{' ' if ok else '!'}"
        for n in sizes:
            print(f"{p:>3} {human(n):>6} | " + " | ".join(cells[a, n] for a in MODEL_ALGORITHMS))
        print(f"    load average after p = {p}: {os.getloadavg()[0]:.2f}")
    print(f"{inside} of {total} within the goal (! marks the others); times in ms")


def median_against_model(sizes, repeats):
    """What a learner's cell shows: the median of the tries at p = 2, against the model's predicted
    median (predict_median: the quick model plus a delay per two steps drawn from the spread of
    the fit's pairs of exchanges). fit_and_time times the all-reduces in the same rounds as the fit's own pairs."""
    start = time.perf_counter()
    load = os.getloadavg()[0]
    fit, tries = costfit.fit_and_time(sizes, MODEL_ALGORITHMS, repeats=repeats)
    print(f"\nmedian at p = 2 (fit and all-reduces in the same rounds, {time.perf_counter() - start:.1f} s, "
          f"{len(next(iter(tries.values())))} tries each; load average {load:.2f} before, "
          f"{os.getloadavg()[0]:.2f} after); goal: median / predicted median within 1.5x")
    print(f"{'size':>6} | " + " | ".join(f"{a:^34}" for a in MODEL_ALGORITHMS))
    print(f"{'':>6} | " + " | ".join(f"{'median':>8} {'predicted':>9} {'ratio':>6} {'quick':>7}" for _ in MODEL_ALGORITHMS))
    ratios = []
    for n in sizes:
        cells = []
        for a in MODEL_ALGORITHMS:
            median, predicted = statistics.median(tries[a, n]), fit.predict_median("all_reduce", a, 2, n)
            ratios.append(median / predicted)
            cells.append(f"{median * 1e3:>8.2f} {predicted * 1e3:>9.2f} {ratios[-1]:>5.2f}{' ' if 1 / 1.5 <= ratios[-1] <= 1.5 else '!'}"
                         f" {median / fit.predict('all_reduce', a, 2, n):>6.2f}x")
        print(f"{human(n):>6} | " + " | ".join(cells))
    inside = sum(1 / 1.5 <= r <= 1.5 for r in ratios)
    print(f"median / predicted median at p = 2: {min(ratios):.2f}-{max(ratios):.2f}, {inside} of {len(ratios)} within 1.5x "
          f"(quick: median / the quick model's prediction); times in ms")


def human(n):
    return f"{n // 2 ** 20} MB" if n >= 2 ** 20 else f"{n // 1024} KB"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--max-size-mb", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--model-ranks", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--only-model", action="store_true", help="skip the ring against gloo")
    ap.add_argument("--only-median", action="store_true", help="only the median at p = 2 against the model")
    args = ap.parse_args()
    sizes = [1024 * 4 ** k for k in range(20) if 1024 * 4 ** k <= args.max_size_mb * 2 ** 20]

    print(f"torch {torch.__version__}, gloo, {len(os.sched_getaffinity(0))} cores, one process per rank "
          f"(1 thread each); load average {os.getloadavg()[0]:.2f}")
    if not (args.only_model or args.only_median):
        ring_against_gloo(args.ranks, sizes, args.repeats)
    if not args.only_median:
        model_against_clock(args.model_ranks, sizes[::2], args.repeats)
    median_against_model([n for n in (2 ** 20, 2 ** 22, 2 ** 24) if n in sizes], 15)


def ring_against_gloo(ranks, sizes, repeats):
    print(f"{'':>12} | {'median of tries, ms':^31} | {'best try, ms':^31}")
    print(f"{'ranks':>5} {'size':>6} | {'pplab ring':>10} {'gloo':>9} {'ring/gloo':>10} | "
          f"{'pplab ring':>10} {'gloo':>9} {'ring/gloo':>10}")
    for p in ranks:
        results = pplab.launch(time_both, sizes, repeats, world_size=p, timeout=600)
        for k, n in enumerate(sizes):
            slowest = [[max(tries) for tries in zip(*(r[k][j] for r in results))] for j in (0, 1)]
            ours, gloo = (statistics.median(t) * 1e3 for t in slowest)
            ours_best, gloo_best = (min(t) * 1e3 for t in slowest)
            print(f"{p:>5} {human(n):>6} | {ours:>10.3f} {gloo:>9.3f} {ours / gloo:>10.2f} | "
                  f"{ours_best:>10.3f} {gloo_best:>9.3f} {ours_best / gloo_best:>10.2f}")
        print()


if __name__ == "__main__":
    main()
