"""Step time: pplab's tensor-parallel MLP block against torch's own tensor parallelism, same run.

torch: `parallelize_module(mlp, DeviceMesh("cpu", p), {"fc1": ColwiseParallel(),
"fc2": RowwiseParallel()})` (DTensor, functional collectives on gloo). pplab:
`ParallelMLP.from_dense(mlp)` (column -> GeLU -> row, pplab.comm traced collectives). Both split
copies of the same dense MLP h -> ffn -> h and run forward + backward of the same [s, b, h] input
(which needs its gradient, as inside a network: so both all-reduce once forward, once backward).
Every rank starts each step after a barrier; a step's time is the slowest rank's; after warm-up
the two take turns step by step and we report the median. The outputs and input gradients of the
two are checked equal (float32, atol 1e-4) before timing. Goal: pplab within 1.2x of torch.

    python benchmarks/tensor_parallel.py [--ranks 2 4] [--hidden 512] [--ffn 2048]
                                         [--seq 256] [--batch 4] [--steps 15] [--threads 1]
"""
import argparse
import copy
import os
import statistics
import time

import torch
import torch.distributed as dist

import pplab
from pplab.tensor_parallel.transformer import MLP, ParallelMLP


def timed_step(model, x, up):
    dist.barrier()
    start = time.perf_counter()
    x.grad = None
    (model(x) * up).sum().backward()
    took = torch.tensor([time.perf_counter() - start])
    dist.all_reduce(took, op=dist.ReduceOp.MAX)        # a step is as slow as its slowest rank
    return took.item()


def bench(hidden, ffn, seq, batch, steps, warmup):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    base = MLP(hidden, ffn)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    theirs = parallelize_module(copy.deepcopy(base), mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    ours = ParallelMLP.from_dense(base)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(seq, batch, hidden, generator=g).requires_grad_()
    up = torch.randn(seq, batch, hidden, generator=g)

    check = {}
    for name, model in (("torch", theirs), ("pplab", ours)):
        x.grad = None
        y = model(x)
        (y * up).sum().backward()
        check[name] = (torch.as_tensor(y).detach().clone(), x.grad.clone())
    same = all(torch.allclose(a, b, atol=1e-4) for a, b in zip(check["torch"], check["pplab"]))

    variants = {"torch TP": theirs, "pplab TP": ours}
    for model in variants.values():
        for _ in range(warmup):
            timed_step(model, x, up)
    times = {name: [] for name in variants}
    for _ in range(steps):                              # take turns, one step each
        for name, model in variants.items():
            with pplab.trace.paused():
                times[name].append(timed_step(model, x, up))
    return same, {name: statistics.median(t) for name, t in times.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--ffn", type=int, default=2048)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    a = ap.parse_args()
    print(f"torch {torch.__version__}, {os.cpu_count()} cores, gloo x {a.threads} thread(s) per rank; "
          f"MLP {a.hidden} -> {a.ffn} -> {a.hidden}, input [s={a.seq}, b={a.batch}, h={a.hidden}] float32; "
          f"forward + backward, median of {a.steps} steps after {a.warmup} warm-up\n")
    print(f"{'ranks':>5} {'torch TP ms':>11} {'pplab TP ms':>11} {'pplab/torch':>11}  same result")
    for p in a.ranks:
        same, med = pplab.launch(bench, a.hidden, a.ffn, a.seq, a.batch, a.steps, a.warmup,
                                 world_size=p, backend="gloo", threads_per_rank=a.threads, timeout=1200)[0]
        ratio = med["pplab TP"] / med["torch TP"]
        print(f"{p:>5} {med['torch TP'] * 1e3:>11.1f} {med['pplab TP'] * 1e3:>11.1f} {ratio:>10.2f}x  {same}")


if __name__ == "__main__":
    main()
