"""Does communication hide under compute? Read it from the trace; and a stand-in for an accelerator.

    steps = overlap_per_step(timeline.select(0))     # one StepOverlap per DDP backward of rank 0
    hooks = stand_in_compute(model, 0.004)            # each layer: 4 ms forward, 8 ms backward
    ...
    hooks.remove()

DDP (pplab.data_parallel) starts a bucket's all-reduce while backward goes on with the
earlier layers. Whether that pays depends on where backward runs:

* **On a CPU**, backward's math and the backend's communication threads (gloo's) share
  the same cores. With 2 ranks on 2 cores, an all-reduce started under backward takes
  cycles backward needed: backward stretches, and the step need not get shorter.
* **On a GPU**, backward runs on the GPU while the host's cores stay almost idle, and
  NCCL moves the bytes on its own CUDA streams (using a few of the GPU's SMs): the
  all-reduces really run beside backward, slowing it only a little.

`stand_in_compute` lets a CPU show the second case. As `PipelineExecutor`'s
`compute_time=` does in chapter 4, each layer computes for real and then sleeps until a
fixed time has passed. A sleeping rank leaves the cores to the communication threads, as
a rank whose GPU is busy would. The numbers computed are unchanged; only the clock moves.

`steps_in_turn` runs several variants (overlap on/off, bucket sizes) one step each in
turn, so that the machine's changing load hits all of them alike; `measured_steps` gives
each step's time, overlap and timeline, and `median_and_range` what repeats support saying.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from .. import trace
from ..stand_in import durations
from ..trace import union_length, now


@dataclass
class StepOverlap:
    """One synchronised step of one rank, read from its trace."""
    backward: float          # seconds from the first gradient hook to the end of backward ("B")
    comm: float              # seconds during which at least one all-reduce was in flight
    hidden: float            # the fraction of that time during which backward was still going
    exposed: float           # seconds from the end of backward until the last all-reduce finished
    all_reduces: int         # how many all-reduces (= buckets)
    payload: int             # bytes handed to the all-reduces (the whole gradient, once)


def overlap_per_step(events) -> list[StepOverlap]:
    """One StepOverlap per synchronised backward ("B" box) in one rank's `events`.

    A step's all-reduces are those starting after its backward began and before the next
    did. Several may be in flight at once (the backend queues them), so time in flight is
    the union of their boxes, not the sum."""
    backs = [e for e in events if e.kind == "B" and e.meta.get("sync", True)]
    ars = [e for e in events if e.kind == "all_reduce" and e.meta.get("bucket") is not None]
    steps = []
    for b, nxt in zip(backs, backs[1:] + [None]):
        mine = [a for a in ars if a.start >= b.start and (nxt is None or a.start < nxt.start)]
        flight = union_length([(a.start, a.end) for a in mine])
        under = union_length([(a.start, min(a.end, b.end)) for a in mine if a.start < b.end])
        steps.append(StepOverlap(b.duration, flight, under / flight if flight else 0.0,
                                 max([0.0] + [a.end - b.end for a in mine]), len(mine),
                                 sum(a.meta.get("payload", 0) for a in mine)))
    return steps


def median_and_range(values) -> tuple[float, float, float]:
    """(median, min, max): what a few noisy repeats support saying."""
    values = list(values)
    return statistics.median(values), min(values), max(values)


# ----------------------------------------------------------------------------------
# Variants taking turns, step by step


def steps_in_turn(trainers: dict, steps: int, warmup: int = 1) -> dict:
    """Run on every rank: each trainer (name -> function doing one training step) in turn,
    one step each, `warmup` + `steps` rounds, so that drift in the machine's load hits every
    variant alike. Returns {name: [(start, end, this rank's trace events), ...]} per step
    after the warm-up, on this rank's clock (one clock for all ranks of a machine)."""
    out = {name: [] for name in trainers}
    for round_ in range(warmup + steps):
        for name, step in trainers.items():
            dist.barrier()                          # every rank starts the step together
            before, start = len(trace.events()), now()
            step()
            if round_ >= warmup:
                out[name].append((start, now(), trace.events()[before:]))
    return out


@dataclass
class Step:
    seconds: float                   # from the first rank's start to the last rank's end
    overlap: StepOverlap | None      # rank 0's, read from its trace
    timeline: trace.Timeline         # this step alone, all ranks, time 0 at its start


def measured_steps(results, name: str) -> list[Step]:
    """The steps of variant `name`; results: what `steps_in_turn` returned on each rank, in rank
    order (the `pplab.launch` results of a function that returns it)."""
    steps = []
    for k in range(len(results[0][name])):
        start = min(r[name][k][0] for r in results)
        end = max(r[name][k][1] for r in results)
        events = [e for r in results for e in r[name][k][2]]
        mine = (overlap_per_step(results[0][name][k][2]) or [None])[0]     # None: no DDP backward
        steps.append(Step(end - start, mine, trace.Timeline(events, world_size=len(results), t0=start)))
    return steps


class _Hooks:
    def __init__(self, handles):
        self.handles = handles

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def stand_in_compute(model: nn.Module, compute_time) -> _Hooks:
    """Make each layer of `model` take a fixed time: a timed wait standing in for an accelerator.

    compute_time: as PipelineExecutor's: t_f seconds per forward of a layer (backward then
    2 t_f), or {"F": t_f, "B": t_b}. A layer is a module that owns parameters. Each layer
    computes for real, then sleeps until the stand-in accelerator is done with it; sleeping
    leaves the CPU to the backend's threads, as a rank whose GPU is busy leaves its cores.
    The accelerator runs the layers of a pass back to back, as kernels queued on a GPU do:
    layer k ends t_f (t_b) after layer k-1 ended, so host work in between (DDP flattening a
    bucket) overlaps it instead of adding to it. In backward the wait comes just before the
    layer's gradients are stored, so DDP sees each gradient when its layer is done.
    The numbers computed are unchanged. Returns an object whose .remove() takes the waits off.
    """
    if isinstance(compute_time, bool) or not isinstance(compute_time, (int, float, dict)):
        raise ValueError(f"stand_in_compute: compute_time must be seconds >= 0 per layer forward (e.g. 0.005), "
                         f"or a dict {{'F': t_f, 'B': t_b}}, got {compute_time!r}")
    pad = durations(compute_time)
    layers = [m for m in model.modules() if any(True for _ in m.parameters(recurse=False))]
    if not layers:
        raise ValueError(f"stand_in_compute: {type(model).__name__} has no parameters, so no layer to pad")
    busy_until = {}                     # "F"/"B": when the accelerator finishes the layers queued so far

    def queue(kind, layer_done):        # one more layer: it ends t after the accelerator is free
        busy_until[kind] = busy_until.get(kind, now()) + pad[kind]
        layer_done[kind] = busy_until[kind]

    def wait_until(t):
        time.sleep(max(0.0, t - now()))

    handles = [model.register_forward_pre_hook(lambda m, args: busy_until.clear())]   # a new pass
    for layer in layers:
        done = {}

        def forward_done(layer, args, out, done=done):
            wait_until(done["F"])
            if isinstance(out, torch.Tensor) and out.requires_grad:   # its gradient = backward starts here
                out.register_hook(lambda grad: queue("B", done))

        handles += [layer.register_forward_pre_hook(lambda m, args, done=done: queue("F", done)),
                    layer.register_forward_hook(forward_done)]
        for p in layer.parameters(recurse=False):       # runs before .grad is stored
            handles.append(p.register_hook(lambda grad, done=done: wait_until(done.get("B", 0.0))))
    return _Hooks(handles)

