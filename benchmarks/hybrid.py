"""Hybrid parallelism at 4 ranks: the planner's predicted step time against measured, for every
layout; and pplab's dp=2×tp=2 against torch's own composition of the same model.

1. Planner. The tiny GPT (float32, AdamW) trains with pplab.hybrid in each layout of 4 ranks:
   dp=4, dp=2×tp=2, pp=2×dp=2 (ZeRO-1: the hybrid runs DDP only without a pipeline), pp=2×tp=2,
   tp=4, pp=4 (1F1B, m = 2·pp micro-batches). A step's time is the slowest rank's, barrier to
   barrier; we report the median over steps after the first, the layouts taking turns round by
   round so that drift in the machine's load hits them alike. The prediction is
   `pplab.planner.predict` from α, β fitted here (`costmodel.fit()`), per-layer times measured
   here on one process (`planner.measure`), and oversubscription = ranks per core (4 ranks on
   2 cores run compute at half speed). Goal: predicted/measured within 1.5× for every layout.

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
from pplab import costmodel, data, hybrid, planner
from pplab.data_parallel import shard
from pplab.models.gpt import GPTConfig, gpt_layers, gpt_loss

LAYOUTS = [planner.Layout(4, 1, 1), planner.Layout(2, 2, 1), planner.Layout(2, 1, 2, m=4, zero=1),
           planner.Layout(1, 2, 2, m=4), planner.Layout(1, 4, 1), planner.Layout(1, 1, 4, m=8)]


def slowest(times):
    """Per step, the slowest rank's time (every rank's list, gathered)."""
    t = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def torch_dp_tp(cfg, batch, steps, seed=0):
    """torch's DTensor TP inside DDP on a dp×tp DeviceMesh: step times of this rank."""
    from torch.distributed._composable.replicate import replicate
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
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
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    times = []
    for step in range(steps):
        x, y = shard(data.batch(batch, cfg.seq, step, seed), mesh.get_local_rank("dp"), 2)
        dist.barrier()
        start = time.perf_counter()
        gpt_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - start)
    return times


def busy_alpha(n_bytes, repeats=50):
    """Mean time of a ring all-reduce's latency round on 2-rank groups while all 4 ranks run them:
    with more ranks than cores a partner is often off its core, and a message waits for its time slice."""
    group = next(g for g in [dist.new_group([0, 1]), dist.new_group([2, 3])] if dist.get_rank() in
                 dist.get_process_group_ranks(g))
    x = torch.zeros(n_bytes // 4)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(repeats):
        dist.all_reduce(x, group=group)
    return (time.perf_counter() - start) / repeats / 2          # a 2-rank ring: A = 2 rounds


def run(cfg, batch, rounds, steps):
    """On every rank: the layouts and torch's dp×tp in turns; per layout, the slowest rank's step times.
    First, as all ranks run at once: per-layer times (planner.measure) and a collective's round."""
    torch.set_num_threads(1)
    out = {"layer_times": planner.measure(cfg, samples=(1, batch), dtype=torch.float32, statistic=statistics.median),
           "busy_alpha": busy_alpha(1024)}
    out.update({L.name: [] for L in LAYOUTS})
    out["torch dp=2×tp=2"] = []
    out["pplab dp=2×tp=2"] = []
    for _ in range(rounds):
        for L in LAYOUTS:
            r = hybrid.train(cfg, {"dp": L.dp, "tp": L.tp, "pp": L.pp}, steps=steps, batch_size=batch,
                             microbatches=L.m if L.pp > 1 else None, zero=L.zero, dtype=torch.float32)
            out[L.name] += slowest(r["step_times"])[1:]
            if L == LAYOUTS[1]:                              # pplab's dp×tp, then torch's, back to back
                out["pplab dp=2×tp=2"] += slowest(r["step_times"])[1:]
                out["torch dp=2×tp=2"] += slowest(torch_dp_tp(cfg, batch, steps))[1:]
    return {k: statistics.median(v) if isinstance(v, list) else v for k, v in out.items()}


def median_times(per_rank):
    """Each number of the ranks' LayerTimes, the median over ranks."""
    fields = ("forward_fixed", "forward_per_sample", "backward_fixed", "backward_per_sample", "saved")
    med = {f: [statistics.median(col) for col in zip(*(getattr(t, f) for t in per_rank))] for f in fields}
    return planner.LayerTimes(**med, optimizer=statistics.median(t.optimizer for t in per_rank),
                              source="measured on all 4 ranks at once (median over ranks)")


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
    fit = costmodel.fit()
    alone = planner.measure(cfg, samples=(1, args.batch), dtype=torch.float32)
    results = pplab.launch(run, cfg, args.batch, args.rounds, args.steps, world_size=4, timeout=1200)
    measured, busy = results[0], median_times([r["layer_times"] for r in results])
    alpha = statistics.median(r["busy_alpha"] for r in results)
    fit_busy = costmodel.Fit(alpha, fit.beta, fit.gamma, fit.sizes, fit.times)
    print(f"cost model (ping-pong, 2 ranks): {fit}\nα of a round while 4 ranks run at once: {alpha * 1e6:.0f} µs")
    over = max(1.0, 4 / cores)
    variants = {"A: one-process layer times × ranks per core, ping-pong α": (alone, fit, over),
                "B: layer times and α measured while 4 ranks run at once": (busy, fit_busy, 1.0)}
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
    print(f"fastest measured: {fastest_m}; fastest predicted: {fastest_p}")
    return preds


if __name__ == "__main__":
    main()
