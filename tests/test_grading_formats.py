"""The one result object (results.py) and what is written from it: CSV, JSON, JUnit XML,
PrairieLearn's results.json (formats.py) and Gradescope's autograder (gradescope.py).

The unit tests build results by hand and compare each output with values written out here.
Three end-to-end runs (the slow part: each grades a small notebook in fresh processes):
Gradescope's zip built, set up against the local packages and run on a wrong submission and,
without the namespace sandbox and past its deadline, on a half-finished one; and `pplab grade`
writing JSON, JUnit and PrairieLearn's layout from the CLI.
"""
import csv
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
import zipfile
from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_notebook

from pplab.course import deadline, formats, gradescope
from pplab.course.results import ExerciseResult, GradeResult, combine

REPO = Path(__file__).resolve().parents[1]
PPLAB = [sys.executable, "-m", "pplab.course.cli"]


def _answer_cell(notebook, fn):
    nb = nbformat.read(REPO / "solutions" / f"{notebook}.ipynb", 4)
    return next(c.source for c in nb.cells if c.cell_type == "code" and f"def {fn}" in c.source)


def _write(path, *sources):
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(new_notebook(cells=[new_code_cell(s) for s in sources]), path)


BROADCAST_WRONG = "def my_broadcast(tensor, src):\n    pass"
TRAFFIC_HANGS = "import time\n\ndef linear_traffic(strategy, B, c_in, c_out):\n    while True:\n        time.sleep(0.5)"


def _result(student="ada"):
    """A student with one of each status, written out by hand."""
    return GradeResult(student, [
        ExerciseResult("broadcast", "Broadcast", 1.0, 1, "passed", "passed on world sizes 2, 3, 4", "", 0.5),
        ExerciseResult("fsdp", "FSDP", 1.5, 4, "partial", "the traffic differs", "Re-run with seed=7 to reproduce.", 9.0),
        ExerciseResult("f_g", "f and g", 0.0, 1, "failed", "f's backward is wrong", "Re-run with seed=3 to reproduce."),
        ExerciseResult("mesh_groups", "Mesh", 0.0, 1, "missing", "no notebook defines the answer"),
        ExerciseResult("zero1_step", "ZeRO-1", 0.0, 1, "timed out", "did not finish within 240 s"),
        ExerciseResult("zero_bytes", "ZeRO bytes", 0.0, 1, "error", "the check process gave no verdict"),
    ], ["cell 3 raised ValueError: x"], "graded", 12.0)


# -- the result object ---------------------------------------------------------------

def test_a_result_round_trips_through_json_and_refuses_what_it_cannot_hold():
    result = _result()
    data = json.loads(json.dumps(result.to_dict()))
    assert data["points"] == 2.5 and data["max_points"] == 9          # 1 + 1.5, 1 + 4 + 1 + 1 + 1 + 1
    assert GradeResult.from_dict(data) == result
    assert result.score == pytest.approx(2.5 / 9)
    with pytest.raises(ValueError, match="status 'passd' is not one of passed, partial"):
        ExerciseResult("broadcast", "B", 1.0, 1, "passd")
    with pytest.raises(ValueError, match="points 2 outside 0..1"):
        ExerciseResult("broadcast", "B", 2, 1, "passed")
    with pytest.raises(ValueError, match="unknown key\\(s\\) score; the keys are"):
        ExerciseResult.from_dict({**result.exercises[0].to_dict(), "score": 1})


