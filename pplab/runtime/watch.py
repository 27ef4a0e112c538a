"""The caller's side of a launch: watch the ranks, relay their output, explain how it ended.

`collect` waits on every rank's result pipe and output pipes, and on what the launch's host
process says (a rank started, a rank ended: launcher.py), and reads the call board
(callboard.py) a few times a second. It ends the launch when every rank has
answered, when one fails (after a short grace so the lowest failing rank is the one
blamed), when two ranks sit in mismatched collectives, or at the timeout. Every failure
becomes one LaunchError whose message says what each rank did, once per distinct story
("ranks 0-3 raised ValueError: ...", not four copies).
"""
from __future__ import annotations

import io
import multiprocessing.connection
import os
import pickle
import re
import signal
import struct
import sys
import time

import cloudpickle

from . import callboard
from .. import trace

BOARD_EVERY = 0.2          # seconds between reads of the call board
READ_MAX = 1 << 20         # bytes of a rank's output read at once: a rank printing without pause
                           # must leave the caller time to look at the clock
LINE_MAX = 64 << 10        # a longer line is printed cut, and never held whole (one may never end)
TAIL_LINES, TAIL_CHARS = 20, 500       # a rank's last output, as kept for error messages

# What the host process (launcher.py) tells the caller, one fixed-size record at a time
# (a pipe never splits a write this small): (STARTED, rank, pid), (EXITED, rank, exit code
# as multiprocessing gives it: -N if killed by signal N), (NOT_STARTED, rank, errno).
STARTED, EXITED, NOT_STARTED = 0, 1, 2
EVENT = struct.Struct("<iii")


def read_events(fd):
    """The host's records waiting in its pipe, as (what, rank, value); None once it has ended."""
    data = os.read(fd, EVENT.size * 256)
    return list(EVENT.iter_unpack(data)) if data else None


class LaunchError(RuntimeError):
    """One or more ranks failed, hung or were interrupted; all of them were stopped.

    rank: the rank blamed first (None for a timeout); tracebacks: {rank: text} of
    ranks that raised; running: ranks still running at the timeout; output: {rank: its
    last lines printed (TAIL_LINES at most, each cut to TAIL_CHARS)}; calls: {rank: the
    pplab.comm call it was inside, described}; stacks: {rank: its Python stack when it
    was stopped at the timeout}; mismatch: the explanation when the launch was ended
    early because ranks sat in mismatched collectives ("" otherwise; `running` then lists
    the ranks that were stopped).
    """

    def __init__(self, message, rank=None, tracebacks=None, running=(), output=None, calls=None, stacks=None,
                 mismatch=""):
        super().__init__(message)
        self.rank = rank
        self.tracebacks = tracebacks or {}
        self.running = tuple(running)
        self.output = output or {}
        self.calls = calls or {}
        self.stacks = stacks or {}
        self.mismatch = mismatch


def ranks_text(ranks) -> str:
    """[3] -> 'rank 3'; [0, 1] -> 'ranks 0, 1'; [0, 1, 2, 3, 5] -> 'ranks 0-3, 5'."""
    ranks = sorted(ranks)
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    runs, start = [], ranks[0]
    for a, b in zip(ranks, ranks[1:] + [None]):
        if b != a + 1:
            runs.append(f"{start}-{a}" if a - start >= 2 else ", ".join(map(str, range(start, a + 1))))
            start = b
    return "ranks " + ", ".join(runs)


