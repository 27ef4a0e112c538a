"""Offload to disk: how much a step slows down when ZeRO's optimizer state lives on disk, measured
against the slowdown predicted from the bytes moved and this machine's fitted disk.

    ram          pplab.zero.ZeroOptimizer(stage=2): the optimizer state in RAM
    disk         pplab.zero.offload.DiskOffloadedZero(stage=2): on disk, written through (fsync) and
                 dropped from the page cache after each move, next shard read ahead on a thread
    no prefetch  the same, each shard read only when its turn comes
    page cache   drop_cache=False: the files' pages stay in the page cache, so "disk" is memory
    stage 3 ram  FullyShardedModule + ZeroOptimizer(stage=3): parameters sharded too, all in RAM
    stage 3 on disk  the same with DiskOffloadedZero(offload_params=fsdp): each unit's parameter shard
                 read from disk before its all-gathers (forward, backward) and by the step, written
                 back after it, with the optimizer state; its added time is taken against stage 3 ram

Every variant trains a copy of the same fp32 MLP with AdamW on p gloo ranks started by pplab.launch
(one step = forward, backward, optimizer step, zero_grad; the slowest rank's time, after a barrier).
After warm-up the variants take turns step by step, so drift in the machine's load hits all alike;
each variant's median step is reported, and the added time is its median minus ram's.

Predicted added time: pplab.zero.offload.fit_disk() (timed writes and reads of one file through the same
TensorFile moves, 64 KiB to 4 MiB, fitted t = latency + bytes/bandwidth, once written through and once
in the page cache), run on every rank at the same time before training, so that the fit sees the
disk shared as the step will; each rank's fit applied to the bytes and files it moves per step
(K·Ψ/N read and as many written, K = 8; at stage 3 on disk (3·4 + 8)Ψ/N read in 5 files per unit
and (4 + 8)Ψ/N written in 3), the slowest rank's prediction taken. The bytes each rank moved per step
are counted by the optimizer and checked against that formula (on the padded shard) here.

    python benchmarks/offload.py [--ranks 2] [--width 512] [--layers 4] [--batch 32] [--steps 12] [--bucket-mb 1]
"""
import argparse
import os
import statistics
import sys

import torch
import torch.distributed as dist

import pplab
from pplab.zero.offload import DiskOffloadedZero, disk_bytes_per_step, fit_disk, param_offload_bytes_per_step
from pplab.zero import FullyShardedModule, ZeroOptimizer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ddp import mlp, timed_step  # noqa: E402 - benchmarks/ddp.py, beside this script

VARIANTS = ("ram", "disk", "no prefetch", "page cache", "stage 3 ram", "stage 3 on disk")
BASE = {"disk": "ram", "no prefetch": "ram", "page cache": "ram", "stage 3 on disk": "stage 3 ram"}


