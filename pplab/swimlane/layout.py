"""Where everything goes: which events a timeline's panel shows, the strips of each
rank's row (a compute lane over a comm lane, the comm lane cut into comm rows when asked),
the size of a figure draw makes, and the checks on draw's arguments."""
from __future__ import annotations

import math
from collections import defaultdict

import matplotlib.colors as mcolors
import numpy as np

from ..trace import Timeline

# Vertical layout, in units of one rank's row (rank r occupies r .. r+1, top to bottom):
# (top, height) of the compute strip and the comm strip, for each kind of figure.
_STRIPS = {"both": ((0.0, 0.56), (0.60, 0.30)),       # compute lane over a comm lane
           "compute": ((0.0, 0.82), None),            # compute only (comm_lanes=False)
           "comm": (None, (0.0, 0.82))}               # a run that only communicates
_LABEL_PT = 7.0            # font size of box labels, in points
_MAX_AUTO_WIDTH = 20.0     # inches: wider figures get shrunk to fit a notebook cell anyway
_MEMORY_ROW = 0.42         # inches per rank's memory panel


def _row(p, e) -> tuple[float, float]:
    """(top, height) of the strip that event e is drawn in."""
    compute, comms = p.strips
    comm = comms[p.row_of(e)]
    if e.category == "compute":
        y, h = compute
    elif e.kind == "send":
        y, h = comm[0], comm[1] / 2
    elif e.kind == "recv":
        y, h = comm[0] + comm[1] / 2, comm[1] / 2
    else:
        y, h = comm
    return e.rank + y, h



# ----------------------------------------------------------------------------------
# Checking what was asked


def _check_timeline(timeline):
    if not isinstance(timeline, Timeline):
        hint = " (a pplab.launch result: pass results.timeline)" if hasattr(timeline, "timeline") else ""
        raise TypeError(f"swimlane.draw needs a pplab.trace.Timeline, e.g. results.timeline from "
                        f"pplab.launch or a simulated schedule, or a list of them; got {type(timeline).__name__}{hint}")


def _check_options(labels, colors):
    if labels not in ("auto", True, False):
        raise ValueError(f"labels must be 'auto', True or False, got {labels!r}")
    for kind, c in (colors or {}).items():
        if not mcolors.is_color_like(c):
            raise ValueError(f"colors[{kind!r}] = {c!r} is not a matplotlib colour (try '#1f77b4' or 'tab:blue')")


def _time_range(time_range, makespan, unit):
    if time_range is None:
        return 0.0, (makespan if makespan > 0 else 1.0)
    try:
        t0, t1 = (float(t) for t in time_range)
    except (TypeError, ValueError):
        raise ValueError(f"time_range must be (start, end) in {unit}, got {time_range!r}") from None
    if not (math.isfinite(t0) and math.isfinite(t1) and t0 < t1):
        raise ValueError(f"time_range=({t0:g}, {t1:g}) is empty or reversed: give (start, end) with "
                         f"start < end, e.g. (0, {makespan:.4g}) for the whole run")
    return t0, t1


class _Panel:
    """One timeline's lanes: which events show, in which layout."""

    def __init__(self, tl, comm_lanes, t0, t1, comm_rows=None):
        has_comm = any(e.category == "comm" for e in tl.events)
        has_compute = any(e.category == "compute" for e in tl.events)
        if comm_lanes == "auto":
            comm_lanes = has_comm
        self.mode = "comm" if (comm_lanes and not has_compute) else ("both" if comm_lanes else "compute")
        self.tl, self.n = tl, max([tl.world_size] + [e.rank + 1 for e in tl.events])
        cats = {"compute", "comm"} if comm_lanes else {"compute"}
        self.shown = [e for e in tl.events if e.category in cats and
                      ((e.end > t0 and e.start < t1) or (e.start == e.end and t0 <= e.start <= t1))]
        chunks = {e.meta.get("chunk", 0) for e in tl.events if e.category == "compute"}
        self.chunked = bool(chunks - {0, None})
        self.rows, self._rows = ["comm"], {}
        if comm_rows and self.mode != "compute":
            self.rows = list(comm_rows)
            for e in self.shown:
                if e.category == "comm":
                    claimed = [i for i, f in enumerate(comm_rows.values()) if f(e)]
                    if not claimed and "other" not in self.rows:
                        self.rows.append("other")
                    self._rows[id(e)] = claimed[0] if claimed else self.rows.index("other")
        compute, comm = _STRIPS[self.mode]
        k = len(self.rows)
        if k > 1:                                      # the comm strip, cut into k rows
            compute = (0.0, 0.40) if compute else None
            top, height = (0.44, 0.48) if compute else (0.0, 0.82)
            comm = [(top + i * height / k, 0.9 * height / k) for i in range(k)]
        else:
            comm = [comm]
        self.strips = (compute, comm)

    def row_of(self, e) -> int:
        return self._rows.get(id(e), 0)

    def lane_height(self):                     # inches
        extra = 0.16 * (len(self.rows) - 1)
        return 0.55 + self.n * ({"both": 0.5, "compute": 0.36, "comm": 0.36}[self.mode] + extra)


def _auto_figsize(panels, memory, t0, t1):
    """Wide enough that a typical box (the median duration on screen) gets ~12 pt, but
    no wider than ~2 slots per box of the busiest lane (measured runs have tiny boxes)."""
    compute = [e.end - e.start for p in panels for e in p.shown if e.category == "compute" and e.end > e.start]
    durations = compute or [e.end - e.start for p in panels for e in p.shown if e.end > e.start]
    per_lane = defaultdict(int)
    for i, p in enumerate(panels):
        for e in p.shown:
            per_lane[(i, e.rank)] += e.category == "compute" or not compute
    slots = min((t1 - t0) / np.median(durations), 2 * max(per_lane.values())) if durations else 0
    width = min(max(8.0, 2.5 + 0.17 * slots), _MAX_AUTO_WIDTH)
    height = 0.5 + sum(p.lane_height() + (p.n * _MEMORY_ROW + 0.3 if memory else 0.0) for p in panels)
    return width, height

