"""Ring attention against the naive baseline that all-gathers K/V: time and K/V memory per rank.

Same shapes, same run, p gloo ranks started by pplab.launch. One step = forward and
backward of attention over a sequence of S tokens sharded over the ranks (S/p each):

* ring:     `pplab.sequence_parallel.ring_attention.ring_attention`: K/V blocks go round the ring, sends
            overlapped with each block's compute; dK/dV travel back round it;
* gathered: `gathered_kv_attention`: all-gather K and V (the backend's all-gather), attend
            to the whole sequence, reduce-scatter dK/dV;
* gathered K/V + torch SDPA: the same all-gather (chapter 3's, reduce-scatter in backward),
            then torch's own fused attention kernel: what the plain-arithmetic versions give up;
* Ulysses:  `pplab.sequence_parallel.ulysses_attention` for comparison (all-to-all by heads,
            then torch's attention kernel).

Every rank starts each step after a barrier; a step's time is the slowest rank's. After
warm-up the methods take turns step by step, so drift in the machine's load hits them
alike; we report the median. K/V memory per rank is the peak of the bytes of K and V
that the rank holds during forward (its own block, blocks in flight, gathered copies),
read from the trace's memory events, next to the closed forms: ring min(3, p)·N_kv,
gathered (p+1)·N_kv, N_kv = one rank's K and V. Goal: ring's K/V memory ≈ 1/p of
gathered, time within 1.5x of gathered.

    python benchmarks/sequence_parallel.py [--ranks 4] [--seq 2048] [--heads 8] [--head-dim 64]
                                           [--steps 7] [--warmup 1] [--threads 1]
"""
import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import pplab
from pplab import trace
from pplab.sequence_parallel.ring_attention import gathered_kv_attention, pieces, ring_attention, shard_sequence
from pplab.sequence_parallel import ulysses_attention
from pplab.tensor_parallel import gather_from_sequence_parallel


def gathered_sdpa(q, k, v, causal=False, layout="contiguous"):
    """All-gather K and V along the sequence (chapter 3's operator: reduce-scatter in backward),
    then torch's scaled_dot_product_attention with the causal mask of this layout's positions."""
    p, r = dist.get_world_size(), dist.get_rank()
    k_all, v_all = (gather_from_sequence_parallel(t, dim=-2) for t in (k, v))
    mask = None
    if causal:
        pos = [torch.cat([torch.arange(a, b) for a, b in runs]) for runs in pieces(q.shape[-2] * p, p, layout)]
        mask = pos[r][:, None] >= torch.cat(pos)[None, :]
    return F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask)


def timed_step(fn, q, k, v, do, **kw):
    dist.barrier()
    trace.reset(dist.get_rank())
    start = time.perf_counter()
    fn(q, k, v, **kw).backward(do)
    took = torch.tensor([time.perf_counter() - start])
    dist.all_reduce(took, op=dist.ReduceOp.MAX)        # the step is as slow as its slowest rank
    peak = max([0] + [e.value for e in trace.events() if e.category == "memory"])
    return took.item(), peak


def bench(seq, heads, head_dim, steps, warmup, causal):
    torch.manual_seed(0)
    layout = "zigzag" if causal else "contiguous"
    Q, K, V, dO = (torch.randn(1, heads, seq, head_dim) for _ in range(4))
    q, k, v, do = (shard_sequence(t, None, layout) for t in (Q, K, V, dO))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    methods = {"gathered K/V": (gathered_kv_attention, {"layout": layout}),
               "ring": (ring_attention, {"layout": layout}),
               "gathered + SDPA": (gathered_sdpa, {"layout": layout})}
    if heads % dist.get_world_size() == 0 and not causal:
        methods["Ulysses"] = (ulysses_attention, {})
    times = {name: [] for name in methods}
    peaks = {}
    for name, (fn, kw) in methods.items():
        for _ in range(warmup):
            timed_step(fn, q, k, v, do, causal=causal, **kw)
    for _ in range(steps):
        for name, (fn, kw) in methods.items():
            t, peaks[name] = timed_step(fn, q, k, v, do, causal=causal, **kw)
            times[name].append(t)
    return {name: statistics.median(t) for name, t in times.items()}, peaks, k.numel() * k.element_size() * 2


def kv_peaks(seq, heads, head_dim):
    """One causal zigzag forward+backward of each method: this rank's peak K/V bytes."""
    torch.manual_seed(0)
    q, k, v, do = (shard_sequence(torch.randn(1, heads, seq, head_dim), None, "zigzag").requires_grad_()
                   for _ in range(4))
    return {name: timed_step(fn, q, k, v, do, causal=True, layout="zigzag")[1]
            for name, fn in (("gathered K/V", gathered_kv_attention), ("ring", ring_attention))}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--steps", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--memory-ranks", type=int, nargs="*", default=[2, 4, 8],
                    help="also count K/V memory (no timing) at these numbers of ranks")
    a = ap.parse_args()
    p = a.ranks
    print(f"torch {torch.__version__}, {os.cpu_count()} cores, {p} gloo ranks x {a.threads} thread(s); "
          f"attention over S = {a.seq} tokens ({a.seq // p} per rank), {a.heads} heads x {a.head_dim}, "
          f"float32, forward + backward; median of {a.steps} steps after {a.warmup} warm-up\n")
    for causal in (False, True):
        res = pplab.launch(bench, a.seq, a.heads, a.head_dim, a.steps, a.warmup, causal,
                           world_size=p, backend="gloo", threads_per_rank=a.threads, timeout=1800)
        times, peaks, n_kv = res[0]
        formula = {"gathered K/V": (p + 1) * n_kv, "ring": min(3, p) * n_kv}
        print(f"{'causal, zigzag' if causal else 'non-causal, contiguous'}:")
        print(f"  {'':16} {'step ms':>9} {'vs gathered':>11} {'K/V MiB/rank':>13} {'formula MiB':>11} "
              f"{'vs gathered':>11}")
        base_t, base_m = times["gathered K/V"], peaks["gathered K/V"]
        for name, t in times.items():
            m = peaks[name]
            f = f"{formula[name] / 2**20:>11.2f}" if name in formula else f"{'':>11}"
            mem = f"{m / 2**20:>13.2f} {f} {m / base_m:>10.2f}x" if name in formula else f"{'':>13} {f} {'':>11}"
            print(f"  {name:16} {t * 1e3:>9.1f} {t / base_t:>10.2f}x {mem}")
        for name in formula:                              # the trace's count must be the closed form
            assert peaks[name] == formula[name], (name, peaks[name], formula[name])
        print()
    if a.memory_ranks:
        print(f"K/V memory per rank as the ranks grow (S = {a.seq}, causal zigzag, one step):")
        print(f"  {'ranks':>5} {'gathered MiB':>12} {'ring MiB':>9} {'ring/gathered':>13} {'min(3,p)/(p+1)':>14} "
              f"{'1/p':>6}")
        for r in a.memory_ranks:
            peaks = pplab.launch(kv_peaks, a.seq, a.heads, a.head_dim, world_size=r, backend="gloo",
                                 timeout=1800)[0]
            g, ring = peaks["gathered K/V"], peaks["ring"]
            print(f"  {r:>5} {g / 2**20:>12.2f} {ring / 2**20:>9.2f} {ring / g:>13.2f} "
                  f"{min(3, r) / (r + 1):>14.2f} {1 / r:>6.2f}")


if __name__ == "__main__":
    main()
