"""Cutting a model into pipeline stages: by parameter count, by measured time, or as given.

    partition(layers, 4)                          # 4 contiguous stages, parameters balanced
    partition(layers, schedule, "time", sample)   # one per stage of the schedule, time balanced
    partition(layers, schedule, [3, 5])           # layer counts per rank (split over its chunks)

`balanced_split` is the classic "linear partition": the cut that minimises the largest
stage, since a pipeline runs at the pace of its slowest stage.
"""
from __future__ import annotations

import math
import time
from itertools import accumulate

import torch
from torch import nn

from .actions import Schedule


class PipelineError(ValueError):
    """The model, the split or the inputs cannot run as a pipeline; the message says what to change."""


# ----------------------------------------------------------------------------------
# Cutting the model into stages


def _as_layers(layers) -> list[nn.Module]:
    layers = list(layers)
    for i, layer in enumerate(layers):
        if not isinstance(layer, nn.Module):
            raise PipelineError(f"layers[{i}] is a {type(layer).__name__}, not an nn.Module: "
                                f"give a list of layers or an nn.Sequential")
    return layers


def layer_times(layers, sample, repeats: int = 3) -> list[float]:
    """Seconds of forward + backward of each layer on `sample` (the best of `repeats`).

    On the CPU these are CPU seconds of this process (`time.process_time`): what the layer costs,
    whatever else shares the cores, as wall-clock time is not on a loaded machine. On a GPU they
    are wall-clock seconds, the device synchronised before each reading.
    Layer i runs on the output of layer i-1, as in the model. One round through all the layers
    warms up first (the first call of a layer allocates, and the first backward loads code), then
    `repeats` rounds. Gradients are taken with autograd.grad, so no .grad is left behind on the
    parameters.
    """
    layers = _as_layers(layers)
    on_gpu = sample.is_cuda

    def now():
        if on_gpu:
            torch.cuda.synchronize()
            return time.perf_counter()
        return time.process_time()
    best = [math.inf] * len(layers)
    for rnd in range(repeats + 1):                     # round 0 warms up and is not counted
        x = sample
        for i, layer in enumerate(layers):
            xin = x.detach().requires_grad_(x.is_floating_point())
            start = now()
            y = layer(xin)
            wrt = [t for t in [xin, *layer.parameters()] if t.requires_grad]
            if y.requires_grad and wrt:
                torch.autograd.grad(y, wrt, torch.ones_like(y), allow_unused=True)
            if rnd:
                best[i] = min(best[i], now() - start)
            x = y.detach()
    return best


def balanced_split(costs: list[float], k: int) -> list[int]:
    """Layer counts of k contiguous stages that make the costliest stage as cheap as possible.

    A pipeline runs at the pace of its slowest stage, so we minimise the maximum, not
    the spread. best[j][i] = lowest possible maximum when the first i layers form j stages.
    Among equal splits the later cut wins (the last stages, which also compute the loss, get the
    least), so a free layer (Tanh) stays with the layer before it.
    """
    n = len(costs)
    prefix = [0, *accumulate(costs)]
    best = [[math.inf] * (n + 1) for _ in range(k + 1)]
    cut = [[0] * (n + 1) for _ in range(k + 1)]
    best[0][0] = 0
    for j in range(1, k + 1):
        for i in range(j, n + 1):
            for c in range(j - 1, i):                  # the last stage is layers c..i-1
                cost = max(best[j - 1][c], prefix[i] - prefix[c])
                if cost <= best[j][i]:
                    best[j][i], cut[j][i] = cost, c
    counts, i = [], n
    for j in range(k, 0, -1):
        counts.append(i - cut[j][i])
        i = cut[j][i]
    return counts[::-1]


def _per_rank_counts(counts, schedule: Schedule) -> list[int]:
    """One layer count per rank -> one per stage: each rank's layers split evenly over its chunks."""
    v = schedule.chunks
    for r, c in enumerate(counts):
        if c % v:
            raise PipelineError(
                f"balance gives rank {r} {c} layers, which do not split into its {v} chunks: give each "
                f"rank a multiple of {v} layers, or one count per stage ({schedule.num_stages} values)")
    return [counts[r] // v for r in schedule.stage_to_rank]


def partition(layers, stages, balance="params", sample=None) -> list[tuple[int, int]]:
    """Cut `layers` into contiguous stages; return each stage's (start, end) layer indices.

    stages: the number of stages, or a Schedule (its num_stages = ranks x chunks).
    balance: "params" (equal parameter counts), "time" (equal forward + backward time,
        measured on `sample`, an input micro-batch), or a list of layer counts, one per
        stage (or, given a Schedule with chunks > 1, one per rank, split evenly over its chunks).
    """
    layers = _as_layers(layers)
    n = len(layers)
    schedule = stages if isinstance(stages, Schedule) else None
    k = schedule.num_stages if schedule else stages
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise PipelineError(f"the number of stages must be a positive integer, got {stages!r}")
    what = f"{k} stages ({schedule.num_ranks} ranks x {schedule.chunks} chunks)" \
        if schedule and schedule.chunks > 1 else f"{k} stages"
    if k > n:
        raise PipelineError(f"got {what} for {n} layers: every stage needs at least one layer; use at "
                            f"most {n} stages or split the model into more layers")
    if isinstance(balance, (list, tuple)):
        counts = list(balance)
        if not all(isinstance(c, int) and not isinstance(c, bool) and c >= 1 for c in counts):
            raise PipelineError(f"balance={counts}: each count must be a whole number of layers >= 1 "
                                f"(every stage needs at least one layer)")
        if schedule and schedule.chunks > 1 and len(counts) == schedule.num_ranks:
            counts = _per_rank_counts(counts, schedule)
        if len(counts) != k:
            per_rank = f", or one per rank ({schedule.num_ranks})" if schedule and schedule.chunks > 1 else ""
            raise PipelineError(f"balance lists {len(counts)} layer counts, but there are {what}: "
                                f"give one count per stage{per_rank}")
        if sum(counts) != n:
            raise PipelineError(f"balance={list(balance)} adds up to {sum(balance)} layers, but the model "
                                f"has {n}: make the counts add up to {n}")
    elif balance == "params":
        counts = balanced_split([sum(p.numel() for p in layer.parameters()) for layer in layers], k)
    elif balance == "time":
        if sample is None:
            raise PipelineError("balance='time' measures each layer on a sample input: pass "
                                "sample=<one micro-batch of inputs>")
        counts = balanced_split(layer_times(layers, sample), k)
    else:
        raise PipelineError(f"balance must be 'params', 'time' or a list of layer counts, got {balance!r}")
    ends = list(accumulate(counts))
    return [(end - c, end) for c, end in zip(counts, ends)]


