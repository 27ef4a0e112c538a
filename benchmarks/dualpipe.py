"""pplab's executor running DualPipeV against torch.distributed.pipelining's ScheduleDualPipeV.

4 ranks (gloo, one thread each) train the same MLP cut into 8 stages placed as a V (rank r holds
stages r and 7-r), on the same batches in the same micro-batches. pplab runs
make_schedule("dualpipev", 4, m), whose order is torch's action for action (asserted below);
torch runs its own PipelineStage pair + ScheduleDualPipeV. Before timing, one step of each from
the same weights must give the same gradients. Then rounds alternate: --steps steps of pplab,
then as many of torch (forward, backward, SGD); we print the median seconds per step over the
rounds, their spread, and the ratio pplab / torch.

    python benchmarks/dualpipe.py [--width 256] [--layers-per-stage 2] [--batch 64] [--microbatches 8]
"""
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, ScheduleDualPipeV
from torch.distributed.pipelining.schedules import _ComputationType as C

import pplab
from pipeline_race import arguments, batches, build, check_then_race, report_times, training_step
from pplab.pipeline import PipelineExecutor, make_schedule

P = 4
STAGES = 2 * P


def same_order(ours, theirs):
    """pplab's actions against torch's pipeline_order (overlapped pairs flattened), every rank."""
    kind = {C.FORWARD: "F", C.FULL_BACKWARD: "B", C.BACKWARD_INPUT: "I", C.BACKWARD_WEIGHT: "W"}
    for r in range(P):
        flat = []
        for a in theirs[r]:
            for sub in (a.sub_actions if a.computation_type == C.OVERLAP_F_B else (a,)):
                flat.append((kind[sub.computation_type], sub.microbatch_index, sub.stage_index))
        if flat != [(a.kind, a.microbatch, a.stage) for a in ours.actions[r]]:
            return False
    return True


def run(width, per_stage, batch, m, steps, warmup, rounds):
    rank = dist.get_rank()
    data = batches(batch, width, 4)
    schedule = make_schedule("dualpipev", P, m)
    n = 2 * per_stage                                         # layers per stage

    ours_layers = build(width, per_stage, STAGES)
    ours_opt = torch.optim.SGD(nn.Sequential(*ours_layers).parameters(), lr=1e-3)
    ours = PipelineExecutor(schedule, ours_layers, nn.MSELoss(), balance=[n] * STAGES)

    layers = build(width, per_stage, STAGES)
    mine = schedule.stages_of(rank)                           # [r, 2p-1-r]
    modules = [nn.Sequential(*layers[s * n:(s + 1) * n]) for s in mine]
    theirs_opt = torch.optim.SGD([p for mod in modules for p in mod.parameters()], lr=1e-3)
    stages = [PipelineStage(mod, s, STAGES, torch.device("cpu")) for mod, s in zip(modules, mine)]
    theirs = ScheduleDualPipeV(stages, n_microbatches=m, loss_fn=nn.MSELoss())
    order_ok = same_order(schedule, theirs.pipeline_order)

    our_step = training_step(ours.step, ours_opt)

    def their_step(x, y):
        if rank == 0:                                         # rank 0 holds the first and the last stage
            theirs.step(x, target=y, losses=[])
        else:
            theirs.step()
    their_step = training_step(their_step, theirs_opt)

    return {"order": order_ok, **check_then_race(ours, ours_opt, theirs_opt, our_step, their_step,
                                                 [(s * n, mod) for s, mod in zip(mine, modules)],
                                                 data, steps, warmup, rounds)}


def main():
    args = arguments(__doc__.splitlines()[0], width=256, layers_per_stage=2, steps=5, warmup=2, rounds=7)
    print(f"torch {torch.__version__}, {os.cpu_count()} cores, {P} ranks (gloo, 1 thread each), "
          f"load {os.getloadavg()[0]:.1f}" + (" - more ranks than cores" if (os.cpu_count() or 1) < P else ""))
    print(f"model: {STAGES} stages (a V over {P} ranks) x {args.layers_per_stage} x (Linear({args.width}, "
          f"{args.width}), ReLU), batch {args.batch}, {args.microbatches} micro-batches, SGD; {args.rounds} "
          f"rounds of {args.steps} steps each after {args.warmup} warm-up steps\n")
    results = pplab.launch(run, args.width, args.layers_per_stage, args.batch, args.microbatches,
                           args.steps, args.warmup, args.rounds, world_size=P, timeout=3600)
    assert all(r["order"] for r in results), "pplab's dualpipev order differs from torch's pipeline_order"
    diff, scale = max(r["diff"] for r in results), max(r["scale"] for r in results)
    print(f"same order as torch's pipeline_order on every rank; same gradients from the same weights: "
          f"max |pplab - torch| = {diff:.2e} (largest gradient {scale:.2e})")
    report_times(results, args.rounds, "pplab PipelineExecutor (dualpipev)", "torch ScheduleDualPipeV")

if __name__ == "__main__":
    main()
