"""What activation recomputation costs in time: a step of N transformer blocks with no, selective
and full recomputation (pplab.recompute), on one process.

Each round times --steps steps (forward + backward) of each policy, in turn, after --warmup steps
of each; we report the median seconds per step over the rounds, their spread (min-max), the ratio
to no recomputation, and beside it what the count of FLOPs predicts (full: 4/3, one more forward;
selective: 1 + q·kᵀ's share) and the bytes kept for backward. Alternating in rounds keeps a machine
whose load changes from favouring one policy. Before timing, one step of each must give the same
gradients as no recomputation, bit for bit.

    python benchmarks/recompute.py [--seq 256] [--batch 2] [--hidden 256] [--heads 8] [--blocks 4]
"""
import argparse
import statistics
import time

import torch
from torch import nn

from pplab.memory import saved_activations
from pplab.recompute import POLICIES, flops, recompute_layers
from pplab.sequence_parallel import MegatronBlock
from pplab.tensor_parallel.transformer import TransformerBlock


def build(args, policy):
    torch.manual_seed(0)
    blocks = [MegatronBlock.from_dense(TransformerBlock(args.hidden, args.heads, 4 * args.hidden), dropout=0.1,
                                       sequence_parallel=False) for _ in range(args.blocks)]
    return nn.Sequential(*recompute_layers(blocks, policy))


def step(model, x):
    torch.manual_seed(1)
    model(x).sum().backward()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    torch.set_num_threads(1)
    x = torch.randn(args.seq, args.batch, args.hidden, requires_grad=True)
    models = {policy: build(args, policy) for policy in POLICIES}

    grads = {}
    for policy, model in models.items():                 # the same gradients first, or timing is moot
        model.zero_grad()
        x.grad = None
        step(model, x)
        grads[policy] = [x.grad.clone()] + [p.grad.clone() for p in model.parameters()]
    for policy in POLICIES:
        assert all(torch.equal(u, v) for u, v in zip(grads[policy], grads["none"])), policy

    counted = {policy: flops(step, model, x) for policy, model in models.items()}
    kept = {}
    for policy, model in models.items():
        with saved_activations(model.parameters()) as saved:
            y = model(x)
        kept[policy] = saved.bytes
        del y

    times = {policy: [] for policy in POLICIES}
    for policy, model in models.items():
        for _ in range(args.warmup):
            step(model, x)
    for _ in range(args.rounds):
        for policy, model in models.items():
            start = time.perf_counter()
            for _ in range(args.steps):
                step(model, x)
            times[policy].append((time.perf_counter() - start) / args.steps)

    base = statistics.median(times["none"])
    print(f"{args.blocks} blocks, s={args.seq}, b={args.batch}, h={args.hidden}, a={args.heads}, float32, "
          f"1 thread; median of {args.rounds} interleaved rounds of {args.steps} steps")
    print(f"{'policy':10s} {'s/step':>8s} {'min-max':>15s} {'time ratio':>10s} {'FLOP ratio':>10s} {'bytes kept':>12s}")
    for policy in POLICIES:
        t = statistics.median(times[policy])
        print(f"{policy:10s} {t:8.4f} {min(times[policy]):7.4f}-{max(times[policy]):.4f} {t / base:10.3f} "
              f"{counted[policy] / counted['none']:10.3f} {kept[policy]:12,}")


if __name__ == "__main__":
    main()
