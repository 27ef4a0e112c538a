"""A sealed launch: the student's code runs on ranks that hold no secret of the check,
and every message between them goes through the checker's process.

    run_sealed(job, answer, inputs, world_size=p, timeout=timeout, exercise=("broadcast", "broadcast"),
               describe=describe, check=check)

Why. Ranks forked from the checker's own process would inherit its stack (the seed, the
references: `sys._getframe()`, `gc.get_objects()`), and ranks that hold a real process
group can talk by routes a watch in the rank cannot see. So, in a sealed launch:

1. Ranks never hold a secret. `run_check` starts a *zygote* (`zygote(answer)`) before it
   draws the seed: a fork of this process that keeps the answer (a function object, or a
   SourceAnswer's source, resolved in each rank) and nothing the check computes later.
   When `pplab grade` checks an exercise listed in denied.py, the zygote is instead a fresh
   interpreter that never imported the checker nor the library modules the exercise asks
   the student to write (fresh_zygote.py): graded, an answer runs where they do not exist.
   For each launch the zygote forks the ranks. Each gets only its own channel (a
   socketpair made here, passed with `socket.send_fds`) and pipes for its output.
2. Inputs come from the checker, per rank. `inputs[i][r]` is plain data for rank r in
   trial i; rank r receives only `[inputs[i][r] for each trial]`, never the seed. The
   checker computes every input and every reference in its own process.
3. All communication goes through the checker. A sealed rank has no process group:
   pplab.comm and torch.distributed's entry points are requests to the `Router`
   (router.py), which matches sends with receives, computes the collectives the
   exercise allows, refuses (and records) those it forbids, and records every call.
   The checker reads that record (`traffic`), not a count kept in the rank.
4. A deadlock is exact (every live rank blocked in the router: stopped at once, with
   what each one waits for); a rank still running at `timeout` is told apart as busy on
   the CPU (a loop) or waiting.
5. What a rank sends back (observations, its result) is plain data decoded with
   `torch.load(weights_only=True)`; it can forge only what it legitimately controls.
6. Isolation between ranks (isolate.py, on pplab/isolation.py; Linux): new user, mount, network and
   PID namespaces, a read-only root, private /tmp, /dev/shm and working folder, locked
   by a nested user namespace; no rank can reach another through files, sockets,
   signals or ptrace. The checker (and the zygote) are made non-dumpable, so a rank
   cannot read their memory. Where the system does not permit unprivileged namespaces
   (some containers) this step is skipped (`isolation()` says what was missing): the
   check still works, but ranks can then reach each other through shared files.

The job, in each rank (a module-level function of a pplab.checks module):

    def _rank(fn, trials):                       # trials: this rank's inputs only
        for i, t in enumerate(trials):
            begin(i)                             # the router files the calls under trial i
            returned = fn(t["tensor"], t["src"]) # the student's code
            observe(i, {"tensor": t["tensor"]})  # plain data

and `check(world_size, i, observed, traffic)` runs here: observed is {rank: data},
traffic is the router's record of trial i, {rank: {"sends": [(dst, bytes)],
"received": [(src, bytes)], ...}} (router.py's Record.traffic says all it holds: the
collectives too, with the phase a job names with `phase("forward")`). A pure function is
called with `call_each(answer, cases, where=, timeout=)` (one sealed rank, every case in
one launch) or `call_answer(answer, *args)`.
"""
from __future__ import annotations

import contextlib
import os
import select
import socket
import sys
import time

from .answers import _not_plain, answer_files, decode, encode
from .failures import Fail, Forbidden, NotImplementedYet, _hang_message, _student_frame
from .forbidden import _forbidden_message
from .router import Reader, Router, WireError, pack
from .rank import begin, observe
from .zygotes import _ZYGOTES, zygote

_ISOLATION = {"missing": None}          # what the last launch's ranks could not isolate ("" = nothing)