def test_combine_keeps_each_exercises_best_notebook_and_marks_the_rest_missing():
    from pplab.course.grading import NotebookGrade

    first = NotebookGrade(results={"broadcast": ExerciseResult.of("broadcast", "failed", 0, "rank 2 differs")},
                          notes=["cell 2 raised KeyError: 'x'"])
    second = NotebookGrade(results={"broadcast": ExerciseResult.of("broadcast", "passed", 1, "passed")})
    result = combine("bob", [(Path("a.ipynb"), first), (Path("b.ipynb"), second)],
                     ["broadcast", "reduce_scatter"], ["c.ipynb is a symbolic link"])
    assert [(r.exercise, r.status, r.points) for r in result.exercises] == \
        [("broadcast", "passed", 1.0), ("reduce_scatter", "missing", 0.0)]
    # a wrong try in one notebook is not a note when another notebook passed it
    assert result.notes == ["c.ipynb is a symbolic link", "a.ipynb: cell 2 raised KeyError: 'x'"]
    assert formats.csv_row(result) == {"student": "bob", "broadcast": 1, "reduce_scatter": "missing", "total": 1,
                                       "notes": "c.ipynb is a symbolic link; a.ipynb: cell 2 raised KeyError: 'x'"}


def test_the_stub_and_the_seed_are_fields_of_a_checks_result_not_words_to_find():
    from pplab import checks

    def answer(body):
        return checks.SourceAnswer("linear_traffic", (("<cell 1>", 1, f"def linear_traffic(strategy, B, c_in, c_out):\n"
                                                                      f"    {body}"),))
    stub = checks.run_check("linear_traffic", answer('raise NotImplementedError("write your solution here")'), seed=5)
    assert (stub.missing, stub.passed, stub.hint) == (True, False, "")
    wrong = checks.run_check("linear_traffic", answer("return 0"), seed=5)
    assert (wrong.missing, wrong.passed, wrong.hint) == (False, False, "Re-run with seed=5 to reproduce.")
    assert wrong.message.endswith(" Re-run with seed=5 to reproduce.")         # the student still reads it


# -- the formats, from a result written by hand ---------------------------------------

def test_csv_and_json(tmp_path):
    ids = [r.exercise for r in _result().exercises]
    formats.write([_result("ada"), _result("=cmd")], tmp_path / "g.csv", "csv", exercise_ids=ids)
    with open(tmp_path / "g.csv", newline="") as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["student", *ids, "total", "notes"]
    assert rows[1] == ["ada", "1", "1.5", "0", "missing", "0", "0", "2.5", "cell 3 raised ValueError: x"]
    assert rows[2][0] == "'=cmd"                                        # not a formula in a spreadsheet
    formats.write([_result()], tmp_path / "g.json", "json", exercise_ids=ids)
    data = json.loads((tmp_path / "g.json").read_text())
    assert data["exercises"] == ids and GradeResult.from_dict(data["students"][0]) == _result()
    with pytest.raises(ValueError, match="unknown format 'xls': the formats are csv, json, junit, prairielearn"):
        formats.write([_result()], tmp_path / "g.xls", "xls", exercise_ids=ids)
    with pytest.raises(ValueError, match="prairielearn grades one submission .* but 2 students were found"):
        formats.write([_result(), _result("bo")], tmp_path / "r.json", "prairielearn", exercise_ids=ids)


def test_junit_xml_has_a_suite_per_student_and_a_case_per_exercise():
    root = ET.fromstring(formats.junit([_result("ada"), _result("bob")]))
    assert root.tag == "testsuites" and [s.get("name") for s in root] == ["ada", "bob"]
    suite = root[0]
    # the counts JUnit readers (Jenkins, GitLab, pytest's junitxml) take from the suite
    assert (suite.get("tests"), suite.get("failures"), suite.get("errors"), suite.get("skipped")) == ("6", "2", "2", "1")
    cases = suite.findall("testcase")
    assert [c.get("name") for c in cases] == ["broadcast", "fsdp", "f_g", "mesh_groups", "zero1_step", "zero_bytes"]
    assert all(c.get("classname") == "pplab.ada" for c in cases)
    kinds = [[child.tag for child in c if child.tag != "properties"] for c in cases]
    assert kinds == [[], ["failure"], ["failure"], ["skipped"], ["error"], ["error"]]
    fsdp = cases[1]
    assert fsdp.find("failure").get("type") == "partial"
    assert fsdp.find("failure").text == "the traffic differs Re-run with seed=7 to reproduce."
    assert {p.get("name"): p.get("value") for p in fsdp.find("properties")} == \
        {"points": "1.5", "max_points": "4", "status": "partial"}
    assert cases[4].find("error").get("type") == "timed out"
    assert suite.find("system-out").text == "cell 3 raised ValueError: x"
    assert float(suite.get("time")) == pytest.approx(9.5)


