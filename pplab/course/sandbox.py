"""The sandbox for a student's code while `pplab grade` runs it (Linux; no root needed).

    argv = sandbox.wrap(["python", "-c", "..."], workdir=scratch, read_only=[library], limits=Limits())
    subprocess.Popen(argv, ...)            # or sandbox.why_not() -> why this machine has none

What the wrapped command sees is an allow list (pplab/isolation.py builds it): the system's
read-only folders, the Python installation and its packages (read-only), the `read_only`
folders (a copy of pplab the grader made before any notebook ran), and its own copy of
`workdir` (its notebook) with /tmp and /dev/shm, all in one tmpfs of `limits.disk`.
Nothing else of the machine: no course checkout, solutions, .git, other submission, home
folder or /sys; its own network with only `lo`; its own process ids, all ended with it.
The student's processes hold no capability and cannot undo the mounts.

`limits` (processes, memory, disk) are the submission's: a sandbox that reaches one is
stopped, exits with LIMIT_HIT, and its last line of output names the limit
(`stopped_by(returncode, lines)`). isolation.py says what each limit rests on.

Where namespaces are not allowed (macOS, Windows, a kernel or container that turns them
off), `why_not()` says why and the grader runs the command as it is, saying so.
"""
from __future__ import annotations

import itertools
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from .. import isolation

SETUP_FAILED, LIMIT_HIT = isolation.SETUP_FAILED, isolation.LIMIT_HIT
STOPPED = "pplab-sandbox: stopped: "
# The boot: isolation.py's text, read once now (a notebook cannot change what later sandboxes run).
_BOOT = Path(isolation.__file__).read_text() + "\nimport sys\nboot(sys.argv[1])\n"
_UIDS = itertools.count()


def parse_size(text) -> int:
    """'512M', '2G', '1.5g', '4096' (bytes) -> bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)i?b?\s*", str(text), re.IGNORECASE)
    if not match:
        raise ValueError(f"not a size: {text!r} (write it as 512M, 2G or a number of bytes)")
    return int(float(match[1]) * 1024 ** " kmgt".index(match[2].lower() or " "))


@dataclass(frozen=True)
class Limits:
    """What one submission may take: each sandbox (its notebook's run, each check) gets these."""
    memory: int = 2 << 30         # bytes held by its processes together
    processes: int = 256          # processes and threads at once
    disk: int = 512 << 20         # bytes in its files: its folder, /tmp and /dev/shm (a tmpfs)

    @classmethod
    def parse(cls, memory="2G", processes=256, disk="512M") -> "Limits":
        limits = cls(parse_size(memory), int(processes), parse_size(disk))
        if limits.memory < 256 << 20 or limits.processes < 16 or limits.disk < 16 << 20:
            raise ValueError(f"limits too small to run Python and torch: {limits.describe()} (at least "
                             f"--memory 256M, --processes 16, --disk 16M)")
        return limits

    def describe(self) -> str:
        return (f"memory {isolation.format_size(self.memory)}, {self.processes} processes, "
                f"disk {isolation.format_size(self.disk)}")


def wrap(argv: list[str], *, workdir: str, read_only=(), writable=(), denied=(), env: dict | None = None,
         limits: Limits = Limits(), user_namespace: bool = False) -> list[str]:
    """The command that runs `argv` in the sandbox, in a copy of `workdir` (and of each
    `writable` folder), seeing `read_only` folders besides the system and Python; `denied`
    folders stay empty even where they lie inside an allowed one. `user_namespace`: build
    it in a user namespace even where the grader is root (as it is built for anyone else)."""
    argv = list(argv)
    if not os.path.isabs(argv[0]):
        argv[0] = _which(argv[0])
    workdirs = [os.path.realpath(workdir)] + [os.path.realpath(w) for w in writable]
    allowed = sorted({os.path.abspath(p) for p in [*read_only, *_installation()]}
                     | {os.path.realpath(p) for p in [*read_only, *_installation()]})
    denied = {os.path.realpath(p) for p in [*denied, *_course()]}
    spec = {
        "argv": argv, "env": dict(os.environ if env is None else env), "workdirs": list(dict.fromkeys(workdirs)),
        "read_only": allowed,
        "denied": sorted(d for d in denied if not any(isolation.under(a, [d]) for a in allowed)),
        "limits": {"memory": limits.memory, "processes": limits.processes, "disk": limits.disk},
        "user_namespace": user_namespace,
        "uid": 200_000 + (os.getpid() % 1000) * 100 + next(_UIDS) % 100,   # where the grader is root
    }
    return [sys.executable, "-I", "-S", "-c", _BOOT, json.dumps(spec)]


def stopped_by(returncode: int, lines: list[str]) -> str | None:
    """The limit a sandbox was stopped at (its note), or None."""
    if returncode == LIMIT_HIT and lines and lines[-1].startswith(STOPPED):
        return lines[-1][len(STOPPED):]
    return None


def _course() -> list[str]:
    """The checkout pplab is imported from, where it is one (not site-packages)."""
    root = Path(isolation.__file__).resolve().parents[1]
    return [str(root)] if any((root / m).exists() for m in (".git", "solutions", "pyproject.toml")) else []


def _installation() -> list[str]:
    """Python, and the folders of packages on sys.path (never the current folder or a checkout)."""
    places = {sys.prefix, sys.base_prefix, os.path.dirname(os.path.dirname(os.path.realpath(sys.executable)))}
    places |= {p for p in sys.path if p and os.path.isdir(p) and ("site-packages" in p or "dist-packages" in p
                                                                   or under_prefix(p))}
    course = _course()
    return sorted(p for p in places if not any(isolation.under(c, [p]) for c in course))


def under_prefix(path: str) -> bool:
    return isolation.under(os.path.realpath(path), [os.path.realpath(sys.base_prefix), os.path.realpath(sys.prefix)])


def _which(name: str) -> str:
    import shutil

    found = shutil.which(name)
    if not found:
        raise FileNotFoundError(f"{name} not found on PATH")
    return found


@lru_cache(maxsize=1)
def why_not() -> str | None:
    """None if this machine can run the sandbox, else why not (said once in the grader's summary)."""
    if not sys.platform.startswith("linux"):
        return f"Linux namespaces are not available on {sys.platform}"
    if os.uname().machine not in isolation.SYS_PIVOT_ROOT:
        return f"the sandbox does not know pivot_root's number on {os.uname().machine}"
    import tempfile

    with tempfile.TemporaryDirectory(prefix="pplab-sandbox-probe-") as tmp:
        probe = [sys.executable, "-I", "-S", "-c",
                 "import os, sys; open('inside', 'w').write('x'); print(os.access(sys.prefix, os.W_OK), "
                 "os.path.exists('inside'))"]
        try:
            run = subprocess.run(wrap(probe, workdir=tmp), capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired) as err:
            return f"the sandbox could not start ({err})"
        if run.returncode != 0:
            reason = (run.stderr.strip().splitlines() or [f"exit code {run.returncode}"])[-1]
            return reason.removeprefix("pplab-sandbox: ")
        if run.stdout.split() != ["False", "True"] or os.path.exists(os.path.join(tmp, "inside")):
            return f"the sandbox did not isolate as expected ({run.stdout.strip()!r})"
    return None
