"""Step time: pplab's DDP against torch.nn.parallel.DistributedDataParallel, same run.

Both wrap copies of the same MLP (~10M parameters by default), on the same local batch,
with p gloo ranks started by pplab.launch. One step = forward, backward (gradients
averaged over ranks), SGD step. Every rank starts each step after a barrier; a step's
time is the slowest rank's. After warm-up steps the two implementations take turns
step by step, so drift in the machine's load hits both alike; we report the median.
Goal: pplab DDP within 1.2x of torch DDP at bucket_cap_mb=25.

For pplab's DDP the trace also gives, per step, how much of the all-reduce time ran
under backward ("hidden") and how long the rank waited for communication after its
backward compute ended ("exposed").

    python benchmarks/ddp.py [--ranks 2] [--width 1120] [--layers 8] [--batch 64]
                             [--steps 15] [--caps 25 1 5 100] [--threads 1] [--stand-in T_F]

--stand-in T_F makes every layer's compute a timed wait (pplab.data_parallel.overlap.stand_in_compute),
standing in for an accelerator: the cores are left to gloo, as on a GPU they would be.
"""
import argparse
import copy
import os
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

import pplab
from pplab import trace
from pplab.data_parallel import DDP
from pplab.data_parallel.overlap import overlap_per_step, stand_in_compute


def mlp(width, layers):
    torch.manual_seed(0)
    mods = []
    for _ in range(layers):
        mods += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*mods[:-1])


def timed_step(model, opt, x, y, set_to_none=False):
    """One training step's time, the slowest rank's (benchmarks/zero.py uses it too)."""
    dist.barrier()
    start = time.perf_counter()
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    opt.zero_grad(set_to_none=set_to_none)
    took = torch.tensor([time.perf_counter() - start])
    dist.all_reduce(took, op=dist.ReduceOp.MAX)        # the step is as slow as its slowest rank
    return took.item()


def overlap_stats(events):
    """Median over steps of: the fraction of all-reduce time (in flight) under backward, and exposed wait."""
    steps = overlap_per_step(events)
    return (statistics.median(s.hidden for s in steps), statistics.median(s.exposed for s in steps))


def bench(width, layers, batch, steps, warmup, caps, stand_in=None):
    rank = dist.get_rank()
    torch.manual_seed(1 + rank)
    x, y = torch.randn(batch, width), torch.randn(batch, width)
    base = mlp(width, layers)

    def fresh():                                     # a copy of the same start, timed waits on if asked
        model = copy.deepcopy(base)
        if stand_in:
            stand_in_compute(model, stand_in)
        return model

    n_params = sum(p.numel() for p in base.parameters())

    theirs = nn.parallel.DistributedDataParallel(fresh(), bucket_cap_mb=25)
    variants = {"torch DDP": (theirs, torch.optim.SGD(theirs.parameters(), lr=1e-3))}
    for cap in caps:
        for overlap in ([True, False] if cap == caps[0] else [True]):
            ours = DDP(fresh(), bucket_cap_mb=cap, overlap=overlap)
            name = f"pplab DDP {cap:g} MB" + ("" if overlap else " no overlap")
            variants[name] = (ours, torch.optim.SGD(ours.parameters(), lr=1e-3))

    times = {name: [] for name in variants}
    stats = {}
    for name, (model, opt) in variants.items():      # warm-up: allocations, torch's bucket rebuild
        for _ in range(warmup):
            timed_step(model, opt, x, y)
    for _ in range(steps):                           # take turns, one step each
        for name, (model, opt) in variants.items():
            if isinstance(model, DDP):
                before = len(trace.events())
                times[name].append(timed_step(model, opt, x, y))
                stats.setdefault(name, []).extend(trace.events()[before:])
            else:
                times[name].append(timed_step(model, opt, x, y))
    medians = {name: statistics.median(t) for name, t in times.items()}
    buckets = {name: len(m.buckets) for name, (m, _) in variants.items() if isinstance(m, DDP)}
    return n_params, medians, {n: overlap_stats(ev) for n, ev in stats.items()}, buckets


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--width", type=int, default=1120)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batch", type=int, default=64, help="local batch per rank")
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--caps", type=float, nargs="+", default=[25, 1, 5, 100],
                    help="pplab bucket sizes in MiB; the first is also run with overlap=False")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--stand-in", type=float, default=None, metavar="T_F",
                    help="make each layer a timed wait of T_F s forward, 2 T_F backward, standing in for an "
                         "accelerator (pplab.data_parallel.overlap.stand_in_compute); try --stand-in 0.005 --batch 4")
    a = ap.parse_args()
    res = pplab.launch(bench, a.width, a.layers, a.batch, a.steps, a.warmup, a.caps, a.stand_in,
                       world_size=a.ranks, backend="gloo", threads_per_rank=a.threads, timeout=1200)
    n_params, medians, stats, buckets = res[0]
    print(f"torch {torch.__version__}, {os.cpu_count()} cores, {a.ranks} gloo ranks x {a.threads} thread(s); "
          f"MLP {a.layers} x Linear({a.width}, {a.width}) = {n_params / 1e6:.1f}M parameters "
          f"({n_params * 4 / 2**20:.0f} MiB of float32 gradients); local batch {a.batch}; "
          f"median of {a.steps} steps after {a.warmup} warm-up"
          + (f"; STAND-IN: each layer a timed wait of {a.stand_in * 1e3:g} ms forward, "
             f"{2 * a.stand_in * 1e3:g} ms backward" if a.stand_in else "") + "\n")
    ref = medians["torch DDP"]
    print(f"{'':28} {'buckets':>7} {'step ms':>8} {'vs torch':>8} {'AR hidden':>9} {'exposed ms':>10}")
    for name, t in medians.items():
        hid, exp = stats.get(name, (None, None))
        extra = f"{hid:>9.0%} {exp * 1e3:>10.1f}" if hid is not None else f"{'':>9} {'':>10}"
        print(f"{name:28} {buckets.get(name, ''):>7} {t * 1e3:>8.1f} {t / ref:>7.2f}x {extra}")


if __name__ == "__main__":
    main()
