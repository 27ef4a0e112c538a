"""The honest path under the allow-list sandbox and the limits (issue 34): `pplab grade` of one
complete correct notebook, this tree against the grader of commit 32a48b1 (before them).

    python benchmarks/grading_honest.py                          # 00_broadcast, 3 rounds each
    python benchmarks/grading_honest.py --notebook 06_sharded_optimizer --rounds 5
    python benchmarks/grading_honest.py --side-by-side     # each round: old and new at the same time

Goal: at most 1.1x the old grader's time. Both graders grade the same folder (one solution
notebook, which must score every point), in alternating rounds on the same machine (old,
new, new, old, ...); the script prints each round and the ratio of the medians. On a machine
whose load swings (other jobs), --side-by-side starts old and new together in each round, so
that both meet the same load (each then has half the cores: compare the ratio, not the times).
"""
from __future__ import annotations

import argparse
import concurrent.futures
import csv
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BASELINE = "32a48b1"          # main before the allow list and the limits


def grade_once(tree: Path, subs: Path, out: Path, exercises: str) -> float:
    env = {"PYTHONPATH": str(tree), "PATH": "/usr/bin:/bin", "HOME": str(out.parent)}
    started = time.perf_counter()
    run = subprocess.run([sys.executable, "-m", "pplab", "grade", str(subs), "--out", str(out),
                          "--exercises", exercises], capture_output=True, text=True, env=env, cwd=out.parent)
    seconds = time.perf_counter() - started
    if run.returncode != 0:
        raise SystemExit(f"grading with {tree} failed:\n{run.stderr[-2000:]}")
    with open(out, newline="") as f:
        row = next(csv.DictReader(f))
    if any(row[ex] in ("0", "missing") for ex in exercises.split(",")):
        raise SystemExit(f"grading with {tree} did not give the solution its points: {row}")
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", default=BASELINE, help=f"git ref of the old grader (default {BASELINE})")
    parser.add_argument("--notebook", default="00_broadcast", help="a notebook of solutions/ (default 00_broadcast)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--side-by-side", action="store_true", help="old and new at the same time in each round")
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    from pplab.checks import EXERCISES

    exercises = ",".join(ex.id for ex in EXERCISES.values() if ex.notebook == args.notebook)
    if not exercises:
        raise SystemExit(f"no exercise is answered in {args.notebook}")
    with tempfile.TemporaryDirectory(prefix="pplab-bench-honest-") as tmp:
        tmp = Path(tmp)
        old = tmp / "baseline"
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "-q", "--detach", str(old), args.baseline],
                       check=True)
        try:
            subs = tmp / "subs"
            subs.mkdir()
            shutil.copy(REPO / "solutions" / f"{args.notebook}.ipynb", subs / "student.ipynb")
            times = {"old": [], "new": []}
            for r in range(args.rounds if args.side_by_side else 0):
                with concurrent.futures.ThreadPoolExecutor(2) as pool:
                    both = {label: pool.submit(grade_once, tree, subs, tmp / f"{label}.csv", exercises)
                            for label, tree in (("old", old), ("new", REPO))}
                for label, future in both.items():
                    times[label].append(future.result())
                print(f"round {r + 1} side by side: old {times['old'][-1]:.1f} s, new {times['new'][-1]:.1f} s",
                      flush=True)
            for r in range(0 if args.side_by_side else args.rounds):
                for label, tree in (("old", old), ("new", REPO)) if r % 2 == 0 else (("new", REPO), ("old", old)):
                    seconds = grade_once(tree, subs, tmp / f"{label}.csv", exercises)
                    times[label].append(seconds)
                    print(f"round {r + 1} {label}: {seconds:.1f} s", flush=True)
        finally:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(old)], check=False)
    old_s, new_s = statistics.median(times["old"]), statistics.median(times["new"])
    print(f"{args.notebook} ({exercises}): old {old_s:.1f} s, new {new_s:.1f} s (medians of {args.rounds}): "
          f"ratio {new_s / old_s:.2f}x (goal: at most 1.1x)")


if __name__ == "__main__":
    main()
