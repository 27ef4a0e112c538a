"""Flat ring vs hierarchical all-reduce on an emulated two-tier network: 2 nodes × 2 ranks.

Four gloo ranks (pplab.launch) are grouped into 2 nodes of 2 (pplab.cluster.Cluster). Inside
a node messages go at this machine's speed; between nodes pplab.cluster.two_tier holds each
message back to `--bandwidth` bytes/s and `--latency` s. Both all-reduces run on the same
float32 tensor, taking turns (the first of each pair alternating), after one warm-up pair;
a run's time is its slowest rank's. Printed: the median and range of each, their ratio, the
bytes that crossed between nodes (from the trace), and the two-tier α-β prediction of
pplab.cluster.predict_all_reduce, with the fast tier measured by the same runs unthrottled.

    python benchmarks/two_tier.py [--numel 1000000] [--bandwidth 50e6] [--latency 1e-3] [--repeats 7]
"""
import argparse
import math
import os
import statistics

import pplab
from pplab.cluster import Cluster, predict_all_reduce, time_all_reduces


def slowest(results, name):
    return [max(ts) for ts in zip(*(r[name] for r in results))]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--numel", type=int, default=1_000_000)
    ap.add_argument("--bandwidth", type=float, default=50e6)
    ap.add_argument("--latency", type=float, default=1e-3)
    ap.add_argument("--repeats", type=int, default=7)
    a = ap.parse_args()
    c, nbytes = Cluster(2, 2), 4 * a.numel
    print(f"load {os.getloadavg()[0]:.1f}; {c.n_nodes} nodes × {c.ranks_per_node} ranks; {nbytes / 1e6:.1f} MB "
          f"float32; between nodes {a.bandwidth / 1e6:g} MB/s, {a.latency * 1e3:g} ms")
    fast = pplab.launch(time_all_reduces, c, a.numel, math.inf, 0.0, a.repeats, world_size=4)
    slow = pplab.launch(time_all_reduces, c, a.numel, a.bandwidth, a.latency, a.repeats, world_size=4)
    # the fast tier as one β (α folded in): the unthrottled flat ring sends 2(p-1)/p·N per rank
    beta_in = statistics.median(slowest(fast, "flat")) / (2 * 3 / 4 * nbytes)
    intra, inter = (0.0, beta_in), (a.latency, 1 / a.bandwidth)
    med = {}
    for name in ("flat", "hierarchical"):
        ts = slowest(slow, name)
        med[name] = statistics.median(ts)
        pred = predict_all_reduce(nbytes, c, intra, inter, name)
        print(f"{name:>13}: median {med[name] * 1e3:7.1f} ms ({min(ts) * 1e3:.1f}-{max(ts) * 1e3:.1f}), "
              f"predicted {pred * 1e3:7.1f} ms")
    print(f"flat / hierarchical: {med['flat'] / med['hierarchical']:.2f}x; "
          f"per-round ratios {[round(f / h, 2) for f, h in zip(slowest(slow, 'flat'), slowest(slow, 'hierarchical'))]}")
    print(f"fast tier (unthrottled): flat {statistics.median(slowest(fast, 'flat')) * 1e3:.1f} ms, "
          f"hierarchical {statistics.median(slowest(fast, 'hierarchical')) * 1e3:.1f} ms; β_intra {beta_in * 1e9:.2f} ns/B")


if __name__ == "__main__":
    main()
