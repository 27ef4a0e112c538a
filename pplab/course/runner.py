"""Run a submitted notebook in a fresh kernel for the grader's notes, and kill process trees.

    python -c "<this file's source>\nmain(sys.argv[1:])" NOTEBOOK NOTES_FD CELL_TIMEOUT

runs NOTEBOOK cell by cell (in its own folder) and writes to the pipe NOTES_FD, as soon as
it knows, one JSON line per note: {"note": "cell 4 raised ValueError: ..."}, "... timed out
after 120 s", "kernel died in cell 6". The grader starts it in the sandbox (sandbox.py),
with a time limit, and takes only notes from it: no mark. The kernel does not inherit the
pipe, and this process is not dumpable, so the kernel cannot write notes of its own.

What the notebook prints is kept only up to OUTPUT_LIMIT bytes per cell (errors always):
a cell that prints without pause cannot grow this process. This file runs on its own,
without the pplab package (and torch): it imports only the standard library, nbformat,
nbclient and psutil.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

OUTPUT_LIMIT = 1 << 20          # bytes of printed output kept per cell; the rest is dropped


def main(argv) -> None:
    path, notes_fd, cell_timeout = Path(argv[0]), int(argv[1]), float(argv[2])
    # jsonschema (under nbformat) builds an IRI grammar at import where rfc3987_syntax is installed:
    # about 1 s of CPU per graded notebook, for a format no notebook schema uses. Left out here.
    sys.modules.setdefault("rfc3987_syntax", None)
    not_dumpable()
    become_subreaper()
    try:
        with open(notes_fd, "w", buffering=1) as notes:
            _run_cells(path, notes, cell_timeout)
    finally:
        kill_children()


def _bounded_client():
    """nbclient's NotebookClient, keeping at most OUTPUT_LIMIT bytes of output per cell."""
    from nbclient import NotebookClient

    class BoundedClient(NotebookClient):
        def output(self, outs, msg, display_id, cell_index):
            if msg["msg_type"] != "error":
                kept = getattr(self, "_kept", {})
                self._kept = kept
                size = len(json.dumps(msg.get("content", {})))
                if kept.get(cell_index, 0) + size > OUTPUT_LIMIT:
                    return None                     # dropped: only the notes matter here
                kept[cell_index] = kept.get(cell_index, 0) + size
            return super().output(outs, msg, display_id, cell_index)

    return BoundedClient


def _run_cells(path: Path, notes, cell_timeout: float) -> None:
    """Run the notebook cell by cell in a fresh kernel; write notes on what went wrong to
    `notes` as soon as they are known."""
    # nbformat here, not at the top: the grader's check processes import this file for its process
    # helpers, and nbformat (jsonschema, through it) would cost each of them about 1.3 s of CPU.
    import nbformat
    from jupyter_core.utils import run_sync
    from nbclient.exceptions import CellTimeoutError, DeadKernelError

    def record(**item):
        notes.write(json.dumps(item) + "\n")

    try:
        nb = nbformat.read(path, as_version=4)
        # A kernel that imports torch can take a minute to start on a busy machine; the whole
        # notebook's time limit (enforced around this process) still bounds it.
        client = _bounded_client()(nb, timeout=int(cell_timeout), kernel_name="python3", allow_errors=True,
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
    import nbformat
    from nbclient.exceptions import CellTimeoutError, DeadKernelError

    saved, client.timeout = client.timeout, int(seconds)
    try:
        client.execute_cell(nbformat.v4.new_code_cell("pass"), index)
        return True
    except (CellTimeoutError, DeadKernelError):
        return False
    finally:
        client.timeout = saved


def kill_tree(pid: int) -> None:
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


def not_dumpable() -> None:
    """No process of the same user without privileges can read or trace this one (its pipes)."""
    import ctypes

    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(4, 0, 0, 0, 0)        # PR_SET_DUMPABLE
        except OSError:
            pass


def become_subreaper() -> None:
    """Processes orphaned below this one (a double fork, setsid) become its children, not
    init's: they stay in its tree, where kill_tree finds them."""
    import ctypes

    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(36, 1, 0, 0, 0)      # PR_SET_CHILD_SUBREAPER
        except OSError:
            pass


def kill_children() -> None:
    import psutil

    for _ in range(3):
        children = psutil.Process(os.getpid()).children()
        if not children:
            return
        for child in children:
            kill_tree(child.pid)