class Rank:
    """The caller's handle on one rank: its result pipe, its output pipes, and what the host
    said of it (its pid once started, its exit code once ended)."""

    def __init__(self, rank, conn, out_conn, err_conn, safe=False):
        self.rank, self.conn = rank, conn
        self.pid = self.exitcode = None
        self.safe = safe                # its code is not trusted: decode its message as plain data
        self.pipes = {out_conn.fileno(): (out_conn, sys.stdout), err_conn.fileno(): (err_conn, sys.stderr)}
        self.partial = {fd: b"" for fd in self.pipes}
        self.cut = {fd: False for fd in self.pipes}     # the line being read was shown already, cut
        self.tail: list[str] = []       # last lines printed, cut short, for error messages
        self.message = None

    def pump(self, fd, final=False) -> None:
        """Print what the child wrote, a whole line at a time, with a rank prefix. At most
        READ_MAX bytes a call, and no more than LINE_MAX of a line kept: a rank that prints
        without pause, or one endless line, neither holds the caller nor fills its memory."""
        conn, stream = self.pipes[fd]
        chunks, size = [self.partial[fd]], 0
        while size < READ_MAX and conn.poll(0):
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        *lines, rest = b"".join(chunks).split(b"\n")
        if final and rest:
            lines, rest = lines + [rest], b""
        if self.cut[fd] and lines:      # the end of a line already shown (cut): not shown again
            lines, self.cut[fd] = lines[1:], False
        if len(rest) > LINE_MAX:        # no end in sight: show its start now, drop the rest of it
            if not self.cut[fd]:
                lines.append(rest)
            self.cut[fd], rest = True, b""
        self.partial[fd] = rest
        for line in lines:
            text = line[:LINE_MAX].decode(errors="replace")
            if len(line) > LINE_MAX:
                text += f" [... line cut: longer than {LINE_MAX:,} bytes]"
            self.tail = (self.tail + [_short(text)])[-TAIL_LINES:]
            print(f"[rank {self.rank}] {text}", file=stream, flush=True)

    def last_output(self) -> list[str]:
        """Its last lines (TAIL_LINES at most, each cut to TAIL_CHARS), and one it has not ended yet."""
        unfinished = [_short(p[:TAIL_CHARS + 1].decode(errors="replace"))
                      for fd, p in self.partial.items() if p and not self.cut[fd]]
        return (self.tail + unfinished)[-TAIL_LINES:]

    def receive(self) -> None:
        """Read the child's one message, if it sent one before its pipe closed."""
        try:
            data = self.conn.recv_bytes(64 << 20 if self.safe else None)   # untrusted: a bogus length is refused
        except (EOFError, OSError):
            self.message = None
            return
        self.message = plain_loads(data) if self.safe else cloudpickle.loads(data)

    def close(self) -> None:
        for c in [self.conn] + [c for c, _ in self.pipes.values()]:
            c.close()


def _short(text: str) -> str:
    return text if len(text) <= TAIL_CHARS else text[:TAIL_CHARS] + " [...]"


class _PlainUnpickler(pickle.Unpickler):
    """Builds numbers, strings, bytes, lists, tuples, dicts, sets and trace events, nothing else:
    unpickling plain data needs no import, so refusing every import refuses any code."""

    def find_class(self, module, name):
        if (module, name) == ("pplab.trace", "Event"):
            return trace.Event
        raise pickle.UnpicklingError(f"{module}.{name} is not plain data")


def plain_loads(data: bytes):
    """A rank's message decoded with _PlainUnpickler; one that is not plain data, or not
    shaped like a rank's message, becomes that rank's error."""
    try:
        message = _PlainUnpickler(io.BytesIO(data)).load()
        if isinstance(message, tuple) and len(message) == 3 and message[0] == "ok" and \
                isinstance(message[2], list) and all(isinstance(e, trace.Event) for e in message[2]):
            return message
        if isinstance(message, tuple) and len(message) == 4 and message[0] == "err" and \
                all(isinstance(m, str) for m in message[1:]):
            return message
        problem = "a message not shaped like a rank's result"
    except Exception as exc:  # noqa: BLE001 - whatever the bytes were, they are refused
        problem = f"{type(exc).__name__}: {exc}"
    return ("err", "return", f"ResultError: its result is not plain data ({problem})", "")


