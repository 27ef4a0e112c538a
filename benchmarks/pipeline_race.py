"""What the pipeline benchmarks share (pipeline.py, pipeline_torch_runtime.py, dualpipe.py): the
same MLP and batches on both sides, the same gradients checked from the same weights before any
timing, and rounds that alternate pplab's executor and torch's runtime, which goes first
changing from round to round, so that a change of load on a shared machine falls on both."""
import argparse
import statistics
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


def check_then_race(ours, ours_opt, theirs_opt, our_step, their_step, placed, data, steps, warmup, rounds):
    """The same gradients from the same weights (one step of each, nothing stepped), then the race:
    {"diff", "scale", "rounds"} for this rank. placed: as gradient_gap takes it."""
    our_step(*data[0], keep_grads=True)
    their_step(*data[0], keep_grads=True)
    diff, scale = gradient_gap(ours, placed)
    ours_opt.zero_grad(set_to_none=True)
    theirs_opt.zero_grad(set_to_none=True)
    return {"diff": diff, "scale": scale, "rounds": race(our_step, their_step, data, steps, warmup, rounds)}


def arguments(description, width, layers_per_stage, steps, warmup, rounds, batch=64, microbatches=8):
    """The command line every pipeline benchmark takes, with its own defaults."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--width", type=int, default=width)
    ap.add_argument("--layers-per-stage", type=int, default=layers_per_stage)
    ap.add_argument("--batch", type=int, default=batch)
    ap.add_argument("--microbatches", type=int, default=microbatches)
    ap.add_argument("--steps", type=int, default=steps)
    ap.add_argument("--warmup", type=int, default=warmup)
    ap.add_argument("--rounds", type=int, default=rounds)
    return ap.parse_args()


def report_times(results, rounds, ours_label, theirs_label):
    """ms per step of each side (median over rounds, min-max) and the ratio, each round's slowest rank."""
    per_round = slowest(results, rounds)
    ours, theirs = [a for a, _ in per_round], [b for _, b in per_round]
    ratios = [a / b for a, b in per_round]
    width = max(len(ours_label), len(theirs_label)) + 1
    for label, xs in ((ours_label, ours), (theirs_label, theirs)):
        print(f"{label + ':':<{width}} {statistics.median(xs) * 1e3:7.1f} ms/step "
              f"(min-max {min(xs) * 1e3:.1f}-{max(xs) * 1e3:.1f})")
    print(f"pplab / torch: {statistics.median(ours) / statistics.median(theirs):.2f}x of the medians; "
          f"per round {min(ratios):.2f}-{max(ratios):.2f}, median {statistics.median(ratios):.2f}")
