"""A Timeline in the Chrome trace format, to open in Perfetto (ui.perfetto.dev) or chrome://tracing.

    path = pplab.swimlane.to_perfetto(results.timeline, "run.json")
    # ui.perfetto.dev -> "Open trace file" -> run.json

This is the format `torch.profiler` writes (`prof.export_chrome_trace`), so a pplab run and a
profiled GPU run are read in the same viewer, with the same keys (WASD) and the same queries.
The file is one JSON object whose "traceEvents" list holds (Chrome's "Trace Event Format"):

* one **process per rank** (`pid` = rank, named "rank r"), with **threads** (lanes): "compute"
  (spans such as F3, B3) and "comm" (sends, receives, collectives), and "comm 2", "comm 3", ...
  when operations were in flight at the same time (see below);
* one **complete event** (`"ph": "X"`) per compute or comm event: `ts` and `dur` in
  microseconds, `name` its label, `cat` its category; `args` holds its kind, bytes sent and
  received, the tensor bytes of a collective (`payload`), its peer or group, and its metadata;
* a **counter** (`"ph": "C"`) per memory event: the bytes the rank holds, drawn as a graph;
* a **flow** arrow (`"ph": "s"` then `"f"`) from each send to its matching receive, and, inside
  a receive posted before its send began, a slice "in flight" for the part after that (rule 3).

Three rules of the viewer shape the file; break one and Perfetto drops data without a word:

1. On one thread, complete events must nest like function calls. DDP's bucket all-reduces, or
   FSDP's prefetched all-gathers, are in flight *at the same time* and overlap without nesting:
   each such event goes on the first lane of its rank that is free (interval partitioning), so
   a rank with three all-reduces in flight at once shows "comm", "comm 2" and "comm 3".
2. Perfetto knows a thread by its id, as Linux numbers threads (machine-wide), and 0 is the
   kernel's idle thread: with thread 0 as every rank's compute lane, rank 1's was taken for rank
   0's and vanished. Each lane gets an id of its own, 1000 x (rank + 1) + lane (compute lanes
   0, 1, ...; comm lanes 100, 101, ...).
3. An arrow's end must come after its start, each end is bound to the slice that encloses it,
   and Perfetto points an arrow from the slice that *starts* first to the other. A receive is
   often posted before its send starts (an irecv waiting for data): its arrow would point back
   from the receive to the send. So inside such a receive a slice "in flight" begins just after
   the send began, and the arrow ends there. Only if the receive finished before the send began
   -- possible only when ranks on different machines disagree about the clock -- can no arrow
   be drawn; `to_perfetto` counts those in "otherData".

Times are written in microseconds with three decimals: whole nanoseconds, which is what the
viewer reads them as (exactly), so what touches here touches there and nothing overlaps.
"""
from __future__ import annotations

import json
from pathlib import Path

LANE_BASE, COMM_LANES = 1000, 100       # thread id = LANE_BASE * (rank + 1) + lane (+ COMM_LANES for comm)


def tid(rank: int, category: str, lane: int = 0) -> int:
    """The thread id of `rank`'s `lane`-th compute or comm lane (never 0, never shared by ranks)."""
    return LANE_BASE * (rank + 1) + (COMM_LANES if category == "comm" else 0) + lane


def lane_name(category: str, lane: int) -> str:
    return category if lane == 0 else f"{category} {lane + 1}"


def _args(e) -> dict:
    args = {"kind": e.kind, "bytes_sent": e.bytes_sent, "bytes_recv": e.bytes_recv}
    if e.peer is not None:
        args["peer"] = e.peer
    if e.group is not None:
        args["group"] = list(e.group)
    for key, value in e.meta.items():
        args[key] = value if isinstance(value, (int, float, str, bool)) or value is None else repr(value)
    return args


def assign_lanes(spans) -> list[int]:
    """For (start, end) pairs in integer ns, a lane each such that a lane's spans never overlap:
    a span goes on the first lane whose last span ended by the time it starts. Spans are taken in
    order of start, so lane 0 gets the most, and a rank gets as many lanes as it had operations
    in flight at once (first fit is optimal for intervals)."""
    lanes, free_from = [0] * len(spans), []        # free_from[k]: end of lane k's last span
    for i in sorted(range(len(spans)), key=lambda i: spans[i]):
        start, end = spans[i]
        k = next((k for k, last in enumerate(free_from) if start >= last), len(free_from))
        if k == len(free_from):
            free_from.append(end)
        free_from[k] = end
        lanes[i] = k
    return lanes


