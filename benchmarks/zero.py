"""ZeRO: pplab's stages against torch's own, same model, same run: step time and memory per rank.

    stage 1   pplab ZeroOptimizer(stage=1)      vs  torch DDP + ZeroRedundancyOptimizer
    stage 2   pplab ZeroOptimizer(stage=2)      vs  the same torch stage-1 pair (torch has no stage 2 of its own
                                                    apart from FSDP's SHARD_GRAD_OP)
    (stages 1 and 2 at 25 MB buckets, torch DDP's default, and at 4 MB)
    stage 3   pplab FullyShardedModule          vs  FSDP2 fully_shard (each Linear, then the root)

Every variant trains copies of the same MLP with AdamW on the same local batch, on p gloo
ranks started by pplab.launch. One step = forward, backward, optimizer step (gradients
averaged over ranks), zero_grad. Every rank starts each step after a barrier; a step's time
is the slowest rank's. After warm-up the variants take turns step by step, so drift in the
machine's load hits all alike; we report the median.

Memory per rank: the bytes of model state each rank holds after a step (parameters,
gradients, optimizer state; every storage counted once, DTensors by their local shard),
next to the formula (4 + 4 + 8)Ψ / what each stage divides by N. Goals: time within 1.3x
of torch's, memory within 10% of the formula.

    python benchmarks/zero.py [--ranks 2 4] [--width 768] [--layers 6] [--batch 32] [--steps 10]
"""
import argparse
import copy
import os
import statistics

import torch
import torch.distributed as dist
from torch import nn

import pplab
from pplab.zero import FullyShardedModule, ZeroOptimizer, model_state_bytes

from ddp import mlp, timed_step  # noqa: E402 - benchmarks/ddp.py, beside this script


def local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def state_bytes(params, optimizer) -> int:
    """Bytes of the storages behind parameters, their gradients and the optimizer's per-element state."""
    seen, total = set(), 0
    params = list(params) + list(getattr(optimizer, "masters", []))   # ZeroOptimizer's shard gradients
    tensors = [local(p) for p in params] + [local(p.grad) for p in params if p.grad is not None]
    inner = getattr(optimizer, "inner", None) or getattr(optimizer, "optim", None) or optimizer
    tensors += [local(t) for st in inner.state.values() for t in st.values() if torch.is_tensor(t) and t.dim() > 0]
    for t in tensors:
        s = t.untyped_storage()
        if s.nbytes() and s.data_ptr() not in seen:
            seen.add(s.data_ptr())
            total += s.nbytes()
    return total


def bench(width, layers, batch, steps, warmup):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.optim import ZeroRedundancyOptimizer

    torch.manual_seed(1 + dist.get_rank())
    x, y = torch.randn(batch, width), torch.randn(batch, width)
    base = mlp(width, layers)
    hp = dict(lr=1e-4, weight_decay=0.01)
    variants = {}

    ddp = nn.parallel.DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=25)
    variants["torch DDP+ZeroRedundancyOpt"] = (ddp, ZeroRedundancyOptimizer(
        ddp.parameters(), optimizer_class=torch.optim.AdamW, **hp), list(ddp.parameters()))
    for stage in (1, 2):
        for cap in (25, 4):                         # torch's DDP default bucket size, and a smaller one
            m = copy.deepcopy(base)
            variants[f"pplab stage {stage}, {cap} MB buckets"] = (m, ZeroOptimizer(
                m.parameters(), torch.optim.AdamW, stage=stage, bucket_cap_mb=cap, **hp), list(m.parameters()))
    fs = copy.deepcopy(base)
    for layer in fs:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(fs)
    variants["torch FSDP2 fully_shard"] = (fs, torch.optim.AdamW(fs.parameters(), **hp), list(fs.parameters()))
    ours = FullyShardedModule(copy.deepcopy(base))
    variants["pplab stage 3"] = (ours, ZeroOptimizer(ours.parameters(), torch.optim.AdamW, stage=3, **hp),
                                 list(ours.parameters()))

    times, memory = {name: [] for name in variants}, {}
    for name, (model, opt, params) in variants.items():          # warm-up, then memory after a step
        for _ in range(warmup):
            timed_step(model, opt, x, y, set_to_none=True)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        memory[name] = state_bytes(params, opt)
        opt.zero_grad(set_to_none=True)
    with pplab.trace.paused():                      # pplab's trace costs little, but keep it out of the timing
        for _ in range(steps):                      # take turns, one step each
            for name, (model, opt, _) in variants.items():
                times[name].append(timed_step(model, opt, x, y, set_to_none=True))
    n_params = sum(p.numel() for p in base.parameters())
    return n_params, {n: statistics.median(t) for n, t in times.items()}, memory


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--width", type=int, default=768)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--batch", type=int, default=32, help="local batch per rank")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    a = ap.parse_args()
    for p in a.ranks:
        res = pplab.launch(bench, a.width, a.layers, a.batch, a.steps, a.warmup,
                           world_size=p, backend="gloo", threads_per_rank=1, timeout=1800)
        n_params, medians, memory = res[0]
        print(f"\ntorch {torch.__version__}, {os.cpu_count()} cores, {p} gloo ranks x 1 thread; MLP {a.layers} x "
              f"Linear({a.width}, {a.width}) = Ψ = {n_params / 1e6:.2f}M fp32 parameters; AdamW; local batch "
              f"{a.batch}; median of {a.steps} steps after {a.warmup} warm-up")
        print(f"{'':34} {'step ms':>8} {'vs torch':>8} {'state MiB/rank':>14} {'formula':>8} {'vs formula':>10}")
        refs = {1: "torch DDP+ZeroRedundancyOpt", 2: "torch DDP+ZeroRedundancyOpt", 3: "torch FSDP2 fully_shard"}
        for name, t in medians.items():
            stage = int(name.split("stage ")[1][0]) if name.startswith("pplab") else (3 if "FSDP" in name else 1)
            formula = model_state_bytes(stage, n_params, p, 4, 4, 8)
            ref = medians[refs[stage]]
            print(f"{name:34} {t * 1e3:>8.1f} {t / ref:>7.2f}x {memory[name] / 2**20:>14.2f} "
                  f"{formula / 2**20:>8.2f} {memory[name] / formula - 1:>+9.1%}")


if __name__ == "__main__":
    main()
