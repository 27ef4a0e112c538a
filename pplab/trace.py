"""What each rank computed, sent and held: recorded per rank, merged into one Timeline.

Inside a rank (a function run by `pplab.launch`, or a script under torchrun):

    with trace.span("F", microbatch=3, stage=1):   # a compute box labelled "F3"
        y = stage(x)
    trace.hold(y)                                  # activations now held: +y.nbytes
    comm.send(y, dst=2)                            # pplab.comm records bytes, peer, times
    ...
    trace.release(y)

`pplab.launch` hands every rank's events back to the caller as `results.timeline`;
under torchrun, `trace.gather()` collects them on every rank. The swimlane renderer
draws a Timeline, and so does the schedule simulator: simulated and measured runs are
the same kind of object, drawn by the same code.

Times are seconds from `time.perf_counter()`, which on Linux reads CLOCK_MONOTONIC:
one clock for every process on a machine, so ranks launched on one machine need no
clock alignment. `gather()` estimates an offset per machine when ranks span machines.
"""
from __future__ import annotations

import contextlib
import socket
import time
from dataclasses import asdict, dataclass, field

now = time.perf_counter


@dataclass
class Event:
    """One thing one rank did: a compute span, a message or collective, or a memory change."""

    rank: int
    kind: str                        # "F", "B", "W", "send", "recv", "all_reduce", "memory", ...
    category: str                    # "compute" | "comm" | "memory"
    start: float                     # seconds
    end: float | None                # None while an async op has not been waited on
    label: str = ""                  # the text drawn in its swimlane box, e.g. "F3" or "AR"
    bytes_sent: int = 0              # bytes this rank put on the wire (point-to-point only)
    bytes_recv: int = 0              # bytes this rank took off the wire
    peer: int | None = None          # the other rank of a send/recv (global rank)
    group: tuple | None = None       # global ranks taking part in a collective
    seq: int | None = None           # n-th message src->dst: pairs each send with its recv
    value: int | None = None         # memory events: bytes held after this event
    meta: dict = field(default_factory=dict)

    @property
    def duration(self) -> float:
        return (self.end if self.end is not None else self.start) - self.start


# ----------------------------------------------------------------------------------
# The recorder: one per process (= one per rank).

_events: list[Event] = []
_state = {"rank": 0, "enabled": True, "held": 0}
_send_seq: dict[int, int] = {}
_recv_seq: dict[int, int] = {}


def reset(rank: int | None = None) -> None:
    """Forget recorded events (the launcher calls this at the start of every rank)."""
    _events.clear()
    _send_seq.clear()
    _recv_seq.clear()
    _state["held"] = 0
    _state["enabled"] = True
    if rank is None:
        rank = _current_rank()
    _state["rank"] = rank


def recording_rank() -> int:
    """The rank this process records its events as (set by reset, at the start of every rank)."""
    return _state["rank"]


def _current_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def enabled() -> bool:
    return _state["enabled"]


@contextlib.contextmanager
def paused():
    """Record nothing inside this block (e.g. the launcher's own bookkeeping)."""
    before = _state["enabled"]
    _state["enabled"] = False
    try:
        yield
    finally:
        _state["enabled"] = before


def record(event: Event) -> Event:
    if _state["enabled"]:
        _events.append(event)
    return event


def next_seq(peer: int, sending: bool) -> int:
    """Number the messages of each (src, dst) pair so a send can be matched to its recv."""
    table = _send_seq if sending else _recv_seq
    table[peer] = table.get(peer, -1) + 1
    return table[peer]


def action_label(kind: str, microbatch, chunk) -> str:
    """How a piece of work is labelled, in a span's box and in a schedule's action: F3, or F3.1 for chunk 1."""
    text = kind if microbatch is None else f"{kind}{microbatch}"
    return text if chunk is None else f"{text}.{chunk}"