def test_prairielearn_results_and_the_1_mb_limit():
    data = formats.prairielearn(_result())
    assert data["gradable"] is True and data["score"] == pytest.approx(2.5 / 9, abs=1e-6)
    assert data["tests"][1] == {"name": "fsdp", "description": "FSDP", "points": 1.5, "max_points": 4,
                                "message": "partial: the traffic differs Re-run with seed=7 to reproduce."}
    assert data["output"] == "cell 3 raised ValueError: x"
    huge = _result()
    huge.exercises[2].message = "x" * 3_000_000
    huge.notes = ["y" * 700_000]
    cut = formats.prairielearn(huge)
    assert len(json.dumps(cut, ensure_ascii=False).encode()) <= formats.PRAIRIELEARN_LIMIT
    assert cut["tests"][2]["message"].endswith("(cut to fit PrairieLearn's 1 MB)")
    assert cut["score"] == data["score"] and cut["tests"][1] == data["tests"][1]
    refused = GradeResult("x", [ExerciseResult("broadcast", "B", 0.0, 1, "missing")], ["not a notebook"], "refused")
    assert formats.prairielearn(refused)["gradable"] is False


def test_gradescope_results_and_a_deadline_that_came_early():
    finished = [ExerciseResult.of("broadcast", "passed", 1, "passed on world sizes 2, 3, 4", seconds=1.2)]
    ids = ["broadcast", "reduce_scatter", "linear_traffic"]
    # the child reported one check and no "done": the two others did not finish
    why = "the autograder's deadline (30 s)"
    result = deadline.what_finished(ids, finished, [{"notebook": "a.ipynb", "notes": ["cell 2 timed out"]}], why)
    assert [(r.exercise, r.status, r.points) for r in result.exercises] == \
        [("broadcast", "passed", 1.0), ("reduce_scatter", "timed out", 0.0), ("linear_traffic", "timed out", 0.0)]
    assert result.notes[0] == "cell 2 timed out" and "deadline (30 s) came before every exercise" in result.notes[1]
    # it finished: an exercise no notebook answered is missing, not timed out
    done = deadline.what_finished(ids, finished, [{"done": "graded", "notes": []}], why)
    assert [r.status for r in done.exercises] == ["passed", "missing", "missing"] and done.notes == []
    # the grading process died (not the deadline): the rest is an error of the grader's, not timed out
    crashed = deadline.what_finished(ids, finished, [{"crashed": 1}], why, "results/pplab.log")
    assert [r.status for r in crashed.exercises] == ["passed", "error", "error"]
    assert crashed.exercises[1].message == "not graded: the grader stopped (exit code 1; see results/pplab.log)"
    data = gradescope.gradescope_results(result, 12.4)
    assert data["score"] == 1.0 and data["execution_time"] == 12
    assert data["tests"][0] == {"score": 1.0, "max_score": 1, "name": f"broadcast: {finished[0].name}", "number": "1",
                                "output": "passed: passed on world sizes 2, 3, 4", "status": "passed",
                                "visibility": "visible"}
    assert data["tests"][2]["status"] == "failed" and data["tests"][2]["output"].startswith("timed out: not graded")


# -- end to end: Gradescope's zip, set up and run --------------------------------------

