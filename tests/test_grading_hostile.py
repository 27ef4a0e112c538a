"""`pplab grade` end to end, against good, broken, attacking and hostile submissions: one grading
run with one notebook of each kind, between two correct students, must finish with a complete
CSV; every attack gets no mark and a note; the correct students keep theirs; nothing is left
running or written.

The attacks that could harm the machine if the sandbox failed are written to be harmless
(a comment line in a .pth file, a daemon that ends by itself within a minute), and the test
puts back anything they changed.
"""
import csv
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

from conftest import descendants
from pplab import checks
from pplab.course import grading, runner, sandbox, submission

REPO = Path(__file__).resolve().parents[1]
PPLAB = [sys.executable, "-m", "pplab.course.cli"]
TOKEN = f"pplab-hostile-{os.getpid()}"          # in the command line of every daemon an attack starts


def _solution_cell():
    nb = nbformat.read(REPO / "solutions" / "00_broadcast.ipynb", 4)
    return next(c.source for c in nb.cells if c.cell_type == "code" and "def my_broadcast" in c.source)


WRONG = "def my_broadcast(tensor, src):\n    pass"


def _write(path, *sources, markdown=()):
    cells = [new_markdown_cell(m) for m in markdown] + [new_code_cell(s) for s in sources]
    nbformat.write(new_notebook(cells=cells), path)


def _site_packages() -> Path:
    return Path(next(p for p in sys.path if p.endswith("site-packages") and os.access(p, os.W_OK)))


def _daemon_code(seconds=60):
    """A daemon in its own session that kills every check process it can see, for a minute."""
    body = ("import os, time, signal\n"
            f"end = time.time() + {seconds}\n"
            "while time.time() < end:\n"
            "    for pid in os.listdir('/proc'):\n"
            "        try:\n"
            "            if pid.isdigit() and b'_check_main' in open(f'/proc/{pid}/cmdline', 'rb').read():\n"
            "                os.kill(int(pid), signal.SIGKILL)\n"
            "        except OSError:\n"
            "            pass\n"
            "    time.sleep(0.05)\n")
    return ("import subprocess, sys\n"
            f"subprocess.Popen([sys.executable, '-c', {body!r}, {TOKEN!r}], start_new_session=True,\n"
            "                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)")


def _ours_alive():
    found = []
    for pid in os.listdir("/proc"):
        try:
            if pid.isdigit() and TOKEN.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(int(pid))
        except OSError:
            pass
    return found


# -- one grading run over every kind of submission ------------------------------------------------
# Each `pplab grade` run pays for its own start and waits out its slowest notebook, so the broken,
# hostile and attacking notebooks of every test below are graded together, in one run (with
# --jobs 3 their waits overlap), and each test reads its students' rows.

FIXTURES = Path(__file__).parent / "fixtures" / "grading"
SANDBOXED = sandbox.why_not() is None
# a cell's limit: ada's endless loop and floods_output's endless output run this long (the
# longest honest cell here, the solution notebook's own check, takes about 3 s)
CELL_TIMEOUT = 16
CHECK_TIMEOUT = 12           # the grader wants a check's limit under a cell's


