"""Gradescope's autograder: `pplab gradescope build --exercises broadcast,... -o autograder.zip`.

The zip holds, at its root (what Gradescope asks for):
    setup.sh          run once, as root, on Gradescope's Ubuntu image: a venv with CPU torch and pplab
    run_autograder    run once per submission: grades /autograder/submission/*.ipynb and writes
                      /autograder/results/results.json
    config.json       the exercises to grade and the time limits, chosen at build time
    pplab-*.whl       this pplab, built from the course's checkout

run_autograder has its own deadline (default 540 s, under Gradescope's default 10 minutes;
deadline.py): at the deadline (or on SIGTERM or SIGINT) the grading child and everything it
started are killed, and results.json holds the exercises that finished, the rest marked
"timed out", rather than Gradescope's timeout zeroing everything. results/pplab.log says each exercise as it finishes. Nothing but results.json goes to results/ and the child's output goes
to results/pplab.log, so nothing gets in the JSON's way.

Gradescope's containers run the autograder as root and have no user namespaces, so the
sandbox (sandbox.py) cannot start there. The grader then still grades, and says what
isolation remains: student code runs as the unprivileged user `nobody`, with limits on
processes, file size and core dumps, and without network where the container lets root
create a network namespace. Every submission gets a fresh container: there is no other
student's work to reach.

The root is $PPLAB_AUTOGRADER_ROOT (default /autograder), so that tests need no root.
"""
from __future__ import annotations

import ctypes
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

from ..isolation import loopback_up
from .deadline import STOP, grade_within
from .results import PASSED, GradeResult

# ctypes, resource and loopback_up are imported up here because _unshare_network and _limits
# run in the grading child between fork and exec, where an import is best avoided.

DEADLINE = 540.0                    # seconds: under Gradescope's default limit of 10 minutes
LIMITS = {"timeout": 240.0, "cell_timeout": 120.0, "check_timeout": 30.0}   # grading.grade_notebook's
UNPRIVILEGED = "nobody"

SETUP_SH = r'''#!/usr/bin/env bash
# Gradescope runs this once, as root, on its Ubuntu image, when the autograder is uploaded.
# It makes a venv with CPU torch and this pplab (the wheel beside this script); no conda.
#   PPLAB_PYTHON       the Python to make the venv with (default: python3 of the image)
#   PPLAB_VENV         where the venv goes (default: $PPLAB_AUTOGRADER_ROOT/pplab-venv); an existing one is kept
#   PPLAB_TORCH        the torch to install when the venv cannot import one (default: torch==2.13.0)
#   PPLAB_TORCH_INDEX  where from (default: PyTorch's CPU wheels)
#   PPLAB_PIP_OPTIONS  more options for pip (a local index: --no-index --find-links DIR)
set -euo pipefail
cd "$(dirname "$0")"
ROOT="${PPLAB_AUTOGRADER_ROOT:-/autograder}"
PYTHON="${PPLAB_PYTHON:-python3}"
VENV="${PPLAB_VENV:-$ROOT/pplab-venv}"
if ! "$PYTHON" -c "import venv, ensurepip" >/dev/null 2>&1; then
  apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y python3-venv python3-pip
fi
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv --system-site-packages "$VENV"
if "$VENV/bin/python" -c "import torch" >/dev/null 2>&1; then
  echo "torch is already importable: keeping it"
else
  "$VENV/bin/python" -m pip install ${PPLAB_PIP_OPTIONS:-} "${PPLAB_TORCH:-torch==2.13.0}" \
    --index-url "${PPLAB_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}"
fi
"$VENV/bin/python" -m pip install ${PPLAB_PIP_OPTIONS:-} ./pplab-*.whl
chmod -R a+rX "$VENV"              # student code runs as an unprivileged user: it must read Python
case "$VENV" in "$ROOT"/*) chmod a+x "$ROOT" ;; esac     # and pass through the autograder's folder to reach it
'''

RUN_AUTOGRADER = r'''#!/usr/bin/env bash
# Gradescope runs this once per submission. Only results/results.json is the grade; the
# grader's own output goes to results/pplab.log.
ROOT="${PPLAB_AUTOGRADER_ROOT:-/autograder}"
PY="${PPLAB_VENV:-$ROOT/pplab-venv}/bin/python"
[ -x "$PY" ] || PY=python3
mkdir -p "$ROOT/results"
exec "$PY" -m pplab.course.gradescope run --config "$ROOT/source/config.json"
'''


# -- building the zip ---------------------------------------------------------------