def isolation() -> str | None:
    """What the ranks of the last sealed launch could not set up ("" if nothing, None if no launch)."""
    return _ISOLATION["missing"]


# ----------------------------------------------------------------------------------
# A launch, run from here


class _Busy:
    """How often each rank was seen running, for _hang_message (0 for a rank blocked in the router)."""

    def __init__(self, pids):
        self.pids, self.procs, self.samples, self.blocked = pids, {}, {}, {}
        self.forked: dict = {}                           # rank -> whether isolate() forked it (its hello says)

    def _process(self, rank):
        """The rank's process: the child of the pid the zygote gave (isolate() forks once), once it exists."""
        import psutil
        if rank not in self.procs:
            holder = psutil.Process(self.pids[rank])
            children = holder.children()
            if rank not in self.forked or (self.forked[rank] and not children):
                return None
            self.procs[rank] = (children or [holder])[0]
        return self.procs[rank]

    def sample(self, blocked) -> None:
        self.blocked = dict(blocked)
        for rank in range(len(self.pids)):
            with contextlib.suppress(Exception):
                proc = self._process(rank)
                if proc is None:
                    continue
                running = proc.status() == "running" and rank not in self.blocked
                self.samples[rank] = (self.samples.get(rank, []) + [running])[-8:]

    def busy(self, rank):
        if rank in self.blocked:
            return 0.0
        s = self.samples.get(rank, [])
        return sum(s) / len(s) if len(s) >= 3 else None


_OUTPUT_LIMIT = 1 << 20                 # bytes of output printed per rank and launch


def run_sealed(job, answer, inputs, *, world_size: int, timeout: float, exercise: tuple, check, describe=None,
               forbidden=("*",), probe=None, prefix=None, single=False):
    """Run `job(answer, [inputs[i][rank] for i])` on `world_size` sealed ranks, then
    `check(world_size, i, observed, traffic)` here for every trial i. Raises Fail for any
    way it went wrong (see the module docstring). Returns each rank's result of `job`.

    exercise: (exercise id, what it builds), for the wording of a forbidden call;
    forbidden: the collectives the router refuses ("*": all of them);
    probe: a module-level function probe(answer) of a pplab.checks module, run in each rank
    before the job, that raises Forbidden if the answer uses the library's own answer
    (refuse_library); prefix(trial): the whole text before each message, instead of
    describe's; single: one rank calling the answer (call_each), named after the answer."""
    if not _ZYGOTES:
        raise RuntimeError("a sealed launch needs the zygote that run_check starts before it draws the seed: "
                           "run the checker through pplab.checks.run_check")
    zygote, p, trials = _ZYGOTES[-1], world_size, len(inputs)
    name, files = getattr(answer, "__name__", "your function"), answer_files(answer)

    def forbidden_message(kind, shown):
        if "*" in forbidden or kind in forbidden:
            return _forbidden_message(exercise[0], exercise[1], shown)
        return None

    router = Router(p, forbidden_message)
    socks, outs, errs, pids = zygote.launch(p)
    observed = [{} for _ in range(trials)]
    results, refused = {}, []
    output = _Output(outs, errs)
    try:
        outcome = _serve(router, socks, output, pids, job, inputs, forbidden, exercise, timeout, observed, results,
                         refused, probe)
    finally:
        statuses = zygote.end()
        output.drain()
        for s in socks:
            s.close()
        for fd in outs + errs:
            os.close(fd)

    def where(rank, trial=None):
        trial = router.trial[rank] if trial is None else trial
        if prefix is not None:
            return prefix(trial) if trial is not None else ""
        return f"{describe(p, trial)}: " if describe is not None and trial is not None else f"world_size={p}: "

    forbidden_calls = refused + router.record.forbidden        # a name bound before the launch, then a call
    if forbidden_calls:
        raise Forbidden(forbidden_calls[0][2])
    complete = outcome[0] == "complete"
    for i in range(trials):
        seen = observed[i]
        if not seen:
            if complete:
                raise Fail(f"{where(0, i)}no rank recorded a result for this trial.")
            break
        missing = [r for r in range(p) if r not in seen]
        if missing and complete:
            raise Fail(f"{where(missing[0], i)}rank {missing[0]} recorded no result for this trial.")
        for rank, data in seen.items():
            if _not_plain(data) and single:
                raise Fail(f"{where(rank, i)}{name} returned a {_not_plain(data)}, which cannot come back from the "
                           f"process it ran in: return numbers, strings, lists, tuples, dicts or tensors.")
            if _not_plain(data):
                raise Fail(f"{where(rank, i)}rank {rank}: the answer gave a {_not_plain(data)}, which cannot come "
                           f"back from the process it ran in: return numbers, strings, lists, tuples, dicts or "
                           f"tensors.")
        try:
            check(p, i, seen, router.record.traffic(i))
        except Forbidden:
            raise
        except Fail as failure:
            raise Fail(f"{where(0, i)}{failure}", failure.seed_matters) from None
        except Exception as exc:  # noqa: BLE001 - data shaped unlike what the job records: refused
            raise Fail(f"{where(0, i)}the results recorded by the ranks could not be read "
                       f"({type(exc).__name__}: {exc}).") from None
        if missing:         # the launch failed in this trial: what ranks recorded after it is out of step
            break
    if not complete:
        raise _failure(outcome, where, name, files, timeout, statuses, pids, single) from None
    return [results[r] for r in range(p)]


