"""Isolating a sealed rank from every other process (Linux; best effort).

`isolate()` runs in each rank before any student code (pplab/isolation.py does the work,
the one home of pplab's Linux isolation): new user, mount, network and PID namespaces
(the rank is root only inside them, sees no other process, has no network and no socket
another rank can reach), every mount read-only, one private tmpfs on /tmp and /dev/shm
(the rank's working folder is /tmp/work; Python, pplab and the folders on sys.path stay
readable where they lie there), then a nested user and mount namespace, which locks
those mounts: the rank cannot remount them writable or unmount its tmpfs. Ranks
therefore share no file and no socket, cannot signal or ptrace each other, and
(non-dumpable) no process may read their memory.

Where the system does not permit unprivileged user namespaces (some containers, some
hardened kernels), `isolate()` does nothing and says so: the check still works, with
the same router and the same record, but ranks could then pass data to each other
through files in /tmp or /dev/shm.
"""
from __future__ import annotations

import contextlib
import os

from ... import isolation

RANK_TMPFS = "256m"          # a rank's /tmp and /dev/shm together; the grader's sandbox sets less (PPLAB_RANK_TMPFS)


def prctl(option: int, value: int) -> None:
    with contextlib.suppress(Exception):
        isolation.prctl(option, value)


def isolate(hide=()) -> str:
    """Namespaces for this rank (see the module docstring); `hide`: paths the rank must not
    read (a folder becomes empty, a file /dev/null; or {folder: {file left in it: text}}, as a graded
    check's library is hidden with stubs: fresh_zygote.py), hidden before the mounts are locked.
    Returns what could not be done ("" if everything was). Forks once: the caller continues
    as PID 1 of a new namespace, while its parent waits for it and exits with its status."""
    try:
        missing = isolation.isolate_rank(os.environ.get("PPLAB_RANK_TMPFS", RANK_TMPFS), hide)
    except (OSError, AttributeError) as exc:            # not permitted, or not Linux
        return f"no namespaces ({exc})"
    return ", ".join(missing)