def build(exercises, out, *, deadline: float = DEADLINE, limits: dict | None = None) -> Path:
    """Write Gradescope's autograder zip for `exercises` (ids) to `out`; return its path."""
    from .grading import chapter_order
    from .results import _known_exercises

    ids = chapter_order(_known_exercises(exercises))
    limits = dict(LIMITS, **(limits or {}))
    if not 0 < deadline <= 3600 * 6:
        raise ValueError(f"deadline must be between 0 and 6 hours (Gradescope's longest), got {deadline:g} s")
    checkout = Path(__file__).resolve().parents[2]
    if not (checkout / "pyproject.toml").is_file():
        raise FileNotFoundError(f"no pyproject.toml at {checkout}: build the autograder from the course's checkout")
    with tempfile.TemporaryDirectory(prefix="pplab-gradescope-") as tmp:
        wheel = _wheel(checkout, Path(tmp))
        out = Path(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as z:
            for name, text in (("setup.sh", SETUP_SH), ("run_autograder", RUN_AUTOGRADER)):
                info = zipfile.ZipInfo(name)
                info.external_attr = 0o100755 << 16               # executable, as Gradescope runs them
                z.writestr(info, text)
            z.writestr("config.json", json.dumps({"exercises": ids, "deadline": deadline, "limits": limits},
                                                 indent=1) + "\n")
            z.write(wheel, wheel.name)
    return out


def _wheel(checkout: Path, folder: Path) -> Path:
    """pplab's wheel, built from the checkout (without its dependencies: setup.sh installs them)."""
    build_dir = folder / "src"
    shutil.copytree(checkout, build_dir, ignore=shutil.ignore_patterns(
        ".git", ".venv", "__pycache__", "*.egg-info", "build", "dist", "notebooks", "solutions", "exercises",
        "tests", "benchmarks", "docs"))
    run = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                          "-w", str(folder), str(build_dir)], capture_output=True, text=True)
    wheels = list(folder.glob("pplab-*.whl"))
    if run.returncode != 0 or not wheels:
        raise RuntimeError(f"could not build pplab's wheel: {(run.stderr or run.stdout).strip()[-500:]}")
    return wheels[0]


# -- running in Gradescope's container -----------------------------------------------

def run(config_path) -> dict:
    """Grade ROOT/submission as one student's, within the deadline; write ROOT/results/results.json."""
    started = time.monotonic()
    for sig in (signal.SIGTERM, signal.SIGINT):           # stopped from outside: write what finished, as at the deadline
        signal.signal(sig, lambda *_: STOP.set())
    root = Path(os.environ.get("PPLAB_AUTOGRADER_ROOT", "/autograder"))
    config = json.loads(Path(config_path).read_text())
    ids = config["exercises"]
    deadline = float(os.environ.get("PPLAB_AUTOGRADER_DEADLINE", config.get("deadline", DEADLINE)))
    results_path = root / "results" / "results.json"
    results_path.parent.mkdir(parents=True, exist_ok=True)
    no_sandbox = _why_no_sandbox()
    with tempfile.TemporaryDirectory(prefix="pplab-autograder-") as tmp, \
            open(results_path.parent / "pplab.log", "ab") as log:
        work = Path(tmp)
        shutil.copytree(root / "submission", work / "submission", symlinks=True) \
            if (root / "submission").is_dir() else (work / "submission").mkdir()
        isolation, preexec = _isolation(no_sandbox, work)
        result = grade_within(work / "submission", ids, limits=config.get("limits", LIMITS),
                              sandboxed=no_sandbox is None, seconds=started + deadline - time.monotonic(),
                              why=f"the autograder's deadline ({deadline:g} s)", log=log,
                              log_name="results/pplab.log", cwd=work, preexec=preexec,
                              env=dict(os.environ, HOME=str(work), TMPDIR=str(work), MPLCONFIGDIR=str(work)))
    result.isolation = isolation
    data = gradescope_results(result, time.monotonic() - started)
    results_path.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n")
    return data


def _why_no_sandbox() -> str | None:
    """Why the namespace sandbox cannot be used here (None: it can). PPLAB_SANDBOX=off says it
    cannot, as on Gradescope (and in the tests that stand in for it)."""
    if os.environ.get("PPLAB_SANDBOX") == "off":
        return "turned off (PPLAB_SANDBOX=off)"
    from . import sandbox

    return sandbox.why_not()


