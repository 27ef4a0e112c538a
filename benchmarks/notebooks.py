"""Each chapter's budget: wall time and peak memory of a notebook run top to bottom, as a learner.

Each notebook is copied alone into an empty folder (as on Colab, or downloaded) and run there by
nbclient in a fresh kernel. Every 0.2 s the proportional set size (PSS: shared pages split between
the processes that share them, so a sum over processes counts each page once) of the kernel and
of everything below it (the ranks, their host, DataLoader workers) is summed; the table gives the
largest sum. Goal, so that each chapter fits Binder's 2 GB: at most 60 s and 1.5 GB per notebook.

Wall time depends on what else the machine runs; the CPU seconds do much less. They are the
kernel's own and those of every process it reaped (the ranks' host reaps the ranks), read at the
last sample before the kernel ends: on an idle machine with c cores the wall time is at least
CPU seconds / c, and not much more for chapters whose ranks keep the cores busy.

    python benchmarks/notebooks.py                    # every notebook in notebooks/
    python benchmarks/notebooks.py 00_start_here 07_hybrid

The prediction cells are left empty, as a learner opens them (no worked answers filled in).
"""
import argparse
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import nbformat
import psutil
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]
GOAL_SECONDS, GOAL_BYTES = 60, 1.5e9
SAMPLE_EVERY = 0.2


def tree_pss(root: psutil.Process) -> int:
    """PSS summed over every process below `root` (not root: nbclient's own process is not the learner's)."""
    total = 0
    for proc in root.children(recursive=True):
        try:
            total += proc.memory_full_info().pss
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass                                   # ended between the listing and the read
    return total


def run(name: str) -> dict:
    folder = Path(tempfile.mkdtemp(prefix=f"pplab-budget-{name}-"))
    try:
        shutil.copy(ROOT / "notebooks" / f"{name}.ipynb", folder)
        nb = nbformat.read(folder / f"{name}.ipynb", 4)
        peak, cpu, done, me = [0, None], [0.0], threading.Event(), psutil.Process()
        running = [None]                              # the cell being run: where the peak was

        def sample():
            while not done.wait(SAMPLE_EVERY):
                pss = tree_pss(me)
                if pss > peak[0]:
                    peak[:] = [pss, running[0]]
                for kernel in me.children():
                    try:
                        t = kernel.cpu_times()
                        cpu[0] = max(cpu[0], t.user + t.system + t.children_user + t.children_system)
                    except psutil.Error:
                        pass

        sampler = threading.Thread(target=sample, daemon=True)
        error = None
        start = time.perf_counter()
        sampler.start()
        try:
            NotebookClient(nb, timeout=900, kernel_name="python3", resources={"metadata": {"path": str(folder)}},
                           on_cell_start=lambda cell, cell_index: running.__setitem__(0, cell_index)).execute()
        except Exception as e:                      # a failing cell: say which, keep measuring the others
            error = f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:120]}"
        seconds = time.perf_counter() - start
        done.set()
        sampler.join()
        left = sorted(p.name for p in folder.iterdir() if p.name != f"{name}.ipynb")
        return {"name": name, "seconds": seconds, "cpu": cpu[0], "peak": peak[0], "peak_cell": peak[1],
                "error": error, "left": left}
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="*", help="names in notebooks/ (default: all)")
    args = parser.parse_args(argv)
    names = args.notebooks or sorted(p.stem for p in (ROOT / "notebooks").glob("*.ipynb"))
    env = {k: v for k, v in os.environ.items() if k != "PPLAB_PREDICTIONS_MUST_MATCH"}
    os.environ.clear()
    os.environ.update(env)
    cores = len(os.sched_getaffinity(0))
    print(f"{cores} cores, load average {os.getloadavg()[0]:.1f} at the start", flush=True)
    print("| notebook | wall time (s) | CPU (s) | peak PSS, all processes (GB) | in cell | within 60 s / 1.5 GB |")
    print("|---|---:|---:|---:|---:|---|")
    results, loads = [], []
    for name in names:
        r = run(name)
        loads.append(os.getloadavg()[0])
        results.append(r)
        ok = r["seconds"] <= GOAL_SECONDS and r["peak"] <= GOAL_BYTES and not r["error"]
        notes = [("yes" if ok else "**no**")] + ([f"failed: {r['error']}"] if r["error"] else []) \
            + ([f"left beside it: {', '.join(r['left'])}"] if r["left"] else [])
        print(f"| `{name}` | {r['seconds']:.0f} | {r['cpu']:.0f} | {r['peak'] / 1e9:.2f} | {r['peak_cell']} "
              f"| {'; '.join(notes)} |", flush=True)
    print(f"load average after each notebook: {min(loads):.1f} to {max(loads):.1f} on {cores} cores")
    return 1 if any(r["error"] for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
