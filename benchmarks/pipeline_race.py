"""What the pipeline benchmarks share (pipeline.py, pipeline_torch_runtime.py, dualpipe.py): the
same MLP and batches on both sides, the same gradients checked from the same weights before any
timing, and rounds that alternate pplab's executor and torch's runtime, which goes first
changing from round to round, so that a change of load on a shared machine falls on both."""
import time

import torch
import torch.distributed as dist
from torch import nn

import pplab


def build(width, per_stage, stages):
    """stages x per_stage x (Linear(width, width), ReLU), the same weights on every call."""
    torch.manual_seed(0)
    return [m for _ in range(stages * per_stage) for m in (nn.Linear(width, width), nn.ReLU())]


def batches(n, width, count):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(n, width, generator=g), torch.randn(n, width, generator=g)) for _ in range(count)]


def training_step(step, optimizer):
    """step(x, y) then SGD; keep_grads=True leaves the gradients to compare and steps nothing."""
    def run(x, y, keep_grads=False):
        step(x, y)
        if not keep_grads:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return run


def gradient_gap(executor, placed):
    """Largest |pplab - torch| over this rank's gradients, and the largest gradient. placed: (index of
    the module's first layer in the whole model, torch's stage module) for each stage of this rank."""
    ours = dict(executor.named_parameters())
    pairs = [(ours[f"{first + int(k.split('.')[0])}.{k.split('.', 1)[1]}"].grad, p.grad)
             for first, module in placed for k, p in module.named_parameters()]
    return max((a - b).abs().max().item() for a, b in pairs), max(b.abs().max().item() for _, b in pairs)


def race(our_step, their_step, data, steps, warmup, rounds):
    """[(pplab, torch) seconds per step] for each round, on this rank, after `warmup` steps of each."""
    def timed(step_fn):
        dist.barrier()
        start = time.perf_counter()
        for k in range(steps):
            step_fn(*data[k % len(data)])
        dist.barrier()
        return (time.perf_counter() - start) / steps

    for k in range(warmup):
        our_step(*data[k % len(data)])
        their_step(*data[k % len(data)])
    out = []
    for k in range(rounds):
        with pplab.trace.paused():                  # keep the trace from growing
            if k % 2 == 0:
                a = timed(our_step)
                b = timed(their_step)
            else:
                b = timed(their_step)
                a = timed(our_step)
        out.append((a, b))
    return out


def slowest(results, rounds):
    """Each round's (pplab, torch) seconds per step on its slowest rank: a step lasts until all are done."""
    return [(max(r["rounds"][k][0] for r in results), max(r["rounds"][k][1] for r in results))
            for k in range(rounds)]
