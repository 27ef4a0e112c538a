"""The `pplab` command.

    pplab exercises [--check]                  write exercises/ from solutions/ (or name what is stale)
    pplab grade SUBMISSIONS --out grades.csv   run and score every submitted notebook
    pplab grade SUBMISSIONS --format junit     ... or write JSON, JUnit XML, PrairieLearn's results.json
    pplab gradescope build --exercises ... -o autograder.zip   Gradescope's autograder (gradescope.py)
    pplab list                                 the exercises and the name each one asks you to define
"""
from __future__ import annotations

import argparse
import sys

from .formats import FORMATS

DEFAULT_OUT = {"csv": "grades.csv", "json": "grades.json", "junit": "grades.xml"}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="pplab", description="pplab course tools")
    sub = parser.add_subparsers(dest="command", required=True)

    ex = sub.add_parser("exercises", help="write exercises/*.ipynb from solutions/*.ipynb")
    ex.add_argument("--check", action="store_true", help="write nothing; exit 1 if exercises/ is out of date")
    ex.add_argument("--solutions", default="solutions", help="folder of solution notebooks (default: solutions)")
    ex.add_argument("--exercises", default="exercises", help="folder to write (default: exercises)")

    gr = sub.add_parser("grade", help="run every submitted notebook and write one row per student")
    gr.add_argument("submissions", help="folder of DIR/<student>.ipynb or DIR/<student>/*.ipynb")
    gr.add_argument("--out", default=None, help="file to write (default: grades.csv, grades.json, grades.xml; "
                    "for prairielearn $PPLAB_PRAIRIELEARN_OUT or /grade/results/results.json)")
    gr.add_argument("--format", default="csv", choices=FORMATS,
                    help="csv (default), json, junit (JUnit XML), or prairielearn (one submission: the whole "
                         "folder is one student's, as in PrairieLearn's /grade/student)")
    gr.add_argument("--timeout", type=float, default=600.0,
                    help="seconds per submitted notebook before it is killed (default: 600)")
    gr.add_argument("--cell-timeout", type=float, default=120.0,
                    help="seconds per cell before the kernel is interrupted (default: 120)")
    gr.add_argument("--check-timeout", type=float, default=30.0,
                    help="seconds per launch of ranks in a check before it counts as hung (default: 30)")
    gr.add_argument("--jobs", type=int, default=1, help="notebooks graded at the same time (default: 1)")
    gr.add_argument("--exercises", default=None,
                    help="comma-separated exercise ids to grade, e.g. broadcast,ring_all_reduce (default: all; "
                         "`pplab list` shows them)")
    gr.add_argument("--answers", default=None,
                    help="folder for each student's written answers (default: next to --out, OUT_answers/)")
    gr.add_argument("--memory", default="2G",
                    help="memory the processes of one sandbox (a notebook's run, a check) may hold together "
                         "(default: 2G)")
    gr.add_argument("--processes", type=int, default=256,
                    help="processes and threads one sandbox may run at once (default: 256)")
    gr.add_argument("--disk", default="512M",
                    help="bytes one sandbox may write: its folder, /tmp and /dev/shm, kept in memory (default: 512M)")
    gr.add_argument("--deadline", type=float, default=None,
                    help="prairielearn only: seconds to grade before writing what finished, the rest marked "
                         "timed out (default: 540; set PrairieLearn's externalGradingOptions.timeout longer)")
    gr.add_argument("--no-sandbox", action="store_true",
                    help="run student code without the sandbox (only where you grade in a container already)")

    gs = sub.add_parser("gradescope", help="Gradescope's autograder zip")
    gs_sub = gs.add_subparsers(dest="action", required=True)
    gb = gs_sub.add_parser("build", help="write autograder.zip (setup.sh, run_autograder, pplab's wheel)")
    gb.add_argument("--exercises", required=True, help="comma-separated exercise ids the assignment grades")
    gb.add_argument("-o", "--out", default="autograder.zip", help="zip to write (default: autograder.zip)")
    gb.add_argument("--deadline", type=float, default=540.0,
                    help="seconds run_autograder grades before it writes what finished (default: 540, under "
                         "Gradescope's 10 minutes; raise it with the assignment's own limit)")

    sub.add_parser("list", help="list the exercises")

    args = parser.parse_args(argv)
    if args.command == "exercises":
        from .exercises import sync_exercises

        try:
            problems = sync_exercises(args.solutions, args.exercises, check=args.check)
        except (FileNotFoundError, ValueError) as err:
            print(f"pplab exercises: {err}", file=sys.stderr)
            return 2
        if args.check:
            if problems:
                print(f"out of date in {args.exercises}/: {', '.join(problems)}. "
                      f"Run `pplab exercises` to regenerate.", file=sys.stderr)
                return 1
            print(f"{args.exercises}/ is up to date")
            return 0
        for p in problems:
            print(("left alone: " if "no solution" in p else "wrote: ") + p)
        return 0
    if args.command == "grade":
        from .grading import grade

        try:
            exercises = None if args.exercises is None else [e.strip() for e in args.exercises.split(",") if e.strip()]
            if args.format == "prairielearn":
                return _prairielearn(args, exercises)
            if args.deadline is not None:
                raise ValueError("--deadline is for --format prairielearn (one submission graded once); for a "
                                 "class, --timeout limits each notebook")
            from .sandbox import Limits

            limits = Limits.parse(args.memory, args.processes, args.disk)
            args.out = args.out or DEFAULT_OUT[args.format]
            rows = grade(args.submissions, args.out, timeout=args.timeout, cell_timeout=args.cell_timeout,
                         check_timeout=args.check_timeout, jobs=args.jobs, exercises=exercises,
                         answers=args.answers, sandboxed=not args.no_sandbox, limits=limits,
                         log=lambda line: print(line, file=sys.stderr, flush=True), fmt=args.format)
        except (FileNotFoundError, ValueError) as err:
            print(f"pplab grade: {err}", file=sys.stderr)
            return 2
        print(f"wrote {args.out}: {len(rows)} student(s)")
        return 0
    if args.command == "gradescope":
        from .gradescope import build

        try:
            out = build([e.strip() for e in args.exercises.split(",") if e.strip()], args.out, deadline=args.deadline)
        except (FileNotFoundError, ValueError, RuntimeError) as err:
            print(f"pplab gradescope build: {err}", file=sys.stderr)
            return 2
        print(f"wrote {out}: upload it as the assignment's autograder (Gradescope: Configure Autograder, zip file)")
        return 0
    if args.command == "list":
        from ..checks import EXERCISES

        for e in EXERCISES.values():
            print(f"{e.id:<20} define {e.answer:<20} {e.title}" + (f" ({e.notebook})" if e.notebook else ""))
        return 0
    return 2


