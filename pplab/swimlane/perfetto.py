"""A Timeline in the Chrome trace format, to open in Perfetto (ui.perfetto.dev) or chrome://tracing.

    path = pplab.swimlane.to_perfetto(results.timeline, "run.json")
    # ui.perfetto.dev -> "Open trace file" -> run.json

This is the format `torch.profiler` writes (`prof.export_chrome_trace`), so a pplab run and a
profiled GPU run are read in the same viewer, with the same keys (WASD) and the same queries.
The file is one JSON object whose "traceEvents" list holds (Chrome's "Trace Event Format"):

* one **process per rank** (`pid` = rank, named "rank r"), with two **threads**: `tid` 0
  "compute" (spans such as F3, B3) and `tid` 1 "comm" (sends, receives, collectives);
* one **complete event** (`"ph": "X"`) per compute or comm event: `ts` and `dur` in
  microseconds, `name` its label, `cat` its category; `args` holds its kind, bytes sent and
  received, the tensor bytes of a collective (`payload`), its peer or group, and its metadata;
* a **counter** (`"ph": "C"`) per memory event: the bytes the rank holds, drawn as a graph;
* a **flow** arrow (`"ph": "s"` then `"f"`) from each send to its matching receive (each end in
  the middle of its slice, which the viewer binds it to).
"""
from __future__ import annotations

import json
from pathlib import Path

COMPUTE_TID, COMM_TID = 0, 1


def _args(e) -> dict:
    args = {"kind": e.kind, "bytes_sent": e.bytes_sent, "bytes_recv": e.bytes_recv}
    if e.peer is not None:
        args["peer"] = e.peer
    if e.group is not None:
        args["group"] = list(e.group)
    for key, value in e.meta.items():
        args[key] = value if isinstance(value, (int, float, str, bool)) or value is None else repr(value)
    return args


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
    us = 1e6 * seconds_per_unit
    out = []
    for r in range(timeline.world_size):
        out.append({"ph": "M", "name": "process_name", "pid": r, "tid": 0, "args": {"name": f"rank {r}"}})
        out.append({"ph": "M", "name": "process_sort_index", "pid": r, "tid": 0, "args": {"sort_index": r}})
        out.append({"ph": "M", "name": "thread_name", "pid": r, "tid": COMPUTE_TID, "args": {"name": "compute"}})
        out.append({"ph": "M", "name": "thread_name", "pid": r, "tid": COMM_TID, "args": {"name": "comm"}})
    for e in timeline.events:
        if e.category == "memory":
            out.append({"ph": "C", "name": "held bytes", "pid": e.rank, "tid": COMPUTE_TID,
                        "ts": e.start * us, "args": {"bytes": e.value}})
        else:
            out.append({"ph": "X", "name": e.label or e.kind, "cat": e.category, "pid": e.rank,
                        "tid": COMPUTE_TID if e.category == "compute" else COMM_TID,
                        "ts": e.start * us, "dur": e.duration * us, "args": _args(e)})
    # A flow event binds to the slice that encloses its timestamp ("bp": "e"): each end sits in the
    # middle of its send or receive, never on an edge, where a viewer's order of equal times decides.
    for i, (send, recv) in enumerate(timeline.messages()):
        out.append({"ph": "s", "name": "message", "cat": "comm", "id": i, "pid": send.rank,
                    "tid": COMM_TID, "ts": (send.start + send.end) / 2 * us})
        out.append({"ph": "f", "bp": "e", "name": "message", "cat": "comm", "id": i, "pid": recv.rank,
                    "tid": COMM_TID, "ts": (recv.start + recv.end) / 2 * us})
    return out


def to_perfetto(timeline, path, seconds_per_unit: float | None = None) -> Path:
    """Write `timeline` as a Chrome trace JSON file at `path` and return the path."""
    path = Path(path)
    doc = {"traceEvents": trace_events(timeline, seconds_per_unit), "displayTimeUnit": "ms",
           "otherData": {"source": f"pplab ({timeline.source})", "world_size": timeline.world_size}}
    path.write_text(json.dumps(doc))
    return path
