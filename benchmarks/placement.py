"""TP inside a node vs TP across nodes: the tiny GPT at dp=2×tp=2 on 2 emulated nodes × 2 ranks.

Four gloo ranks (pplab.launch) grouped into 2 nodes of 2 (pplab.cluster.Cluster). The same
training step (pplab.hybrid.train, float64, DDP over dp) runs on two placements of the mesh:
order (dp, tp), tp innermost, each tp pair inside a node; and order (tp, dp), dp innermost, each tp
pair spanning both nodes. Between the nodes pplab.cluster.two_tier holds each message back to
`--bandwidth` bytes/s and `--latency` s. The placements take turns (pplab.planner.time_placements):
a warm-up round, then `--repeats` rounds of `--steps` steps each; a step's time is its slowest
rank's, a round's the median of its steps after the first. Printed: the median and range over
rounds, their ratio, the planner's prediction (the unthrottled step, measured the same way, plus
what pplab.planner.predict(..., cluster=, inter=) says the slow tier adds), and the bytes each
dimension sends between nodes per step (pplab.cluster.Placement of pplab.planner.step_traffic).

    python benchmarks/placement.py [--bandwidth 20e6] [--latency 4e-3] [--repeats 5] [--steps 4]
"""
import argparse
import math
import os
import statistics

import pplab
from pplab import costfit, planner
from pplab.cluster import Cluster, place
from pplab.planner import time_placements
from pplab.hybrid import GPTConfig

ORDERS = {"tp inside": ("dp", "tp"), "tp across": ("tp", "dp")}
SIZES, BATCH = dict(dp=2, tp=2), 8


def per_round(results):
    """{order: [median over a round's steps (the first left out) of the slowest rank's time]}"""
    return {o: [statistics.median(max(r[o][k][i] for r in results) for i in range(1, len(results[0][o][k])))
                for k in range(len(results[0][o]))] for o in results[0]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bandwidth", type=float, default=20e6)
    ap.add_argument("--latency", type=float, default=4e-3)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, default=4)
    a = ap.parse_args()
    c = Cluster(2, 2)
    cfg = GPTConfig(vocab=32, seq=16, hidden=32, heads=4, ffn=64, layers=2)
    print(f"load {os.getloadavg()[0]:.1f}; {c.n_nodes} nodes × {c.ranks_per_node} ranks; tiny GPT dp=2×tp=2, "
          f"batch {BATCH}, float64; between nodes {a.bandwidth / 1e6:g} MB/s, {a.latency * 1e3:g} ms")
    orders = list(ORDERS.values())
    fast = per_round(pplab.launch(time_placements, cfg, c, SIZES, orders, math.inf, 0.0, a.repeats, a.steps,
                                  world_size=c.world_size))
    slow = per_round(pplab.launch(time_placements, cfg, c, SIZES, orders, a.bandwidth, a.latency, a.repeats, a.steps,
                                  world_size=c.world_size))
    free, times = costfit.Fit(0.0, 0.0, 0.0, [1], [0.0]), planner.estimate(cfg)
    alone = planner.predict(cfg, planner.Layout(2, 2, 1), BATCH, free, times, dtype_bytes=8).time["total"]
    traffic = planner.step_traffic(cfg, planner.Layout(2, 2, 1), BATCH, dtype_bytes=8)
    med = {}
    for name, o in ORDERS.items():
        ts = slow[o]
        med[name] = statistics.median(ts)
        extra = planner.predict(cfg, planner.Layout(2, 2, 1, order=o), BATCH, free, times, dtype_bytes=8, cluster=c,
                                inter=(a.latency, 1 / a.bandwidth)).time["total"] - alone
        crossed = {d: round(b) for d, b in place(c, order=o, **SIZES).cross_node_bytes(traffic).items() if b}
        print(f"{name:>10}: median {med[name] * 1e3:7.1f} ms/step ({min(ts) * 1e3:.1f}-{max(ts) * 1e3:.1f}), "
              f"predicted {(statistics.median(fast[o]) + extra) * 1e3:7.1f} ms; unthrottled "
              f"{statistics.median(fast[o]) * 1e3:.1f} ms; bytes between nodes per step {crossed}")
    ratios = [round(x / y, 2) for x, y in zip(slow[ORDERS["tp across"]], slow[ORDERS["tp inside"]])]
    print(f"tp across / tp inside: {med['tp across'] / med['tp inside']:.2f}x; per-round ratios {ratios}")


if __name__ == "__main__":
    main()