@pytest.fixture(scope="module")
def autograder():
    """The zip built for broadcast and linear_traffic (chapters 0 and 3d), unpacked as Gradescope
    lays it out (ROOT/source, ROOT/run_autograder), and setup.sh run against the local packages:
    its venv sees this environment's torch (and pplab's other dependencies) through a .pth file,
    as an image with torch already installed would, and pip installs only the wheel, offline."""
    base = Path(tempfile.mkdtemp(prefix="pplab-gradescope-test-"))
    try:
        base.chmod(0o755)                       # student code runs as `nobody` when the sandbox is off
        gradescope.build(["linear_traffic", "broadcast"], base / "autograder.zip")
        with zipfile.ZipFile(base / "autograder.zip") as z:
            assert sorted(z.namelist())[:3] == ["config.json", "pplab-0.1.0-py3-none-any.whl", "run_autograder"]
            assert "setup.sh" in z.namelist()
            z.extractall(base / "source")
            modes = {i.filename: i.external_attr >> 16 for i in z.infolist()}
        assert modes["setup.sh"] & stat.S_IXUSR and modes["run_autograder"] & stat.S_IXUSR
        for name, mode in modes.items():                 # extractall drops the modes; Gradescope keeps them
            (base / "source" / name).chmod(mode & 0o777)
        venv = base / "venv"
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
        site = next(venv.glob("lib/python3*/site-packages"))
        (site / "image.pth").write_text(next(p for p in sys.path if p.endswith("site-packages")) + "\n")
        env = dict(os.environ, PPLAB_AUTOGRADER_ROOT=str(base), PPLAB_VENV=str(venv),
                   PPLAB_PIP_OPTIONS="--no-index --no-deps --force-reinstall")
        env.pop("PYTHONPATH", None)
        setup = subprocess.run(["bash", str(base / "source" / "setup.sh")], env=env, capture_output=True, text=True,
                               timeout=300)
        assert setup.returncode == 0, setup.stdout + setup.stderr
        assert "torch is already importable: keeping it" in setup.stdout
        assert (site / "pplab" / "course" / "gradescope.py").is_file()       # the wheel's pplab, in the venv
        shutil.copy(base / "source" / "run_autograder", base / "run_autograder")
        yield base, env
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _prepare(base, submission: dict):
    shutil.rmtree(base / "submission", ignore_errors=True)
    shutil.rmtree(base / "results", ignore_errors=True)
    for name, sources in submission.items():
        _write(base / "submission" / name, *sources)


def _run_autograder(base, env, submission: dict, **extra):
    _prepare(base, submission)
    run = subprocess.run([str(base / "run_autograder")], env=dict(env, **extra), capture_output=True, text=True,
                         timeout=400)
    assert run.returncode == 0, run.stdout + run.stderr + (base / "results" / "pplab.log").read_text()
    return _check_results(base), run.stdout


def _check_results(base):
    assert sorted(p.name for p in (base / "results").iterdir()) == ["pplab.log", "results.json"]
    data = json.loads((base / "results" / "results.json").read_text())
    # Gradescope's documented fields
    assert {"score", "execution_time", "output", "tests"} <= set(data) and isinstance(data["execution_time"], int)
    for i, test in enumerate(data["tests"], 1):
        assert set(test) == {"score", "max_score", "name", "number", "output", "status", "visibility"}
        assert test["number"] == str(i) and 0 <= test["score"] <= test["max_score"]
    assert data["score"] == sum(t["score"] for t in data["tests"])
    return data


@pytest.mark.usefixtures("no_leftover_processes")
def test_gradescope_autograder_grades_a_wrong_submission(autograder):
    base, env = autograder
    data, stdout = _run_autograder(base, env, {"mine.ipynb": ["from pplab import comm", BROADCAST_WRONG]})
    assert stdout.startswith("pplab: 0 of 2 points in ")
    broadcast, traffic = data["tests"]
    assert broadcast["name"].startswith("broadcast: ") and traffic["name"].startswith("linear_traffic: ")
    assert (broadcast["score"], broadcast["status"]) == (0, "failed")
    assert broadcast["output"].startswith("failed: ") and "Re-run with seed=" in broadcast["output"]
    assert (traffic["score"], traffic["output"]) == (0, "missing: no notebook defines the answer (or it is still the stub)")
    assert data["output"].startswith("broadcast: ")                    # the short note, and no isolation note