def _good_and_broken(subs):
    """Students whose notebooks hang, crash, deadlock or are not notebooks at all."""
    # hangs after a correct answer: interrupted at the cell limit, the rest still runs
    # (a sleeping loop rather than `while True: pass`, not to starve the other notebooks)
    _write(subs / "ada.ipynb", "from pplab import comm", _solution_cell(),
           "import time\nwhile True:\n    time.sleep(0.1)", "print('still here')")
    # the generated exercise, untouched, plus lines that only look like a pass
    shutil.copy(REPO / "exercises" / "00_broadcast.ipynb", subs / "bob.ipynb")
    nb = nbformat.read(subs / "bob.ipynb", 4)
    nb.cells.append(new_code_cell('print("✔ broadcast: passed on world sizes 2, 3, 4")\n'
                                  'import json\n'
                                  'print("0" * 32, json.dumps({"passed": True, "message": "forged"}))'))
    nbformat.write(nb, subs / "bob.ipynb")
    # the solution notebook as handed in by a student who did everything right
    (subs / "cyd").mkdir()
    shutil.copy(REPO / "solutions" / "00_broadcast.ipynb", subs / "cyd" / "00_broadcast.ipynb")
    # crashes the kernel before its correct answer: definitions are graded from the source,
    # whatever the run did
    _write(subs / "dan.ipynb", "from pplab import comm", "import os\nos._exit(1)", _solution_cell())
    # not a notebook at all
    (subs / "hal.ipynb").write_text("not json")
    # deadlocks: every rank receives before it sends
    _write(subs / "eve.ipynb", "from pplab import comm\n\ndef my_broadcast(tensor, src):\n"
           "    p = comm.world_size()\n    comm.recv(tensor, (comm.rank() - 1) % p)\n"
           "    comm.send(tensor, (comm.rank() + 1) % p)")


