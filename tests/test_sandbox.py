"""The grader's sandbox (pplab/course/sandbox.py, pplab/isolation.py): what a process in it
sees (an allow list: no course checkout, solutions, .git, other checkout, home folder, /sys,
only the `lo` network device), that it can still run torch and pplab, and each limit
(processes, memory, disk) stopping it with a note that names the limit.

Each test runs one small sandboxed probe (a fraction of a second, a few seconds with torch).
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pplab.course import check_process, sandbox

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(sandbox.why_not() is not None, reason=f"no sandbox here: {sandbox.why_not()}")

VIEW = r'''
import json, os, socket, sys
paths = json.loads(sys.argv[1])
seen = {p: sorted(os.listdir(p)) if os.path.isdir(p) else os.path.exists(p) for p in paths}
written = {}
for path in (*sys.argv[3:], "."):
    try:
        open(os.path.join(path, "written-by-sandbox"), "w").close()
        written[path] = "wrote"
    except OSError as err:
        written[path] = err.errno
status = open("/proc/self/status").read()
print(json.dumps({"seen": seen, "written": written, "net": [n for _, n in socket.if_nameindex()],
                  "uid": os.getuid(), "caps": status.split("CapEff:")[1].split()[0],
                  "pids": sorted(int(p) for p in os.listdir("/proc") if p.isdigit()),
                  "root": sorted(os.listdir("/")), "cwd": sorted(os.listdir("."))}))
'''


def _run(argv, **kw):
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, **kw)


def _checkout(folder: Path) -> Path:
    """A stand-in for a second checkout of the course: .git, solutions/ and pplab/."""
    for sub in (".git", "solutions", "pplab"):
        (folder / sub).mkdir(parents=True)
        (folder / sub / "secret.txt").write_text("the answer")
    return folder


@pytest.mark.parametrize("user_namespace", [False, True])
def test_a_sandboxed_process_sees_only_what_is_allowed(tmp_path, user_namespace):
    work, other = tmp_path / "work", _checkout(tmp_path / "other_checkout")
    work.mkdir()
    (work / "student.ipynb").write_text("{}")
    home = os.path.expanduser("~")
    paths = [str(REPO), str(REPO / ".git"), str(REPO / "solutions"), str(REPO / "pplab"), str(other),
             str(other / "solutions"), home, "/sys/class/net", "/work", sys.prefix, os.path.dirname(os.__file__)]
    argv = sandbox.wrap([sys.executable, "-I", "-S", "-c", VIEW, json.dumps(paths), str(tmp_path), sys.prefix,
                         os.path.dirname(os.__file__)],
                        workdir=str(work), denied=[str(other)], user_namespace=user_namespace)
    run = _run(argv)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    seen = out["seen"]
    assert not any(seen[p] for p in paths[1:6] + ["/sys/class/net"]), seen
    # the checkout, the home folder, or /work, only as the way to an allowed folder (the Python
    # installation: `make test` keeps its .venv inside the checkout)
    allowed = sandbox._installation()
    for folder in (str(REPO), home, "/work"):
        assert all(any(a.startswith(os.path.join(folder, name) + "/") or a == os.path.join(folder, name) for a in allowed)
                   for name in seen[folder] or []), (folder, seen[folder])
    assert out["seen"][sys.prefix] and out["seen"][os.path.dirname(os.__file__)]
    assert out["written"][sys.prefix] == 30 and out["written"][os.path.dirname(os.__file__)] == 30    # EROFS
    assert out["written"]["."] == "wrote" and not (work / "written-by-sandbox").exists()     # its own copy
    assert out["cwd"] == ["student.ipynb", "written-by-sandbox"]
    assert out["net"] == ["lo"]
    assert out["uid"] != 0 and out["caps"] == "0000000000000000"
    assert out["pids"][0] == 1 and len(out["pids"]) <= 3          # its own pid namespace
    assert set(out["root"]) <= {".rw", "bin", "dev", "etc", "lib", "lib32", "lib64", "libx32", "proc", "sbin", "tmp",
                                "usr", *[p.strip("/").split("/")[0] for p in sandbox._installation()]}, out["root"]


def test_torch_and_a_copy_of_pplab_run_in_the_sandbox(tmp_path):
    """A launch of two ranks over gloo (on lo), pplab imported from the copy, not the checkout."""
    library, work = tmp_path / "library", tmp_path / "work"
    work.mkdir()
    check_process.copy_pplab(check_process.pplab_sources(), library)
    probe = ("import pplab, torch, torch.distributed as dist\n"
             "def step():\n    t = torch.ones(2) * (dist.get_rank() + 1)\n    dist.all_reduce(t)\n    return t.tolist()\n"
             "print(pplab.__file__, pplab.launch(step, world_size=2, timeout=60)[1])")
    env = {"PATH": os.environ.get("PATH", "/usr/bin"), "PYTHONPATH": str(library), "HOME": str(work)}
    run = _run(sandbox.wrap([sys.executable, "-c", probe], workdir=str(work), read_only=[library], env=env))
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split() == [str(library / "pplab" / "__init__.py"), "[3.0,", "3.0]"]


def _stopped(code, limits, tmp_path):
    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    run = _run(sandbox.wrap([sys.executable, "-I", "-S", "-c", code], workdir=str(work), limits=limits))
    lines = [line.strip() for line in (run.stdout + run.stderr).splitlines() if line.strip()]
    return run, sandbox.stopped_by(run.returncode, lines)


def test_a_fork_bomb_is_stopped_at_the_process_limit(tmp_path):
    code = ("import os, time\nfor _ in range(200):\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
            "time.sleep(30)")
    run, note = _stopped(code, sandbox.Limits(processes=40), tmp_path)
    assert run.returncode == sandbox.LIMIT_HIT, run.stderr[-500:]
    assert "processes and threads at once" in note and "pplab grade --processes 40" in note


def test_one_huge_allocation_fails_at_once_and_many_processes_are_summed(tmp_path):
    """RLIMIT_DATA refuses 30 GB in one process; the watchdog sums what four processes hold."""
    run, note = _stopped("try:\n    bytearray(30 << 30)\nexcept MemoryError:\n    print('MemoryError')",
                         sandbox.Limits(memory=512 << 20), tmp_path)
    assert run.returncode == 0 and run.stdout.strip() == "MemoryError" and note is None
    code = ("import os, time\nfor _ in range(4):\n    if os.fork() == 0:\n        x = bytearray(200 << 20)\n"
            "        time.sleep(30)\n        os._exit(0)\ntime.sleep(30)")
    run, note = _stopped(code, sandbox.Limits(memory=512 << 20), tmp_path)
    assert run.returncode == sandbox.LIMIT_HIT, run.stderr[-500:]
    assert "of memory, more than the limit" in note and "pplab grade --memory 512M" in note


def test_a_full_disk_is_stopped_and_nothing_reaches_the_graders_disk(tmp_path):
    code = ("import time\nfor folder in ('/tmp', '/dev/shm', '.'):\n    try:\n"
            "        with open(folder + '/fill', 'wb') as f:\n            while True:\n"
            "                f.write(b'x' * (1 << 20))\n    except OSError as err:\n        print(folder, err.errno, flush=True)\n"
            "time.sleep(30)")
    run, note = _stopped(code, sandbox.Limits(disk=32 << 20), tmp_path)
    assert run.returncode == sandbox.LIMIT_HIT, run.stderr[-500:]
    assert "/tmp 28" in run.stdout                              # ENOSPC: one tmpfs for all three
    assert "pplab grade --disk 32M" in note
    assert list((tmp_path / "work").iterdir()) == []


def test_limits_are_read_as_sizes_and_refused_when_too_small():
    assert sandbox.parse_size("512M") == 512 << 20 and sandbox.parse_size("2g") == 2 << 30
    assert sandbox.parse_size("1.5G") == 3 << 29 and sandbox.parse_size("4096") == 4096
    assert sandbox.Limits.parse("1G", 64, "100M") == sandbox.Limits(1 << 30, 64, 100 << 20)
    with pytest.raises(ValueError, match=r"not a size: 'lots' \(write it as 512M, 2G or a number of bytes\)"):
        sandbox.parse_size("lots")
    with pytest.raises(ValueError, match=r"limits too small to run Python and torch: memory 100M, 256 processes"):
        sandbox.Limits.parse("100M")
