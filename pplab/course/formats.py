"""The grader's outputs, each written from GradeResults (results.py) and nothing else.

    csv            one row per student: a column per exercise (points, or "missing"), total, notes
    json           {"exercises": [ids], "students": [GradeResult.to_dict()]}, read back with GradeResult.from_dict
    junit          JUnit XML: a <testsuite> per student, a <testcase> per exercise (CI dashboards, pytest-style readers)
    prairielearn   PrairieLearn's external grader results.json, for ONE submission (see prairielearn())

Gradescope's results.json is gradescope.py's (it belongs with the autograder it runs in).
"""
from __future__ import annotations

import csv
import json
import xml.etree.ElementTree as ET
from pathlib import Path

from .results import ERROR, MISSING, PASSED, TIMED_OUT, GradeResult

FORMATS = ("csv", "json", "junit", "prairielearn")
PRAIRIELEARN_OUT = "/grade/results/results.json"
PRAIRIELEARN_LIMIT = 1_000_000          # PrairieLearn refuses a results.json larger than 1 MB


def points(x: float):
    """1 and 0 stay whole numbers; a part of a point keeps two decimals."""
    return int(x) if float(x).is_integer() else round(x, 2)


def csv_row(result: GradeResult) -> dict:
    """{student, <exercise id>: points or "missing", total, notes}."""
    row = {"student": result.student}
    row.update({r.exercise: MISSING if r.status == MISSING else points(r.points) for r in result.exercises})
    row["total"] = points(result.points)
    row["notes"] = "; ".join(result.notes)
    return row


def csv_safe(value):
    """A cell a spreadsheet would run as a formula (=, +, -, @, tab, CR first) gets a leading '."""
    if isinstance(value, str) and value[:1] in ("=", "+", "-", "@", "\t", "\r"):
        return "'" + value
    return value


def write(results: list, out, fmt: str, *, exercise_ids: list) -> None:
    """Write `results` (GradeResults) to the file `out` in format `fmt`."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}: the formats are {', '.join(FORMATS)}")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if fmt == "csv":
        with open(out, "w", newline="", encoding="utf-8") as f:   # names are Unicode whatever the locale
            writer = csv.DictWriter(f, ["student", *exercise_ids, "total", "notes"])
            writer.writeheader()
            writer.writerows({k: csv_safe(v) for k, v in csv_row(r).items()} for r in results)
    elif fmt == "json":
        out.write_text(json.dumps({"exercises": list(exercise_ids), "students": [r.to_dict() for r in results]},
                                  indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    elif fmt == "junit":
        out.write_bytes(junit(results))
    else:
        if len(results) != 1:
            raise ValueError(f"--format prairielearn grades one submission (PrairieLearn runs the grader once per "
                             f"student), but {len(results)} students were found: {', '.join(r.student for r in results)[:200]}")
        out.write_text(json.dumps(prairielearn(results[0]), ensure_ascii=False), encoding="utf-8")


def junit(results: list) -> bytes:
    """JUnit XML: <testsuites> of one <testsuite> per student, one <testcase> per exercise. A passed
    exercise is a bare testcase; partial and failed ones a <failure>, a check that timed out or
    broke an <error>, a missing answer <skipped>. Points go in each testcase's <properties>."""
    root = ET.Element("testsuites", name="pplab")
    for result in results:
        ex = result.exercises
        suite = ET.SubElement(root, "testsuite", name=result.student, tests=str(len(ex)),
                              failures=str(sum(r.status not in (PASSED, MISSING, TIMED_OUT, ERROR) for r in ex)),
                              errors=str(sum(r.status in (TIMED_OUT, ERROR) for r in ex)),
                              skipped=str(sum(r.status == MISSING for r in ex)),
                              time=f"{sum(r.seconds for r in ex):.2f}")
        props = ET.SubElement(suite, "properties")
        for name, value in (("points", points(result.points)), ("max_points", result.max_points)):
            ET.SubElement(props, "property", name=name, value=str(value))
        for r in ex:
            case = ET.SubElement(suite, "testcase", classname=f"pplab.{result.student}", name=r.exercise,
                                 time=f"{r.seconds:.2f}")
            props = ET.SubElement(case, "properties")
            for name, value in (("points", points(r.points)), ("max_points", r.max_points), ("status", r.status)):
                ET.SubElement(props, "property", name=name, value=str(value))
            text = f"{r.message} {r.hint}".strip()
            if r.status == MISSING:
                ET.SubElement(case, "skipped", message=r.message)
            elif r.status in (TIMED_OUT, ERROR):
                ET.SubElement(case, "error", type=r.status, message=_first_line(text)).text = text
            elif r.status != PASSED:
                ET.SubElement(case, "failure", type=r.status, message=_first_line(text)).text = text
        if result.notes:
            ET.SubElement(suite, "system-out").text = "\n".join(result.notes)
    ET.indent(root)
    return ET.tostring(root, encoding="utf-8", xml_declaration=True) + b"\n"


def _first_line(text: str, limit: int = 200) -> str:
    line = text.splitlines()[0] if text else ""
    return line if len(line) <= limit else line[: limit - 1] + "…"


def prairielearn(result: GradeResult, limit: int = PRAIRIELEARN_LIMIT) -> dict:
    """PrairieLearn's results.json for one submission: gradable, score in [0, 1], a message, and
    tests[] with name, points, max_points, message. Messages are cut (longest first) until the
    JSON fits in `limit` bytes, PrairieLearn's 1 MB."""
    tests = [{"name": r.exercise, "description": r.name, "points": points(r.points), "max_points": r.max_points,
              "message": f"{r.status}: {r.message} {r.hint}".strip()} for r in result.exercises]
    data = {"gradable": result.status != "refused", "score": round(result.score, 6),
            "message": f"{points(result.points)} of {result.max_points} points",
            "output": "\n".join(result.notes), "tests": tests}
    if result.isolation:
        data["output"] = f"note: {result.isolation}\n" + data["output"]
    texts = [(data, "output")] + [(t, "message") for t in tests]
    while len(json.dumps(data, ensure_ascii=False).encode()) > limit:
        owner, key = max(texts, key=lambda place: len(place[0][place[1]]))
        text = owner[key]
        if len(text) <= 100:                 # every text already short: nothing more to cut
            raise ValueError("the results do not fit in PrairieLearn's 1 MB even with every message cut short")
        owner[key] = text[: len(text) // 2] + " … (cut to fit PrairieLearn's 1 MB)"
    return data
