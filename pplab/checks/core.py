"""The registry of exercises, `check`, and the helpers every chapter's checkers use.

    result = pplab.check("broadcast", my_broadcast)
    ✔ broadcast: passed on world sizes 2, 3, 4 (18 trials with random data, ...)

Every exercise is registered once, with `@exercise(id, title, answer=...)` on its
checker, in the module named by its id in its chapter's package (pplab/checks/chNN_<chapter>/<id>.py,
which imports from this module and from sealed/; its notebook is exercises/NNx_<id>.ipynb). `answer` is the name the student defines (the grader looks for it in
the notebook). A checker is a plain function `checker(answer, seed, timeout)` that
returns a short summary of what it tried, or raises `Fail("what was wrong")`.

The contract that keeps a mark honest
-------------------------------------
`answer` is either the student's function itself (pplab.check in a notebook) or, when
`pplab grade` runs the checker, a `SourceAnswer`: the student's definitions as source
text, which must never run in the checker's process (the grader runs checkers in a
fresh process where no student code runs, and believes only what that process says).
So a checker never calls the answer itself; it goes through one of these (the sealed floor, sealed/):

* `sealed.run_sealed(job, answer, inputs, world_size=, timeout=, exercise=, describe=, check=)`
  (register the exercise with `sealed=True`): the way a checker runs the answer on ranks.
  `run_check` forks a zygote before it draws the seed; the ranks are forked from it and
  hold no secret of the check. The checker computes every input here and passes
  `inputs[trial][rank]`; rank r gets only its own, as `job(answer, [its input per trial])`.
  The job calls `sealed.begin(i)` at each trial and `sealed.observe(i, data)` with plain
  data of what the student's code produced. The ranks have no process group: every
  send, receive and collective goes through a router in the checker's process, which
  refuses the collectives in `forbidden=` ("*": all, the default), records every call,
  and stops a deadlock at once. `check(world_size, i, {rank: data}, traffic)` runs here
  afterwards; traffic is the router's record of trial i, {rank: {"sends": [(dst, bytes)],
  "received": [(src, bytes)], "collectives": [...]}}: what each rank really sent and
  received (router.py's Record.traffic). It
  compares every rank with the reference and raises each `Fail` (prefixed with
  `describe(world_size, i)`). The module docstring of sealed/launch.py has the whole contract.
* `sealed.call_each(answer, cases, where=, timeout=, probe=)` yields what the answer
  returned for each case (a tuple of arguments), called in one sealed rank (all cases in
  one launch); a raise or a hang in case i is a Fail when the iteration reaches it.
  `sealed.call_answer(answer, *args)` is one such call.
* `probe=` (both): a module-level function of the checker's module, run in each rank on
  the answer before the job, which raises Forbidden if the answer uses the library's own
  answer (`refuse_library`, forbidden.py): looking inside the answer's code happens where
  the answer exists, never here.

Whatever comes back from a process where student code ran is decoded with
`torch.load(weights_only=True)`, never plain pickle (`decode`; a small pplab dataclass
can be let through with `allow_type`, in the rank too: a probe can call it). Data
that is malformed or not plain data makes the check fail, never pass. A `Fail` raised
inside a rank still fails the check, but a pass can only come from `check` here.

A sketch (see ch00_start_here/broadcast.py for a whole one):

    def _rank(fn, trials):                                 # in every sealed rank
        for i, tensor in enumerate(trials):                # this rank's inputs only
            sealed.begin(i)
            fn(tensor)                                     # the student's code
            sealed.observe(i, {"tensor": tensor})

    def _check(name, seed):
        def check(p, i, observed, traffic):                # here, after the ranks ran
            for rank, seen in sorted(observed.items()):    # every rank, not only rank 0
                if first_difference(seen["tensor"], reference(seed, i, p)) is not None:
                    raise Fail(f"rank {rank}'s result differs ...")
        return check

    inputs = [[make_input(seed, i, p, rank) for rank in range(p)] for i in range(n)]
    sealed.run_sealed(_rank, fn, inputs, world_size=p, timeout=timeout, exercise=(id, "all_reduce"),
                      describe=..., check=_check(fn.__name__, seed))

`check` gets only the ranks that recorded trial i when the launch failed (a rank hung
or crashed), so loop over what it is given; when the launch succeeded, every rank must
have recorded every trial (the launch fails it otherwise). Treat observed data as
untrusted: anything that is not what your job records (a KeyError, a wrong type) makes
the check fail with "could not be read". A SourceAnswer has `__name__` and, for a plain
def, `__signature__` (so `require_function` and messages work), and `callable()` is
true, but calling it here raises TypeError. The answer runs with a fresh temporary
folder as its working directory.

* a checker for a collective runs the answer on sealed ranks with `run_sealed`, compares
  every rank with a reference, and forbids the library collectives (the router refuses
  and records them; each rank also looks for one bound by name, `forbidden_references`);
* a checker for a numeric answer (a bubble fraction, a byte count) compares a number
  (`check_number`); one for a pure function calls it with `sealed.call_each`.

Inputs are random, from a seed drawn fresh on every call (os.urandom) unless you
pass seed=, so an answer cannot be tuned to them; a failure says which seed
reproduces it. In a sealed launch, what a rank says (its observations) is only what the
student's code left in its own tensors; what it sent and received is the router's record.
"""
from __future__ import annotations

