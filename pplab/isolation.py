"""Linux isolation, in one place: namespaces, mounts, ids and limits (the standard library only).

Two users:

* the grader's sandbox (course/sandbox.py) runs `boot(spec)` in a fresh `python -I -S`
  (this file's text, read by the grader): a process that runs a student's code sees an
  **allow list**, built on an empty root (`pivot_root`): the system's read-only folders
  (/usr, /lib*, /bin, /sbin, /etc), the Python installation and its packages, read-only,
  the folders the caller names read-only (a copy of pplab), its own writable folders in
  one size-limited tmpfs (its work folder, /tmp, /dev/shm: nothing reaches the grader's
  disk), a few devices, its own /proc, and nothing else: no course, no .git, no home, no
  /sys (whose /sys/class/net would list the host's network devices), no other checkout.
  It has its own network (only `lo`) and its own process ids; its first process stays
  outside the student's reach as a watchdog and, when it ends, the kernel ends every
  process in the sandbox.
* a sealed rank (checks/sealed/isolate.py) calls `isolate_rank()` in a forked process: its own
  namespaces, every mount read-only, one private tmpfs for /tmp and /dev/shm.

Why hand-written and not bubblewrap (`bwrap`): a sealed rank isolates itself *after a
fork*, with torch already imported (a launch takes 0.1 s); bwrap can only wrap a new
program. One set of primitives serves both here, needs no package, and runs where the
grader is root without user namespaces (Gradescope): there the mounts are made as root
and the student's processes run as a distinct unprivileged uid.

Limits (course/sandbox.Limits), and what each rests on:
* processes: RLIMIT_NPROC (counts threads too). The kernel counts it per user namespace
  and uid (Linux >= 5.14), so the sandbox's own processes only; where the grader is root
  the student runs as a uid of its own (root itself is never limited by RLIMIT_NPROC).
  The watchdog stops the sandbox when the count reaches the limit.
* memory: RLIMIT_DATA per process (a 30 GB allocation fails at once), and the watchdog,
  which sums the resident memory of the sandbox's processes (their proportional share,
  PSS, once the plain sum passes the limit: forked ranks share pages) and stops the
  sandbox above the limit.
* disk and tmpfs: one tmpfs of that size holds every writable folder; the watchdog stops
  the sandbox when it is full.
"""
from __future__ import annotations

import ctypes
import json
import os
import signal
import sys
import time

NEWNS, NEWUSER, NEWPID, NEWNET = 0x00020000, 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = \
    1, 2, 4, 8, 32, 4096, 16384, 1 << 18
MNT_DETACH = 2
# Mount flags a user namespace may not clear on a remount (mountinfo's names): kept as they are.
KEEP = {"nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC, "noatime": 1024, "nodiratime": 2048,
        "relatime": 1 << 21}
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_NO_NEW_PRIVS = 1, 4, 38
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "riscv64": 41, "ppc64le": 203, "s390x": 217}

SETUP_FAILED = 111       # exit code: the sandbox could not be set up (the message says why)
LIMIT_HIT = 112          # exit code: the watchdog stopped the sandbox (the last line says which limit)
SYSTEM = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc")
DEVICES = ("null", "zero", "full", "random", "urandom")
STUDENT_UID = 1000       # the student's uid inside the sandbox (no capability, cannot undo the mounts)

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]


