"""Gradescope's autograder: `pplab gradescope build --exercises broadcast,... -o autograder.zip`.

The zip holds, at its root (what Gradescope asks for):
    setup.sh          run once, as root, on Gradescope's Ubuntu image: a venv with CPU torch and pplab
    run_autograder    run once per submission: grades /autograder/submission/*.ipynb and writes
                      /autograder/results/results.json
    config.json       the exercises to grade and the time limits, chosen at build time
    pplab-*.whl       this pplab, built from the course's checkout

run_autograder has its own deadline (default 540 s, under Gradescope's default 10 minutes):
the grading runs in a child process that reports each exercise as its check ends; at the
deadline (or on SIGTERM or SIGINT) the child and everything it started are killed, and
results.json holds the exercises that finished, the rest marked "timed out", rather than
Gradescope's timeout zeroing everything. results/pplab.log says each exercise as it finishes. Nothing but results.json goes to results/ and the child's output goes
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
import threading
import time
import zipfile
from pathlib import Path

from ..isolation import loopback_up
from .results import ERROR, PASSED, TIMED_OUT, ExerciseResult, GradeResult, combine

# ctypes, resource and loopback_up are imported up here because _unshare_network and _limits
# run in the grading child between fork and exec, where an import is best avoided.

DEADLINE = 540.0                    # seconds: under Gradescope's default limit of 10 minutes
LIMITS = {"timeout": 240.0, "cell_timeout": 120.0, "check_timeout": 30.0}   # grading.grade_notebook's
UNPRIVILEGED = "nobody"
STOP = threading.Event()            # set by SIGTERM or SIGINT: stop grading, write what finished

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
        finished, notebooks = _grade_in_child(work, ids, config.get("limits", LIMITS), no_sandbox is None,
                                              started + deadline - time.monotonic(), preexec, log)
    result = _what_finished(ids, finished, notebooks, deadline, "stopped by a signal" if STOP.is_set() else None)
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


def _grade_in_child(work: Path, ids, limits, sandboxed: bool, seconds: float, preexec, log):
    """Grade in a child process that writes one JSON line per finished check (and per notebook)
    to a pipe; at `seconds` the child and all it started are killed. Returns (the finished
    ExerciseResults, [(notebook name, its notes and status)])."""
    from .runner import kill_tree

    read_fd, write_fd = os.pipe()
    job = {"folder": str(work / "submission"), "exercises": ids, "limits": limits, "sandboxed": sandboxed,
           "fd": write_fd}
    env = dict(os.environ, HOME=str(work), TMPDIR=str(work), MPLCONFIGDIR=str(work))
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(Path(__file__).parents[2]), env.get("PYTHONPATH", "")] if p)
    child = subprocess.Popen([sys.executable, "-m", "pplab.course.gradescope", "child", json.dumps(job)],
                             cwd=work, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                             pass_fds=[write_fd], start_new_session=True, preexec_fn=preexec)
    os.close(write_fd)
    finished, notebooks = [], []

    def read():
        with open(read_fd, "rb") as f:
            for line in f:
                try:
                    record = json.loads(line)
                    if "result" in record:
                        finished.append(ExerciseResult.from_dict(record["result"]))
                        log.write(f"pplab: finished {finished[-1].exercise}: {finished[-1].status}\n".encode())
                        log.flush()
                    else:
                        notebooks.append(record)               # a notebook's notes, or the last: "done"
                except (ValueError, TypeError, KeyError):
                    pass                                   # a line cut short by the kill
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    end = time.monotonic() + max(seconds, 1.0)
    while child.poll() is None and time.monotonic() < end and not STOP.is_set():
        STOP.wait(0.1)
    crashed = child.poll() is not None and child.returncode != 0
    kill_tree(child.pid)                                  # the checks and notebooks still running too
    child.wait()
    reader.join(5)
    if crashed:                                            # not the deadline: say so, not "timed out"
        notebooks.append({"crashed": child.returncode})
    return list(finished), list(notebooks)


def _what_finished(ids, finished, notebooks, deadline, stopped: str | None = None) -> GradeResult:
    """The student's GradeResult from what the child reported: for each exercise the best
    finished result. If the child did not finish (its last record is {"done": ...}), the
    exercises without a result are marked timed out."""
    from .grading import NotebookGrade

    grade = NotebookGrade()
    for r in finished:
        if r.exercise not in grade.results or r.points > grade.results[r.exercise].points:
            grade.results[r.exercise] = r
    done = [record for record in notebooks if "done" in record]
    crashed = [record["crashed"] for record in notebooks if "crashed" in record]
    result = combine("submission", [("submission", grade)], ids)
    if done:
        result.notes = done[-1]["notes"]                   # the whole submission's notes, as the child's combine wrote them
        return result
    result.notes = [n for record in notebooks for n in record.get("notes", [])] + result.notes
    if crashed:
        status, message = ERROR, f"not graded: the grader stopped (exit code {crashed[0]}; see results/pplab.log)"
        result.notes.append(f"grader error: the grading process stopped (exit code {crashed[0]}) before every "
                            f"exercise was graded; please report it with results/pplab.log")
    else:
        why = stopped or f"the autograder's deadline ({deadline:g} s)"
        status, message = TIMED_OUT, f"not graded before {why}"
        result.notes.append(f"{why[0].upper()}{why[1:]} came before every exercise was graded: "
                            f"the finished ones are scored, the rest marked timed out")
    for i, r in enumerate(result.exercises):
        if r.exercise not in grade.results:
            result.exercises[i] = ExerciseResult.of(r.exercise, status, 0.0, message)
    return result


def gradescope_results(result: GradeResult, seconds: float) -> dict:
    """Gradescope's results.json: score, execution_time, output, and tests[] with score,
    max_score, name, number, output, status and visibility."""
    output = "\n".join(([f"Note: {result.isolation}"] if result.isolation else []) + result.notes)
    tests = [{"score": r.points, "max_score": r.max_points, "name": f"{r.exercise}: {r.name}", "number": str(i),
              "output": f"{r.status}: {r.message} {r.hint}".strip(), "status": "passed" if r.status == PASSED
              else "failed", "visibility": "visible"} for i, r in enumerate(result.exercises, 1)]
    return {"score": result.points, "execution_time": round(seconds), "output": output,
            "visibility": "visible", "stdout_visibility": "hidden", "tests": tests}


def _child(job: dict) -> None:
    """In the grading child: grade the submission, one JSON line per finished check and notebook,
    then {"done": ..., "notes": [...]} with the whole submission's notes."""
    from .api import grade_submission

    out = os.fdopen(job["fd"], "w", buffering=1)

    def on_result(r):
        out.write(json.dumps({"result": r.to_dict()}) + "\n")

    def on_notebook(path, grade):
        out.write(json.dumps({"notebook": Path(path).name, "notes": grade.notes}) + "\n")
    result = grade_submission(job["folder"], job["exercises"], limits=job["limits"], sandboxed=job["sandboxed"],
                              on_result=on_result, on_notebook=on_notebook)
    out.write(json.dumps({"done": result.status, "notes": result.notes}) + "\n")
    out.close()


def main(argv=None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m pplab.course.gradescope")
    sub = parser.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="grade ROOT/submission, write ROOT/results/results.json")
    r.add_argument("--config", required=True)
    c = sub.add_parser("child")
    c.add_argument("job")
    args = parser.parse_args(argv)
    if args.command == "child":
        _child(json.loads(args.job))
        return 0
    data = run(args.config)
    print(f"pplab: {data['score']:g} of {sum(t['max_score'] for t in data['tests'])} points "
          f"in {data['execution_time']} s (results.json written)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