import importlib
import inspect
import math
import os
from dataclasses import dataclass
from typing import Callable

import torch

from ..runtime import comm  # noqa: F401 - chapters' checkers import comm from here (tensor_parallel)
from .compare import Difference, _fmt, first_difference, known_mistake  # noqa: F401 - checkers import them from here
from .sealed import call_answer, zygote  # noqa: F401 - run_check enters zygote() before the seed exists
from .sealed.answers import SourceAnswer, allow_type, decode, encode  # noqa: F401 - what checkers use, in one place
from .sealed.denied import DENIED
from .sealed.failures import Fail, Forbidden, NotImplementedYet, Scored  # noqa: F401 - Scored: what a graded-on-quality checker returns
from .sealed.forbidden import forbidden_references, refuse_library  # noqa: F401
from .sealed.fresh_zygote import fresh_zygote, jobs_of   # a graded answer to an exercise in DENIED: ranks from a fresh interpreter
from .stage_rank import WatchedStage  # noqa: F401 - run in the ranks, so kept where they may import it

# ----------------------------------------------------------------------------------
# The registry


@dataclass(frozen=True)
class Exercise:
    id: str
    title: str
    answer: str                          # the name the student defines: a function or a variable
    checker: Callable                    # checker(answer, seed, timeout) -> summary, or raise Fail
    notebook: str = ""                   # where the exercise lives, for messages and the grader
    sealed: bool = False                 # the checker uses run_sealed: run_check starts a zygote first
    preload: tuple = ()                  # modules the ranks use (imported before the zygote forks, once)
    points: int = 1                      # what a whole answer earns in the grader's CSV


EXERCISES: dict[str, Exercise] = {}


def exercise(id: str, title: str, answer: str, notebook: str = "", sealed: bool = False, preload: tuple = (),
             points: int = 1):
    """Register the decorated function as the checker of exercise `id` (sealed=True: it
    launches ranks with run_sealed, see sealed/launch.py; preload: modules its ranks import, such as
    the library a probe refuses, imported here once rather than in every rank; points: what a
    whole answer earns, of which a checker may give part: `Fail(..., earned=k)` for an answer
    right in some of its parts, `Scored(summary, earned=k)` for one graded on how good it is)."""
    def register(checker):
        EXERCISES[id] = Exercise(id, title, answer, checker, notebook, sealed, tuple(preload), points)
        return checker
    return register


@dataclass
class CheckResult:
    """What `check` found. Truthy if and only if the answer passed."""

    exercise: str
    passed: bool
    message: str
    seed: int
    score: float = 0.0                   # points earned (the grader's CSV); a pass earns them all
    points: int = 1
    hint: str = ""                       # the sentence of `message` that says how to reproduce it
    missing: bool = False                # the answer is still the stub (the grader: missing, not 0)

    def __bool__(self) -> bool:
        return self.passed

    def __str__(self) -> str:
        return f"{'✔' if self.passed else '✘'} {self.exercise}: {self.message}"

    def __repr__(self) -> str:
        return f"<CheckResult {self.exercise}: {'passed' if self.passed else 'failed'}>"


# Exercise ids that were renamed (November 2026), so that an exercise has one name everywhere: its
# notebook NNx_<id>, its id and its checker module. An old id gets an error naming the new one.
RENAMED: dict[str, str] = {
    "ddp_bucketing": "ddp_from_scratch",           # notebook 02c_ddp_from_scratch
    "1f1b_order": "one_f_one_b_order",             # an id must be a module name: it names its checker
}


def unknown_exercise(exercise_id) -> str:
    """Why `exercise_id` is not an exercise: its new name if it was renamed, else the list."""
    if exercise_id in RENAMED:
        new = RENAMED[exercise_id]
        return (f"exercise {exercise_id!r} is now called {new!r} (notebook "
                f"{EXERCISES[new].notebook if new in EXERCISES else '?'}): use {new!r}")
    known = ", ".join(sorted(EXERCISES)) or "(none)"
    return f"unknown exercise {exercise_id!r}: the exercises are {known}"