def call(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def prctl(option: int, value: int) -> None:
    _libc.prctl(option, value, 0, 0, 0)


def mount(source, target, fstype, flags, data=None) -> None:
    enc = (lambda s: None if s is None else s.encode())
    call(_libc.mount(enc(source), enc(target), enc(fstype), flags, enc(data)), f"mount {target}")


def unshare(flags: int) -> None:
    call(_libc.unshare(flags), "unshare")


def map_ids(inside: int, outside_uid: int, outside_gid: int) -> None:
    """In a user namespace this process just entered: be `inside` there, as these ids outside."""
    for name, text in (("setgroups", "deny"), ("uid_map", f"{inside} {outside_uid} 1"),
                       ("gid_map", f"{inside} {outside_gid} 1")):
        with open(f"/proc/self/{name}", "w") as f:
            f.write(text)


def enter_user_namespace(flags: int) -> None:
    """unshare(2) a new user namespace (and `flags`), as root there. Root cannot write its own
    map to root (Linux >= 5.12 asks for CAP_SETFCAP outside): a helper forked outside writes it."""
    uid, gid = os.getuid(), os.getgid()
    if os.geteuid() != 0:
        # A non-dumpable process's /proc/self files belong to root, which the new namespace does
        # not map: dumpable while it writes its own map (nothing of the student has run yet).
        was = _libc.prctl(3, 0, 0, 0, 0)          # PR_GET_DUMPABLE
        prctl(PR_SET_DUMPABLE, 1)
        try:
            unshare(NEWUSER | flags)
            map_ids(0, uid, gid)
        finally:
            prctl(PR_SET_DUMPABLE, was)
        return
    go_read, go_write = os.pipe()
    helper = os.fork()
    if helper == 0:
        os.close(go_write)
        os.read(go_read, 1)
        try:
            for name, text in (("setgroups", "deny"), ("uid_map", f"0 {uid} 1"), ("gid_map", f"0 {gid} 1")):
                with open(f"/proc/{os.getppid()}/{name}", "w") as f:
                    f.write(text)
        except OSError:
            os._exit(1)
        os._exit(0)
    os.close(go_read)
    try:
        unshare(NEWUSER | flags)
    finally:
        os.write(go_write, b"x")
        os.close(go_write)
        _, status = os.waitpid(helper, 0)
    if status != 0:
        raise OSError(1, "the user namespace's uid map could not be written")


def mounts() -> list:
    """(mount point, flags to keep) of every mount this process sees, parents first."""
    found = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            point = fields[4].encode().decode("unicode_escape")      # "\040" is a space
            found.append((point, sum(KEEP.get(o, 0) for o in fields[5].split(","))))
    return found


def under(path: str, roots) -> bool:
    return any(path == r or path.startswith(r.rstrip("/") + "/") for r in roots)


def read_only(writable=()) -> list:
    """Remount every mount read-only but /proc and the mount points in `writable` (not what
    is mounted inside them); returns those that refused."""
    failed = []
    for point, flags in mounts():
        if under(point, ["/proc"]) or point in writable:
            continue
        try:
            mount(None, point, None, MS_REMOUNT | MS_BIND | MS_RDONLY | flags)
        except OSError:
            failed.append(point)
    return failed


def loopback_up() -> None:
    import fcntl
    import socket
    import struct

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        flags = struct.unpack("16sH", fcntl.ioctl(s, 0x8913, struct.pack("16sH14s", b"lo", 0, b""))[:18])[1]
        fcntl.ioctl(s, 0x8914, struct.pack("16sH14s", b"lo", flags | 1, b""))      # IFF_UP


def set_limits(processes: int | None, memory: int | None) -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if processes:
        resource.setrlimit(resource.RLIMIT_NPROC, (processes, processes))
    if memory:
        resource.setrlimit(resource.RLIMIT_DATA, (memory, memory))


# ----------------------------------------------------------------------------------
# A sealed rank: isolate this (forked) process in place


def isolate_rank(tmpfs_size: str, hide=()) -> list:
    """New user, mount, network and pid namespaces for this process; every mount read-only;
    one private tmpfs (`tmpfs_size`) on /tmp and /dev/shm, with the folders Python needs that
    lie there bound back read-only; `hide`: paths replaced by empty ones (a folder by an empty
    read-only tmpfs, a file by /dev/null), or {path: {file left in it: text}}; then a nested user namespace locks the mounts.
    Forks once: the caller continues as pid 1 of the new namespace. Returns what could not
    be done; raises OSError if no namespace could be made at all."""
    enter_user_namespace(NEWNS | NEWNET | NEWPID)
    child = os.fork()                                    # the first child of a new pid namespace is its pid 1
    if child:
        _, status = os.waitpid(child, 0)
        os._exit(os.waitstatus_to_exitcode(status) & 0xFF if os.WIFEXITED(status) else 128 + os.WTERMSIG(status))
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    try:
        os.setsid()                                      # kill(0, ...) reaches no process outside
    except OSError:
        pass
    missing = []
    for attempt in ((None, "/", None, MS_REC | MS_PRIVATE), ("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)):
        try:
            mount(*attempt)
        except OSError:
            pass
    if "/" in read_only():
        missing.append("read-only root")
    kept = {path: os.open(path, os.O_PATH | os.O_DIRECTORY) for path in needed_under(("/tmp", "/dev/shm"))}
    try:
        mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, f"size={tmpfs_size},mode=1777")
        os.makedirs("/tmp/.shm", mode=0o1777, exist_ok=True)
        os.chmod("/tmp/.shm", 0o1777)
        mount("/tmp/.shm", "/dev/shm", None, MS_BIND)
    except OSError:
        missing.append("private /tmp and /dev/shm")
    for path, fd in kept.items():                        # Python, pplab, sys.path: back, read-only
        try:
            os.makedirs(path, exist_ok=True)
            mount(f"/proc/self/fd/{fd}", path, None, MS_BIND | MS_REC)
            mount(None, path, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
        except OSError:
            missing.append(f"{path} (read-only)")
        finally:
            os.close(fd)
    hide = hide if isinstance(hide, dict) else dict.fromkeys(hide, {})
    for path, files in hide.items():
        try:
            _hide(path, files)
        except OSError:
            missing.append(f"{path} (hidden)")
    # Lock the mounts: a namespace below cannot undo them. A non-dumpable process (a graded check's
    # zygote is one) may not write its own /proc/self maps where its owner is not mapped here (the
    # grader's check process, run as a uid of its own): dumpable while it does, as in
    # enter_user_namespace; nothing of the student's has run yet.
    was = _libc.prctl(3, 0, 0, 0, 0)                     # PR_GET_DUMPABLE
    prctl(PR_SET_DUMPABLE, 1)
    try:
        unshare(NEWUSER | NEWNS)
        map_ids(0, 0, 0)
    except OSError:
        missing.append("locked mounts")
    finally:
        prctl(PR_SET_DUMPABLE, was)
    return missing


def _hide(path: str, files: dict) -> None:
    """Cover `path`: a folder with an empty read-only tmpfs holding only `files` ({relative path:
    text}, e.g. a stub saying why a module is not there: fresh_zygote.py), a file with /dev/null."""
    if os.path.isdir(path):
        mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=1m,mode=755")
        for name, text in files.items():
            target = os.path.join(path, name)
            os.makedirs(os.path.dirname(target), exist_ok=True)
            with open(target, "w") as f:
                f.write(text)
        mount(None, path, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC)
    elif os.path.lexists(path):
        mount("/dev/null", path, None, MS_BIND)


def needed_under(hidden) -> list:
    """Folders a rank must still read that lie in a folder it gets a private copy of (a
    checkout, or a virtual environment, in /tmp): Python's installation, the folders on
    sys.path, and the folder pplab is imported from, outermost first, none inside another."""
    places = {sys.prefix, sys.base_prefix, os.path.dirname(os.path.dirname(os.path.realpath(sys.executable)))}
    places |= {p for p in sys.path if p}
    pplab = sys.modules.get("pplab")
    if pplab is not None and getattr(pplab, "__file__", None):
        places.add(os.path.dirname(os.path.dirname(os.path.realpath(pplab.__file__))))
    inside = [os.path.realpath(p) for p in places if os.path.isdir(p)
              and any(os.path.realpath(p).startswith(h + "/") for h in hidden)]      # never all of /tmp
    return sorted(p for p in set(inside) if not any(p != q and p.startswith(q + "/") for q in inside))


# ----------------------------------------------------------------------------------
# The grader's sandbox: an allow list on an empty root, a watchdog as its pid 1


def boot(spec_json: str) -> None:
    """Run spec["argv"] in the sandbox (see the module docstring); never returns. Run as
    `python -I -S -c <this file> + boot(...)`: nothing the student wrote is imported."""
    spec = json.loads(spec_json)
    privileged = os.geteuid() == 0 and not spec.get("user_namespace")
    try:
        try:                                     # root: no user namespace needed (nor, on Gradescope, allowed)
            if not privileged:
                raise PermissionError
            unshare(NEWNS | NEWPID | NEWNET)
        except OSError:
            privileged = False
            enter_user_namespace(NEWNS | NEWPID | NEWNET)
    except OSError as err:
        print(f"pplab-sandbox: no namespaces here ({err})", file=sys.stderr, flush=True)
        os._exit(SETUP_FAILED)
    report_read, report_write = os.pipe()
    child = os.fork()
    if child:
        os.close(report_write)
        _wait_outside(child, report_read)
    os.close(report_read)
    try:                                         # pid 1 of the new namespace
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # if the waiter outside is killed, so is the sandbox
        prctl(PR_SET_DUMPABLE, 0)
        _build_root(spec, privileged)
        loopback_up()
        command = _start(spec, privileged, report_write)
    except BaseException as err:  # noqa: BLE001
        print(f"pplab-sandbox: could not set up the sandbox: {type(err).__name__}: {err}", file=sys.stderr, flush=True)
        os._exit(SETUP_FAILED)
    _watch(command, spec["limits"], report_write)


def _wait_outside(child: int, report_read: int) -> None:
    """The process outside the sandbox: wait for its pid 1 and pass its end on (a limit's
    note as the last line, from a pipe no student process holds)."""
    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(s, lambda *_: os.kill(child, signal.SIGKILL))
    while True:
        try:
            _, status = os.waitpid(child, 0)
            break
        except InterruptedError:
            continue
    note = os.read(report_read, 4096).decode(errors="replace").strip()
    if note:
        print(f"pplab-sandbox: stopped: {note}", file=sys.stderr, flush=True)
        os._exit(LIMIT_HIT)
    if os.WIFSIGNALED(status):                   # die the same way, so the caller sees the signal
        signal.signal(os.WTERMSIG(status), signal.SIG_DFL)
        os.kill(os.getpid(), os.WTERMSIG(status))
    os._exit(os.waitstatus_to_exitcode(status) % 256)


def _build_root(spec: dict, privileged: bool) -> None:
    """An empty tmpfs becomes the root; only what the allow list names is bound into it."""
    import shutil

    limits, owner = spec["limits"], spec["uid"] if privileged else 0
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    # Every source is opened before anything is mounted over it (the sources may lie in /tmp).
    sources = {}
    for path in [*SYSTEM, *spec["read_only"], *spec["workdirs"]]:
        if path not in sources and os.path.lexists(path):
            sources[path] = os.readlink(path) if os.path.islink(path) and path in SYSTEM else \
                os.open(path, os.O_PATH | (os.O_DIRECTORY if os.path.isdir(path) else 0))
    devices = {d: os.open(f"/dev/{d}", os.O_PATH) for d in DEVICES if os.path.exists(f"/dev/{d}")}
    mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, "size=16m,mode=755")       # the new root, staged here
    new = "/tmp"
    os.mkdir(f"{new}/.rw", 0o755)
    mount("tmpfs", f"{new}/.rw", "tmpfs", MS_NOSUID | MS_NODEV, f"size={limits['disk']},mode=755")
    writable = {"/tmp": f"{new}/.rw/tmp", "/dev/shm": f"{new}/.rw/shm"}
    for i, path in enumerate(spec["workdirs"]):
        if not under(path, ["/tmp"]):
            writable[path] = f"{new}/.rw/work{i}"
    for path, store in writable.items():
        os.makedirs(store)
        os.chmod(store, 0o1777 if path in ("/tmp", "/dev/shm") else 0o700)
        os.chown(store, owner, owner)
    place = (lambda p: f"{new}{p}")
    for path in ("/proc", "/dev", "/tmp"):
        os.makedirs(place(path), exist_ok=True)
    mount(writable["/tmp"], place("/tmp"), None, MS_BIND)

    def bind(source: str, target: str, is_dir: bool) -> None:
        parent = os.path.dirname(target)
        os.makedirs(parent, exist_ok=True)
        if is_dir:
            os.makedirs(target, exist_ok=True)
        elif not os.path.exists(target):
            open(target, "w").close()
        mount(source, target, None, MS_BIND | MS_REC)

    for path in sorted(sources, key=len):           # parents first
        source = sources[path]
        if isinstance(source, str):                 # /bin -> usr/bin
            os.symlink(source, place(path))
        elif path in spec["workdirs"]:
            continue
        else:
            bind(f"/proc/self/fd/{source}", place(path), os.path.isdir(f"/proc/self/fd/{source}"))
    for i, path in enumerate(spec["workdirs"]):     # each work folder: a copy of what the caller put there
        target = place(path)
        if path in writable:
            bind(writable[path], target, True)
        else:
            os.makedirs(target, mode=0o700)
            os.chown(target, owner, owner)
        shutil.copytree(f"/proc/self/fd/{sources[path]}", target, symlinks=True, dirs_exist_ok=True)
        if privileged:
            for root, dirs, files in os.walk(target):
                for name in [root, *(os.path.join(root, n) for n in dirs + files)]:
                    os.lchown(name, owner, owner)
    for d, fd in devices.items():
        bind(f"/proc/self/fd/{fd}", place(f"/dev/{d}"), False)
    os.makedirs(place("/dev/shm"), exist_ok=True)
    mount(writable["/dev/shm"], place("/dev/shm"), None, MS_BIND)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                         ("stderr", "/proc/self/fd/2")):
        os.symlink(target, place(f"/dev/{name}"))
    mount("proc", place("/proc"), "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    for path in spec["denied"]:                      # never visible, even inside an allowed folder
        if os.path.isdir(place(path)):
            mount("tmpfs", place(path), "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV, "size=4k,mode=555")
    for fd in [*devices.values(), *(s for s in sources.values() if isinstance(s, int))]:
        os.close(fd)
    os.chdir(new)                                    # pivot: the old root is gone, not merely hidden
    call(_libc.syscall(SYS_PIVOT_ROOT[os.uname().machine], b".", b"."), "pivot_root")
    call(_libc.umount2(b".", MNT_DETACH), "umount the old root")
    os.chdir("/")
    failed = read_only(writable=["/.rw", *writable])
    if "/" in failed or any(under(p, failed) for p in spec["read_only"]):
        raise OSError(f"could not make {failed} read-only")


def _start(spec: dict, privileged: bool, report_write: int) -> int:
    """Fork the command: no capability, limits set, a uid of its own where the grader is root."""
    limits = spec["limits"]
    child = os.fork()
    if child:
        return child
    try:
        os.close(report_write)
        if privileged:                               # a distinct unprivileged uid: RLIMIT_NPROC counts only it
            os.setgroups([])
            os.setresgid(spec["uid"], spec["uid"], spec["uid"])
            set_limits(limits["processes"], limits["memory"])
            os.setresuid(spec["uid"], spec["uid"], spec["uid"])
        else:                                        # a nested user namespace, as an ordinary user: the mounts
            set_limits(limits["processes"], limits["memory"])      # set up above are locked
            unshare(NEWUSER | NEWNS)
            map_ids(STUDENT_UID, 0, 0)
        prctl(PR_SET_NO_NEW_PRIVS, 1)
        prctl(PR_SET_DUMPABLE, 1)
        os.chdir(spec["workdirs"][0])
        os.execve(spec["argv"][0], spec["argv"], spec["env"])
    except BaseException as err:  # noqa: BLE001
        print(f"pplab-sandbox: could not start {spec['argv'][0]}: {type(err).__name__}: {err}", file=sys.stderr,
              flush=True)
    os._exit(SETUP_FAILED)


def _watch(command: int, limits: dict, report_write: int) -> None:
    """pid 1: reap orphans, end with the command, and stop everything at a limit (exiting
    as pid 1 makes the kernel kill every process of the namespace)."""
    for s in range(1, signal.NSIG):                  # pid 1 takes only the signals it handles: none
        if s not in (signal.SIGKILL, signal.SIGSTOP, signal.SIGCHLD):
            try:
                signal.signal(s, signal.SIG_IGN)
            except (OSError, ValueError):
                pass
    page, state = os.sysconf("SC_PAGE_SIZE"), {}
    while True:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                os._exit(0)
            if pid == 0:
                break
            if pid == command:
                os._exit(128 + os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status))
        note = over_limit(limits, page, state)
        if note:
            os.write(report_write, note.encode())
            os._exit(LIMIT_HIT)
        time.sleep(0.1)


def format_size(n: float) -> str:
    for unit, shift in (("G", 30), ("M", 20), ("K", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.3g}{unit}"
    return f"{n:.0f}"


def over_limit(limits: dict, page: int, state: dict) -> str:
    """Which limit the sandbox's processes (all of /proc here) are past now, as a note; '' if none.
    The proportional count (PSS) walks every page of every process: at most once a second."""
    tasks, rss, pids = 0, 0, []
    for name in os.listdir("/proc"):
        if not name.isdigit() or name == "1":
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
            tasks += int(fields[17])                 # num_threads
            rss += int(fields[21]) * page
            pids.append(name)
        except (OSError, IndexError, ValueError):
            continue
    if limits["processes"] and tasks >= limits["processes"]:
        return (f"it ran {tasks} processes and threads at once, the limit for a submission "
                f"(pplab grade --processes {limits['processes']})")
    if limits["memory"] and rss > limits["memory"] and time.monotonic() > state.get("next_pss", 0):
        state["next_pss"] = time.monotonic() + 1.0
        pss = 0                                      # forked processes share pages: count each page once
        for name in pids:
            try:
                with open(f"/proc/{name}/smaps_rollup") as f:
                    pss += next(int(line.split()[1]) for line in f if line.startswith("Pss:")) * 1024
            except (OSError, StopIteration, ValueError):
                pss += 0
        if pss > limits["memory"]:
            return (f"its processes held {format_size(pss)}B of memory, more than the limit for a submission "
                    f"(pplab grade --memory {format_size(limits['memory'])})")
    disk = os.statvfs("/.rw")
    if limits["disk"] and disk.f_bavail * disk.f_frsize < min(1 << 20, limits["disk"] // 100 + 1):
        return (f"it filled the {format_size(limits['disk'])}B its files may take (its folder, /tmp and /dev/shm), "
                f"the limit for a submission (pplab grade --disk {format_size(limits['disk'])})")
    return ""
