"""How long the pipeline simulator takes on large schedules: build, validate, simulate.

The goal (issue 28): 1F1B with p = 64 ranks and m = 4,096 micro-batches (524,288 actions)
built, validated and simulated in under 1 s in all, so that the explorer and the planner
stay interactive at the sizes of published runs. Two more schedules show the other shapes
at the largest sizes pplab builds (MAX_ACTIONS = 1,000,000): interleaved 1F1B (v = 2, twice the
actions per micro-batch) and ZB-H1 (the backward split into I and W, three actions per
micro-batch and stage).

Each step is timed on its own: make_schedule (which validates the schedule it builds),
validate called again (as a learner does; the schedule remembers that it passed), and
simulate with the lecture's t_f = 1, t_b = 2. Both the wall-clock time and this process's
CPU time are shown. All of it runs in this one thread without waiting for anything, so on an
idle machine the two are equal; on a shared one the wall-clock time also counts the time
spent waiting for a core, and the goal is judged on the CPU time. Median of --repeats fresh
runs; no ranks are launched, it takes about 15 seconds.

    python benchmarks/simulator.py [--repeats 3]

To time the code of another checkout the same way: PYTHONPATH=/that/checkout python benchmarks/simulator.py
"""
import argparse
import os
import statistics
import time

from pplab.pipeline import make_schedule, simulate, validate

GOAL_S = 1.0
CASES = [("1f1b", 64, 4096, None), ("interleaved-1f1b", 64, 3840, 2), ("zb-h1", 64, 4096, None)]


def timed(step):
    """(what step() returns, (wall seconds, cpu seconds) it took)."""
    wall, cpu = time.perf_counter(), time.process_time()
    out = step()
    return out, (time.perf_counter() - wall, time.process_time() - cpu)


def time_schedule(name, p, m, chunks=None):
    """[(wall, cpu) of make_schedule, of validate, of simulate], the schedule and its SimResult."""
    schedule, made = timed(lambda: make_schedule(name, p, m, chunks=chunks))
    _, validated = timed(lambda: validate(schedule))
    result, simulated = timed(lambda: simulate(schedule, t_f=1, t_b=2))
    return [made, validated, simulated], schedule, result


def report(name, p, m, chunks=None, repeats=3):
    """Print one row: medians over `repeats` fresh runs; return the median total (wall, cpu)."""
    runs = [time_schedule(name, p, m, chunks) for _ in range(repeats)]
    schedule, result = runs[-1][1], runs[-1][2]
    steps = [tuple(statistics.median(r[0][j][clock] for r in runs) for clock in (0, 1)) for j in range(3)]
    total = tuple(statistics.median(sum(t[clock] for t in r[0]) for r in runs) for clock in (0, 1))
    n = sum(map(len, schedule.actions))
    label = f"{name} p={p}, m={m}" + (f", v={chunks}" if chunks else "")
    print(f"{label:<33} {n:>9,} | " + " | ".join(f"{w:5.2f} ({c:4.2f})" for w, c in steps + [total])
          + f" | {total[1] / n * 1e6:6.2f} | makespan {result.makespan:g} t_f, utilisation {result.utilization:.1%}")
    return total


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    print(f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}; seconds, wall (cpu), median of "
          f"{args.repeats} fresh runs\n")
    print(f"{'schedule':<33} {'actions':>9} | {'make':>11} | {'validate':>11} | {'simulate':>11} | {'total':>11} | "
          f"cpu us/action")
    totals = [report(name, p, m, chunks, args.repeats) for name, p, m, chunks in CASES]
    wall, cpu = totals[0]
    print(f"\ngoal: 1f1b p=64, m=4096 built, validated and simulated in under {GOAL_S:g} s: "
          f"{'met' if cpu < GOAL_S else 'NOT met'} in CPU time ({cpu:.2f} s); wall-clock {wall:.2f} s "
          f"({'met' if wall < GOAL_S else 'not met'} on this machine now: waiting for a shared core counts there)")


if __name__ == "__main__":
    main()