def call_each(answer, cases, *, where, timeout: float, probe=None, job=None):
    """Yield `answer(*args)` for each args in `cases`, in order: a pure function's answers.

    The answer runs in one sealed rank (forked from the zygote: it never held the seed),
    all cases in one launch; what it returned comes back as plain data. where(i) starts
    the message of case i ("p=4, m=8: "). A raise, a hang or a death in case i is raised
    as a Fail when the iteration reaches case i, so a wrong value in an earlier case is
    told first. probe: as for run_sealed (refuse_library, in the rank). job: instead of
    calling the answer on each case, a job of the checker's module, job(answer, cases),
    that records each case with begin(i) and observe(i, data) (e.g. calls that depend on
    what the answer returned before); `_call_rank_and_args` records (returned, args)."""
    got = {}

    def keep(p, i, observed, traffic):
        got[i] = observed[0]
    failure = None
    try:
        run_sealed(job or _call_rank, answer, [[tuple(args)] for args in cases], world_size=1, timeout=timeout,
                   exercise=("", ""), check=keep, forbidden=(), probe=probe, prefix=where, single=True)
    except Fail as exc:
        failure = exc
    if isinstance(failure, Forbidden):
        raise failure
    for i in range(len(cases)):
        if i not in got:
            break
        yield got[i]
    if failure is not None:
        raise failure


def call_answer(answer, *args, where: str = "", timeout: float = 30.0):
    """What `answer(*args)` returns, called in a sealed rank: the check's zygote's, or, outside
    a check (where no secret exists), a zygote forked for this call. Fail if it raises or hangs."""
    if _ZYGOTES:
        return next(call_each(answer, [args], where=lambda i: where, timeout=timeout))
    with zygote(answer):
        return next(call_each(answer, [args], where=lambda i: where, timeout=timeout))


def _call_rank(fn, calls):
    """The job of call_each, in its rank: call the answer on each case, record what it returned."""
    for i, args in enumerate(calls):
        begin(i)
        observe(i, fn(*args))


def _call_rank_and_args(fn, calls):
    """As _call_rank, recording (returned, the arguments after the call): did it change its inputs?"""
    for i, args in enumerate(calls):
        begin(i)
        returned = fn(*args)
        observe(i, (returned, args))


