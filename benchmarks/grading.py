"""How long `pplab grade` takes for correct notebooks, against the grader of an earlier commit.

    python benchmarks/grading.py                     # baseline: the commit before the sandbox
    python benchmarks/grading.py --baseline REF --rounds 3

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
NOTEBOOKS = ["00_broadcast", "01b_ring_all_reduce", "03d_linear_traffic"]   # 1 point each, then and now
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", default=BASELINE, help=f"git ref of the old grader (default {BASELINE})")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
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