@contextlib.contextmanager
def span(kind: str, label: str | None = None, *, microbatch=None, chunk=None, **meta):
    """Mark a compute span: `with trace.span("F", microbatch=3, stage=1): ...`.

    The box is labelled `label`, or kind + micro-batch ("F3"), with ".chunk" for
    interleaved schedules ("F3.1"). Extra keywords are kept in `event.meta`.
    """
    meta = dict(meta)
    if microbatch is not None:
        meta["microbatch"] = microbatch
    if chunk is not None:
        meta["chunk"] = chunk
    event = Event(_state["rank"], kind, "compute", now(), None,
                  label if label is not None else action_label(kind, microbatch, chunk), meta=meta)
    try:
        yield event
    finally:
        event.end = now()
        record(event)


def _nbytes(x) -> int:
    if isinstance(x, int):
        return x
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(t) for t in x)
    if hasattr(x, "numel") and hasattr(x, "element_size"):
        return x.numel() * x.element_size()
    raise TypeError(f"trace.hold/release take a tensor, a list of tensors or a byte count, not {type(x).__name__}")


def memory(nbytes: int, label: str = "") -> None:
    """Record that this rank now holds `nbytes` bytes (of activations, say)."""
    _state["held"] = int(nbytes)
    t = now()
    record(Event(_state["rank"], "memory", "memory", t, t, label, value=_state["held"]))


def hold(x, label: str = "") -> None:
    """This rank starts holding `x` (a tensor, list of tensors or byte count)."""
    memory(_state["held"] + _nbytes(x), label)


def release(x, label: str = "") -> None:
    """This rank no longer holds `x`."""
    memory(_state["held"] - _nbytes(x), label)


def held() -> int:
    return _state["held"]


def events() -> list[Event]:
    """This rank's events so far (unfinished async ops get end = start)."""
    for e in _events:
        if e.end is None:
            e.end = e.start
            e.meta["never_waited"] = True
    return list(_events)


def gather(group=None) -> "Timeline":
    """Collect every rank's events on every rank (a collective: all ranks must call it).

    Ranks on one machine share a clock. Ranks on other machines are shifted by an
    offset estimated right after a barrier, good to roughly the barrier's skew.
    """
    import torch.distributed as dist

    if not dist.is_initialized():
        return Timeline(events(), world_size=1)
    with paused():
        dist.barrier(group=group)
        mark = now()
        mine = (socket.gethostname(), mark, [asdict(e) for e in events()])
        everyone = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, mine, group=group)
    host0, mark0 = everyone[0][0], everyone[0][1]
    host_offset = {host0: 0.0}
    for host, mark_r, _ in everyone:       # the first rank seen on each machine sets its offset
        host_offset.setdefault(host, mark_r - mark0)
    merged = []
    for host, _, evs in everyone:
        for d in evs:
            d["start"] -= host_offset[host]
            d["end"] -= host_offset[host]
            d["group"] = tuple(d["group"]) if d["group"] is not None else None
            merged.append(Event(**d))
    return Timeline(merged, world_size=len(everyone))


# ----------------------------------------------------------------------------------
# The merged view of all ranks.

def union_length(intervals) -> float:
    """Length of the union of (start, end) intervals: time covered by at least one of them."""
    total, cur_s, cur_e = 0.0, None, None
    for s, e in sorted(intervals):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total



