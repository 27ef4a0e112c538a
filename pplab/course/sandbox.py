"""A sandbox for a student's code while `pplab grade` runs it (Linux namespaces, no root needed).

    argv = sandbox.wrap(["python", "-c", "..."], workdir=scratch, writable=[scratch], hidden=[subs])
    subprocess.Popen(argv, ...)            # or sandbox.why_not() -> why this machine has none

What the wrapped command sees, and why:
* the whole filesystem is read-only: the course (pplab's own files), the Python environment
  (site-packages, where a `.pth` file or `sitecustomize.py` would run in every later check)
  and everything else. Only `writable` folders (its scratch folder) can be written;
* `hidden` folders (the other submissions, the solutions) and /tmp, /var/tmp, /dev/shm are
  replaced by empty in-memory folders, so nothing of another student's run is visible and
  nothing this run writes there outlives it;
* its own process ids (a pid namespace): when the sandbox's first process ends, or is
  killed, the kernel kills every process it started, even one in a new session or a
  double-forked daemon. Nothing it starts can signal or read processes outside;
* its own network, with only the loopback device: ranks and kernels talk over 127.0.0.1
  inside it, and cannot reach anything outside;
* it runs as an ordinary user without capabilities, in a user namespace nested inside the
  one that set the mounts up, so it cannot undo them (mounts set up by a more privileged
  namespace are locked).

How: `python -I -S -c BOOT` calls unshare(2) for new user, mount, pid and network
namespaces, forks the process that becomes pid 1, sets up the mounts, brings up the
loopback, enters a nested user namespace and execs the command. The same `unshare
--user --map-root-user --mount --pid --net --fork` the shell offers, plus the mounts.

Where user namespaces are not allowed (macOS, Windows, a kernel or container that turns
them off), `why_not()` says why and the grader runs the command as it is, saying so: a
student's code can then write the environment and leave processes behind.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from functools import lru_cache

TMPFS_SIZE = "512m"            # each in-memory folder: a student cannot fill the machine's memory
_ALWAYS_HIDDEN = ("/tmp", "/var/tmp", "/dev/shm")

# Runs in a fresh `python -I -S` (no site-packages, no current folder on sys.path): only the
# standard library, and nothing the student could have written.
BOOT = r'''
import ctypes, fcntl, json, os, signal, socket, struct, sys
spec = json.loads(sys.argv[1])
libc = ctypes.CDLL(None, use_errno=True)
libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
NEWNS, NEWUSER, NEWPID, NEWNET = 0x00020000, 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 2, 4, 8, 32, 4096, 16384, 1 << 18
ST_TO_MS = {1: MS_RDONLY, 2: MS_NOSUID, 4: MS_NODEV, 8: MS_NOEXEC, 1024: 1024, 2048: 2048, 4096: 1 << 21}

def ok(ret, what):
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")

def put(path, text):
    with open(path, "w") as f:
        f.write(text)

def mount(source, target, fstype, flags, data=None):
    enc = lambda s: None if s is None else s.encode()
    ok(libc.mount(enc(source), enc(target), enc(fstype), flags, enc(data)), f"mount {target}")

def enter_user_namespace(flags, inside_uid, outside_uid, outside_gid):
    ok(libc.unshare(NEWUSER | flags), "unshare")
    put("/proc/self/setgroups", "deny")
    put("/proc/self/uid_map", f"{inside_uid} {outside_uid} 1")
    put("/proc/self/gid_map", f"{inside_uid} {outside_gid} 1")

def unescape(path):                      # mountinfo writes a space as \040
    return path.replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n").replace("\\134", "\\")

try:
    enter_user_namespace(NEWNS | NEWPID | NEWNET, 0, os.getuid(), os.getgid())
except OSError as err:
    print(f"pplab-sandbox: no namespaces here ({err})", file=sys.stderr, flush=True)
    os._exit(111)
child = os.fork()
if child:                                # outside the pid namespace: wait, and pass its end on
    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(s, lambda *_: os.kill(child, signal.SIGKILL))
    while True:
        try:
            _, status = os.waitpid(child, 0)
            break
        except InterruptedError:
            continue
    if os.WIFSIGNALED(status):           # die the same way, so the caller sees the signal
        signal.signal(os.WTERMSIG(status), signal.SIG_DFL)
        os.kill(os.getpid(), os.WTERMSIG(status))
    os._exit(os.waitstatus_to_exitcode(status) % 256)
try:                                     # pid 1 of the new namespace
    libc.prctl(1, signal.SIGKILL)        # PR_SET_PDEATHSIG: if the waiter is killed, so is the sandbox
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    writable = [os.path.realpath(p) for p in spec["writable"]]
    kept = {p: os.open(p, os.O_PATH | os.O_DIRECTORY) for p in writable + spec["visible"] if os.path.isdir(p)}
    under = lambda p, roots: any(p == r or p.startswith(r.rstrip("/") + "/") for r in roots)
    hidden = [os.path.realpath(p) for p in spec["hidden"] if os.path.isdir(p) and not os.path.islink(p)]
    fresh = []

    def hide(paths):
        for path in paths:
            if os.path.isdir(path):
                mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV, f"size={spec['tmpfs_size']},mode=1777")
                fresh.append(path)
    # Hidden folders first, then the kept ones back where they were (a kept folder may lie in
    # a hidden one: the scratch folder in /tmp), then hidden folders inside kept ones.
    hide([h for h in hidden if not any(under(h, [k]) and h != k for k in kept)])
    for path, fd in kept.items():
        os.makedirs(path, exist_ok=True)
        mount(f"/proc/self/fd/{fd}", path, None, MS_BIND | MS_REC)
        os.close(fd)
    hide([h for h in hidden if any(under(h, [k]) and h != k for k in kept)])
    failed = []
    with open("/proc/self/mountinfo") as f:
        points = [unescape(line.split()[4]) for line in f]
    for point in sorted(set(points), key=len):
        if under(point, ["/proc"]) or under(point, writable) or point in fresh or not os.path.exists(point):
            continue
        try:
            flags = os.statvfs(point).f_flag
            keep = sum(ms for st, ms in ST_TO_MS.items() if flags & st)
            mount(None, point, None, MS_REMOUNT | MS_BIND | MS_RDONLY | keep)
        except OSError as err:
            failed.append(point)
            if point == "/" or any(under(p, [point]) for p in spec["must_be_read_only"]):
                raise
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)   # the loopback device, up
    flags = struct.unpack("16sH", fcntl.ioctl(s, 0x8913, struct.pack("16sH14s", b"lo", 0, b""))[:18])[1]
    fcntl.ioctl(s, 0x8914, struct.pack("16sH14s", b"lo", flags | 1, b""))
    s.close()
    # a nested user namespace, as an ordinary user: no capability left to undo the mounts
    enter_user_namespace(NEWNS, spec["uid"], 0, 0)
    libc.prctl(38, 1, 0, 0, 0)           # PR_SET_NO_NEW_PRIVS
    os.chdir(spec["workdir"])
    os.execve(spec["argv"][0], spec["argv"], spec["env"])
except BaseException as err:
    print(f"pplab-sandbox: could not set up the sandbox: {type(err).__name__}: {err}", file=sys.stderr, flush=True)
    os._exit(111)
'''

SETUP_FAILED = 111           # the exit code of a sandbox that could not be set up


def wrap(argv: list[str], *, workdir: str, writable=(), visible=(), hidden=(), env: dict | None = None) -> list[str]:
    """The command that runs `argv` in the sandbox, in `workdir` (which is writable), with
    `writable` folders writable, `visible` folders read-only (even under a hidden one) and
    `hidden` folders replaced by empty ones."""
    argv = list(argv)
    if not os.path.isabs(argv[0]):
        argv[0] = _which(argv[0])
    spec = {
        "argv": argv, "workdir": os.path.realpath(workdir), "env": dict(os.environ if env is None else env),
        "writable": sorted({os.path.realpath(workdir), *map(os.path.realpath, writable)}),
        "visible": sorted(set(map(os.path.realpath, [*visible, *_installation()]))),
        "hidden": sorted({*_ALWAYS_HIDDEN, *map(os.path.realpath, hidden)}),
        "must_be_read_only": [sys.prefix, _course_root()],
        "tmpfs_size": TMPFS_SIZE, "uid": 1000 if os.getuid() == 0 else os.getuid(),
    }
    return [sys.executable, "-I", "-S", "-c", BOOT, json.dumps(spec)]


def _course_root() -> str:
    """The folder pplab is imported from (the course's checkout, or site-packages)."""
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _installation() -> list[str]:
    """What every sandboxed command needs to see, even where it lies in a hidden folder (a
    course cloned into /tmp): Python, its packages, and the folder pplab is imported from."""
    here = _course_root()
    places = {sys.prefix, sys.base_prefix, os.path.dirname(os.path.dirname(os.path.realpath(sys.executable))), here}
    places |= {p for p in sys.path if p and os.path.isdir(p) and "site-packages" in p}
    return sorted(places)


def _which(name: str) -> str:
    import shutil

    found = shutil.which(name)
    if not found:
        raise FileNotFoundError(f"{name} not found on PATH")
    return found


@lru_cache(maxsize=1)
def why_not() -> str | None:
    """None if this machine can run the sandbox, else why not (said once in the grader's summary)."""
    if not sys.platform.startswith("linux"):
        return f"Linux namespaces are not available on {sys.platform}"
    import tempfile

    with tempfile.TemporaryDirectory(prefix="pplab-sandbox-probe-") as tmp:
        probe = [sys.executable, "-I", "-S", "-c",
                 "import os, sys; open('inside', 'w').write('x'); print(os.access(sys.prefix, os.W_OK))"]
        try:
            run = subprocess.run(wrap(probe, workdir=tmp), capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired) as err:
            return f"the sandbox could not start ({err})"
        if run.returncode != 0:
            reason = (run.stderr.strip().splitlines() or [f"exit code {run.returncode}"])[-1]
            return reason.removeprefix("pplab-sandbox: ")
        if run.stdout.strip() != "False" or not os.path.exists(os.path.join(tmp, "inside")):     # read-only, but here writable
            return f"the sandbox did not isolate as expected ({run.stdout.strip()!r})"
    return None