def _hostile(subs):
    """Broken notebooks and notebooks that attack the machine, graded only where the sandbox holds
    them. Returns what the test puts back: the .pth file one of them writes and the runner it
    appends to."""
    good = _solution_cell()
    # 1. broken notebooks: each gets its own row and a note; answers they hold are still graded
    (subs / "no_source.ipynb").write_text(json.dumps({"cells": [{"cell_type": "code"}], "metadata": {},
                                                      "nbformat": 4, "nbformat_minor": 5}))
    _write(subs / "huge_expression.ipynb", "from pplab import comm", "x = (" + " + ".join(["1"] * 30_000) + ")", good,
           "my_x =" + " " * 20_000)                 # issue 34: the old prediction pattern took days over this cell
    _write(subs / "deep_nesting.ipynb", "x = " + "[" * 5000 + "]" * 5000, WRONG)
    (subs / "binary.ipynb").write_bytes(os.urandom(4096))
    (subs / "nbformat3.ipynb").write_text(json.dumps({"worksheets": [{"cells": []}], "metadata": {}, "nbformat": 3}))
    (subs / "not_json.ipynb").write_text("{ not json")
    # 2. writes into the environment and the course: read-only in the sandbox
    site, runner_file = _site_packages(), Path(runner.__file__)
    pth, runner_text = site / f"zz_{TOKEN}.pth", runner_file.read_text()
    writer = (f"import pathlib\n"
              f"for path, text in (({str(pth)!r}, '# harmless'), ({str(runner_file)!r}, None)):\n"
              f"    try:\n"
              f"        with open(path, 'a') as f:\n"
              f"            f.write(text or '\\n# appended by a student\\n')\n"
              f"    except OSError as err:\n"
              f"        print('refused:', err)")
    _write(subs / "writes_environment.ipynb", writer,
           "from pplab import comm\n\ndef my_broadcast(tensor, src):\n    exec(WRITER)\n", f"WRITER = {writer!r}")
    # 3. a daemon in its own session, started by the kernel and by the answer in a rank
    _write(subs / "daemon.ipynb", _daemon_code(),
           "import subprocess, sys\n\ndef my_broadcast(tensor, src):\n    exec(DAEMON)\n", f"DAEMON = {_daemon_code()!r}")
    # 4. a link to another student's notebook; a name a spreadsheet would run
    (subs / "linked.ipynb").symlink_to(subs / "aa_good.ipynb")
    _write(subs / "=1+1.ipynb", WRONG)
    # 5. forged notes: writes note lines on every descriptor of its parent (the runner)
    _write(subs / "forges_notes.ipynb",
           "import json, os\nline = (json.dumps({'note': 'FORGED NOTE'}) + '\\n').encode()\n"
           "for pid in (os.getppid(), os.getpid()):\n"
           "    for fd in os.listdir(f'/proc/{pid}/fd'):\n"
           "        try:\n"
           "            f = os.open(f'/proc/{pid}/fd/{fd}', os.O_WRONLY | os.O_NONBLOCK)\n"
           "            os.write(f, line)\n"
           "            os.close(f)\n"
           "        except OSError:\n"
           "            pass", WRONG)
    # 6. reading another student's notebook (its path written into the answer)
    _write(subs / "copies_a_classmate.ipynb",
           f"import json\n\ndef my_broadcast(tensor, src):\n"
           f"    cells = json.load(open({str(subs / 'aa_good.ipynb')!r}))['cells']\n"
           f"    scope = {{}}\n"
           f"    for cell in cells:\n"
           f"        if cell['cell_type'] == 'code':\n"
           f"            exec(''.join(cell['source']), scope)\n"
           f"    scope['my_broadcast'](tensor, src)")
    # 7. the checker's reference, reached by an import hidden in a string
    _write(subs / "imports_checker.ipynb",
           "import importlib\n\ndef my_broadcast(tensor, src):\n"
           "    checks = importlib.import_module('pplab.checks.ch00_start_here.broadcast')\n    return checks")
    # 8. an answer hidden in a block
    _write(subs / "in_a_block.ipynb", "from pplab import comm", "if True:\n" + "\n".join("    " + line for line in
                                                                                      good.splitlines()))
    # 9. output without end: a cell that prints 1 MB lines until its timeout
    _write(subs / "floods_output.ipynb", "from pplab import comm", good,
           "import sys\nwhile True:\n    sys.stdout.write('x' * (1 << 20) + '\\n')")
    # 10. attacks from inside the answer, on the check's own ranks (tests/test_checks_sealed.py):
    #     the seed through frames and the heap, a forbidden call's record erased, the backend
    #     object, the functional collectives, a file shared between ranks
    import inspect
    import test_checks_sealed as sealed_attacks
    for attack in (sealed_attacks.steals_from_frames, sealed_attacks.erases_the_record, sealed_attacks.uses_the_backend,
                   sealed_attacks.uses_functional_collectives, sealed_attacks.shares_a_file):
        code = inspect.getsource(attack).replace(f"def {attack.__name__}(", "def my_broadcast(", 1)
        _write(subs / f"rank_{attack.__name__}.ipynb", sealed_attacks.IMPORTS, inspect.getsource(sealed_attacks._token),
               inspect.getsource(sealed_attacks._plain_broadcast), code)
    # 11. issue 34: not a regular file (a FIFO blocked the read forever), two names that read as one student
    os.mkfifo(subs / "fifo.ipynb")
    (subs / "folder.ipynb").mkdir()
    _write(subs / "folder.ipynb" / "inside.ipynb", good)
    _write(subs / "zo\xeb.ipynb", good)
    _write(subs / "zoe\u0308.ipynb", good)
    # 12. limits (issue 34): a fork bomb, a 30 GB allocation, a full disk; each in the kernel and in the answer
    bomb = "import os\nfor _ in range(10_000):\n    try:\n        os.fork()\n    except OSError:\n        pass"
    huge = "import torch\nx = torch.zeros(30 << 30, dtype=torch.uint8)"
    fill = ("with open('/tmp/fill', 'wb') as f:\n    for _ in range(10_000):\n"
            "        f.write(b'x' * (1 << 20))")
    for name, attack in (("fork_bomb", bomb), ("allocates_30_gb", huge), ("fills_the_disk", fill)):
        _write(subs / f"{name}.ipynb", attack, f"def my_broadcast(tensor, src):\n    exec(ATTACK)\n",
               f"ATTACK = {attack!r}")
    return pth, runner_file, runner_text


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    """The one grading run. Two correct students come first and last (aa_good, zz_good); the
    attacks on the grader (tests/fixtures/grading, with a wrong my_broadcast) and the broken
    notebooks come between. The grader runs from a copy of pplab, so that the attack that writes
    into pplab's folder and onto sys.path writes only into the copy."""
    tmp = tmp_path_factory.mktemp("graded")
    copy, site, subs = tmp / "pplab-copy", tmp / "pplab-site", tmp / "submissions"
    shutil.copytree(REPO / "pplab", copy / "pplab", ignore=shutil.ignore_patterns("__pycache__"))
    site.mkdir()
    subs.mkdir()
    good = _solution_cell()
    _write(subs / "aa_good.ipynb", "from pplab import comm", good)
    _write(subs / "zz_good.ipynb", "from pplab import comm", good,
           markdown=["My written answer: the tree needs ceil(log2 p) rounds."])
    for notebook in FIXTURES.glob("*.ipynb"):
        shutil.copy(notebook, subs / notebook.name)
    _good_and_broken(subs)
    pth, runner_file, runner_text = _hostile(subs) if SANDBOXED else (None, None, None)
    limits = ["--memory", "1500M", "--processes", "200", "--disk", "128M"] if SANDBOXED else []
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), str(copy)]))
    out = tmp / "grades.csv"
    before = descendants()
    try:
        run = subprocess.run(PPLAB + ["grade", str(subs), "--out", str(out), "--timeout", "150", "--cell-timeout",
                                      str(CELL_TIMEOUT), "--check-timeout", str(CHECK_TIMEOUT), "--jobs", "3", *limits],
                             capture_output=True, text=True, timeout=900, env=env, cwd=tmp)
        left = _ours_alive()
    finally:
        for pid in _ours_alive():
            os.kill(pid, signal.SIGKILL)
        changed = written = False
        if SANDBOXED:
            changed = runner_file.read_text() != runner_text
            if changed:
                runner_file.write_text(runner_text)
            written = pth.exists()
            pth.unlink(missing_ok=True)
    leftover = descendants() - before
    assert run.returncode == 0, run.stderr[-3000:]
    with open(out, newline="") as f:
        rows = {row["student"]: row for row in csv.DictReader(f)}
    return SimpleNamespace(run=run, rows=rows, notes={s: r["notes"] for s, r in rows.items()}, left=left,
                           leftover=leftover, changed=changed, written=written, tmp=tmp, copy=copy,
                           site=site)