class _Output:
    """What the ranks print, shown here as "[rank r] line", at most _OUTPUT_LIMIT bytes per rank."""

    def __init__(self, outs, errs):
        self.pipes = {fd: (r, sys.stdout) for r, fd in enumerate(outs)}
        self.pipes.update({fd: (r, sys.stderr) for r, fd in enumerate(errs)})
        self.printed = {}

    def __call__(self, fd) -> None:
        r, stream = self.pipes[fd]
        data = os.read(fd, 1 << 16)
        if not data:
            del self.pipes[fd]
            return
        printed = self.printed.get(r, 0)
        if printed < _OUTPUT_LIMIT:
            text = data[:_OUTPUT_LIMIT - printed].decode(errors="replace")
            for line in text.rstrip("\n").split("\n"):
                print(f"[rank {r}] {line}", file=stream, flush=True)
        self.printed[r] = printed + len(data)

    def drain(self) -> None:
        """After the ranks ended: what they printed last (a process they left behind gets 1 s)."""
        end = time.monotonic() + 1.0
        while self.pipes and time.monotonic() < end:
            ready, _, _ = select.select(list(self.pipes), [], [], 0.2)
            if not ready:
                break
            for fd in ready:
                self(fd)


def _serve(router, socks, output, pids, job, inputs, forbidden, exercise, timeout, observed, results, refused, probe):
    """The checker's side of a launch: route requests, print output, until the ranks end
    or cannot go on. Returns ("complete",) or what stopped it."""
    p = len(socks)
    outbox = {r: bytearray() for r in range(p)}
    readers = {r: Reader() for r in range(p)}
    for r in range(p):                                   # the launch message: this rank's inputs only
        outbox[r] += pack({"job": f"{job.__module__}:{job.__name__}", "rank": r, "world_size": p,
                           "forbidden": list(forbidden), "refuse": list(exercise) if forbidden else [],
                           "probe": f"{probe.__module__}:{probe.__name__}" if probe else None},
                          [encode([trial[r] for trial in inputs])])
        socks[r].setblocking(False)
    busy, deadline, next_sample = _Busy(pids), time.monotonic() + timeout, 0.0
    done = set()

    def take(r, header, blobs):
        """One message from rank r: the checker's own kinds here, requests to the router."""
        op = header.get("op")
        if op == "hello":
            missing = str(header.get("isolation", ""))
            _ISOLATION["missing"] = missing if r == 0 else _ISOLATION["missing"] or missing
            busy.forked[r] = not missing.startswith("no namespaces")
        elif op == "observe":
            trial = header.get("trial")
            if not isinstance(trial, int) or not 0 <= trial < len(observed) or len(blobs) != 1:
                raise WireError("an observation of no trial")
            try:
                observed[trial][r] = decode(blobs[0])
            except Exception as exc:  # noqa: BLE001 - not plain data: a fail
                return ("not plain", r, trial, type(exc).__name__)
        elif op == "refused":
            refused.append((r, None, str(header.get("message"))))
        elif op == "done":
            try:
                results[r] = decode(blobs[0])
            except Exception as exc:  # noqa: BLE001
                return ("not plain", r, None, type(exc).__name__)
            done.add(r)
            router.finish(r)
        elif op == "raised":
            return ("raised", r, str(header.get("kind")), str(header.get("message")), str(header.get("traceback")))
        else:
            for rank, reply, out in router.handle(r, header, blobs):
                outbox[rank] += pack(reply, out)
        return None

    while len(done) < p:
        now = time.monotonic()
        if now >= next_sample or now >= deadline:
            busy.sample(router.blocked)
            next_sample = now + 0.5
        if now >= deadline:
            return ("hang", [r for r in range(p) if r not in done], busy)
        live = [socks[r] for r in range(p) if r not in done]
        ready, writable, _ = select.select(live + list(output.pipes), [socks[r] for r in range(p) if outbox[r]],
                                           [], min(0.5, deadline - now))
        for s in writable:
            r = socks.index(s)
            try:
                del outbox[r][:s.send(outbox[r])]
            except BlockingIOError:
                pass
            except OSError:                              # the rank is gone: its EOF comes next
                outbox[r].clear()
        for item in ready:
            if not isinstance(item, socket.socket):
                output(item)
                continue
            r = socks.index(item)
            try:
                data = item.recv(1 << 20)
            except BlockingIOError:
                continue
            except ConnectionError:
                data = b""
            if not data:
                return ("died", r)
            try:
                for header, blobs in readers[r].feed(data):
                    stopped = take(r, header, blobs)
                    if stopped:
                        return stopped
            except WireError as exc:
                return ("malformed", r, str(exc))
        waiting = router.deadlock()
        if waiting:
            return ("deadlock", waiting, [r for r in range(p) if router.finished[r]])
    return ("complete",)