class Timeline:
    """Events of all ranks on one clock, with time 0 at `t0` (default: the first event).

    `source` says where it came from ("measured" or "simulated"); the renderer and the
    summaries do not care. `unit` is the time unit ("s" when measured; a simulator may
    count in units of one forward pass), `memory_unit` what memory events count
    ("B" for bytes; a pipeline simulator counts "micro-batches" of activations).
    """

    def __init__(self, events, world_size: int | None = None, source: str = "measured",
                 t0: float | None = None, unit: str = "s", memory_unit: str = "B"):
        events = [e for e in events]
        for e in events:
            if e.end is None:
                e.end = e.start
        if t0 is None:
            t0 = min((e.start for e in events), default=0.0)
        self.events = sorted(
            (Event(**{**e.__dict__, "start": e.start - t0, "end": e.end - t0}) for e in events),
            key=lambda e: (e.start, e.rank))
        self.world_size = world_size if world_size is not None else \
            1 + max((e.rank for e in self.events), default=0)
        self.source = source
        self.unit = unit
        self.memory_unit = memory_unit
        # An isend is only "done" when its rank waits on it, which may be much later than
        # the data arrived. Its message cannot still be in flight once the matching
        # receive has completed, so end the send there at the latest.
        for send, recv in self.messages():
            if send.end > recv.end:
                send.end = max(send.start, recv.end)

    # -- selection --------------------------------------------------------------
    def select(self, rank=None, category=None, kind=None) -> list[Event]:
        kinds = {kind} if isinstance(kind, str) else (set(kind) if kind else None)
        return [e for e in self.events
                if (rank is None or e.rank == rank)
                and (category is None or e.category == category)
                and (kinds is None or e.kind in kinds)]

    def __iter__(self):
        return iter(self.events)

    def __len__(self):
        return len(self.events)

    @property
    def makespan(self) -> float:
        """From time 0 to the end of the last compute or comm event."""
        return max((e.end for e in self.events if e.category != "memory"), default=0.0)

    # -- utilisation --------------------------------------------------------------
    def busy(self, rank: int) -> float:
        """Time `rank` spent computing (overlapping spans counted once)."""
        return union_length((e.start, e.end) for e in self.select(rank, "compute"))

    def utilization(self, rank: int | None = None) -> float:
        """Busy / total: for one rank, or overall = sum of busy / (ranks x makespan)."""
        span = self.makespan
        if span <= 0:
            return 0.0
        if rank is not None:
            return self.busy(rank) / span
        return sum(self.busy(r) for r in range(self.world_size)) / (self.world_size * span)

    def bubble(self, rank: int) -> float:
        """Idle (non-compute) time of `rank` within the makespan."""
        return self.makespan - self.busy(rank)

    # -- communication ------------------------------------------------------------
    def bytes_sent(self, rank: int | None = None, kind=None) -> int:
        return sum(e.bytes_sent for e in self.select(rank, "comm", kind))

    def bytes_received(self, rank: int | None = None, kind=None) -> int:
        return sum(e.bytes_recv for e in self.select(rank, "comm", kind))

    def messages(self) -> list[tuple[Event, Event]]:
        """(send, recv) pairs, matched by (src, dst, n-th message between them)."""
        recvs = {(e.peer, e.rank, e.seq): e for e in self.events
                 if e.category == "comm" and e.bytes_recv and e.seq is not None}
        pairs = []
        for e in self.events:
            if e.category == "comm" and e.bytes_sent and e.seq is not None:
                r = recvs.get((e.rank, e.peer, e.seq))
                if r is not None:
                    pairs.append((e, r))
        return pairs

    # -- memory -------------------------------------------------------------------
    def memory_curve(self, rank: int):
        """(times, bytes held) of `rank`, a step function starting at 0."""
        times, values = [0.0], [0]
        for e in self.select(rank, "memory"):
            times.append(e.start)
            values.append(e.value)
        return times, values

    def peak_memory(self, rank: int) -> int:
        return max(self.memory_curve(rank)[1])

    # -- reports --------------------------------------------------------------------
    def summary(self) -> str:
        """A per-rank table: busy time, utilisation, bytes sent/received, peak memory."""
        u = self.unit
        rows = [f"{'rank':>4} {'busy ' + u:>10} {'util':>6} {'sent B':>12} {'recv B':>12} {'peak mem B':>12}"]
        for r in range(self.world_size):
            rows.append(f"{r:>4} {self.busy(r):>10.4g} {self.utilization(r):>6.1%} "
                        f"{self.bytes_sent(r):>12,} {self.bytes_received(r):>12,} {self.peak_memory(r):>12,}")
        rows.append(f"makespan {self.makespan:.4g} {u}, overall utilisation {self.utilization():.1%}")
        return "\n".join(rows)

    def __repr__(self):
        return (f"Timeline({self.source}, {self.world_size} ranks, {len(self.events)} events, "
                f"makespan {self.makespan:.4g} {self.unit})")