@pytest.mark.timeout(960)         # the first of these pays for the run (45 students, up to 900 s on a loaded machine)
def test_a_folder_of_good_and_broken_submissions(graded):
    assert not graded.leftover, f"processes left behind: {sorted(graded.leftover)}"
    rows = graded.rows
    ids = grading.chapter_order(checks.EXERCISES)
    assert ids[:4] == ["broadcast", "reduce_scatter", "ring_all_reduce", "predict_time"]       # chapters 0, 1a-c
    assert list(rows["ada"]) == ["student", *ids, "total", "notes"]
    scores = {s: (rows[s]["broadcast"], int(rows[s]["total"])) for s in ("ada", "bob", "cyd", "dan", "eve", "hal")}
    # bob handed in the exercise untouched: "missing" (not attempted), which is not 0 (tried, wrong)
    assert scores == {"ada": ("1", 1), "bob": ("missing", 0), "cyd": ("1", 1), "dan": ("1", 1), "eve": ("0", 0),
                      "hal": ("missing", 0)}, rows
    assert all(r["ring_all_reduce"] == "missing" for r in rows.values())
    assert rows["ada"]["notes"] == f"cell 3 timed out after {CELL_TIMEOUT} s"
    assert "is not implemented yet" not in rows["bob"]["notes"]
    assert rows["cyd"]["notes"] == ""
    assert "kernel died in cell 2" in rows["dan"]["notes"]
    assert "a deadlock: rank 0 waits to receive from rank 1" in rows["eve"]["notes"]
    assert rows["hal"]["notes"].startswith("could not read the notebook: not a notebook (not JSON")


ATTACKS = ["helpers", "attack_run_check", "attack_grader_functions", "attack_results_file", "attack_monkeypatch",
           "attack_files", "attack_call_time", "attack_kills_checker"]


