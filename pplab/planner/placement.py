"""Chapter 10d's experiment: one layout trained under each of several placements, on the emulated
two-tier network, the placements taking turns.

It puts chapter 7's hybrid training (`pplab.hybrid.train` on a `Mesh` numbered in a given order)
on chapter 10b's throttled link (`pplab.cluster.two_tier`), so it sits above both, here with the
planner that predicts the same placements (predict.py, by `pplab.cluster.place`).

    per_rank = pplab.launch(time_placements, cfg, Cluster(2, 2), {"dp": 2, "tp": 2}, orders,
                            bandwidth=20e6, latency=4e-3, world_size=4)
"""
from __future__ import annotations

from .. import collectives, trace
from ..cluster import Cluster, two_tier
from ..hybrid import train
from ..mesh import Mesh


def time_placements(cfg, cluster: Cluster, sizes: dict, orders: list, bandwidth: float, latency: float = 0.0,
                    repeats: int = 3, steps: int = 3, **train_options) -> dict:
    """On every rank (inside pplab.launch): pplab.hybrid.train of `cfg` on the mesh of `sizes`
    numbered along each order in `orders`, on the emulated network; {order: [this rank's step
    times, one list per repeat]}. The orders take turns (the first of each round alternating), so a
    change in the machine's load hits all alike; a first round warms up and is dropped. Every
    step's time is its slowest rank's: take the max over ranks."""
    meshes = {tuple(o): Mesh(order=o, **sizes) for o in orders}      # every rank makes every group
    out = {o: [] for o in meshes}
    with collectives.unchecked(), two_tier(cluster, bandwidth, latency), trace.paused():
        for i in range(repeats + 1):
            for o in (list(meshes) if i % 2 else list(meshes)[::-1]):
                took = train(cfg, meshes[o], steps=steps, **train_options)["step_times"]
                if i:
                    out[o].append(took)
    return out