def _failure(outcome, where, name, files, timeout, statuses, pids, single=False) -> Fail:
    """The Fail that says why a launch did not complete (single: one rank calling the answer)."""
    kind = outcome[0]
    who = (lambda rank: name) if single else (lambda rank: f"rank {rank}")
    if kind == "raised":
        _, rank, exc, message, text = outcome
        if exc == "Forbidden":
            return Forbidden(message)
        if exc == "Fail":
            return Fail(where(rank) + message)
        if exc == "Unavailable":                         # a denied module reached for (library_view.py)
            return Fail(f"{where(rank)}{message}.", seed_matters=False)
        if exc == "NotImplementedError":
            return NotImplementedYet(name)
        return Fail(f"{where(rank)}{who(rank)} raised {exc}: {message}{_student_frame(text, files)}.")
    if kind == "deadlock":
        _, waiting, finished = outcome
        what = ", ".join(f"rank {r} {w}" for r, w in waiting)
        ended = f"; rank{'s' if len(finished) > 1 else ''} {', '.join(map(str, finished))} had returned" \
            if finished else ""
        return Fail(f"{where(waiting[0][0])}a deadlock: {what}{ended}. No rank could go on, so the check stopped "
                    f"them at once. Every recv needs a matching send from the rank it names, and a rank that "
                    f"waits to receive before it sends waits forever if its sender is waiting too.")
    if kind == "hang":
        _, running, busy = outcome
        looping = [r for r in running if (busy.busy(r) or 0) >= 0.7]
        if single:
            return Fail(where(running[0]) + _hang_message(running, timeout, busy, name, name))
        if looping or all(r in busy.blocked for r in running):
            return Fail(where(looping[0] if looping else running[0]) + _hang_message(running, timeout, busy, name))
        idle = [r for r in running if r not in busy.blocked]     # not waiting for a message, not busy
        waiting = [f"rank {r} {busy.blocked[r]}" for r in running if r in busy.blocked]
        also = f" ({'; '.join(waiting)})" if waiting else ""
        return Fail(f"{where(idle[0])}rank{'s' if len(idle) > 1 else ''} {', '.join(map(str, idle))} "
                    f"{'were' if len(idle) > 1 else 'was'} still running after {timeout:g} s, neither busy on the "
                    f"CPU nor waiting for a message: what {'are they' if len(idle) > 1 else 'is it'} waiting for "
                    f"(a sleep, an input, a lock)?{also}")
    if kind == "died":
        rank = outcome[1]
        status = statuses.get(pids[rank])
        signal_number = -status if isinstance(status, int) and status < 0 else \
            status - 128 if isinstance(status, int) and status > 128 else None
        how = f"killed by signal {signal_number}" if signal_number else f"exit code {status}"
        running = "" if single else f" while running {name}"
        return Fail(f"{where(rank)}{who(rank)} died ({how}){running}, without raising an exception: "
                    f"did the code call os._exit, or kill a process?")
    if kind == "not plain":
        _, rank, trial, why = outcome
        return Fail(f"{where(rank, trial)}rank {rank} recorded something that is not plain data ({why}).")
    return Fail(f"{where(outcome[1])}rank {outcome[1]} broke its channel to the checker ({outcome[2]}): does the "
                f"code write to file descriptors it did not open?")
