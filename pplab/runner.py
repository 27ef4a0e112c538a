"""Run a submitted notebook in a fresh kernel for the grader's notes, and kill process trees.

    python -c "import runpy, sys; runpy.run_path('pplab/runner.py')['main'](sys.argv[1:])" \
        NOTEBOOK NOTES.jsonl CELL_TIMEOUT

runs NOTEBOOK cell by cell (in its own folder) and appends to NOTES.jsonl, as soon as it
knows, {"note": "cell 4 raised ValueError: ..."}, "... timed out after 120 s", "kernel died
in cell 6". The grader starts it in a process of its own, with a time limit, and takes
only notes from it: no mark. This file is loaded on its own, without the pplab package
(and torch), so it imports only the standard library, nbformat, nbclient and psutil.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import nbformat


def main(argv) -> None:
    path, records, cell_timeout = Path(argv[0]), Path(argv[1]), float(argv[2])
    _become_subreaper()
    try:
        _run_cells(path, records, cell_timeout)
    finally:
        _kill_children()


def _run_cells(path: Path, records: Path, cell_timeout: float) -> None:
    """Run the notebook cell by cell in a fresh kernel; append notes on what went wrong to
    `records` as soon as they are known."""
    from jupyter_core.utils import run_sync
    from nbclient import NotebookClient
    from nbclient.exceptions import CellTimeoutError, DeadKernelError

    def record(**item):
        with open(records, "a") as f:
            f.write(json.dumps(item) + "\n")

    try:
        nb = nbformat.read(path, as_version=4)
        # A kernel that imports torch can take a minute to start on a busy machine; the whole
        # notebook's time limit (enforced around this process) still bounds it.
        client = NotebookClient(nb, timeout=int(cell_timeout), kernel_name="python3", allow_errors=True,
                                startup_timeout=600, shutdown_kernel="immediate",
                                resources={"metadata": {"path": str(path.parent)}})
        with client.setup_kernel():
            for index, cell in enumerate(nb.cells):
                number = index + 1
                if cell.cell_type != "code":
                    continue
                try:
                    client.execute_cell(cell, index)
                except CellTimeoutError:
                    record(note=f"cell {number} timed out after {cell_timeout:g} s")
                    run_sync(client.km.interrupt_kernel)()      # Ctrl-C: a launch stops its ranks
                    if not _responds(client, index):
                        record(note="the kernel did not respond to an interrupt: the rest was not run")
                        break
                    continue
                except DeadKernelError:
                    record(note=f"kernel died in cell {number}")
                    break
                for out in cell.outputs:
                    if out.get("output_type") == "error":
                        value = (str(out.get("evalue", "")).strip().splitlines() or [""])[0][:150]
                        record(note=f"cell {number} raised {out.get('ename', 'an error')}" +
                               (f": {value}" if value else ""))
    except Exception as exc:  # noqa: BLE001 - the kernel would not start
        record(note=f"could not run the notebook: {type(exc).__name__}: {str(exc)[:200]}")


def _responds(client, index, seconds: float = 30.0) -> bool:
    """After an interrupt: does the kernel run a trivial cell again?"""
    from nbclient.exceptions import CellTimeoutError, DeadKernelError

    saved, client.timeout = client.timeout, int(seconds)
    try:
        client.execute_cell(nbformat.v4.new_code_cell("pass"), index)
        return True
    except (CellTimeoutError, DeadKernelError):
        return False
    finally:
        client.timeout = saved


def _kill_tree(pid: int) -> None:
    """Kill a process and every process below it: freeze them all first, so none can
    start another or be orphaned out of reach while we go."""
    import psutil

    try:
        root = psutil.Process(pid)
    except psutil.NoSuchProcess:
        return
    frozen: dict[int, psutil.Process] = {}
    for _ in range(3):                                  # catch what was forked while we froze
        for proc in [root] + root.children(recursive=True):
            if proc.pid not in frozen:
                try:
                    proc.suspend()
                    frozen[proc.pid] = proc
                except psutil.NoSuchProcess:
                    pass
    for proc in frozen.values():
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(list(frozen.values()), timeout=10)


def _become_subreaper() -> None:
    """Processes orphaned below this one (a double fork, setsid) become its children, not
    init's: they stay in its tree, where _kill_tree finds them."""
    import ctypes

    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(36, 1, 0, 0, 0)      # PR_SET_CHILD_SUBREAPER
        except OSError:
            pass


def _kill_children() -> None:
    import os

    import psutil

    for _ in range(3):
        children = psutil.Process(os.getpid()).children()
        if not children:
            return
        for child in children:
            _kill_tree(child.pid)
