"""pplab's 1F1B executor against torch.distributed.pipelining's Schedule1F1B, same model, same batches.

4 ranks (gloo, one thread each) train the same 4-stage MLP, stage r = layers of rank r,
on the same batches, cut into the same micro-batches. Each round runs --steps training
steps (forward, backward, SGD step) with pplab's PipelineExecutor, then as many with
torch's PipelineStage + Schedule1F1B (which goes first alternates by round: pipeline_race.py), after --warmup steps of each; we report samples/s,
median over rounds, and the ratio torch / pplab (goal: pplab within 1.3x, i.e. >= 0.77).
Alternating in rounds keeps a machine whose load changes from favouring one of them.
Before timing, one step of each from the same weights must give the same gradients.

It also times the simulator on a large schedule: 1F1B with p=64 and m=4096 (make_schedule,
validate and simulate; benchmarks/simulator.py times more schedules, without launching ranks).

    python benchmarks/pipeline.py [--width 512] [--layers-per-stage 4] [--batch 64] [--microbatches 8]
"""
import os
import statistics

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B

import pplab
from pplab.pipeline import PipelineExecutor, make_schedule
from pipeline_race import arguments, batches, build, check_then_race, slowest, training_step
from simulator import time_schedule

P = 4


def run(width, per_stage, batch, m, steps, warmup, rounds):
    rank = dist.get_rank()
    data = batches(batch, width, 4)
    split = [2 * per_stage] * P                              # stage r = its Linear+ReLU pairs

    # pplab: every rank gets the full list and keeps its stage
    ours_layers = build(width, per_stage, P)
    ours_opt = torch.optim.SGD(nn.Sequential(*ours_layers).parameters(), lr=1e-3)
    ours = PipelineExecutor(make_schedule("1f1b", P, m), ours_layers, nn.MSELoss(), balance=split)

    # torch.distributed.pipelining: each rank builds its stage's module
    layers = build(width, per_stage, P)
    module = nn.Sequential(*layers[rank * 2 * per_stage:(rank + 1) * 2 * per_stage])
    theirs_opt = torch.optim.SGD(module.parameters(), lr=1e-3)
    stage = PipelineStage(module, rank, P, torch.device("cpu"))
    theirs = Schedule1F1B(stage, n_microbatches=m, loss_fn=nn.MSELoss())

    our_step = training_step(ours.step, ours_opt)

    def their_step(x, y):
        if rank == 0:
            theirs.step(x)
        elif rank == P - 1:
            theirs.step(target=y, losses=[])
        else:
            theirs.step()
    their_step = training_step(their_step, theirs_opt)

    return check_then_race(ours, ours_opt, theirs_opt, our_step, their_step, [(rank * 2 * per_stage, module)],
                           data, steps, warmup, rounds)


def main():
    args = arguments(__doc__.splitlines()[0], width=512, layers_per_stage=4, steps=10, warmup=3, rounds=5)
    print(f"torch {torch.__version__}, {os.cpu_count()} cores, {P} ranks (gloo, 1 thread each)"
          + (" - oversubscribed: more ranks than cores" if (os.cpu_count() or 1) < P else ""))
    print(f"model: {P} stages x {args.layers_per_stage} x (Linear({args.width}, {args.width}), ReLU), "
          f"batch {args.batch}, {args.microbatches} micro-batches, SGD; {args.rounds} rounds of "
          f"{args.steps} steps after {args.warmup} warm-up steps\n")

    results = pplab.launch(run, args.width, args.layers_per_stage, args.batch, args.microbatches,
                           args.steps, args.warmup, args.rounds, world_size=P, timeout=3600)
    diff = max(r["diff"] for r in results)
    scale = max(r["scale"] for r in results)
    print(f"same gradients from the same weights: max |pplab - torch| = {diff:.2e} (largest gradient {scale:.2e})")
    per_round = slowest(results, args.rounds)
    ours = statistics.median(args.batch / t for t, _ in per_round)
    theirs = statistics.median(args.batch / t for _, t in per_round)
    print(f"pplab PipelineExecutor (1f1b): {ours:8.1f} samples/s")
    print(f"torch Schedule1F1B:            {theirs:8.1f} samples/s")
    print(f"torch / pplab: {theirs / ours:.2f}x  (pplab reaches {ours / theirs:.0%} of torch's throughput)")
    print("per round (pplab, torch samples/s): "
          + ", ".join(f"({args.batch / a:.0f}, {args.batch / b:.0f})" for a, b in per_round))

    (made, validated, simulated), schedule, r = time_schedule("1f1b", 64, 4096)   # benchmarks/simulator.py
    wall, cpu = (made[j] + validated[j] + simulated[j] for j in (0, 1))
    print(f"\nsimulate 1f1b p=64, m=4096 ({sum(map(len, schedule.actions)):,} actions): make_schedule {made[0]:.2f} s, "
          f"validate {validated[0]:.2f} s, simulate {simulated[0]:.2f} s, total {wall:.2f} s wall, {cpu:.2f} s cpu "
          f"(goal: under 1 s of cpu, {'met' if cpu < 1 else 'not met'}); makespan {r.makespan:g} t_f, "
          f"utilisation {r.utilization:.1%}")


if __name__ == "__main__":
    main()
