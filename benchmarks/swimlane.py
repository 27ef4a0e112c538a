"""How fast pplab.swimlane draws, and how a big picture reads.

    python benchmarks/swimlane.py                 # timings + a 16 ranks x 64 micro-batch PNG
    python benchmarks/swimlane.py --out lanes.png --repeats 5

Goal (from the issue): 10,000 boxes drawn and saved to PNG in under 2 s. The schedule
is a 1F1B pipeline worked out here by plain dependency arithmetic (so the benchmark
needs nothing but pplab.trace): each stage runs F(i) after F(i) of the stage before,
B(i) after B(i) of the stage after, in 1F1B order, one op at a time.
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import matplotlib

matplotlib.use("Agg")

from pplab import swimlane  # noqa: E402
from pplab.trace import Event, Timeline  # noqa: E402


def one_f_one_b(p: int, m: int, t_f: float = 1.0, t_b: float = 2.0, comm: bool = True,
                t_c: float = 0.25, all_reduce: bool = True) -> Timeline:
    """A simulated 1F1B schedule: p stages, m micro-batches, sends of t_c per hop."""
    order = []                              # per stage: ("F"|"B", i) in 1F1B order
    for s in range(p):
        warm = min(p - 1 - s, m)
        ops = [("F", i) for i in range(warm)]
        for i in range(m - warm):
            ops += [("F", warm + i), ("B", i)]
        ops += [("B", i) for i in range(m - warm, m)]
        order.append(ops)
    end, free, nxt, events = {}, [0.0] * p, [0] * p, []
    hop = t_c if comm else 0.0
    while any(nxt[s] < len(order[s]) for s in range(p)):
        progressed = False
        for s in range(p):
            if nxt[s] == len(order[s]):
                continue
            kind, i = order[s][nxt[s]]
            dep = ("F", s - 1, i) if kind == "F" else (("B", s + 1, i) if s < p - 1 else ("F", s, i))
            if kind == "F" and s == 0:
                ready = 0.0
            elif dep not in end:
                continue
            else:
                ready = end[dep] + (hop if dep[1] != s else 0.0)
            start = max(free[s], ready)
            dur = t_f if kind == "F" else t_b
            end[(kind, s, i)] = free[s] = start + dur
            events.append(Event(s, kind, "compute", start, start + dur, f"{kind}{i}", meta={"microbatch": i}))
            dst = s + 1 if kind == "F" else s - 1
            if comm and 0 <= dst < p:
                t = start + dur
                events.append(Event(s, "send", "comm", t, t + hop, f"→{dst}", bytes_sent=1, peer=dst, seq=2 * i + (kind == "B")))
                events.append(Event(dst, "recv", "comm", t, t + hop, f"←{s}", bytes_recv=1, peer=s, seq=2 * i + (kind == "B")))
            nxt[s] += 1
            progressed = True
        assert progressed, "schedule deadlocked"
    if all_reduce:                          # data-parallel gradient sync at the end of the step
        t = max(free)
        events += [Event(s, "all_reduce", "comm", t, t + 2.0, "AR", group=tuple(range(p))) for s in range(p)]
    # activations held: +1 at each F, -1 at each B
    held = [0] * p
    for e in sorted((e for e in events if e.category == "compute"), key=lambda e: e.end):
        held[e.rank] += 1 if e.kind == "F" else -1
        events.append(Event(e.rank, "memory", "memory", e.end, e.end, value=held[e.rank]))
    return Timeline(events, world_size=p, source="simulated", unit="t_f", memory_unit="micro-batches")


def time_draw(tl: Timeline, repeats: int, **kw) -> list[float]:
    times = []
    with tempfile.TemporaryDirectory() as d:
        for _ in range(repeats):
            t = time.perf_counter()
            swimlane.draw(tl, **kw).savefig(os.path.join(d, "lanes.png"))
            times.append(time.perf_counter() - t)
    return times


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="PNG of a 16 ranks x 64 micro-batch 1F1B (default: a temp file)")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()

    p, m = 16, 313                          # 16 x 313 x 2 = 10,016 compute boxes
    big = one_f_one_b(p, m, comm=False)
    n = len(big.select(category="compute"))
    t = time_draw(big, args.repeats)
    med = statistics.median(t)
    print(f"{n:,} compute boxes + {p} all-reduce, 16 ranks: draw + savefig median {med:.2f} s "
          f"(min {min(t):.2f}, max {max(t):.2f}, {args.repeats} runs) -> "
          f"{'under' if med < 2.0 else 'OVER'} the 2 s goal")

    full = one_f_one_b(p, m, comm=True)
    boxes = len([e for e in full.events if e.category != "memory"])
    t = time_draw(full, max(1, args.repeats // 2), arrows=True, memory=True)
    print(f"with every send/recv, arrows and memory ({boxes:,} boxes, {len(full.messages()):,} arrows): "
          f"median {statistics.median(t):.2f} s")

    out = args.out or os.path.join(tempfile.mkdtemp(), "swimlane_16x64.png")
    pic = one_f_one_b(16, 64)
    swimlane.draw(pic, arrows=False, memory=True, title="1F1B, 16 stages x 64 micro-batches (simulated)").savefig(out, dpi=100)
    zoom = out.replace(".png", "_zoom.png")
    swimlane.draw(pic, arrows=True, time_range=(0, 40), title="the same, first 40 t_f").savefig(zoom, dpi=100)
    print(f"pictures: {out}  {zoom}")


if __name__ == "__main__":
    main()