@pytest.mark.timeout(960)         # the first of these pays for the run (45 students, up to 900 s on a loaded machine)
def test_attacks_on_the_grader_get_no_marks_and_a_note(graded):
    """Each attack notebook (tests/fixtures/grading, with a wrong my_broadcast) gets 0 and a
    note on what was ignored; correct answers graded in the same run, before and after the
    attacks wrote their files (aa_good, zz_good), still pass."""
    rows, notes, copy, site = graded.rows, graded.notes, graded.copy, graded.site
    assert {s: int(rows[s]["broadcast"]) for s in ["aa_good", "zz_good", *ATTACKS]} == {
        "aa_good": 1, "zz_good": 1, "helpers": 1, "attack_run_check": 0, "attack_grader_functions": 0, "attack_results_file": 0,
        "attack_monkeypatch": 0, "attack_files": 0, "attack_call_time": 0, "attack_kills_checker": 0}, rows
    assert "ignored cell 4, line 4: `pplab.checks.run_check = ...`: the grader runs only definitions" in \
        notes["attack_run_check"]
    assert "ignored cell 5, line 7: `pplab.course.grading.grade_in_kernel = ...`" in notes["attack_grader_functions"]
    assert "ignored cell 5, line 8: `pplab.course.grading.run_check_process = ...`" in notes["attack_grader_functions"]
    assert "ignored cell 5, line 1: `for pid in (os.getppid(), os.getpid()):`" in notes["attack_results_file"]
    sandboxed = sandbox.why_not() is None
    assert "ignored cell 5, line 7: `for parent in (pathlib.Path.cwd(), pathlib.Path.cwd().parent):`" in \
        notes["attack_results_file"]
    assert "ignored cell 3, line 2: `comm.send = ...`" in notes["attack_monkeypatch"]
    assert "ignored cell 3, line 3: `dist.ProcessGroup.broadcast = ...`" in notes["attack_monkeypatch"]
    assert "ignored cell 4, line 1: `class Quiet:" in notes["attack_monkeypatch"]
    assert "`(here.parent / 'results.jsonl').write_text(json.dumps(FORGED) + '\\n')`" in notes["attack_files"]
    # the answer imports pplab.checks.collectives: refused before it runs
    assert "my_broadcast uses `pplab.checks` (cell 2), the grader's own code" in notes["attack_call_time"]
    assert re.search(r"broadcast: ignored [1-9]\d* forged verdict\(s\)", notes["attack_kills_checker"])
    assert "cell 8 raised ValueError: a cell that raises" in notes["helpers"]
    if sandboxed:
        # pplab's files and the folders on sys.path are read-only in the sandbox: nothing was written,
        # and the kill of the check process (pid 1 of its sandbox) had no effect
        assert not (copy / "pplab" / "checks" / "zz_forged.py").exists()
        assert not (site / "pplab" / "__init__.py").exists()
        assert (copy / "pplab" / "checks" / "core.py").read_text() == (REPO / "pplab" / "checks" / "core.py").read_text()
        assert "differs from the reference" in notes["attack_kills_checker"]
        assert not any("forged" in notes[s].lower() and "ignored" not in notes[s].lower() for s in ATTACKS)
    else:
        assert "pplab's files on disk changed while the notebook ran (pplab.checks.core, pplab.checks.zz_forged)" \
            in notes["attack_files"]