def collect(ranks, host, folder, timeout):
    """Wait for every rank; return their messages ("ok", result, events) by rank, or raise LaunchError.

    host: the read end of the host's pipe (read_events). A rank's end is learnt from the host,
    which waits for it (waitpid), not from a pipe closing: a process the rank started may
    hold its pipes open long after it died.
    """
    deadline = time.monotonic() + timeout               # timeout=inf: no deadline
    board_path, p = os.path.join(folder, "board"), len(ranks)
    pending = {rk.rank for rk in ranks}
    by_fd = {fd: rk for rk in ranks for fd in rk.pipes}
    by_conn = {rk.conn: rk for rk in ranks}
    failed: dict[int, tuple] = {}
    board = callboard.read(board_path, p)

    def settle(rk):
        if rk.message is not None and rk.message[0] == "ok":
            pending.discard(rk.rank)
        elif rk.message is not None:
            failed[rk.rank] = rk.message

    def ended(rk, code):
        """The host saw it end: did it answer first? (Read only what is there: a process it
        started may hold the pipe open, and would keep a blocking read waiting.)"""
        rk.exitcode = code
        if by_conn.pop(rk.conn, None) is not None and rk.conn.poll(0):
            rk.receive()
            settle(rk)
        if rk.message is None:
            failed[rk.rank] = ("died", code)

    in_grace, mismatch = False, None
    while pending:
        if failed and not in_grace:
            # Ranks often fail together (each checks its own result): wait a moment for the
            # others so the lowest failing rank is reported every run, not whichever came first.
            in_grace, deadline = True, min(deadline, time.monotonic() + 0.25)
        left = deadline - time.monotonic()
        if left <= 0:
            break
        watched = list(by_fd) + list(by_conn) + ([host] if host is not None else [])
        ready = multiprocessing.connection.wait(watched, timeout=min(left, BOARD_EVERY))
        for obj in ready:
            if obj in by_fd:
                by_fd[obj].pump(obj)
            elif obj in by_conn:
                rk = by_conn.pop(obj)
                rk.receive()
                settle(rk)
        if host is not None and host in ready:
            events = read_events(host)
            if events is None:          # the host was killed, and every rank with it
                for rk in ranks:
                    if rk.exitcode is None and rk.rank not in failed:
                        ended(rk, None)
                host = None
            for what, r, value in events or ():
                if what == STARTED:
                    ranks[r].pid = value
                elif what == EXITED:
                    ended(ranks[r], value)
                else:
                    failed[r] = ("not started", value)
        if not failed and not mismatch:
            board = callboard.read(board_path, p)
            mismatch = callboard.find_mismatch(board)
            if mismatch:            # a moment for a rank that gloo aborts over it, to say why
                in_grace, deadline = True, min(deadline, time.monotonic() + 0.25)
    for fd, rk in by_fd.items():
        rk.pump(fd)
    board = callboard.read(board_path, p)                       # the last look: who was in what
    mismatch = mismatch or callboard.find_mismatch(board)
    calls = {r: callboard.describe(slot["call"]) for r, slot in enumerate(board) if slot["inside"]}
    if failed:
        err = failure(ranks, failed, calls)
        if mismatch:                # the cause first, then what it did to the ranks
            err.args = (f"{mismatch}. Then: {err.args[0]}",)
            err.mismatch = mismatch
        raise err
    if mismatch:
        involved = [r for r in pending if r in calls]
        raise LaunchError(mismatch + ". All ranks were stopped.", rank=min(involved, default=None),
                          running=sorted(pending), calls=calls, mismatch=mismatch,
                          output={r: ranks[r].last_output() for r in pending})
    if pending:
        raise _timed_out(ranks, sorted(pending), folder, timeout, board)
    return [rk.message for rk in ranks]


# ----------------------------------------------------------------------------------
# Explaining a timeout: where was every rank?


def _stacks(ranks, running, folder) -> dict:
    """Ask every running rank for its Python stack (faulthandler, on SIGUSR1), main thread only."""
    for r in running:
        try:
            if ranks[r].pid is not None:
                os.kill(ranks[r].pid, signal.SIGUSR1)
        except ProcessLookupError:
            pass
    stacks, until = {}, time.monotonic() + 1.0
    while time.monotonic() < until and len(stacks) < len(running):
        time.sleep(0.05)
        for r in running:
            try:
                with open(os.path.join(folder, f"stack.{r}")) as f:
                    text = f.read()
            except OSError:
                continue
            threads = [t for t in re.split(r"\n(?=(?:Current thread|Thread) 0x)", text) if "rank_main" in t]
            if threads and text.endswith("\n"):
                lines = []
                for ln in threads[0].strip().splitlines()[1:]:
                    if "pplab/runtime/rank_main.py" in ln or "multiprocessing/process.py" in ln:
                        break                   # below fn: how the rank was started, not the user's code
                    lines.append(ln)
                stacks[r] = "\n".join(lines)
    return stacks


def _where(stack: str) -> str:
    """The torch.distributed function a rank is blocked in, from its stack, if any."""
    frames = re.findall(r'File "([^"]+)", line (\d+) in (\S+)', stack)   # innermost first
    torch_calls = [(i, fn) for i, (path, _, fn) in enumerate(frames)
                   if "torch/distributed" in path.replace("\\", "/") and not fn.startswith("_")
                   and fn not in ("wrapper",)]
    if not torch_calls:
        if frames:
            path, line, fn = frames[0]
            return f"running {fn} ({os.path.basename(path)}:{line})"
        return ""
    i, fn = torch_calls[-1]                          # the outermost: the call the user made
    caller = next(((p, ln, f) for p, ln, f in frames[i + 1:] if "torch/" not in p.replace("\\", "/")), None)
    where = f" called from {caller[2]} ({os.path.basename(caller[0])}:{caller[1]})" if caller else ""
    return f"in torch.distributed.{fn}{where}"


def _recv_cycle(board, running) -> str:
    """' Ranks 0 -> 1 -> 0 each wait to receive from the next: ...' when receives form a cycle."""
    waits = {r: board[r]["call"]["src"] for r in running
             if board[r]["inside"] and board[r]["call"].get("kind") in ("recv", "wait for recv")
             and isinstance(board[r]["call"].get("src"), int)}
    for start in sorted(waits):
        path = [start]
        while path[-1] in waits and waits[path[-1]] not in path:
            path.append(waits[path[-1]])
        if path[-1] in waits and waits[path[-1]] == start:
            loop = " -> ".join(map(str, path + [start]))
            return (f" Ranks {loop} each wait to receive from the next, so none of them ever sends: a "
                    f"deadlock. One of them must send first, or post both with comm.exchange / isend.")
    return ""


