"""Launch-to-first-all-reduce: pplab.launch against torch.multiprocessing.spawn, same run.

For each world size, both launchers start `p` gloo ranks on this machine; each rank
joins the process group, does one all-reduce of a 1 KB tensor and notes the time.
We report (a) the time from the call until the last rank's all-reduce finished and
(b) the time until the call returned, median over --repeats runs, and the ratio
spawn / pplab (> 1 means pplab is faster). Goal: at least 5x at 4 ranks.

Then the stall line: --launches (100) launches of 4 ranks in a row, each timed from the
call until it returned: median, p95 and max. Goal: max < 0.5 s on a 2-core machine (the
5 s stall, one launch in ten, came from reverse DNS lookups inside torch's TCPStore; see
pplab/runtime/rank_main.py).

    python benchmarks/launch.py [--sizes 2 4 8] [--repeats 5] [--launches 100]
"""
import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as tmp

import pplab
from pplab.runtime.launcher import _free_port


def first_all_reduce():
    t = torch.ones(256)
    dist.all_reduce(t)
    return time.perf_counter()          # CLOCK_MONOTONIC: one clock for all processes here


def spawn_worker(rank, world_size, port, queue):
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    queue.put(first_all_reduce())
    dist.barrier()
    dist.destroy_process_group()


def time_pplab(p):
    start = time.perf_counter()
    done = pplab.launch(first_all_reduce, world_size=p)
    return max(done) - start, time.perf_counter() - start


def time_spawn(p):
    queue = tmp.get_context("spawn").SimpleQueue()
    start = time.perf_counter()
    tmp.spawn(spawn_worker, args=(p, _free_port(), queue), nprocs=p, join=True)
    returned = time.perf_counter() - start
    return max(queue.get() for _ in range(p)) - start, returned


def launches_in_a_row(n, p=4):
    """Seconds per launch of `p` ranks, `n` launches back to back."""
    times = []
    for _ in range(n):
        start = time.perf_counter()
        pplab.launch(first_all_reduce, world_size=p)
        times.append(time.perf_counter() - start)
    return times


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--launches", type=int, default=100)
    args = ap.parse_args()
    print(f"torch {torch.__version__}, {os.cpu_count()} cores, median of {args.repeats} runs\n")
    print(f"{'ranks':>5} | {'pplab: first AR':>15} {'returned':>9} | {'mp.spawn: first AR':>18} "
          f"{'returned':>9} | {'ratio (first AR)':>16} {'ratio (returned)':>16}")
    for p in args.sizes:
        ours = [time_pplab(p) for _ in range(args.repeats)]
        theirs = [time_spawn(p) for _ in range(args.repeats)]
        o_ar, o_ret = (statistics.median(x) for x in zip(*ours))
        t_ar, t_ret = (statistics.median(x) for x in zip(*theirs))
        print(f"{p:>5} | {o_ar:>14.3f}s {o_ret:>8.3f}s | {t_ar:>17.3f}s {t_ret:>8.3f}s | "
              f"{t_ar / o_ar:>15.1f}x {t_ret / o_ret:>15.1f}x")
    times = sorted(launches_in_a_row(args.launches))
    p95 = times[min(len(times) - 1, round(0.95 * (len(times) - 1)))]
    print(f"\n{args.launches} launches of 4 ranks in a row: median {statistics.median(times):.3f} s, "
          f"p95 {p95:.3f} s, max {times[-1]:.3f} s (goal: max < 0.5 s)")


if __name__ == "__main__":
    main()