@pytest.mark.timeout(960)
@pytest.mark.skipif(not SANDBOXED, reason=f"no sandbox on this machine: {sandbox.why_not()}")
def test_every_kind_of_hostile_submission_gets_its_row_and_note(graded):
    run, rows = graded.run, graded.rows
    assert not graded.left, f"processes started by the attacks outlived the grading: {graded.left}"
    assert not graded.changed and not graded.written, "a submission wrote into pplab or site-packages"
    marks = {s: r["broadcast"] for s, r in rows.items() if s not in ATTACKS + ["ada", "bob", "cyd", "dan", "eve", "hal"]}
    assert marks == {
        "aa_good": "1", "zz_good": "1", "huge_expression": "1",
        "no_source": "missing", "deep_nesting": "0", "binary": "missing", "nbformat3": "missing",
        "not_json": "missing", "writes_environment": "0", "daemon": "0", "linked": "missing", "'=1+1": "0",
        "forges_notes": "0", "copies_a_classmate": "0", "imports_checker": "0", "in_a_block": "missing",
        "floods_output": "1", "rank_steals_from_frames": "0", "rank_erases_the_record": "0",
        "rank_uses_the_backend": "0", "rank_uses_functional_collectives": "0", "rank_shares_a_file": "0",
        "fifo": "missing", "folder": "missing", "zo\\xeb": "missing", "zoe\\u0308": "missing",
        "fork_bomb": "0", "allocates_30_gb": "0", "fills_the_disk": "0"}, rows
    notes = graded.notes
    assert "cell 1 is not a well-formed cell (no cell_type or source): skipped" in notes["no_source"]
    assert "cell 2 could not be read by Python's parser (RecursionError)" in notes["huge_expression"]
    assert "could not read the notebook: not a notebook (not JSON" in notes["binary"]
    assert "nbformat 3: open and save it in Jupyter" in notes["nbformat3"]
    assert "linked.ipynb is a symbolic link" in notes["linked"]
    assert not any("FORGED NOTE" in n for n in notes.values())
    assert "uses `pplab.checks`" in notes["imports_checker"] and "gets no mark" in notes["imports_checker"]
    assert "my_broadcast is defined inside an `if` block (cell 2, line 2)" in notes["in_a_block"]
    # output without end: the cell times out, or the messages queued for it pass the memory limit first
    # (or, where the kernel buffers the output itself, a MemoryError at the submission's memory limit)
    assert f"cell 3 timed out after {CELL_TIMEOUT} s" in notes["floods_output"] or \
        "the notebook was stopped: its processes held" in notes["floods_output"] or \
        "cell 3 raised MemoryError (the submission's memory limit: pplab grade --memory 1.46G)" in notes["floods_output"]
    assert "a check's ranks have no process group" in notes["rank_uses_the_backend"]
    assert "torch.distributed._functional_collectives" in notes["rank_uses_functional_collectives"]
    assert "you called torch.distributed.all_reduce" in notes["rank_erases_the_record"]
    assert "fifo.ipynb is a named pipe (FIFO), not a notebook file" in notes["fifo"]
    assert "folder.ipynb is a folder, not a notebook file" in notes["folder"]
    assert "cannot tell them apart: neither was graded" in notes["zo\\xeb"]
    assert "cell 4 has a syntax error" in notes["huge_expression"]
    assert "the notebook was stopped: it ran" in notes["fork_bomb"] and "--processes 200" in notes["fork_bomb"]
    # in the check, the bomb's ranks reach the limit, or (forking slowly on a loaded machine) its time limit
    assert "the check was stopped: it ran" in notes["fork_bomb"] or f"still running after {CHECK_TIMEOUT} s" in notes["fork_bomb"]
    assert "can't allocate memory" in notes["allocates_30_gb"] and "--memory 1.46G" in notes["allocates_30_gb"]
    assert "--disk 128M" in notes["fills_the_disk"]
    assert "limits per submission: memory 1.46G, 200 processes, disk 128M" in run.stderr
    assert f"summary: {29 + len(ATTACKS) + 6} student(s)" in run.stderr
    assert (graded.tmp / "grades_answers" / "zz_good.md").read_text().count("ceil(log2 p)") == 1