def chapter_order(exercise_ids) -> list[str]:
    """Exercise ids in the order of the course: by their chapter notebook (an exercise's notebook
    is NNx_<id>: 00, 01, ..., 03, 03b, ...), then in the order the chapter registers them (its
    package imports its checkers in the order its notebook links the exercises)."""
    registered = {ex: i for i, ex in enumerate(EXERCISES)}
    return sorted(exercise_ids, key=lambda ex: ((EXERCISES[ex].notebook or "~").split("_")[0], registered[ex]))


def get_exercise(exercise_id: str) -> Exercise:
    if exercise_id not in EXERCISES:
        raise ValueError(unknown_exercise(exercise_id))
    return EXERCISES[exercise_id]


def run_check(exercise_id: str, answer, *, seed: int | None = None, timeout: float = 30.0) -> CheckResult:
    """Check `answer` against exercise `exercise_id` without printing anything.

    timeout: seconds each launch of ranks may take before the ranks still running are
    reported as hung (a check launches once per world size).
    """
    ex = get_exercise(exercise_id)
    if ex.sealed and answer is not None and answer is not Ellipsis and callable(answer):
        for module in ex.preload:                       # no secret in a module: the zygote inherits it
            importlib.import_module(module)
        denies = DENIED.get(ex.id, ()) if isinstance(answer, SourceAnswer) else ()
        fresh = fresh_zygote(answer, denies, ("pplab.checks.sealed", *ex.preload, *jobs_of(ex.checker))) \
            if denies else None
        with fresh or zygote(answer):                   # started now, before the seed exists
            return _run_check(ex, answer, seed, timeout)
    return _run_check(ex, answer, seed, timeout)


def fresh_seed() -> int:
    """The seed of a check called without one: fresh from os.urandom, so no answer can be tuned to
    it. (The project's tests replace this with a seed fixed per test: tests/conftest.py.)"""
    return int.from_bytes(os.urandom(4), "little")


def _run_check(ex: Exercise, answer, seed, timeout) -> CheckResult:
    if seed is None:
        seed = fresh_seed()
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**32:
        raise ValueError(f"seed must be a whole number from 0 to 2**32 - 1, got {seed!r}")
    try:
        if answer is None or answer is Ellipsis:
            raise Fail(f"{ex.answer} has no answer yet.", seed_matters=False)
        summary = ex.checker(answer, seed, timeout)
    except Fail as failure:
        hint = f" Re-run with seed={seed} to reproduce." if failure.seed_matters else ""
        earned = _clamp(failure.earned or 0, ex.points - 1)        # a Fail never earns every point
        return CheckResult(ex.id, False, f"{failure}{hint}{_of(earned, ex.points)}", seed, earned, ex.points,
                           hint.strip(), isinstance(failure, NotImplementedYet))
    earned = _clamp(getattr(summary, "earned", ex.points), ex.points)
    verdict = "passed" if earned == ex.points else "scored"      # a graded-on-quality answer short of full marks
    return CheckResult(ex.id, earned == ex.points, f"{verdict} {summary}{_of(earned, ex.points)}", seed, earned, ex.points)


def _clamp(earned, most) -> float:
    return min(max(float(earned), 0.0), float(most))


def _of(earned, points) -> str:
    return f" [{earned:g} of {points} points]" if points > 1 else ""


def check(exercise_id: str, answer, *, seed: int | None = None, timeout: float = 30.0) -> CheckResult:
    """Check your answer to an exercise, print ✔ or ✘ with what was wrong, return the result.

        result = pplab.check("broadcast", my_broadcast)
        assert result                # truthy if and only if it passed

    seed: fix the random inputs (a failure prints the seed that reproduces it).
    timeout: seconds per launch of ranks before a rank still waiting is called hung.
    """
    result = run_check(exercise_id, answer, seed=seed, timeout=timeout)
    print(result, flush=True)
    return result


# ----------------------------------------------------------------------------------
# Helpers for checkers


