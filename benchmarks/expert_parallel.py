"""Expert parallelism against data parallelism for the same MoE layer: step time and the all-to-all's share.

Same layer, same tokens, same run, p gloo ranks started by pplab.launch. One step = forward
and backward of `pplab.expert_parallel.MoE` on this rank's n tokens, then the gradient sync:

* EP: the E experts split over the p ranks (E/p each); tokens dispatched and combined by two
      all-to-alls forward and two backward (`pplab.collectives`, traced point-to-point sends,
      the counts exchanged first); only the router's gradient is all-reduced;
* DP: every rank holds all E experts (a group of one rank: no all-to-all, every expert runs
      locally on its own tokens); every gradient, experts included, is all-reduced.

Both do the same arithmetic per rank on average (n·k token-expert pairs); EP moves activations
(about 4·n·k·(p-1)/p rows of h per step), DP moves the experts' gradients (2·(p-1)/p of E
experts' weights). Every rank starts each step after a barrier; a step's time is the slowest
rank's; after warm-up the two take turns step by step and we report the median. The all-to-all's
share is the time each rank spends inside the all-to-alls (waiting included) over its step,
averaged over ranks. Calls run inside `collectives.unchecked()` (no argument check round trip).
Bytes sent per rank: the all-to-alls' sends from the trace, plus a ring's 2(p-1)/p of every
all-reduce's payload (EP: the router's gradient; DP: every gradient, one flat all-reduce).

    python benchmarks/expert_parallel.py [--ranks 2 4] [--tokens 512] [--hidden 256] [--ffn 1024]
                                         [--experts 8] [--k 2] [--steps 9] [--warmup 2]
"""
import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

import pplab
from pplab import collectives, trace
from pplab.expert_parallel import MoE, sync_gradients


class _Stopwatch:
    """Time spent inside collectives.all_to_all_single on this rank (the MoE layer's exchanges)."""

    def __init__(self):
        self.seconds, self.original = 0.0, collectives.all_to_all_single

    def __enter__(self):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return self.original(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
        collectives.all_to_all_single = timed
        return self

    def __exit__(self, *exc):
        collectives.all_to_all_single = self.original


def sent_bytes(p):
    """Bytes this rank sent in the step: the all-to-alls' point-to-point sends (from the trace),
    plus 2(p-1)/p of each all-reduce's payload (a ring's bytes; the backend's own algorithm may differ)."""
    events = [e for e in trace.events() if e.category == "comm"]
    return (sum(e.bytes_sent for e in events if e.kind == "send")
            + sum(2 * (p - 1) / p * e.meta["payload"] for e in events if e.kind == "all_reduce"))


def step(layer, x, batch_group, replica_group):
    dist.barrier()
    trace.reset(dist.get_rank())
    start = time.perf_counter()
    with _Stopwatch() as a2a:
        layer.zero_grad()
        (layer(x).square().mean() + 0.01 * layer.aux_loss).backward()
        sync_gradients(layer, batch_group, replica_group)
    mine = time.perf_counter() - start
    took = torch.tensor([mine])
    dist.all_reduce(took, op=dist.ReduceOp.MAX)         # the step is as slow as its slowest rank
    share = torch.tensor([a2a.seconds / mine])
    dist.all_reduce(share)
    return took.item(), share.item() / dist.get_world_size(), sent_bytes(dist.get_world_size())


def bench(tokens, hidden, ffn, experts, k, steps, warmup):
    rank, p = dist.get_rank(), dist.get_world_size()
    alone = [dist.new_group([r]) for r in range(p)][rank]        # every rank makes every group
    torch.manual_seed(0)
    dense = MoE(hidden, ffn, experts, k, capacity_factor=1.25, group=alone)   # all experts, same on every rank
    layers = {"EP": (MoE.from_dense(dense), None, None),
              "DP": (MoE.from_dense(dense, group=alone), None, dist.group.WORLD)}
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(rank)).requires_grad_()   # as inside a model
    times, shares, sent = {name: [] for name in layers}, {name: [] for name in layers}, {}
    with collectives.unchecked():
        for i in range(warmup + steps):
            for name, args in layers.items():
                t, s, sent[name] = step(args[0], x, *args[1:])
                if i >= warmup:
                    times[name].append(t)
                    shares[name].append(s)
    return ({name: statistics.median(t) for name, t in times.items()},
            statistics.median(shares["EP"]), layers["EP"][0].dropped, sent)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--tokens", type=int, default=512, help="tokens per rank")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--ffn", type=int, default=1024)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--k", type=int, default=2)
    ap.add_argument("--steps", type=int, default=9)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    a = ap.parse_args()
    print(f"torch {torch.__version__}, {os.cpu_count()} cores, gloo ranks x {a.threads} thread(s); MoE layer: "
          f"{a.experts} experts of {a.hidden}->{a.ffn}->{a.hidden}, top-{a.k}, capacity factor 1.25, "
          f"{a.tokens} tokens per rank, float32, forward + backward + gradient sync; median of {a.steps} steps "
          f"after {a.warmup} warm-up, the two taking turns; load average {os.getloadavg()[0]:.1f}\n")
    print(f"{'ranks':>5} {'EP step ms':>11} {'DP step ms':>11} {'EP/DP':>7} {'all-to-all share of EP step':>28}"
          f" {'dropped':>8} {'EP sent/rank':>15} {'DP sent/rank':>15}   (last step, busiest rank)")
    for p in a.ranks:
        if a.experts % p:
            print(f"{p:>5}  skipped: {a.experts} experts do not split over {p} ranks")
            continue
        res = pplab.launch(bench, a.tokens, a.hidden, a.ffn, a.experts, a.k, a.steps, a.warmup,
                           world_size=p, backend="gloo", threads_per_rank=a.threads, timeout=1800)
        times, share, dropped, sent = res[0]
        ep_bytes, dp_bytes = max(r[3]["EP"] for r in res), max(r[3]["DP"] for r in res)
        print(f"{p:>5} {times['EP'] * 1e3:>11.1f} {times['DP'] * 1e3:>11.1f} {times['EP'] / times['DP']:>7.2f} "
              f"{share:>28.0%} {dropped:>8} {ep_bytes / 2**20:>11.2f} MiB {dp_bytes / 2**20:>11.2f} MiB")
    print(f"\nload average after: {os.getloadavg()[0]:.1f} (2 cores shared: timings are noisy)")


if __name__ == "__main__":
    main()