def _prairielearn(args, exercises) -> int:
    """PrairieLearn runs the grader once per submission: the folder is one student's. It stops the
    container at its own timeout with no marks at all, so the grading has a deadline of its own
    (deadline.py): what finished before it is scored, the rest marked timed out."""
    import json
    import os
    import signal
    from pathlib import Path

    from . import sandbox
    from .api import _known_exercises
    from .deadline import STOP, grade_within
    from .formats import PRAIRIELEARN_OUT, prairielearn
    from .grading import chapter_order

    seconds = 540.0 if args.deadline is None else args.deadline
    if not 0 < seconds <= 24 * 3600:
        raise ValueError(f"--deadline must be between 0 and 24 hours, got {seconds:g} s")
    if not Path(args.submissions).is_dir():
        raise FileNotFoundError(f"no folder {args.submissions}: PrairieLearn puts the submission in /grade/student")
    out = Path(args.out or os.environ.get("PPLAB_PRAIRIELEARN_OUT", PRAIRIELEARN_OUT))
    limits = dict(timeout=args.timeout, cell_timeout=args.cell_timeout, check_timeout=args.check_timeout,
                  memory=args.memory, processes=args.processes, disk=args.disk)
    for sig in (signal.SIGTERM, signal.SIGINT):           # stopped from outside: write what finished
        signal.signal(sig, lambda *_: STOP.set())
    result = grade_within(Path(args.submissions).resolve(), chapter_order(_known_exercises(exercises)),
                          limits=limits, sandboxed=not args.no_sandbox, seconds=seconds,
                          why=f"the grader's deadline (--deadline {seconds:g} s)", log=sys.stderr.buffer,
                          log_name="the grading job's output")
    why = "--no-sandbox" if args.no_sandbox else sandbox.why_not()
    if why:                        # PrairieLearn's container is the isolation left: say so in the output
        result.isolation = f"not sandboxed ({why}): student code ran with the grader's rights in this container"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(prairielearn(result), ensure_ascii=False))
    print(f"wrote {out}: {result.points:g} of {result.max_points} points")
    return 0


if __name__ == "__main__":
    sys.exit(main())