def test_a_cell_is_refused_and_the_others_read(tmp_path):
    """read_cells: a malformed cell is skipped with a note, the rest are kept in order."""
    path = tmp_path / "nb.ipynb"
    path.write_text(json.dumps({"cells": [
        {"cell_type": "code", "source": ["a = 1\n", "b = 2"]}, {"cell_type": "code", "source": 7},
        "not a cell", {"cell_type": "markdown", "source": "text"},
        {"cell_type": "code", "source": "x" * (grading.MAX_CELL_CHARS + 1)}], "nbformat": 4}))
    cells, notes = grading.read_cells(path)
    assert cells == [(1, "code", "a = 1\nb = 2"), (4, "markdown", "text")]
    assert notes == ["cell 2 is not a well-formed cell (no cell_type or source): skipped",
                     "cell 3 is not a well-formed cell (no cell_type or source): skipped",
                     f"cell 5 holds {grading.MAX_CELL_CHARS + 1:,} characters, more than the grader reads "
                     f"({grading.MAX_CELL_CHARS:,}): skipped"]
    big = tmp_path / "big.ipynb"
    with open(big, "wb") as f:                     # sparse: refused by its size, never read
        f.truncate(grading.MAX_NOTEBOOK_BYTES + 1)
    with pytest.raises(ValueError, match=r"the notebook is 20 MB, more than the grader reads \(20 MB\)"):
        grading.read_cells(big)


@pytest.mark.parametrize("source, used", [
    ("import pplab.checks\ndef my_broadcast(t, s):\n    pplab.checks.core", "`pplab.checks`"),
    ("from pplab.checks.ch00_start_here import broadcast\ndef my_broadcast(t, s):\n    broadcast", "`pplab.checks`"),
    ("from pplab import checks\ndef my_broadcast(t, s):\n    checks", "`pplab.checks`"),
    ("import pplab\ndef my_broadcast(t, s):\n    getattr(pplab, 'course')", "`pplab.course`"),
    ("import pplab\ndef helper():\n    return pplab.checks.ch01_collectives.ring_checks._inputs\n"
     "def my_broadcast(t, s):\n    helper()", "`pplab.checks`"),
    ("import importlib\ndef my_broadcast(t, s):\n    importlib.import_module('pplab.course.check_process')",
     "`pplab.course`"),
])
def test_an_answer_that_uses_the_checker_at_any_depth_is_refused(source, used):
    found = submission.definitions([(3, source)], {"my_broadcast"})
    assert used in found.refused["my_broadcast"], found.refused


def test_an_answer_that_does_not_use_the_checker_is_not_refused():
    source = ("import pplab\nfrom pplab import comm\nCHECKS = 'checks'\n"
              "def my_broadcast(t, s):\n    print('see pplab.check in the notebook', CHECKS)\n    comm.send(t, 1)")
    assert submission.definitions([(1, source)], {"my_broadcast"}).refused == {}


def test_csv_cells_that_a_spreadsheet_would_run_are_quoted():
    assert [grading._csv_safe(v) for v in ["=1+1", "+cmd", "-2", "@SUM(A1)", "bob", 3, "a=b"]] == \
        ["'=1+1", "'+cmd", "'-2", "'@SUM(A1)", "bob", 3, "a=b"]


def test_unknown_exercises_are_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match=r"unknown exercise\(s\) brodcast: the exercises are broadcast, "):
        grading.grade(tmp_path, tmp_path / "g.csv", exercises=["brodcast"])


@pytest.mark.parametrize("as_source", [False, True])
def test_the_library_answer_reached_through_helpers_is_refused(as_source):
    """refuse_library follows the student's helpers and classes at any depth."""
    from pplab import checks

    code = ("from pplab import pipeline\n"
            "class Model:\n    def fraction(self, p, m):\n        return pipeline.bubble_fraction(p, m)\n"
            "def helper(p, m):\n    return Model().fraction(p, m)\n"
            "def measure_bubble(timeline):\n    return helper(timeline.world_size, 4)")
    if as_source:
        answer = checks.SourceAnswer("measure_bubble", (("<cell 1>", 1, code),))
    else:
        scope = {"__name__": "student"}
        exec(compile(code, "<cell 1>", "exec"), scope)
        answer = scope["measure_bubble"]
    message = checks.run_check("bubble_fraction", answer).message
    if as_source:        # graded: the module holding the answer does not exist where the answer runs (denied.py)
        assert "the library's pplab.pipeline.simulate is not available while your answer is checked" in message
    else:
        assert "you use pplab's own measure (Timeline.busy, bubble or utilization, or bubble_fraction), the " \
               "library's answer" in message