def _where_nobody_can_run_python(view: Path) -> tuple[list, str]:
    """(a command prefix under which the user nobody can run this Python, or why none can be
    made). This machine's Python may lie in a folder only root may enter (/root/.pyenv): then,
    in a mount namespace of its own, that folder is covered by `view` (mode 755) holding only
    the Python's own subfolder, bound back in: the rest of it stays out of sight."""
    import pwd

    if os.getuid() != 0:
        return [], "needs root (the autograder drops to nobody only when it runs as root)"
    try:
        pwd.getpwnam("nobody")
    except KeyError:
        return [], "this machine has no user nobody"
    python = Path(sys._base_executable).resolve()
    closed = [d for d in reversed(python.parents) if not os.stat(d).st_mode & stat.S_IXOTH]
    if not closed:
        return [], ""                                      # nobody can already run it
    if not (shutil.which("unshare") and shutil.which("mount")):
        return [], f"{closed[0]} is closed to nobody and unshare/mount (util-linux) are missing"
    top = closed[0]
    inner = python.relative_to(top).parts[0]
    (view / inner).mkdir(parents=True)
    view.chmod(0o755)
    script = (f'mount --bind "{top / inner}" "{view / inner}" && mount --rbind "{view}" "{top}" && exec "$@"')
    probe = subprocess.run(["unshare", "-m", "sh", "-c", script, "sh", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        return [], f"{top} is closed to nobody and no mount namespace could open it: {probe.stderr.strip()[:200]}"
    return ["unshare", "-m", "sh", "-c", script, "sh"], ""


@pytest.fixture(scope="module")
def without_namespaces(autograder):
    """Gradescope's container: root, no user namespaces (PPLAB_SANDBOX=off stands in for them).
    One run serves two tests (each run grades in fresh processes: the slow part). Where this
    machine lets it, the run is made so that nobody can run this Python (see
    _where_nobody_can_run_python), and the autograder then drops to nobody for real.

    The submission: a spy cell, which records the kernel's user and what it could reach (the
    autograder's config and an instructor's solutions, root's with mode 600, and results.json
    to forge); broadcast's answer; and a linear_traffic that never returns (its check would
    wait 300 s). Once broadcast has finished, the run is stopped (SIGTERM, which
    run_autograder treats as its deadline, so that this does not depend on how fast a loaded
    machine grades). Returns (results.json, what the spy saw, why the run could not drop to
    nobody: "" if it could)."""
    from conftest import descendants

    base, env = autograder
    prefix, why = _where_nobody_can_run_python(base / "rootview")
    config = json.loads((base / "source" / "config.json").read_text())
    config["limits"].update(check_timeout=300.0)
    (base / "source" / "config.json").write_text(json.dumps(config))
    (base / "source" / "config.json").chmod(0o600)
    secret = base / "source" / "solutions" / "00_broadcast.ipynb"          # what an instructor might ship
    secret.parent.mkdir(exist_ok=True)
    shutil.copy(REPO / "solutions" / "00_broadcast.ipynb", secret)
    secret.chmod(0o600)
    probe = base / "probe"
    probe.mkdir()
    probe.chmod(0o777)
    spy = f"""import json, os
seen = {{"uid": os.getuid(), "euid": os.geteuid(), "gid": os.getgid(), "groups": os.getgroups(),
        "oom_score_adj": open("/proc/self/oom_score_adj").read().strip()}}
for name, path in {{"config": {str(base / "source" / "config.json")!r}, "solutions": {str(secret)!r}}}.items():
    try:
        open(path).read()
        seen[name] = "read"
    except OSError as err:
        seen[name] = type(err).__name__
try:
    open({str(base / "results" / "results.json")!r}, "w").write('{{"score": 99}}')
    seen["forge"] = "wrote"
except OSError as err:
    seen["forge"] = type(err).__name__
open({str(probe / "kernel.json")!r}, "w").write(json.dumps(seen))"""
    _prepare(base, {"mine.ipynb": [spy, "from pplab import comm", _answer_cell("00_broadcast", "my_broadcast"),
                                   TRAFFIC_HANGS]})
    before = descendants()
    proc = subprocess.Popen(prefix + [str(base / "run_autograder")], env=dict(env, PPLAB_SANDBOX="off"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        log = base / "results" / "pplab.log"
        for _ in range(3000):                                  # up to 300 s on a loaded machine
            if log.exists() and "pplab: finished broadcast" in log.read_text():
                break
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 0, stdout + stderr + log.read_text()
    assert descendants() - before == set(), "processes left behind"
    data = _check_results(base)
    seen = json.loads((probe / "kernel.json").read_text()) if (probe / "kernel.json").exists() else None
    return data, seen, why


def test_gradescope_without_namespaces_stopped_midway_scores_what_finished(without_namespaces):
    """It grades anyway and says what isolation remains; broadcast is scored and linear_traffic
    marked timed out."""
    data, _, why = without_namespaces
    broadcast, traffic = data["tests"]
    assert (broadcast["score"], broadcast["status"]) == (1, "passed"), data
    assert (traffic["score"], traffic["status"]) == (0, "failed")
    assert traffic["output"] == "timed out: not graded before stopped by a signal"
    assert data["output"].startswith("Note: no namespace sandbox (turned off (PPLAB_SANDBOX=off)) and ") or \
        data["output"].startswith("Note: no namespace sandbox (turned off (PPLAB_SANDBOX=off)): student code ran as ")
    if os.getuid() == 0:               # nobody, unless nobody cannot run this machine's Python
        assert ("nobody cannot run this Python" if why else "as the unprivileged user nobody (not root)") \
            in data["output"]
    assert "Stopped by a signal came before every exercise was graded" in data["output"]


def test_gradescope_as_root_drops_to_nobody(without_namespaces):
    """Gradescope's case for real: student code runs as nobody, with no supplementary groups;
    the notebook's kernel ran to its end (it reached 127.0.0.1: the loopback of the grader's own
    network namespace is up) and could not read the autograder's config or an instructor's
    solutions nor write results.json; it is the first the OOM killer takes; broadcast's ranks
    talked over the same loopback; and results.json is the grader's."""
    import pwd

    data, seen, why = without_namespaces
    if why:
        pytest.skip(f"the autograder could not drop to nobody here: {why}")
    assert "as the unprivileged user nobody (not root)" in data["output"]
    nobody = pwd.getpwnam("nobody")
    assert seen is not None, f"the spy cell did not run to its end: {data['output']}"
    assert (seen["uid"], seen["euid"], seen["gid"], seen["groups"]) == (nobody.pw_uid, nobody.pw_uid, nobody.pw_gid, [])
    assert (seen["config"], seen["solutions"], seen["forge"]) == ("PermissionError",) * 3
    assert seen["oom_score_adj"] == "1000"       # out of memory, the kernel's OOM killer takes this, not the grader
    assert data["tests"][0]["score"] == 1 and data["score"] == 1      # the grader's results.json, not the forged one
    assert "notebook's time limit" not in data["output"]


@pytest.mark.usefixtures("no_leftover_processes")
def test_gradescope_deadline_writes_results_even_when_nothing_finished(autograder):
    base, env = autograder
    data, _ = _run_autograder(base, env, {"mine.ipynb": [TRAFFIC_HANGS]}, PPLAB_AUTOGRADER_DEADLINE="1")
    assert [(t["score"], t["output"]) for t in data["tests"]] == \
        [(0, "timed out: not graded before the autograder's deadline (1 s)")] * 2
    assert "The autograder's deadline (1 s) came before every exercise was graded" in data["output"]


# -- end to end: the CLI's formats --------------------------------------------------

@pytest.mark.usefixtures("no_leftover_processes")
def test_grade_writes_json_junit_and_prairielearn(tmp_path):
    subs = tmp_path / "subs"
    _write(subs / "ada.ipynb", _answer_cell("03_linear_traffic", "linear_traffic"))
    _write(subs / "bob.ipynb", "def linear_traffic(strategy, B, c_in, c_out):\n    return 0")
    out = tmp_path / "grades.json"
    run = subprocess.run(PPLAB + ["grade", str(subs), "--format", "json", "--out", str(out), "--exercises",
                                  "linear_traffic", "--check-timeout", "20", "--jobs", "2"], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr
    data = json.loads(out.read_text())
    ada, bob = (GradeResult.from_dict(s) for s in data["students"])
    assert (ada.student, ada.points, ada.exercises[0].status) == ("ada", 1.0, "passed")
    assert (bob.student, bob.points, bob.exercises[0].status) == ("bob", 0.0, "failed")
    assert bob.exercises[0].message and "linear_traffic: " in bob.notes[-1]
    # JUnit and PrairieLearn from the same results (what --format junit / prairielearn write)
    suites = ET.fromstring(formats.junit([ada, bob]))
    assert [(s.get("name"), s.get("failures")) for s in suites] == [("ada", "0"), ("bob", "1")]
    assert formats.prairielearn(bob)["tests"][0]["points"] == 0


BROADCAST_HANGS = "import time\n\ndef my_broadcast(tensor, src):\n    while True:\n        time.sleep(0.5)"


@pytest.mark.usefixtures("no_leftover_processes")
def test_prairielearn_stopped_midway_scores_what_finished_and_its_deadline_writes_results(tmp_path):
    """PrairieLearn stops the container at its timeout with no marks at all: `pplab grade --format
    prairielearn` stops itself first. Stopped (SIGTERM, as at the deadline, so that a loaded machine
    changes nothing) once linear_traffic has finished, while broadcast's check hangs: linear_traffic
    is scored, broadcast marked timed out. With --deadline 1 nothing finishes and results.json is
    still written."""
    student = tmp_path / "grade" / "student"
    _write(student / "a.ipynb", _answer_cell("03_linear_traffic", "linear_traffic"))
    _write(student / "b.ipynb", BROADCAST_HANGS)
    pl = tmp_path / "results.json"
    args = PPLAB + ["grade", str(student), "--format", "prairielearn", "--exercises", "linear_traffic,broadcast",
                    "--check-timeout", "300"]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, PPLAB_PRAIRIELEARN_OUT=str(pl)))
    try:
        seen = []
        for line in proc.stderr:                       # the grader's log: "pplab: finished <id>: <status>"
            seen.append(line)
            if line.startswith("pplab: finished linear_traffic"):
                break
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 0, "".join(seen) + stderr
    assert stdout.startswith(f"wrote {pl}: 1 of 2 points")
    results = json.loads(pl.read_text())
    assert results["gradable"] is True and results["message"] == "1 of 2 points"
    assert [(t["name"], t["points"], t["max_points"], t["message"]) for t in results["tests"]] == \
        [("broadcast", 0, 1, "timed out: not graded before stopped by a signal"),
         ("linear_traffic", 1, 1, results["tests"][1]["message"])]
    assert results["score"] == 0.5 and results["tests"][1]["message"].startswith("passed")
    assert "Stopped by a signal came before every exercise was graded" in results["output"]
    run = subprocess.run(args + ["--out", str(pl), "--deadline", "1"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    results = json.loads(pl.read_text())
    assert [t["message"] for t in results["tests"]] == \
        ["timed out: not graded before the grader's deadline (--deadline 1 s)"] * 2
    assert results["score"] == 0 and results["gradable"] is True
    refused = subprocess.run(PPLAB + ["grade", str(student), "--deadline", "5"], capture_output=True, text=True)
    assert refused.returncode == 2 and "--deadline is for --format prairielearn" in refused.stderr