def _timed_out(ranks, running, folder, timeout, board) -> LaunchError:
    stacks = _stacks(ranks, running, folder)
    now, parts, calls = time.time(), [], {}
    for r in running:
        slot = board[r]
        if slot["inside"] and slot["call"].get("kind") == callboard.RETURNED:
            text = "had returned from fn and waits for the others"
        elif slot["inside"]:
            text = f"in {callboard.describe(slot['call'])} since {now - slot['since']:.1f} s"
        else:
            text = _where(stacks.get(r, "")) or "not in a communication call"
        calls[r] = text
        parts.append(f"rank {r} {text}")
    hint = _recv_cycle(board, running)
    output = {r: ranks[r].last_output() for r in running}
    shown = "".join(f"\n  last output of rank {r}: " + " | ".join(lines[-5:])
                    for r, lines in output.items() if lines)
    stack_text = "".join(f"\n--- Python stack of rank {r} (most recent call first) ---\n{s}"
                         for r, s in stacks.items() if s)
    return LaunchError(
        f"{ranks_text(running)} still running after {timeout:g} s (timeout={timeout:g}) and "
        f"{'were' if len(running) > 1 else 'was'} stopped; {len(ranks) - len(running)} of {len(ranks)} "
        f"had finished. Where they were: {'; '.join(parts)}.{hint} A rank waiting in recv() or in a "
        f"collective that some peer never joins waits forever; if the work is only slow, pass a larger "
        f"timeout=.{shown}{stack_text}", running=running, output=output, calls=calls, stacks=stacks)


# ----------------------------------------------------------------------------------
# Explaining failures: who failed first, and why


# What a rank says when it failed only because a peer it was talking to had gone away.
_PEER_GONE = ("connection closed by peer", "connection reset by peer", "broken pipe", "remote worker crash")


def _knock_on(info) -> bool:
    return info[0] == "err" and any(s in info[2].lower() for s in _PEER_GONE)


def _native_reason(tail) -> str:
    """The C++ exception a rank aborted with (gloo's "what(): ..."), from its last output lines."""
    for line in reversed(tail):
        if "what():" in line:
            reason = line.split("what():", 1)[1].strip()
            return re.sub(r"^\[enforce fail at [^\]]*\]\s*", "", reason)
    return ""


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:                  # one Python has no name for (a real-time signal)
        return str(number)


def failure(ranks, failed, calls=None) -> LaunchError:
    """Blame the lowest rank that really failed; ranks that failed *because* it stopped
    (their connection to it closed) are listed after it as knock-on failures. Ranks with
    the same story are told once."""
    calls = calls or {}
    causes = [r for r in failed if not _knock_on(failed[r])]
    first = min(causes) if causes else min(failed)
    tracebacks, stories = {}, {}                     # story -> ranks, in order of first telling
    for r in sorted(failed, key=lambda r: (r != first, _knock_on(failed[r]), r)):
        info = failed[r]
        if info[0] == "not started":
            story = f"could not be started ({os.strerror(info[1])})"
        elif info[0] == "died":
            code = info[1]
            how = ("the launch's host process was killed, and the rank with it" if code is None else
                   f"killed by signal {_signal_name(-code)}" if code < 0 else f"exit code {code}")
            story = f"exited without returning a result ({how})"
            reason = _native_reason(ranks[r].tail)
            if reason:
                story += f": {reason}"
            if r in calls:
                story += f" [it was in {calls[r]}]"
        elif _knock_on(info) and r != first:
            tracebacks[r] = info[3]
            story = "lost the connection to a rank that had stopped"
        else:
            _, phase, summary, text = info
            tracebacks[r] = text
            where = "during start-up (joining the process group)" if phase == "init" else \
                "after fn returned: its result could not be sent back" if phase == "return" else ""
            story = f"raised {summary}" + (f" {where}" if where else "")
        stories.setdefault(story, []).append(r)
    message = "; ".join(f"{ranks_text(rs)} {story}" for story, rs in stories.items()) + ". All ranks were stopped."
    if first in tracebacks:
        message += f"\n\n--- traceback of rank {first} ---\n{tracebacks[first]}"
    return LaunchError(message, rank=first, tracebacks=tracebacks, calls=calls,
                       output={r: ranks[r].last_output() for r in failed})
