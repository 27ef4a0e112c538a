"""How long the planner at scale takes to rank every layout of a cluster.

Llama 3 405B (batch 2,048 sequences of 8,192 tokens) on 16,384 and 8,192 H100s, and Narayanan et
al.'s 1T GPT (batch 3,072) on 3,072 A100s: every dp × tp × pp × cp layout with ZeRO 0-3, three
recomputation modes, micro-batches up to 16, interleaving up to 8 and both stage splits (even,
Llama 3's balanced), evaluated at once (pplab.planner.at_scale.search). Printed: how many layouts, how many fit, the median and range of
`--repeats` timed searches (after one warm-up), and the fastest layout.

    python benchmarks/planner_at_scale.py [--repeats 5]
"""
import argparse
import os
import statistics
import time

from pplab.hardware import A100_80GB, H100_SXM
from pplab.planner.at_scale import GPUCluster, search
from pplab.planner.published import LLAMA3_405B, NARAYANAN_TABLE_1, megatron_gpt

CASES = [("Llama 3 405B, 16,384 H100", LLAMA3_405B, GPUCluster(H100_SXM, 2048, 8), 2048),
         ("Llama 3 405B, 8,192 H100", LLAMA3_405B, GPUCluster(H100_SXM, 1024, 8), 2048),
         ("GPT 1T, 3,072 A100", megatron_gpt(NARAYANAN_TABLE_1[-1]), GPUCluster(A100_80GB, 384, 8), 3072)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    print(f"load {os.getloadavg()[0]:.1f}")
    print("| cluster | layouts | fit | seconds, median (min-max) | fastest |")
    print("|---|---|---|---|---|")
    for name, model, cluster, batch in CASES:
        plan = search(model, cluster, batch)                     # warm-up
        times = []
        for _ in range(a.repeats):
            start = time.perf_counter()
            plan = search(model, cluster, batch)
            times.append(time.perf_counter() - start)
        best = plan.top(1)[0]
        print(f"| {name} | {len(plan.x['dp']):,} | {len(plan.order):,} | {statistics.median(times):.3f} "
              f"({min(times):.3f}-{max(times):.3f}) | {best.layout.name}, MFU {best.mfu:.1%} |")


if __name__ == "__main__":
    main()