def flow_times(send: tuple[int, int], recv: tuple[int, int]) -> tuple[int, int] | None:
    """Where the arrow from a send to its receive starts and ends (ns), or None if it cannot be
    drawn. Each end lies inside its slice, off its edges (the viewer binds an end to the slice
    that encloses it, and at an edge two slices may touch), and the end comes after the start
    (the viewer reads events in time order: an end before its start is an arrow to nowhere)."""
    (a, b), (c, d) = send, recv
    s_lo, s_hi = a + 1, min(b - 1, d - 2)            # start: in the send, early enough to end in the receive
    if s_lo > s_hi or c + 1 > d - 1:
        return None
    s = min(max((a + min(b, d)) // 2, s_lo), s_hi)   # the middle of the send's part before the receive ends
    f_lo, f_hi = max(c + 1, s + 1), d - 1
    return s, min(max((max(c, s) + d) // 2, f_lo), f_hi)   # the middle of the receive's part after that


def trace_events(timeline, seconds_per_unit: float | None = None) -> list[dict]:
    """The Chrome trace events of `timeline` (see the module's docstring for what each holds).

    A measured timeline counts seconds. A simulated one may count in other units (one forward
    pass, say): give `seconds_per_unit` to place it on a clock.
    """
    if seconds_per_unit is None:
        if timeline.unit != "s":
            raise ValueError(f"this timeline counts time in {timeline.unit!r}, not seconds: pass "
                             f"seconds_per_unit= (how many seconds one {timeline.unit!r} lasts)")
        seconds_per_unit = 1.0
    ns_per_unit = 1e9 * seconds_per_unit
    spans = {id(e): (round(e.start * ns_per_unit), round(e.end * ns_per_unit)) for e in timeline.events}
    boxes = [e for e in timeline.events if e.category != "memory"]
    where, lanes_of = {}, {}                      # event -> its thread id; (rank, category) -> lanes
    for r in range(timeline.world_size):
        for category in ("compute", "comm"):
            mine = [e for e in boxes if e.rank == r and (e.category == "compute") == (category == "compute")]
            lanes = assign_lanes([spans[id(e)] for e in mine])
            lanes_of[r, category] = 1 + max(lanes, default=0)
            where.update((id(e), tid(r, category, k)) for e, k in zip(mine, lanes))

    us = lambda ns: ns / 1000                                    # noqa: E731 - the file counts µs
    out = []
    for r in range(timeline.world_size):
        out.append({"ph": "M", "name": "process_name", "pid": r, "tid": tid(r, "compute"),
                    "args": {"name": f"rank {r}"}})
        out.append({"ph": "M", "name": "process_sort_index", "pid": r, "tid": tid(r, "compute"),
                    "args": {"sort_index": r}})
        order = 0
        for category in ("compute", "comm"):
            for k in range(lanes_of[r, category]):
                out.append({"ph": "M", "name": "thread_name", "pid": r, "tid": tid(r, category, k),
                            "args": {"name": lane_name(category, k)}})
                out.append({"ph": "M", "name": "thread_sort_index", "pid": r, "tid": tid(r, category, k),
                            "args": {"sort_index": order}})
                order += 1
    for e in timeline.events:
        start, end = spans[id(e)]
        if e.category == "memory":
            out.append({"ph": "C", "name": "held bytes", "pid": e.rank, "tid": tid(e.rank, "compute"),
                        "ts": us(start), "args": {"bytes": e.value}})
        else:
            out.append({"ph": "X", "name": e.label or e.kind, "cat": e.category, "pid": e.rank,
                        "tid": where[id(e)], "ts": us(start), "dur": us(end - start), "args": _args(e)})
    for i, (send, recv) in enumerate(timeline.messages()):
        (a, _), (c, d) = spans[id(send)], spans[id(recv)]
        if c <= a:              # the receive began first: the arrow goes into its part after the send began
            c = a + 1
        times = flow_times(spans[id(send)], (c, d))
        if times is None:
            continue
        if c != spans[id(recv)][0]:
            out.append({"ph": "X", "name": "in flight", "cat": "comm", "pid": recv.rank, "tid": where[id(recv)],
                        "ts": us(c), "dur": us(d - c), "args": {
                            "kind": "in_flight", "message": i,
                            "what": f"the part of this receive after rank {send.rank} began sending"}})
        out.append({"ph": "s", "name": "message", "cat": "comm", "id": i, "pid": send.rank,
                    "tid": where[id(send)], "ts": us(times[0])})
        out.append({"ph": "f", "bp": "e", "name": "message", "cat": "comm", "id": i, "pid": recv.rank,
                    "tid": where[id(recv)], "ts": us(times[1])})
    return out


def to_perfetto(timeline, path, seconds_per_unit: float | None = None) -> Path:
    """Write `timeline` as a Chrome trace JSON file at `path` and return the path."""
    path = Path(path)
    events = trace_events(timeline, seconds_per_unit)
    arrows = sum(e["ph"] == "s" for e in events)
    doc = {"traceEvents": events, "displayTimeUnit": "ms",
           "otherData": {"source": f"pplab ({timeline.source})", "world_size": timeline.world_size,
                         "messages": len(timeline.messages()), "messages_without_arrow":
                         len(timeline.messages()) - arrows}}
    # UTF-8, not \u escapes: Perfetto shows "\u2192" as those six characters, not as the arrow in "→1"
    path.write_text(json.dumps(doc, ensure_ascii=False), encoding="utf-8")
    return path