def _isolation(no_sandbox, work: Path):
    """(the note on what isolates student code, a preexec function for the grading child)."""
    if no_sandbox is None:
        return "", None
    if os.getuid() != 0:
        return (f"no namespace sandbox ({no_sandbox}): student code ran as the grader's own user, "
                f"in a fresh container for this submission"), _limits
    import pwd

    user = pwd.getpwnam(os.environ.get("PPLAB_AUTOGRADER_USER", UNPRIVILEGED))
    network = _own_network_possible()
    try:
        probe = subprocess.run([sys.executable, "-c", "import torch, pplab"], capture_output=True, text=True,
                               user=user.pw_uid, group=user.pw_gid, extra_groups=[], cwd="/")
        why = None if probe.returncode == 0 else \
            (probe.stderr.strip().splitlines() or [f"exit code {probe.returncode}"])[-1][:200]
    except OSError as err:
        why = str(err)[:200]
    if why:                             # its Python lies in a folder only root may read (/root/.pyenv, say)
        return (f"no namespace sandbox ({no_sandbox}) and {user.pw_name} cannot run this Python ({why}): "
                f"student code ran AS ROOT, with limits on processes, file size and core dumps, "
                + ("without network" if network else "WITH the container's network")
                + ", in a fresh container for this submission; install Python where every user can read it"), \
            (lambda: (_unshare_network() if network else None, _limits()))
    for path in [work, *work.rglob("*")]:                     # the child writes its scratch files here
        os.lchown(path, user.pw_uid, user.pw_gid)
    note = (f"no namespace sandbox ({no_sandbox}): student code ran as the unprivileged user {user.pw_name} "
            f"(not root), with limits on processes, file size and core dumps, "
            + ("without network (a network namespace of its own)" if network else
               "WITH the container's network (no network namespace could be made)")
            + ", in a fresh container for this submission")

    def preexec():
        if network:
            _unshare_network()
        _limits()
        os.setgroups([])
        os.setgid(user.pw_gid)
        os.setuid(user.pw_uid)
    return note, preexec


def _limits():
    """Limits for everything the grading child starts: a fork bomb or a huge file stops there.
    And if the container runs out of memory, the kernel's OOM killer is to take a process of
    the student's grading first (oom_score_adj 1000, inherited), never this one: results.json
    is still written, the exercise it hit noted as not graded."""
    try:
        with open("/proc/self/oom_score_adj", "w") as f:  # raising it needs no privilege
            f.write("1000")
    except OSError:                                       # not Linux
        pass
    for limit, value in ((resource.RLIMIT_NPROC, 1024), (resource.RLIMIT_FSIZE, 1 << 30), (resource.RLIMIT_CORE, 0)):
        soft, hard = resource.getrlimit(limit)
        value = value if hard == resource.RLIM_INFINITY else min(value, hard)
        resource.setrlimit(limit, (value, value))


def _unshare_network():
    """A network namespace of our own, with its loopback up: a new namespace's `lo` is down, and
    both the notebook's kernel (ZeroMQ on 127.0.0.1) and gloo's ranks talk over it."""
    CLONE_NEWNET = 0x40000000
    if ctypes.CDLL(None, use_errno=True).unshare(CLONE_NEWNET) != 0:
        raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNET)")
    loopback_up()


def _own_network_possible() -> bool:
    """Whether root may make a network namespace here (Docker's default seccomp profile forbids it)."""
    probe = subprocess.run([sys.executable, "-c", "from pplab.course.gradescope import _unshare_network as u; u()"],
                           capture_output=True, env=dict(os.environ, PYTHONPATH=str(Path(__file__).parents[2])))
    return probe.returncode == 0


def gradescope_results(result: GradeResult, seconds: float) -> dict:
    """Gradescope's results.json: score, execution_time, output, and tests[] with score,
    max_score, name, number, output, status and visibility."""
    output = "\n".join(([f"Note: {result.isolation}"] if result.isolation else []) + result.notes)
    tests = [{"score": r.points, "max_score": r.max_points, "name": f"{r.exercise}: {r.name}", "number": str(i),
              "output": f"{r.status}: {r.message} {r.hint}".strip(), "status": "passed" if r.status == PASSED
              else "failed", "visibility": "visible"} for i, r in enumerate(result.exercises, 1)]
    return {"score": result.points, "execution_time": round(seconds), "output": output,
            "visibility": "visible", "stdout_visibility": "hidden", "tests": tests}


def main(argv=None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m pplab.course.gradescope")
    sub = parser.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="grade ROOT/submission, write ROOT/results/results.json")
    r.add_argument("--config", required=True)
    args = parser.parse_args(argv)
    data = run(args.config)
    print(f"pplab: {data['score']:g} of {sum(t['max_score'] for t in data['tests'])} points "
          f"in {data['execution_time']} s (results.json written)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