def bench(width, layers, batch, steps, warmup, bucket_mb):
    rank = dist.get_rank()
    fits = {}
    for name, drop in (("disk", True), ("page cache", False)):
        dist.barrier()
        fits[name] = fit_disk(drop_cache=drop)
    torch.manual_seed(1 + rank)
    x, y = torch.randn(batch, width), torch.randn(batch, width)
    runs = {}
    for name in VARIANTS:
        model = mlp(width, layers)
        if name == "ram":
            opt = ZeroOptimizer(model.parameters(), torch.optim.AdamW, 2, bucket_cap_mb=bucket_mb, lr=1e-3)
        elif name.startswith("stage 3"):
            model = FullyShardedModule(model)              # one unit per Linear
            opt = (ZeroOptimizer(model.parameters(), torch.optim.AdamW, 3, lr=1e-3) if name == "stage 3 ram" else
                   DiskOffloadedZero(model.parameters(), torch.optim.AdamW, 3, offload_params=model, lr=1e-3))
        else:
            opt = DiskOffloadedZero(model.parameters(), torch.optim.AdamW, 2, bucket_cap_mb=bucket_mb, lr=1e-3,
                                    prefetch=name != "no prefetch", drop_cache=name != "page cache")
        runs[name] = (model, opt)
    times = {name: [] for name in VARIANTS}
    moved = {}
    for s in range(warmup + steps):
        for name in VARIANTS:
            model, opt = runs[name]
            took = timed_step(model, opt, x, y, set_to_none=True)
            if s >= warmup:
                times[name].append(took)
            if name in BASE:
                moved[name] = (opt.bytes_read, opt.bytes_written, len(opt.inner.files))
    shard = sum(b.shard_size for b in runs["ram"][1].buckets)
    units = runs["stage 3 ram"][0].units
    shard3 = sum(u.shard.numel() for u in units)
    for name in BASE:
        runs[name][1].close()
    psi = sum(q.numel() for q in runs["ram"][0].parameters())
    return {"times": times, "moved": moved, "shard": shard, "shard3": shard3, "units": len(units), "psi": psi,
            "fits": fits, "buckets": len(runs["ram"][1].buckets)}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--bucket-mb", type=float, default=1.0, help="bucket cap in MiB: one shard per bucket")
    a = ap.parse_args()
    p = a.ranks
    results = pplab.launch(bench, a.width, a.layers, a.batch, a.steps, a.warmup, a.bucket_mb, world_size=p,
                           timeout=600)
    for rank, r in enumerate(results):
        for name, f in r["fits"].items():
            print(f"rank {rank} fitted {name:10s}: read {f.read_bandwidth / 1e9:.2f} GB/s + "
                  f"{f.read_latency * 1e3:.2f} ms, write {f.write_bandwidth / 1e9:.2f} GB/s + "
                  f"{f.write_latency * 1e3:.2f} ms per file")
    r0 = results[0]
    psi, shard = r0["psi"], r0["shard"]
    formula = disk_bytes_per_step(psi, p)
    print(f"\nMLP width {a.width} x {a.layers} layers, Ψ = {psi:,}, {p} ranks, fp32 AdamW, ZeRO stage 2, "
          f"{a.bucket_mb:g} MiB buckets ({r0['buckets']} shards per rank); {a.steps} interleaved steps per variant")
    print(f"formula: 8Ψ/N = {formula / 1e6:.3f} MB read and written per rank per step "
          f"(padded shard {shard:,} elements: {8 * shard / 1e6:.3f} MB)")
    read3, written3 = param_offload_bytes_per_step(psi, p)
    print(f"stage 3 on disk: (3·4 + 8)Ψ/N = {read3 / 1e6:.3f} MB read, (4 + 8)Ψ/N = {written3 / 1e6:.3f} MB "
          f"written per rank per step ({r0['units']} units, padded shard {r0['shard3']:,} elements)")
    print(f"\n{'variant':15s} {'median step':>12s} {'spread (min-max)':>18s} {'added':>9s} {'predicted':>10s}  "
          f"bytes read / written per rank")
    for name in VARIANTS:
        t = r0["times"][name]
        med = statistics.median(t)
        line = f"{name:15s} {med * 1e3:9.1f} ms {min(t) * 1e3:7.1f}-{max(t) * 1e3:7.1f} ms"
        if name not in BASE:
            print(line)
            continue
        base = statistics.median(r0["times"][BASE[name]])
        kind = "page cache" if name == "page cache" else "disk"
        moved = [r["moved"][name] for r in results]
        if name == "stage 3 on disk":          # per unit: 2 shard reads + the step's 3 files; 3 files written
            for r, (read, written, _) in zip(results, moved):
                assert (read, written) == (20 * r["shard3"], 12 * r["shard3"]), (name, read, written, r["shard3"])
            predicted = max(r["fits"][kind].read_time(r["moved"][name][0], 5 * r["units"]) +
                            r["fits"][kind].write_time(r["moved"][name][1], 3 * r["units"]) for r in results)
            what = "= 20 / 12 x padded shard"
        else:
            for read, written, _ in moved:
                assert read == written == 8 * shard, (name, read, written, 8 * shard)
            predicted = max(r["fits"][kind].predict(*r["moved"][name]) for r in results)
            what = "= 8 x padded shard"
        print(f"{line} {(med - base) * 1e3:6.1f} ms {predicted * 1e3:7.1f} ms  "
              f"{moved[0][0] / 1e6:.3f} / {moved[0][1] / 1e6:.3f} MB ({what})")


if __name__ == "__main__":
    main()
