"""Hybrid parallelism at 4 ranks: the planner's predicted step time against measured, for every
layout; and pplab's dp=2×tp=2 against torch's own composition of the same model.

1. Planner. The tiny GPT (float32, AdamW) trains with pplab.hybrid in each layout of 4 ranks:
   dp=4, dp=2×tp=2, pp=2×dp=2 (DDP's all-reduce once after the flush), pp=2×tp=2,
   tp=4, pp=4 (1F1B, m = 2·pp micro-batches). A step's time is the slowest rank's, barrier to
   barrier; we report the median over steps after the first, the layouts taking turns round by
   round so that drift in the machine's load hits them alike (each mesh is built once). The
   prediction is `pplab.planner.predict` with per-layer times measured on one process
   (`planner.measure`), in three variants:
   A. each layer's time alone × ranks per core (4 ranks on 2 cores: 2); every collective priced
      by `costfit.fit()` (chapter 1's model of this machine) told that all 4 ranks are at work
      on the cores meanwhile (`ranks_busy`: its s and σ' terms), a pipeline hop as one message;
   B. the same, with compute × the slowdown `planner.calibrate` measures while the 4 ranks run
      a plain training step at once (other programs' load included): what notebook 07 shows;
   C. an older calibration, kept for comparison: compute × that slowdown, and the classic α-β
      model with α + the extra wait of a tiny all-reduce's latency round measured while every
      rank computes between collectives, β and γ × the slowdown.
   Goal: predicted/measured within 1.5× for every layout.

2. torch. The same dense model, dp=2×tp=2: torch's DTensor tensor parallelism
   (`parallelize_module` with ColwiseParallel qkv/fc1 and RowwiseParallel proj/fc2 on the "tp"
   dimension of a 2-D `DeviceMesh`; qkv's rows reordered so each rank's contiguous shard holds
   whole heads) and torch DDP over the "dp" dimension's group; embedding and head replicated
   (pplab splits them by vocabulary: 31 tokens, negligible work). gloo, CPU, one thread per rank.
   Steps alternate with pplab's in the same run. Goal: pplab's step time within 1.3× of torch's.

    python benchmarks/hybrid.py [--hidden 64] [--layers 4] [--seq 32] [--batch 16] [--rounds 3] [--steps 5]
"""
import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

import pplab
from pplab import costfit, data, hybrid, planner
from pplab.data_parallel import shard
from pplab.mesh import Mesh
from pplab.models.gpt import GPTConfig, gpt_layers, gpt_loss

LAYOUTS = [planner.Layout(4, 1, 1), planner.Layout(2, 2, 1), planner.Layout(2, 1, 2, m=4),
           planner.Layout(1, 2, 2, m=4), planner.Layout(1, 4, 1), planner.Layout(1, 1, 4, m=8)]


def slowest(times):
    """Per step, the slowest rank's time (every rank's list, gathered)."""
    t = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def torch_dp_tp(cfg, mesh, batch, steps, seed=0):
    """torch's DTensor TP inside DDP on a dp×tp DeviceMesh: step times of this rank."""
    from torch.distributed._composable.replicate import replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    tp = mesh["tp"].size()
    layers = gpt_layers(cfg, seed, torch.float32)
    for block in layers[1:-1]:
        attn, h = block.attn, cfg.hidden
        with torch.no_grad():        # rows (q|k|v, head, d) -> (rank, q|k|v, its heads, d): a contiguous shard = whole heads
            attn.qkv.weight.copy_(attn.qkv.weight.view(3, tp, -1, h).transpose(0, 1).reshape(3 * h, h))
            attn.qkv.bias.copy_(attn.qkv.bias.view(3, tp, -1).transpose(0, 1).reshape(-1))
        attn.heads //= tp            # each rank attends with its own heads
        parallelize_module(block, mesh["tp"], {"attn.qkv": ColwiseParallel(), "attn.proj": RowwiseParallel(),
                                               "mlp.fc1": ColwiseParallel(), "mlp.fc2": RowwiseParallel()})
    model = replicate(nn.Sequential(*layers), device_mesh=mesh["dp"])     # torch's DDP, composable, on the dp dim
    return timed_steps(model, steps, lambda step: shard(data.batch(batch, cfg.seq, step, seed), mesh.get_local_rank("dp"), 2))


def timed_steps(model, steps, batch_of):
    """Seconds of each training step (forward, backward, AdamW), barrier to barrier, on this rank."""
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    times = []
    for step in range(steps):
        x, y = batch_of(step)
        dist.barrier()
        start = time.perf_counter()
        gpt_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - start)
    return times


