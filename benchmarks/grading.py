"""How long `pplab grade` takes for correct notebooks, against the grader of an earlier commit;
and (--platform) the time and memory one student's assignment takes, for the platforms' machines.

    python benchmarks/grading.py                     # baseline: the commit before the sandbox
    python benchmarks/grading.py --baseline REF --rounds 3
    python benchmarks/grading.py --platform          # each chapter's exercises, then all at once, on 1 CPU
    python benchmarks/grading.py --platform --chapters 0,1,3 --no-all
    python benchmarks/grading.py --platform --chapters "" --cpu 1   # only all 39 at once, on CPU 1

--platform (issue #35): Gradescope and PrairieLearn grade one student per container, by default
1 CPU, about 1.5 GB and 10 minutes. For each chapter, the chapter's solution notebooks handed in
as one student are graded with `pplab grade --format json --exercises <the chapter's>`, pinned to
CPU 0 (taskset) when it can be, and the script samples, every 0.2 s, the proportional set size
(PSS: shared pages split among their users, so the sum is what the processes really hold) of
the grader and every process below it, and prints the wall time, the peak of that sum and the
points earned (every solution should earn all of its points; a row says so when one did not).

The goal (issue #21): the sandbox and the checks that survive hostile students cost an honest
class little, at most 1.5x the old grader's time for the same correct notebooks. Both graders
grade the same folder (three solution notebooks: a collective on ranks, a ring on ranks, a
formula), one notebook at a time, in alternating rounds on the same machine; the script
prints each round and the ratio of the medians.
"""
from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
NOTEBOOKS = ["00_broadcast", "01_ring_all_reduce", "03_linear_traffic"]   # 1 point each, then and now
BASELINE = "3958f32"          # main before the sandbox (session 5)


def grade_once(tree: Path, subs: Path, out: Path) -> float:
    env = {"PYTHONPATH": str(tree), "PATH": "/usr/bin:/bin", "HOME": str(out.parent)}
    started = time.perf_counter()
    command = "pplab.cli" if (tree / "pplab" / "cli.py").exists() else "pplab"      # an older tree, or this one
    run = subprocess.run([sys.executable, "-m", command, "grade", str(subs), "--out", str(out)],
                         capture_output=True, text=True, env=env, cwd=out.parent)
    seconds = time.perf_counter() - started
    if run.returncode != 0 or out.read_text().count(",1,") + out.read_text().count(",1\n") < 1:
        raise SystemExit(f"grading with {tree} failed:\n{run.stderr[-2000:]}")
    totals = [line.split(",")[-2] for line in out.read_text().splitlines()[1:]]
    if totals != ["1"] * len(NOTEBOOKS):
        raise SystemExit(f"grading with {tree} did not pass every solution: {out.read_text()}")
    return seconds


def grade_measured(notebooks: list, exercises: list, tmp: Path, cpu: int | None = 0) -> tuple[float, float, float, float, int]:
    """(seconds, CPU seconds of every process, peak summed PSS in MiB, points earned, max points)
    of grading `notebooks` as one student."""
    import ctypes
    import json
    import os
    import resource
    import shutil as sh
    import threading

    import psutil

    # CPU seconds: a process's own and those of the children it reaped reach us when we reap the
    # grader. A process whose parent died first would be reaped by init and lost, so this script
    # becomes a "subreaper": such orphans come to it, and it reaps them below.
    PR_SET_CHILD_SUBREAPER = 36
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)

    subs = tmp / "subs"
    sh.rmtree(subs, ignore_errors=True)
    (subs / "student").mkdir(parents=True)
    for nb in notebooks:
        sh.copy(REPO / "solutions" / f"{nb}.ipynb", subs / "student" / f"{nb}.ipynb")
    out = tmp / "grades.json"
    command = [sys.executable, "-m", "pplab", "grade", str(subs), "--format", "json", "--out", str(out),
               "--exercises", ",".join(exercises)]
    if cpu is not None and sh.which("taskset"):
        command = ["taskset", "-c", str(cpu)] + command
    peak, stop = [0.0], threading.Event()
    started = time.perf_counter()
    proc = subprocess.Popen(command, cwd=tmp, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**__import__("os").environ, "PYTHONPATH": str(REPO)})

    def sample():
        root = psutil.Process(proc.pid)
        while not stop.is_set():
            total = 0
            try:
                for p in [root, *root.children(recursive=True)]:
                    try:
                        total += p.memory_full_info().pss
                    except psutil.Error:
                        pass
            except psutil.Error:
                break
            peak[0] = max(peak[0], total / 2**20)
            stop.wait(0.2)
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    _, err = proc.communicate()
    seconds = time.perf_counter() - started
    stop.set()
    sampler.join()
    left = psutil.Process().children()              # orphans the grader left behind (there should be none)
    if left:
        print(f"warning: the grader left {len(left)} processes behind: {[p.pid for p in left]}", file=sys.stderr)
        psutil.wait_procs(left, timeout=10)
    while True:                                     # reap what came to us as subreaper
        try:
            if os.waitpid(-1, os.WNOHANG)[0] == 0:
                break
        except ChildProcessError:
            break
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_s = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if proc.returncode != 0:
        raise SystemExit(f"grading {notebooks} failed:\n{err[-2000:]}")
    student = json.loads(out.read_text())["students"][0]
    for r in student["exercises"]:                  # why an exercise fell short: on stderr, under the table
        if r["points"] < r["max_points"]:
            print(f"{r['exercise']}: {r['points']:g} of {r['max_points']}, {r['status']}: {r['message'][:300]}",
                  file=sys.stderr, flush=True)
    return seconds, cpu_s, peak[0], student["points"], student["max_points"]


