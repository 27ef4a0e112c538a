"""pplab's ring all-reduce against torch.distributed.all_reduce (gloo): same tensors, same launch.

For each number of ranks and each tensor size (1 KB to 64 MB, x4 steps), every rank runs
pplab.collectives.all_reduce(algorithm="ring") and dist.all_reduce on copies of the same
float32 data, one after the other (which goes first alternates), each after a barrier.
A try takes as long as its slowest rank; we report the median and the best of --repeats
tries after a warm-up, the ratio ours / gloo (goal: below 2 from 1 MB up), and what the
α-β-γ model predicts for the ring from a ping-pong fit (pplab.costmodel.fit) made first.
On a loaded machine the median carries other programs' noise, and ours more than gloo's:
our ring is 2(p-1) separate sends and receives, and a rank that waits on each one may
wait for the CPU each time, where gloo's all-reduce is one call. The best try is closer
to what the algorithms themselves cost.

Ours runs inside collectives.unchecked() (no argument exchange before each call) and
trace.paused() (nothing recorded): the algorithm and its messages only, as gloo's are.

    python benchmarks/collectives.py [--ranks 2 4] [--max-size-mb 64] [--repeats 9]
"""
import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

import pplab
from pplab import collectives as C
from pplab import costmodel, trace


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


def human(n):
    return f"{n // 2 ** 20} MB" if n >= 2 ** 20 else f"{n // 1024} KB"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--max-size-mb", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=9)
    args = ap.parse_args()
    sizes = [1024 * 4 ** k for k in range(20) if 1024 * 4 ** k <= args.max_size_mb * 2 ** 20]

    print(f"torch {torch.__version__}, gloo, {os.cpu_count()} cores, one process per rank (1 thread each)")
    fit = costmodel.fit(sizes=sizes, repeats=2 * args.repeats)
    print(f"ping-pong fit: {fit}\n")
    print(f"{'':>12} | {'median of tries, ms':^31} | {'best try, ms':^31} | {'α-β-γ model':^20}")
    print(f"{'ranks':>5} {'size':>6} | {'pplab ring':>10} {'gloo':>9} {'ring/gloo':>10} | "
          f"{'pplab ring':>10} {'gloo':>9} {'ring/gloo':>10} | {'ms':>8} {'best/model':>11}")
    for p in args.ranks:
        results = pplab.launch(time_both, sizes, args.repeats, world_size=p, timeout=600)
        for k, n in enumerate(sizes):
            slowest = [[max(tries) for tries in zip(*(r[k][j] for r in results))] for j in (0, 1)]
            ours, gloo = (statistics.median(t) * 1e3 for t in slowest)
            ours_best, gloo_best = (min(t) * 1e3 for t in slowest)
            model = fit.predict("all_reduce", "ring", p, n) * 1e3
            print(f"{p:>5} {human(n):>6} | {ours:>10.3f} {gloo:>9.3f} {ours / gloo:>10.2f} | "
                  f"{ours_best:>10.3f} {gloo_best:>9.3f} {ours_best / gloo_best:>10.2f} | "
                  f"{model:>8.3f} {ours_best / model:>11.2f}")
        print()


if __name__ == "__main__":
    main()