def run(cfg, batch, rounds, steps):
    """On every rank: the layouts and torch's dp×tp in turns; per layout, the slowest rank's step times.
    """
    torch.set_num_threads(1)
    out = {"contention": planner.contention(cfg, batch // 4)}       # what running at once adds, under this run's load
    out.update({L.name: [] for L in LAYOUTS})
    out["torch dp=2×tp=2"] = []
    out["pplab dp=2×tp=2"] = []
    # every mesh built once: process groups made anew on each call pile up, and later steps slow down
    meshes = {L: Mesh(dp=L.dp, tp=L.tp, pp=L.pp) for L in LAYOUTS}
    from torch.distributed.device_mesh import init_device_mesh
    torch_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    for _ in range(rounds):
        for L in LAYOUTS:
            r = hybrid.train(cfg, meshes[L], steps=steps, batch_size=batch,
                             microbatches=L.m if L.pp > 1 else None, zero=L.zero, dtype=torch.float32)
            out[L.name] += slowest(r["step_times"])[1:]
            if L == LAYOUTS[1]:                              # pplab's dp×tp, then torch's, back to back
                out["pplab dp=2×tp=2"] += slowest(r["step_times"])[1:]
                out["torch dp=2×tp=2"] += slowest(torch_dp_tp(cfg, torch_mesh, batch, steps))[1:]
    return {k: statistics.median(v) if k != "contention" else v for k, v in out.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    cfg = GPTConfig(vocab=len(data.VOCAB), seq=args.seq, hidden=args.hidden, heads=args.heads,
                    ffn=4 * args.hidden, layers=args.layers)
    cores = os.cpu_count() or 1
    print(f"tiny GPT {cfg}: {cfg.parameters():,} parameters, batch {args.batch}, float32, 4 ranks on {cores} cores")
    print(f"load average before: {os.getloadavg()[0]:.1f}")
    fit = costfit.fit()
    alone = planner.measure(cfg, samples=(1, args.batch), dtype=torch.float32)
    results = pplab.launch(run, cfg, args.batch, args.rounds, args.steps, world_size=4, timeout=1200)
    measured = results[0]
    fit_busy, slowdown = planner.calibrate(cfg, args.batch // 4, 4, fit, alone, [r["contention"] for r in results])
    print(f"cost model (costfit.fit()): {fit}\nwhile 4 ranks run at once (planner.calibrate): a latency "
          f"round waits {(fit_busy.alpha - fit.alpha) * 1e6:.0f} µs more; compute runs {slowdown:.2f}× slower than alone")
    over = max(1.0, 4 / cores)
    variants = {"A: one-process layer times × ranks per core; costfit.fit() with 4 ranks busy": (alone, fit, over),
                "B: compute slowdown measured while 4 ranks run at once; costfit.fit() with 4 ranks busy":
                    (alone, fit, slowdown),
                "C: compute slowdown and α measured while 4 ranks run at once (classic α-β)": (alone, fit_busy, slowdown)}
    for title, (times, f, o) in variants.items():
        preds = report(title, cfg, args.batch, measured, times, f, o)

    ours, theirs = measured["pplab dp=2×tp=2"], measured["torch dp=2×tp=2"]
    print(f"\n2. dp=2×tp=2, pplab {ours * 1e3:.2f} ms vs torch DTensor TP + DDP {theirs * 1e3:.2f} ms per step: "
          f"{ours / theirs:.2f}× (goal: within 1.3×): {'met' if ours / theirs <= 1.3 else 'NOT met'}")
    print(f"load average after: {os.getloadavg()[0]:.1f}")


def report(title, cfg, batch, measured, times, fit, over):
    preds = [planner.predict(cfg, L, batch, fit, times, 4, over) for L in LAYOUTS]
    print(f"\n1{title[0]}. predicted vs measured step time, {title[3:]}")
    print(f"{'layout':28s} {'predicted ms':>12s} {'measured ms':>12s} {'ratio':>6s}   prediction's parts (ms)")
    worst = 1.0
    for p in preds:
        m = measured[p.layout.name]
        ratio = p.time["total"] / m
        worst = max(worst, ratio, 1 / ratio)
        parts = ", ".join(f"{k} {v * 1e3:.2f}" for k, v in p.time.items() if k != "total" and v > 0)
        print(f"{p.layout.name:28s} {p.time['total'] * 1e3:12.2f} {m * 1e3:12.2f} {ratio:6.2f}   {parts}")
    print(f"worst ratio {worst:.2f}× (goal: within 1.5×): {'met' if worst <= 1.5 else 'NOT met'}")
    fastest_m = min(preds, key=lambda p: measured[p.layout.name]).layout.name
    fastest_p = min(preds, key=lambda p: p.time["total"]).layout.name
    slowest_m = max(preds, key=lambda p: measured[p.layout.name]).layout.name
    slowest_p = max(preds, key=lambda p: p.time["total"]).layout.name
    print(f"fastest measured: {fastest_m}; predicted: {fastest_p}. Slowest measured: {slowest_m}; predicted: {slowest_p}")
    return preds


if __name__ == "__main__":
    main()