class Parts:
    """A capstone checked in parts (forward, backward, traffic, ...): each part keeps the first
    problem found with it, prefixed with where (the trial); `finish` raises Fail naming the first
    problem and earning the parts that were right, or returns the summary with every part ✔.

        parts = Parts(("forward", "traffic"))
        parts.note("traffic", problem, where="t=2")            # problem None: nothing wrong
        return parts.finish("on t = 2 and 3 (...)")            # Parts: forward ✔ · traffic ✘ (1 of 2)

    labels: {part: what the breakdown calls it}. must_reach=True: a part earns only once it was
    judged (noted) without a problem; one never reached shows "not reached" (a capstone whose
    run can stop before some parts are judged: sharded_optimizer).
    """

    def __init__(self, names, labels: dict | None = None, must_reach: bool = False):
        self.problems = dict.fromkeys(names)
        self.labels, self.must_reach, self.reached = dict(labels or {}), must_reach, set()

    def note(self, part: str, problem, where: str = "") -> None:
        self.reached.add(part)
        if problem and not self.problems[part]:
            self.problems[part] = f"{where}, {problem}" if where else problem

    def _right(self, part) -> bool:
        return self.problems[part] is None and (part in self.reached or not self.must_reach)

    def earned(self) -> int:
        return sum(self._right(part) for part in self.problems)

    def breakdown(self) -> str:
        def mark(part):
            return "✘" if self.problems[part] else "✔" if self._right(part) else "not reached"
        marks = " · ".join(f"{self.labels.get(part, part)} {mark(part)}" for part in self.problems)
        return f"Parts: {marks} ({self.earned()} of {len(self.problems)})"

    def first(self):
        return next((v for v in self.problems.values() if v), None)

    def aborted(self, failure: Fail) -> Fail:
        """The run stopped (a raise, a hang): no part can be vouched for. Its failure, then the
        first problem found before it, if any."""
        before = f" Before that: {self.first()}" if self.first() else ""
        if isinstance(failure, NotImplementedYet):
            return failure                       # still the stub: nothing was checked before it
        return Fail(f"{failure}{before}", failure.seed_matters)

    def finish(self, summary: str) -> str:
        first = self.first()
        if first:
            raise Fail(f"{first} {self.breakdown()}.", earned=self.earned())
        return f"{summary}. {self.breakdown()}"


def check_number(got, expected: float, *, what: str, rel_tol: float = 1e-6, abs_tol: float = 1e-12) -> str:
    """A numeric answer: pass if math.isclose(got, expected), else Fail saying both."""
    if isinstance(got, bool) or not isinstance(got, (int, float)) or isinstance(got, complex):
        if isinstance(got, torch.Tensor) and got.numel() == 1:
            got = got.item()
        else:
            raise Fail(f"{what} should be a number, got {type(got).__name__} {got!r}.", seed_matters=False)
    if not math.isclose(got, expected, rel_tol=rel_tol, abs_tol=abs_tol):
        raise Fail(f"{what} is {got:.6g}, expected {expected:.6g} (relative tolerance {rel_tol:g}).")
    return f"({what} = {got:.6g})"


def random_mlp_and_cap(rng, element_bytes: int, small_cap: bool) -> tuple[list[int], int]:
    """An MLP's 4 widths and a bucket cap in bytes, for the DDP checkers. small_cap: below the
    largest weight (a parameter that gets a bucket of its own); else at least a whole layer."""
    widths = [rng.randint(2, 9) for _ in range(4)]
    weights = [element_bytes * a * b for a, b in zip(widths, widths[1:])]
    layers = [w + element_bytes * b for w, b in zip(weights, widths[1:])]
    if small_cap:
        return widths, rng.randint(2 * element_bytes, max(weights) - 1)
    return widths, rng.randint(max(layers), sum(layers) - element_bytes)


def problems_showing(draw, shows, wanted, count: int, enough=None, tries: int = 10_000) -> list:
    """`count` problems from draw(i) (None: draw again), among them, for each of `wanted` (the slips
    a checker promises to catch, or the cases it promises to try), at least one that shows it:
    shows(problem) is the set of those it shows. Room is kept for what is not yet shown, so the list
    is never longer than `count` unless it must be; enough(problems), if given, must also hold.
    After `tries` draws, something no problem shows is the checker's own error, raised."""
    out, shown = [], set()
    for i in range(tries):
        if len(out) >= count and shown >= set(wanted) and (enough is None or enough(out)):
            return out
        problem = draw(i)
        if problem is None:
            continue
        new = shows(problem) - shown
        if len(out) < count - len(set(wanted) - shown) or new:
            out.append(problem)
            shown |= new
    raise RuntimeError(f"no problem shows {sorted(set(wanted) - shown)} in {tries} draws")


def require_function(fn, exercise_id: str, params: str, *sample_args) -> None:
    """Fail unless `fn` is a function that can be called with `sample_args` (named `params`)."""
    if not callable(fn):
        answer = EXERCISES[exercise_id].answer if exercise_id in EXERCISES else "your_function"
        raise Fail(f"pass your function itself: pplab.check({exercise_id!r}, {answer}), got {type(fn).__name__}.",
                   seed_matters=False)
    try:
        inspect.signature(fn).bind(*sample_args)
    except TypeError:
        raise Fail(f"{getattr(fn, '__name__', 'your function')} must take ({params}); yours takes "
                   f"{inspect.signature(fn)}.", seed_matters=False) from None
    except ValueError:
        pass                                             # no signature to inspect (a builtin)
