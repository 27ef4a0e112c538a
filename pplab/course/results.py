"""One result object for grading: what every output (CSV, JSON, JUnit, PrairieLearn, Gradescope) is built from.

    result = pplab.course.grade_notebook("alice.ipynb", exercises=["broadcast"])     # api.py
    result.points, result.max_points            # 1.0, 1
    result.exercises[0].status                   # "passed", "partial", "failed", "missing", "timed out" or "error"
    json.dumps(result.to_dict())                 # and GradeResult.from_dict(...) back

A check's verdict becomes an ExerciseResult once, where the grader reads it (grading.py);
one student's notebooks become one GradeResult (best points per exercise), and the writers
in formats.py and gradescope.py read nothing else. Facts are fields, never words to look
for in a message: whether the answer was still the stub (status "missing"), the seed that
reproduces a failure (`hint`), whether the check ran out of time (status "timed out").
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

PASSED, PARTIAL, FAILED, MISSING, TIMED_OUT, ERROR = "passed", "partial", "failed", "missing", "timed out", "error"
STATUSES = (PASSED, PARTIAL, FAILED, MISSING, TIMED_OUT, ERROR)


def _known_keys(cls, data: dict) -> dict:
    """`data` as keyword arguments of `cls`, refusing what is not a field (a typo, another format)."""
    if not isinstance(data, dict):
        raise ValueError(f"{cls.__name__}.from_dict needs a dict, got {type(data).__name__}")
    fields = set(cls.__dataclass_fields__)
    unknown = sorted(set(data) - fields)
    if unknown:
        raise ValueError(f"{cls.__name__}.from_dict: unknown key(s) {', '.join(unknown)}; "
                         f"the keys are {', '.join(sorted(fields))}")
    return dict(data)


@dataclass
class ExerciseResult:
    """One exercise of one submission, as graded."""

    exercise: str                  # the exercise's id ("broadcast")
    name: str                      # its title
    points: float                  # earned, 0 <= points <= max_points
    max_points: int
    status: str                    # one of STATUSES
    message: str = ""              # what the check said (without the hint)
    hint: str = ""                 # how to reproduce a failure ("Re-run with seed=7 to reproduce.")
    seconds: float = 0.0           # how long its check took

    def __post_init__(self):
        if self.status not in STATUSES:
            raise ValueError(f"status {self.status!r} is not one of {', '.join(STATUSES)}")
        if not 0 <= self.points <= self.max_points:
            raise ValueError(f"{self.exercise}: points {self.points} outside 0..{self.max_points}")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "ExerciseResult":
        return cls(**_known_keys(cls, data))

    @classmethod
    def missing(cls, exercise_id: str) -> "ExerciseResult":
        """An exercise no notebook of the submission answers (or still its stub)."""
        return cls.of(exercise_id, MISSING, 0.0, "no notebook defines the answer (or it is still the stub)")

    @classmethod
    def of(cls, exercise_id: str, status: str, points: float, message: str = "", hint: str = "",
           seconds: float = 0.0) -> "ExerciseResult":
        """A result for a registered exercise: its name and max points from the registry."""
        from ..checks import EXERCISES

        ex = EXERCISES[exercise_id]
        return cls(ex.id, ex.title, min(max(float(points), 0.0), float(ex.points)), ex.points, status, message,
                   hint, round(float(seconds), 2))


def status_of(passed: bool, points: float, *, timed_out: bool = False, error: bool = False) -> str:
    """The status of a check that gave a verdict (or ran out of time, or broke)."""
    if passed:
        return PASSED
    if timed_out:
        return TIMED_OUT
    if error:
        return ERROR
    return PARTIAL if points > 0 else FAILED


@dataclass
class GradeResult:
    """One student's submission (one or several notebooks): a result per exercise, in chapter order."""

    student: str
    exercises: list = field(default_factory=list)     # [ExerciseResult]
    notes: list = field(default_factory=list)         # what went wrong running the notebooks, what was ignored
    status: str = "graded"                            # "graded", "refused" (not read) or "failed to run"
    seconds: float = 0.0
    isolation: str = ""                               # what isolated student code, when not the full sandbox

    @property
    def points(self) -> float:
        return sum(r.points for r in self.exercises)

    @property
    def max_points(self) -> int:
        return sum(r.max_points for r in self.exercises)

    @property
    def score(self) -> float:
        """points / max_points, in [0, 1] (0 when there is nothing to earn)."""
        return self.points / self.max_points if self.max_points else 0.0

    def by_id(self) -> dict:
        return {r.exercise: r for r in self.exercises}

    def to_dict(self) -> dict:
        data = asdict(self)
        data.update(points=self.points, max_points=self.max_points)   # for readers; from_dict recomputes them
        return data

    @classmethod
    def from_dict(cls, data: dict) -> "GradeResult":
        data = _known_keys(cls, {k: v for k, v in data.items() if k not in ("points", "max_points")})
        data["exercises"] = [ExerciseResult.from_dict(r) for r in data.get("exercises", [])]
        return cls(**data)


def combine(student: str, notebooks: list, exercise_ids: list, refused: list = ()) -> GradeResult:
    """One student's GradeResult from the NotebookGrades of their notebooks [(path, grade)]: for
    each exercise the best result any notebook earned (missing if none tried it); the notes of every
    notebook (prefixed with its name when there are several) and a short note per exercise that
    was not passed in full."""
    notes, status, seconds = list(refused), ("refused" if refused and not notebooks else "graded"), 0.0
    best = {}
    for path, grade in notebooks:
        for ex, r in grade.results.items():
            if ex in exercise_ids and (ex not in best or r.points > best[ex].points):
                best[ex] = r
        seconds += grade.seconds
    results = [best.get(ex) or ExerciseResult.missing(ex) for ex in exercise_ids]
    for path, grade in notebooks:
        prefix = f"{Path(path).name}: " if len(notebooks) > 1 else ""
        notes += [prefix + n for n in grade.notes]
        notes += [f"{prefix}{ex}: {short(r.message)}" for ex, r in grade.results.items()
                  if ex in exercise_ids and r.status != PASSED and best[ex].points != best[ex].max_points and r.message]
        if grade.status != "graded":
            status = grade.status
    return GradeResult(student, results, notes, status, round(seconds, 2))


def short(message: str, limit: int = 200) -> str:
    return message if len(message) <= limit else message[: limit - 1] + "…"


def _known_exercises(exercises) -> list:
    from ..checks import EXERCISES, get_exercise

    ids = list(EXERCISES if exercises is None else exercises)
    for ex in ids:
        get_exercise(ex)                       # a ValueError naming the exercises, for an unknown id
    if not ids:
        raise ValueError("no exercise to grade: give at least one id (`pplab list` shows them)")
    return ids
