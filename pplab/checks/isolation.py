"""Isolating a sealed rank from every other process (Linux; best effort).

`isolate()` runs in each rank before any student code: new user, mount, network and PID
namespaces (the rank is root only inside them, sees no other process, has no network
and no socket another rank can reach), the root filesystem read-only, private tmpfs on
/tmp and /dev/shm (the rank's working folder is /tmp/work; Python, pplab and the folders on
sys.path stay readable where they lie there), then a nested user and mount
namespace, which locks those mounts: the rank cannot remount them writable or unmount
its tmpfs. Ranks therefore share no file and no socket, cannot signal or ptrace each
other, and (non-dumpable) no process may read their memory.

Where the system does not permit unprivileged user namespaces (some containers, some
hardened kernels), `isolate()` does nothing and says so: the check still works, with
the same router and the same record, but ranks could then pass data to each other
through files in /tmp or /dev/shm.
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import signal


_CLONE_NEWNS, _CLONE_NEWUSER, _CLONE_NEWPID, _CLONE_NEWNET = 0x00020000, 0x10000000, 0x20000000, 0x40000000
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC, _MS_REMOUNT, _MS_BIND, _MS_REC, _MS_PRIVATE = \
    1, 2, 4, 8, 32, 4096, 16384, 1 << 18
_MS_KEEP = {"nosuid": _MS_NOSUID, "nodev": _MS_NODEV, "noexec": _MS_NOEXEC, "noatime": 1024,
            "nodiratime": 2048, "relatime": 1 << 21}      # flags a user namespace may not clear
_PR_SET_PDEATHSIG, _PR_SET_DUMPABLE = 1, 4


def _libc():
    return ctypes.CDLL(None, use_errno=True)


def prctl(option: int, value: int) -> None:
    with contextlib.suppress(Exception):
        _libc().prctl(option, value, 0, 0, 0)


def _call(result: int, what: str) -> None:
    if result != 0:
        raise OSError(ctypes.get_errno(), f"{what}: {os.strerror(ctypes.get_errno())}")


def _map_root(uid: int, gid: int) -> None:
    """In a new user namespace: be root there, as `uid` outside."""
    for name, text in (("setgroups", "deny"), ("uid_map", f"0 {uid} 1"), ("gid_map", f"0 {gid} 1")):
        with open(f"/proc/self/{name}", "w") as f:
            f.write(text)


def _mount(source, target, fstype, flags, data=None) -> None:
    enc = (lambda s: None if s is None else s.encode())
    _call(_libc().mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)), f"mount {target}")


def _mounts() -> list:
    """(mount point, flags to keep) of every mount, parents first."""
    found = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            point = fields[4].encode().decode("unicode_escape")      # "\040" is a space
            flags = sum(_MS_KEEP.get(o, 0) for o in fields[5].split(","))
            found.append((point, flags))
    return found


def _needed_under(hidden) -> list:
    """Folders the rank must still read that lie in a folder it gets a private copy of (a
    checkout, or a virtual environment, in /tmp): Python's installation, the folders on
    sys.path (the tests), and the folder pplab is imported from (an editable install finds it
    without sys.path: a notebook's kernel runs in solutions/, and a checker that imports a
    chapter module in the rank must still find it), outermost first and none inside another."""
    import sys

    places = {sys.prefix, sys.base_prefix, os.path.dirname(os.path.dirname(os.path.realpath(sys.executable)))}
    places |= {p for p in sys.path if p}
    places.add(os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(__file__)))))   # above pplab/
    under = [os.path.realpath(p) for p in places if os.path.isdir(p)
             and any(os.path.realpath(p).startswith(h + "/") for h in hidden)]     # never all of /tmp
    return sorted(p for p in set(under) if not any(p != q and p.startswith(q + "/") for q in under))


def isolate(hide=()) -> str:
    """Namespaces for this rank (see the module docstring). Returns what could not be done
    ("" if everything was). Forks once: the caller continues as PID 1 of a new namespace,
    while its parent waits for it and exits with its status. hide: {file or folder: {file
    left in it: text}} the rank must not read (a graded check's library and references,
    fresh_zygote.py), covered before the mounts are locked."""
    uid, gid = os.getuid(), os.getgid()
    try:
        _call(_libc().unshare(_CLONE_NEWUSER | _CLONE_NEWNS | _CLONE_NEWNET | _CLONE_NEWPID), "unshare")
        _map_root(uid, gid)
    except (OSError, AttributeError) as exc:            # not permitted, or not Linux
        return f"no namespaces ({exc})"
    child = os.fork()                                    # the first child of a new PID namespace is its PID 1
    if child:
        _, status = os.waitpid(child, 0)
        os._exit(os.waitstatus_to_exitcode(status) & 0xFF if os.WIFEXITED(status) else 128 + os.WTERMSIG(status))
    prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    with contextlib.suppress(OSError):
        os.setsid()                                      # kill(0, ...) reaches no process outside
    missing = []
    with contextlib.suppress(OSError):
        _mount(None, "/", None, _MS_REC | _MS_PRIVATE)
    with contextlib.suppress(OSError):
        _mount("proc", "/proc", "proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC)
    for point, flags in _mounts():
        if point == "/proc" or point.startswith("/proc/"):
            continue                                     # the nested namespace below writes to /proc/self
        try:
            _mount(None, point, None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY | flags)
        except OSError:
            if point == "/":
                missing.append("read-only root")
    kept = {path: os.open(path, os.O_PATH | os.O_DIRECTORY) for path in _needed_under(("/tmp", "/dev/shm"))}
    for point in ("/tmp", "/dev/shm"):
        try:
            _mount("tmpfs", point, "tmpfs", _MS_NOSUID | _MS_NODEV, "size=256m,mode=1777")
        except OSError:
            missing.append(f"private {point}")
    for path, fd in kept.items():                        # Python, pplab, sys.path: back, read-only
        try:
            os.makedirs(path, exist_ok=True)
            _mount(f"/proc/self/fd/{fd}", path, None, _MS_BIND | _MS_REC)
            _mount(None, path, None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY | _MS_NOSUID | _MS_NODEV)
        except OSError:
            missing.append(f"{path} (read-only)")
        finally:
            os.close(fd)
    for path, files in dict(hide).items():
        try:
            _hide(path, files)
        except OSError:
            missing.append(f"hidden {path}")
    try:                                                 # lock the mounts: a namespace below cannot undo them
        _call(_libc().unshare(_CLONE_NEWUSER | _CLONE_NEWNS), "unshare (nested)")
        _map_root(0, 0)
    except OSError:
        missing.append("locked mounts")
    return ", ".join(missing)


def _hide(path: str, files: dict) -> None:
    """Cover `path`: a folder with an empty read-only tmpfs holding only `files` ({relative path:
    text}, e.g. a stub saying why a module is not there), a file with /dev/null."""
    if os.path.isdir(path):
        _mount("tmpfs", path, "tmpfs", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC, "size=1m,mode=755")
        for name, text in files.items():
            target = os.path.join(path, name)
            os.makedirs(os.path.dirname(target), exist_ok=True)
            with open(target, "w") as f:
                f.write(text)
        _mount(None, path, None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY | _MS_NOSUID | _MS_NODEV | _MS_NOEXEC)
    elif os.path.lexists(path):
        _mount("/dev/null", path, None, _MS_BIND)
