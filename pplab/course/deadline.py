"""One student's submission graded within a deadline of the grader's own.

Gradescope and PrairieLearn run the grader once per submission and stop it at their own timeout;
what they stop gives no marks at all, not even for the exercises that had finished. So the grading
runs in a child process that reports each exercise as its check ends (one JSON line on a pipe);
at the deadline, or when STOP is set (SIGTERM or SIGINT from the platform), the child and
everything it started are killed, and the result holds the exercises that finished, the rest
marked "timed out". The platform's timeout must be a little longer than this deadline.

    result = grade_within(folder, ids, limits=..., sandboxed=..., seconds=540,
                          why="the autograder's deadline (540 s)", log=log_file)

gradescope.py (run_autograder) and `pplab grade --format prairielearn --deadline S` use it.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from .results import ERROR, TIMED_OUT, ExerciseResult, GradeResult, combine

STOP = threading.Event()            # set by the platform's SIGTERM or SIGINT: stop, report what finished


def grade_within(folder, ids, *, limits: dict, sandboxed: bool, seconds: float, why: str, log,
                 log_name: str = "the grader's log", cwd=None, env: dict | None = None,
                 preexec=None) -> GradeResult:
    """Grade every notebook under `folder` as one student's, for at most `seconds`.

    why: how the result names the deadline ("the autograder's deadline (540 s)"); log: a file the
    child's own output goes to (named log_name in a note if the child crashes); cwd, env, preexec:
    where and as whom the child runs (Gradescope drops it to an unprivileged user)."""
    finished, notebooks = _grade_in_child(folder, ids, limits, sandboxed, seconds, log, cwd, env, preexec)
    return what_finished(ids, finished, notebooks, "stopped by a signal" if STOP.is_set() else why, log_name)


def _grade_in_child(folder, ids, limits, sandboxed: bool, seconds: float, log, cwd, env, preexec):
    """Grade in a child process that writes one JSON line per finished check (and per notebook)
    to a pipe; at `seconds` the child and all it started are killed. Returns (the finished
    ExerciseResults, [records of the notebooks: their notes, "done" or "crashed"])."""
    from .runner import kill_tree

    read_fd, write_fd = os.pipe()
    job = {"folder": str(folder), "exercises": ids, "limits": limits, "sandboxed": sandboxed, "fd": write_fd}
    env = dict(env if env is not None else os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(Path(__file__).parents[2]), env.get("PYTHONPATH", "")] if p)
    child = subprocess.Popen([sys.executable, "-m", "pplab.course.deadline", json.dumps(job)],
                             cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
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


def what_finished(ids, finished, notebooks, why: str, log_name: str = "the grader's log") -> GradeResult:
    """The student's GradeResult from what the child reported: for each exercise the best
    finished result. If the child did not finish (its last record is {"done": ...}), the
    exercises without a result are marked timed out (or, if it crashed, an error of the grader's)."""
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
        status, message = ERROR, f"not graded: the grader stopped (exit code {crashed[0]}; see {log_name})"
        result.notes.append(f"grader error: the grading process stopped (exit code {crashed[0]}) before every "
                            f"exercise was graded; please report it with {log_name}")
    else:
        status, message = TIMED_OUT, f"not graded before {why}"
        result.notes.append(f"{why[0].upper()}{why[1:]} came before every exercise was graded: "
                            f"the finished ones are scored, the rest marked timed out")
    for i, r in enumerate(result.exercises):
        if r.exercise not in grade.results:
            result.exercises[i] = ExerciseResult.of(r.exercise, status, 0.0, message)
    return result


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


if __name__ == "__main__":                                 # python -m pplab.course.deadline JOB: the child
    _child(json.loads(sys.argv[1]))