def platform(chapters: list | None, everything: bool, cpu: int = 0) -> None:
    sys.path.insert(0, str(REPO))
    from pplab.checks import EXERCISES

    by_chapter: dict = {}
    for ex in EXERCISES.values():
        by_chapter.setdefault(int(ex.notebook[:2]), []).append(ex)
    with tempfile.TemporaryDirectory(prefix="pplab-bench-platform-") as tmp:
        for chapter in sorted(by_chapter):
            if chapters is not None and chapter not in chapters:
                continue
            row(f"chapter {chapter}", by_chapter[chapter], Path(tmp), cpu)
        if everything:
            row("all at once", list(EXERCISES.values()), Path(tmp), cpu)


def row(label: str, exs: list, tmp: Path, cpu: int) -> None:
    """Grade `exs` as one student and print one row of the README's table."""
    import os

    load = os.getloadavg()[0]
    s, cpu_s, mib, got, most = grade_measured(sorted({e.notebook for e in exs}), [e.id for e in exs], tmp, cpu)
    short = "" if got == most else " (short of full marks: a check hit its time limit on a loaded machine?)"
    print(f"| {label} | {len(exs)} | {s:.0f} s | {cpu_s:.0f} s | {mib:.0f} MiB | {got:g} / {most}{short} "
          f"| {load:.1f} → {os.getloadavg()[0]:.1f} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", default=BASELINE, help=f"git ref of the old grader (default {BASELINE})")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--platform", action="store_true", help="time and peak memory per chapter, on 1 CPU")
    parser.add_argument("--chapters", default=None, help="with --platform: comma-separated chapter numbers")
    parser.add_argument("--no-all", action="store_true", help="with --platform: skip grading all exercises at once")
    parser.add_argument("--cpu", type=int, default=0, help="with --platform: the CPU to pin the grader to (default 0)")
    args = parser.parse_args()
    if args.platform:
        print("| graded | exercises | wall time | CPU, all processes | peak memory (summed PSS) | points | load (1 min) |\n"
              "|---|---|---|---|---|---|---|", flush=True)
        platform(None if args.chapters is None else [int(c) for c in args.chapters.split(",") if c], not args.no_all,
                 args.cpu)
        return
    with tempfile.TemporaryDirectory(prefix="pplab-bench-grading-") as tmp:
        tmp = Path(tmp)
        old = tmp / "baseline"
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "-q", "--detach", str(old), args.baseline],
                       check=True)
        try:
            subs = tmp / "subs"
            subs.mkdir()
            for name in NOTEBOOKS:
                shutil.copy(REPO / "solutions" / f"{name}.ipynb", subs / f"{name}.ipynb")
            times = {"old": [], "new": []}
            for r in range(args.rounds):
                for label, tree in (("old", old), ("new", REPO)) if r % 2 == 0 else (("new", REPO), ("old", old)):
                    times[label].append(grade_once(tree, subs, tmp / f"{label}.csv"))
                print(f"round {r + 1}: old {times['old'][-1]:.1f} s, new {times['new'][-1]:.1f} s", flush=True)
        finally:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(old)], check=False)
    old_s, new_s = statistics.median(times["old"]), statistics.median(times["new"])
    print(f"grading {len(NOTEBOOKS)} correct notebooks: old grader (commit {args.baseline}) median {old_s:.1f} s, "
          f"this grader {new_s:.1f} s: ratio {new_s / old_s:.2f} (goal: at most 1.5)")


if __name__ == "__main__":
    main()
