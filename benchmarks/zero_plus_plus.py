"""ZeRO-3 vs ZeRO++ training steps on an emulated two-tier network: 2 nodes × 2 ranks.

Four gloo ranks (pplab.launch) grouped into 2 nodes of 2 (pplab.cluster.Cluster); between the
nodes pplab.cluster.two_tier holds each message back to `--bandwidth` bytes/s and `--latency` s.
Both wrappers train the same MLP (fp32 master shards, bf16 compute: the paper's fp16 weights and
gradients on the wire) with SGD: ZeroPlusPlus with all three switches off (ZeRO-3: ring
all-gathers and ring reduce-scatter) and with all three on (qwZ int8 weights, hpZ, qgZ int4
gradients). They take turns step by step (the first of each pair alternating), after one
warm-up pair; a step's time is its slowest rank's. Printed: median and range of each, their
ratio, and the bytes that crossed between nodes per step (from the trace) next to
pplab.zero.plusplus.predict_cross_node_bytes, with their ratio, all from the same run.

    python benchmarks/zero_plus_plus.py [--hidden 1024] [--bandwidth 20e6] [--latency 1e-3] [--repeats 7]
"""
import argparse
import math
import os
import statistics

import torch
import torch.distributed as dist
from torch import nn

import pplab
from pplab import collectives, trace
from pplab.cluster import Cluster, cross_node_bytes, two_tier
from pplab.trace import Timeline, now
from pplab.zero.plusplus import ZeroPlusPlus, predict_cross_node_bytes

CLUSTER = Cluster(2, 2)
SETTINGS = {"ZeRO-3": dict(qwz=False, hpz=False, qgz=False), "ZeRO++": dict(qwz=True, hpz=True, qgz=True)}


def model(width, hidden):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, width))


def steps(width, hidden, bandwidth, latency, repeats):
    """On every rank: {name: [seconds per step]}, {name: cross-node bytes this rank sent per step}, padded sizes."""
    torch.manual_seed(dist.get_rank())
    x, y = torch.randn(8, width), torch.randn(8, width)
    wrapped = {name: ZeroPlusPlus(model(width, hidden), CLUSTER, compute_dtype=torch.bfloat16, **flags)
               for name, flags in SETTINGS.items()}
    opts = {name: torch.optim.SGD(w.parameters(), lr=1e-3) for name, w in wrapped.items()}
    times, crossed = {name: [] for name in SETTINGS}, {}
    with collectives.unchecked(), two_tier(CLUSTER, bandwidth, latency):
        for i in range(repeats + 1):                  # the first pair warms up and is dropped
            for name in (list(SETTINGS) if i % 2 else list(SETTINGS)[::-1]):
                dist.barrier()
                trace.reset(dist.get_rank())
                start = now()
                nn.functional.mse_loss(wrapped[name](x).float(), y).backward()
                opts[name].step()
                opts[name].zero_grad()
                if i:
                    times[name].append(now() - start)
                crossed[name] = cross_node_bytes(Timeline(trace.events()), CLUSTER, rank=dist.get_rank())
    return times, crossed, [u.bucket.padded for u in wrapped["ZeRO++"].layers]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--bandwidth", type=float, default=20e6)
    ap.add_argument("--latency", type=float, default=1e-3)
    ap.add_argument("--repeats", type=int, default=7)
    a = ap.parse_args()
    runs = pplab.launch(steps, a.width, a.hidden, a.bandwidth, a.latency, a.repeats, world_size=CLUSTER.world_size)
    padded = runs[0][2]
    print(f"load {os.getloadavg()[0]:.1f}; {CLUSTER.n_nodes} nodes × {CLUSTER.ranks_per_node} ranks; MLP "
          f"{a.width}-{a.hidden}-{a.width}, {sum(padded):,} parameters (bf16 on the wire); between nodes "
          f"{a.bandwidth / 1e6:g} MB/s, {a.latency * 1e3:g} ms")
    med, crossed = {}, {}
    for name, flags in SETTINGS.items():
        ts = [max(t) for t in zip(*(r[0][name] for r in runs))]
        med[name] = statistics.median(ts)
        crossed[name] = sum(r[1][name] for r in runs)
        predicted = predict_cross_node_bytes(padded, CLUSTER, 2, **flags)["total"]
        assert crossed[name] == predicted, f"{name}: {crossed[name]} bytes crossed, the formula says {predicted}"
        print(f"{name:>7}: step median {med[name] * 1e3:7.1f} ms ({min(ts) * 1e3:.1f}-{max(ts) * 1e3:.1f}); "
              f"cross-node bytes per step {crossed[name]:,} (formula {predicted:,})")
    print(f"ZeRO-3 / ZeRO++: time {med['ZeRO-3'] / med['ZeRO++']:.2f}x, cross-node bytes "
          f"{crossed['ZeRO-3'] / crossed['ZeRO++']:.2f}x")


if __name__ == "__main__":
    main()
