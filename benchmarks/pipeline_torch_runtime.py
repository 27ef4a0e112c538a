"""pplab's executor against torch.distributed.pipelining's runtime on Looped BFS, same model, same batches.

4 ranks (gloo, one thread each), 2 stages per rank (stage = chunk * 4 + rank, 8 stages of
--layers-per-stage x (Linear, ReLU)), the same batches cut into the same micro-batches. Each
round runs --steps training steps (forward, backward, SGD step) with pplab's PipelineExecutor
on make_schedule("looped-bfs", 4, m, 2), then as many with torch's ScheduleLoopedBFS on the same
stages, the order of the two alternating from round to round, after --warmup steps of each. We
report seconds per step, median over rounds with the spread, and the ratio pplab / torch.
Before timing, one step of each from the same weights must give the same gradients, and the
two schedules must be the same order (pplab's rows equal torch's pipeline_order).

    python benchmarks/pipeline_torch_runtime.py [--width 256] [--layers-per-stage 2] [--batch 64] [--microbatches 8]
"""
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, ScheduleLoopedBFS

import pplab
from pipeline_race import arguments, batches, build, check_then_race, report_times, training_step
from pplab.pipeline import PipelineExecutor, make_schedule
from pplab.pipeline.torch_csv import from_torch_rows

P, V = 4, 2


def run(width, per_stage, batch, m, steps, warmup, rounds):
    rank = dist.get_rank()
    data = batches(batch, width, 4)
    schedule = make_schedule("looped-bfs", P, m, V)
    per = 2 * per_stage                                     # modules per stage

    # pplab: every rank gets the full list and keeps its two stages
    ours_layers = build(width, per_stage, P * V)
    ours_opt = torch.optim.SGD(nn.Sequential(*ours_layers).parameters(), lr=1e-3)
    ours = PipelineExecutor(schedule, ours_layers, nn.MSELoss(), balance=[per * V] * P)

    # torch: each rank builds its two stages' modules
    layers = build(width, per_stage, P * V)
    mine = schedule.stages_of(rank)
    modules = [nn.Sequential(*layers[s * per:(s + 1) * per]) for s in mine]
    theirs_opt = torch.optim.SGD([p for mod in modules for p in mod.parameters()], lr=1e-3)
    stages = [PipelineStage(mod, s, P * V, torch.device("cpu")) for mod, s in zip(modules, mine)]
    theirs = ScheduleLoopedBFS(stages, n_microbatches=m, loss_fn=nn.MSELoss())
    rows = [["" if a is None else str(a) for a in theirs.pipeline_order[r]] for r in range(P)]
    same_order = from_torch_rows(rows).actions == schedule.actions

    our_step = training_step(ours.step, ours_opt)

    def their_step(x, y):
        args = (x,) if 0 in mine else ()
        theirs.step(*args, target=y if P * V - 1 in mine else None)
    their_step = training_step(their_step, theirs_opt)

    return {"same_order": same_order, **check_then_race(ours, ours_opt, theirs_opt, our_step, their_step,
                                                        [(s * per, mod) for s, mod in zip(mine, modules)],
                                                        data, steps, warmup, rounds)}


def main():
    args = arguments(__doc__.splitlines()[0], width=256, layers_per_stage=2, steps=5, warmup=2, rounds=9)
    print(f"torch {torch.__version__}, {os.cpu_count()} cores, {P} ranks (gloo, 1 thread each)"
          + (" - oversubscribed: more ranks than cores" if (os.cpu_count() or 1) < P else "")
          + f", load average {os.getloadavg()[0]:.1f}")
    print(f"model: {P * V} stages ({V} per rank) x {args.layers_per_stage} x (Linear({args.width}, {args.width}), "
          f"ReLU), batch {args.batch}, {args.microbatches} micro-batches, SGD; {args.rounds} interleaved rounds "
          f"of {args.steps} steps after {args.warmup} warm-up steps\n")

    results = pplab.launch(run, args.width, args.layers_per_stage, args.batch, args.microbatches,
                           args.steps, args.warmup, args.rounds, world_size=P, timeout=3600)
    assert all(r["same_order"] for r in results), "pplab's looped-bfs is not torch's ScheduleLoopedBFS order"
    diff = max(r["diff"] for r in results)
    scale = max(r["scale"] for r in results)
    print(f"same order as torch's ScheduleLoopedBFS: yes; same gradients from the same weights: "
          f"max |pplab - torch| = {diff:.2e} (largest gradient {scale:.2e})")
    report_times(results, args.rounds, "pplab PipelineExecutor (looped-bfs)", "torch ScheduleLoopedBFS")

if __name__ == "__main__":
    main()
