"""Swimlanes: what every rank did, when, on one clock.

    fig = pplab.swimlane.draw(results.timeline)            # a measured run (pplab.launch)
    fig = pplab.swimlane.draw(simulated_timeline, arrows=True, memory=True)
    fig = pplab.swimlane.draw([gpipe_tl, one_f_one_b_tl], titles=["GPipe", "1F1B"])   # stacked
    pplab.swimlane.explore(make_schedule, m=(1, 16), p=(2, 8))   # the same, with controls

How to read one:

* **Lanes.** One horizontal lane per rank, rank 0 at the top; time runs left to right.
  Under each rank a thinner *comm lane* holds its messages and collectives: sends
  fill its upper half and receives its lower half (so the send and the receive of
  a simultaneous ring `exchange` both show), collectives fill all of it. A run that
  only communicates gets comm lanes alone, full height, with its sends numbered
  (step 1, 2, ... of a ring) and the bytes each rank sent where utilisation would be.
* **Boxes.** One box per piece of work, labelled with what it was ("F3" = forward of
  micro-batch 3, "B3" backward, "I3"/"W3" input- and weight-gradient halves of a
  split backward, "AR" an all-reduce, "→2" a send to rank 2). One colour per kind,
  the same in every figure and told apart with any colour vision (`KIND_COLORS`;
  other kinds get a fixed colour from their name). A label is shortened ("F3.1" ->
  "F3" -> "3") or left out where the box is too narrow for it; zoom in with
  `time_range` to read more.
* **Chunks.** When a rank holds several stages (interleaved 1F1B, ZB-V), its later
  chunks are hatched, the lane says which stages the rank holds, and a line follows
  micro-batch 0's forward through the stages in model order: for ZB-V it goes down the
  ranks and back up, the V.
* **Bubbles.** The grey lane background shows through wherever a rank computed
  nothing: that idle time is the pipeline *bubble* (or time lost waiting for data).
* **Utilisation.** At the right end of each lane: busy / total, the share of the run
  that rank spent computing (communication does not count as busy). In the title:
  the overall figure, busy time summed over ranks / (ranks x makespan).
* **Comm rows** (`comm_rows={"TP": is_tp, "PP": is_pp, "DP": is_dp}`): the comm lane of
  each rank is cut into one row per named kind of traffic (a function of the event says
  which; an event none claims goes to a row "other"), e.g. a hybrid run's tensor-parallel
  all-reduces, pipeline sends and data-parallel gradient sync each on a row of their own.
* **Arrows** (`arrows=True`) join the end of each send to the end of its receive.
  **Memory** (`memory=True`) plots what each rank holds over time (activations kept
  for the backward pass, from `trace.hold`/`trace.release`), one small panel per rank
  under the lanes, on the same time axis and the same scale.

A simulated schedule and a measured run are both a `pplab.trace.Timeline`, so this
one function draws both: stack them (`draw([simulated, measured])`) to see where
reality departs from the model.
"""
from __future__ import annotations

import inspect
import math
import string
import zlib
from collections import defaultdict

import matplotlib.colors as mcolors
import matplotlib.pyplot as plt
import numpy as np
from matplotlib import patheffects
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.ticker import FuncFormatter
from matplotlib.transforms import Bbox, blended_transform_factory

from .trace import Timeline

# One colour per kind of work, the same in every figure. The compute kinds come from
# Okabe & Ito's palette, picked so that F, B, I and W stay apart under protanopia,
# deuteranopia and tritanopia too (tests/test_swimlane.py simulates all three).
# A pipeline backward split in two is I (gradient w.r.t. the input, which the previous
# stage waits for) and W (gradient w.r.t. the weights, which can wait).
KIND_COLORS = {
    "F": "#0072B2",            # forward: blue
    "B": "#D55E00",            # backward: vermillion
    "I": "#F0E442",            # backward, input gradient: yellow
    "W": "#882255",            # backward, weight gradient: wine
    "send": "#56B4E9",         # point-to-point: sky blue (send) and pale sky (recv)
    "recv": "#A9D8F5",
    "all_reduce": "#CC79A7",   # collectives: pinks, greens, greys
    "reduce_scatter": "#E7B5D1",
    "all_gather": "#009E73",
    "broadcast": "#999933",
    "reduce": "#44AA99",
    "barrier": "#999999",
}
KIND_NAMES = {"F": "F forward", "B": "B backward", "I": "I input grad", "W": "W weight grad"}
# Kinds not listed above take a colour from here, chosen by a hash of their name
# (crc32, not Python's per-process salted hash) so a kind keeps its colour everywhere.
PALETTE = ["#332288", "#117733", "#DDCC77", "#AA4499", "#88CCEE", "#661100", "#6699CC",
           "#CC6677", "#E69F00", "#44AA99", "#AA4466", "#999933"]
IDLE = "#e4e4e4"           # compute-lane background: what shows through is a bubble
COMM_IDLE = "#f2f2f2"
HATCHES = ["", "///", "...", "xxx", "\\\\\\"]     # chunk 0, 1, 2, ... of a rank

# Vertical layout, in units of one rank's row (rank r occupies r .. r+1, top to bottom):
# (top, height) of the compute strip and the comm strip, for each kind of figure.
_STRIPS = {"both": ((0.0, 0.56), (0.60, 0.30)),       # compute lane over a comm lane
           "compute": ((0.0, 0.82), None),            # compute only (comm_lanes=False)
           "comm": (None, (0.0, 0.82))}               # a run that only communicates
_LABEL_PT = 7.0            # font size of box labels, in points
_MAX_AUTO_WIDTH = 20.0     # inches: wider figures get shrunk to fit a notebook cell anyway
_MEMORY_ROW = 0.42         # inches per rank's memory panel


def color_of(kind: str, colors: dict | None = None) -> str:
    """The colour of `kind`: from `colors` (overrides), KIND_COLORS, else from its name."""
    if colors and kind in colors:
        return colors[kind]
    if kind in KIND_COLORS:
        return KIND_COLORS[kind]
    return PALETTE[zlib.crc32(kind.encode()) % len(PALETTE)]


def _ink(color) -> str:
    """Black text on light boxes, white on dark ones."""
    r, g, b = mcolors.to_rgb(color)
    return "black" if 0.299 * r + 0.587 * g + 0.114 * b > 0.55 else "white"


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


def _fmt_bytes(n: float) -> str:
    for factor, name in ((1e9, "GB"), (1e6, "MB"), (1e3, "kB")):
        if n >= factor:
            return f"{n / factor:.3g} {name}"
    return f"{n:g} B"


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


# ----------------------------------------------------------------------------------
# draw


def draw(timeline, *, ax=None, comm_lanes="auto", arrows=False, memory=False, time_range=None,
         title=None, titles=None, labels="auto", colors=None, figsize=None, path="auto",
         comm_rows=None) -> Figure:
    """Draw `timeline` (a pplab.trace.Timeline) as swimlanes; return the figure.

    timeline: one Timeline, or a list of them to stack on one time axis (e.g. GPipe
      over 1F1B), each with its own lanes and title; `titles` gives those titles.
    ax: draw into this Axes (one timeline; with memory=True, a pair (lanes_ax, [one
      Axes per rank])); default: a new figure sized to the number of ranks and boxes.
    comm_lanes: a comm lane under each rank (False: messages are not drawn; "auto":
      only if the timeline has communication, so simulated schedules get no empty lanes).
      A timeline with communication and no compute gets its comm lanes alone.
    arrows: an arrow from the end of each send to the end of its receive.
    memory: what each rank holds over time, one small panel per rank under the lanes.
    time_range: (start, end) to zoom in, in timeline.unit.
    labels: "auto" (text only where it fits, shortened if need be), True (every box's
      full label, fitting or not) or False.
    colors: {kind: colour} overriding KIND_COLORS.
    title: the first title line (default: timeline.title if set, else what the
      timeline is); for a list of timelines, a title over all of them.
    path: the micro-batch whose forward is followed through the stages by a line
      ("auto": micro-batch 0 when ranks hold several chunks; None: no line).
    comm_rows: {row name: function(event) -> bool}: cut each comm lane into these rows, an
      event going to the first row whose function is true (or to a row "other").

    A figure draw makes is closed in pyplot before it is returned: in a notebook it
    shows as the value of a cell (or with display(fig)); in a script, fig.savefig(...).
    """
    stacked = isinstance(timeline, (list, tuple)) and not hasattr(timeline, "timeline")   # not launch results
    tls = list(timeline) if stacked else [timeline]
    if stacked:
        if not tls:
            raise ValueError("draw([...]) needs at least one Timeline in the list")
        if ax is not None:
            raise ValueError("a list of timelines is drawn into a figure of its own: leave ax=None")
        if titles is not None and len(titles) != len(tls):
            raise ValueError(f"titles has {len(titles)} entries for {len(tls)} timelines: give one per timeline")
    elif titles is not None:
        raise ValueError("titles= goes with a list of timelines; for one timeline use title=")
    for tl in tls:
        _check_timeline(tl)
    if len({tl.unit for tl in tls}) > 1:
        raise ValueError(f"timelines in {sorted({tl.unit for tl in tls})} cannot share a time axis: "
                         f"stack timelines measured in the same unit")
    _check_options(labels, colors)
    makespan = max(tl.makespan for tl in tls)
    t0, t1 = _time_range(time_range, makespan, tls[0].unit)
    if comm_rows is not None and not (isinstance(comm_rows, dict) and comm_rows
                                      and all(callable(f) for f in comm_rows.values())):
        raise ValueError("comm_rows must be a non-empty dict {row name: function(event) -> bool}, e.g. "
                         "{'TP': lambda e: e.kind == 'all_reduce', 'PP': lambda e: e.kind in ('send', 'recv')}")
    panels = [_Panel(tl, comm_lanes, t0, t1, comm_rows) for tl in tls]

    # -- the figure and its axes: per timeline its lanes, then (memory) one row per rank
    own_figure = ax is None
    if own_figure:
        # Made with pyplot (which sets up a notebook's inline display), then closed at the
        # end: pyplot keeps no reference, and the figure shows once, as the cell's value.
        fig = plt.figure(figsize=figsize or _auto_figsize(panels, memory, t0, t1), layout="constrained")
        ratios = []
        for p in panels:
            ratios += [p.lane_height()] + ([_MEMORY_ROW] * p.n if memory else [])
        grid = fig.subplots(len(ratios), 1, sharex=True, height_ratios=ratios, squeeze=False)[:, 0]
        if memory:
            fig.get_layout_engine().set(h_pad=0.02, hspace=0.0)
        layout, k = [], 0
        for p in panels:
            layout.append((grid[k], list(grid[k + 1:k + 1 + p.n]) if memory else []))
            k += 1 + (p.n if memory else 0)
    else:
        if figsize is not None:
            raise ValueError("figsize applies only when draw makes the figure (ax=None); size your own figure instead")
        mem_axes = []
        if memory:
            if not (isinstance(ax, (tuple, list)) and len(ax) == 2 and isinstance(ax[1], (tuple, list, np.ndarray))
                    and len(ax[1]) == panels[0].n):
                raise ValueError(f"memory=True draws one panel per rank: pass ax=(lanes_ax, [{panels[0].n} Axes, "
                                 f"one per rank]), or leave ax=None")
            ax, mem_axes = ax[0], list(ax[1])
        if not all(hasattr(a, "broken_barh") for a in [ax] + mem_axes):
            raise TypeError(f"ax must be a matplotlib Axes (e.g. from fig.subplots()), got {type(ax).__name__}")
        fig, layout = ax.figure, [(ax, mem_axes)]

    tops = defaultdict(float)            # stacked timelines share one memory scale (per unit)
    for tl in tls:
        tops[tl.memory_unit] = max([tops[tl.memory_unit]] + [tl.peak_memory(r) for r in range(tl.world_size)])
    jobs, present, chunks, traced = [], set(), set(), False
    for i, (p, (lane_ax, mem_axes)) in enumerate(zip(panels, layout)):
        head = (titles[i] if titles is not None else None) if stacked else title
        jobs += _draw_lanes(lane_ax, p, t0, t1, head, time_range is not None, colors, arrows, labels)
        present |= {e.kind for e in p.shown}
        chunks |= {e.meta.get("chunk") or 0 for e in p.shown if e.category == "compute"}
        mb = (0 if p.chunked else None) if path == "auto" else path
        traced |= mb is not None and _draw_path(lane_ax, p, mb)
        if mem_axes:
            _draw_memory(mem_axes, p.tl, p.n, top=tops[p.tl.memory_unit])
    bottom = layout[-1][1][-1] if layout[-1][1] else layout[-1][0]
    scale, unit = (1e3, "ms") if tls[0].unit == "s" and 0 < max(makespan, t1) < 1 else (1.0, tls[0].unit)
    bottom.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v * scale:g}"))
    bottom.set_xlabel(f"time ({unit})")
    if stacked and title:
        fig.suptitle(title, fontsize=11)

    # -- the legend: kinds, chunks, the path, bubbles ------------------------------
    order = [k for k in KIND_COLORS if k in present] + sorted(present - set(KIND_COLORS))
    handles = [Patch(facecolor=color_of(k, colors), label=KIND_NAMES.get(k, k)) for k in order]
    if len(chunks) > 1:
        handles += [Patch(facecolor="white", edgecolor="#555555", hatch=HATCHES[c % len(HATCHES)],
                          label=f"chunk {c}") for c in sorted(chunks)]
    if traced:
        handles.append(Line2D([], [], color="#222222", marker="o", markersize=3,
                              label=f"micro-batch {0 if path == 'auto' else path}, stage by stage"))
    handles.append(Patch(facecolor=IDLE, label="idle (bubble)"))
    if own_figure:
        fig.legend(handles=handles, loc="outside lower center", ncols=min(len(handles), 8), fontsize=8, frameon=False)
    else:
        layout[0][0].legend(handles=handles, loc="upper right", fontsize=7, framealpha=0.9)

    # -- labels last, once the layout is settled: measured, never overlapping -------
    if labels and jobs:
        fig.draw_without_rendering()
        _place_labels(jobs, force=labels is True)
    if own_figure:
        plt.close(fig)
    return fig


def _draw_lanes(ax, p, t0, t1, head, zoomed, colors, arrows, labels):
    """One timeline's lanes into `ax`; returns the labels to place once the layout is known."""
    tl, mode, n = p.tl, p.mode, p.n
    makespan = tl.makespan
    compute, comms = p.strips
    comm = comms[0] if mode != "compute" else None
    main = compute or comm                 # the strip that carries the rank's name
    ax.set_label("swimlanes")
    ax.set_xlim(t0, t1)
    ax.set_ylim(n, -0.15)                  # inverted: rank 0 at the top

    # -- lane backgrounds: idle time shows through as grey -------------------------
    span = [(0.0, max(makespan, t1))]
    for r in range(n):
        if compute:
            ax.broken_barh(span, (r + compute[0], compute[1]), facecolors=IDLE, zorder=0, gid="idle")
        for c in (comms if comm else []):
            ax.broken_barh(span, (r + c[0], c[1]), facecolors=COMM_IDLE if compute else IDLE,
                           zorder=0, gid="idle")

    # -- the boxes: one collection per (strip, kind, chunk) keeps 10,000 boxes fast -----
    pt_per_unit = ax.get_position().width * ax.figure.get_figwidth() * 72 / (t1 - t0)
    groups = defaultdict(list)
    for e in p.shown:
        chunk = (e.meta.get("chunk") or 0) if e.category == "compute" else 0
        groups[(_row(p, e), e.kind, chunk)].append((e.start, e.end - e.start))
    for ((y, h), kind, chunk), spans in groups.items():
        thin = np.median([d for _, d in spans]) * pt_per_unit < 3      # white edges would hide them
        color = color_of(kind, colors)
        ax.broken_barh(spans, (y, h), facecolors=color, zorder=2, edgecolors="white",
                       linewidths=0 if thin else 0.6, gid=f"box:{kind}")
        if chunk:                          # later chunks hatched, in the ink colour of the box
            ax.broken_barh(spans, (y, h), facecolors="none", edgecolors=mcolors.to_rgba(_ink(color), 0.45),
                           linewidths=0, hatch=HATCHES[chunk % len(HATCHES)], zorder=2.5, gid=f"chunk:{chunk}")

    # -- arrows from each send to its receive --------------------------------------
    if arrows and tl.events:
        segs = []
        for s, rv in tl.messages():
            if max(s.end, rv.end) < t0 or min(s.end, rv.end) > t1:
                continue
            ys = _row(p, s) if comm else (s.rank + main[0], main[1])
            yr = _row(p, rv) if comm else (rv.rank + main[0], main[1])
            segs.append((s.end, ys[0] + ys[1] / 2, rv.end, yr[0] + yr[1] / 2))
        if segs:
            x, y, x2, y2 = np.array(segs).T
            ax.quiver(x, y, x2 - x, y2 - y, angles="xy", scale_units="xy", scale=1, color="#333333", alpha=0.75,
                      units="dots", width=1.1, headwidth=4.5, headlength=5.5, headaxislength=5, zorder=4,
                      gid="arrows")

    # -- lane names (with the stages a rank holds), the right-hand column, the title ---
    names = [f"rank {r}" for r in range(n)]
    if p.chunked:
        stages = defaultdict(set)
        for e in tl.events:
            if e.category == "compute" and "stage" in e.meta:
                stages[e.rank].add(e.meta["stage"])
        names = [f"rank {r}\nstages {', '.join(map(str, sorted(stages[r])))}" if stages[r] else names[r]
                 for r in range(n)]
    ax.set_yticks([r + main[0] + main[1] / 2 for r in range(n)], names)
    if mode == "both":
        ax.set_yticks([r + c[0] + c[1] / 2 for r in range(n) for c in comms], p.rows * n, minor=True)
        ax.tick_params(axis="y", which="minor", labelsize=6, labelcolor="#777777", length=0)
    ax.tick_params(axis="y", which="major", length=0, labelsize=8 if n <= 16 else 6)
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    right = blended_transform_factory(ax.transAxes, ax.transData)
    size = 8 if n <= 16 else 6
    scale, unit = (1e3, "ms") if tl.unit == "s" and 0 < max(makespan, t1) < 1 else (1.0, tl.unit)
    if mode == "comm":                     # nothing computed: say what was sent instead
        ax.text(1.005, -0.15, "sent", transform=right, ha="left", va="bottom", fontsize=7, color="#555555")
        for r in range(n):
            ax.text(1.005, r + main[0] + main[1] / 2, _fmt_bytes(tl.bytes_sent(r)), transform=right,
                    ha="left", va="center", fontsize=size, gid="sent")
        n_msg, n_coll = len(tl.select(kind="send")), len({(e.rank, e.start) for e in tl.select(category="comm")
                                                          if e.kind not in ("send", "recv")})
        second = f"communication only: {n_msg} sends, {_fmt_bytes(tl.bytes_sent())} in all" + \
            (f", {n_coll} collective calls" if n_coll else "")
    else:
        ax.text(1.005, -0.15, "busy", transform=right, ha="left", va="bottom", fontsize=7, color="#555555")
        busy = [tl.busy(r) for r in range(n)]      # utilisation = busy / makespan, as tl.utilization(r)
        for r in range(n):
            ax.text(1.005, r + main[0] + main[1] / 2, f"{busy[r] / makespan if makespan else 0:.1%}",
                    transform=right, ha="left", va="center", fontsize=size, gid="util")
        total, used = tl.world_size * makespan, sum(busy[:tl.world_size])
        second = (f"utilisation {used / total if total else 0:.1%} (busy {used * scale:.4g} of "
                  f"{total * scale:.4g} rank-{unit})")
    if zoomed:
        second += f", showing {t0 * scale:.4g} to {t1 * scale:.4g} {unit}"
    default = f"{tl.source.capitalize()} timeline: {n} rank{'s' * (n != 1)}" + \
        (f", makespan {makespan * scale:.4g} {unit}" if tl.events else " (no events)")
    ax.set_title(f"{head or getattr(tl, 'title', None) or default}\n{second}", fontsize=10)

    # -- what each box would say: its label, then shorter forms -----------------------
    if not labels:
        return []
    jobs, step = [], defaultdict(int)
    for e in p.shown:                                      # p.shown is in time order
        text = e.label or e.kind
        if mode == "comm" and e.kind == "send":            # number the steps of a ring
            step[e.rank] += 1
            tries = [f"step {step[e.rank]} {text}", f"{step[e.rank]} {text}", f"{step[e.rank]}"]
        else:
            tries = _shorter(text)
        y, h = _row(p, e)
        a, b, size = max(e.start, t0), min(e.end, t1), _LABEL_PT if e.category == "compute" else _LABEL_PT - 1
        if labels is True or 1.5 * (b - a) * pt_per_unit >= 0.45 * size * min(map(len, tries)):
            jobs.append((ax, (e.rank, y), a, b, y, h, tries, size, _ink(color_of(e.kind, colors))))
    return jobs       # only those that might fit (estimated before layout, generously): measured later


def _shorter(text: str) -> list[str]:
    """'F3.1' -> ['F3.1', 'F3', '3']: drop the chunk (the hatching shows it), then the kind (the colour does)."""
    base = text.split(".")[0] or text
    tries = [text] + ([base] if base != text else [])
    number = base.lstrip(string.ascii_letters)
    if number != base and number.isdigit():
        tries.append(number)
    return tries


def _place_labels(jobs, force=False):
    """Put each label in its box, in the longest form that fits inside the box (measured
    by the renderer) without touching a label already placed in the same strip."""
    placed, sizes = defaultdict(list), {}

    def extent(ax, text, size):                # (width, height) in pixels, measured once per text
        if (text, size) not in sizes:
            probe = ax.text(0, 0, text, fontsize=size)
            bb = probe.get_window_extent()
            sizes[(text, size)] = (bb.width, bb.height)
            probe.remove()
        return sizes[(text, size)]

    for ax, strip, a, b, y, h, tries, size, ink in sorted(jobs, key=lambda j: (j[1], j[2])):
        if b <= a:
            continue
        (xa, ya), (xb, yb) = ax.transData.transform([(a, y), (b, y + h)])
        clip = ax.get_window_extent()
        left, right = max(min(xa, xb), clip.x0) + 1, min(max(xa, xb), clip.x1) - 1
        low, high = min(ya, yb), max(ya, yb)
        em = size * ax.figure.dpi / 72
        for text in tries:
            if not force:
                if 0.45 * em * len(text) > right - left or em > high - low:
                    continue                   # cannot fit: not worth measuring
                w, hh = extent(ax, text, size)
                cx, cy = (xa + xb) / 2, (ya + yb) / 2
                bb = Bbox.from_extents(cx - w / 2, cy - hh / 2, cx + w / 2, cy + hh / 2)
                if not (bb.x0 >= left and bb.x1 <= right and bb.y0 >= low - 0.5 and bb.y1 <= high + 0.5) or \
                        any(bb.overlaps(o) for o in placed[(id(ax), strip)][-8:]):
                    continue
                placed[(id(ax), strip)].append(bb)
            t = ax.text((a + b) / 2, y + h / 2, text, ha="center", va="center", fontsize=size, color=ink,
                        clip_on=True, zorder=3, gid="label")
            t.set_in_layout(False)
            break


def _draw_path(ax, p, microbatch) -> bool:
    """A line through the forward boxes of one micro-batch, in stage order: the V of ZB-V."""
    boxes = sorted((e.meta["stage"], e) for e in p.tl.events
                   if e.kind == "F" and e.meta.get("microbatch") == microbatch and "stage" in e.meta)
    if len(boxes) < 2:
        return False
    y, h = p.strips[0] or p.strips[1][0]
    xs = [(e.start + e.end) / 2 for _, e in boxes]
    ys = [e.rank + y + 0.18 * h for _, e in boxes]
    line, = ax.plot(xs, ys, color="black", linewidth=1.5, marker="o", markersize=4, zorder=5, gid="path",
                    path_effects=[patheffects.withStroke(linewidth=3.5, foreground="white")])
    line.set_in_layout(False)
    return True


def _memory_scale(unit: str, peak: float):
    """Bytes are shown in kB/MB/GB once large; other units (e.g. micro-batches) as they are."""
    if unit != "B":
        return 1.0, unit
    for factor, name in ((1e9, "GB"), (1e6, "MB"), (1e3, "kB")):
        if peak >= factor:
            return factor, name
    return 1.0, "B"


def _draw_memory(axes, tl, n_lanes, top=None):
    """Small multiples: one panel per rank of what it holds (trace.hold / trace.release),
    on the lanes' time axis and one shared scale, so ranks compare by height."""
    curves = [tl.memory_curve(r) for r in range(n_lanes)]
    peaks = [max(v) for _, v in curves]
    top = max(peaks, default=0) if top is None else top      # stacked timelines share one scale
    factor, unit = _memory_scale(tl.memory_unit, top)
    top = max(top / factor, 1e-12) * 1.25
    end = tl.makespan
    for r, (ax, (t, v)) in enumerate(zip(axes, curves)):
        ax.set_label(f"memory:{r}")
        last = {}                            # several changes at one instant: keep where it ends up
        for x, y in zip(t, v):
            last[x] = y / factor
        xs, ys = list(last) + [max(end, t[-1])], list(last.values()) + [v[-1] / factor]
        ax.fill_between(xs, ys, step="post", color="#0072B2", alpha=0.18, linewidth=0)
        ax.step(xs, ys, where="post", color="#0072B2", linewidth=1.1)
        ax.set_ylim(0, top)
        ax.set_yticks([])
        ax.set_ylabel(f"rank {r}", rotation=0, ha="right", va="center", fontsize=7)
        for side in ("top", "right"):
            ax.spines[side].set_visible(False)
        ax.text(1.005, 0.5, f"peak {peaks[r] / factor:.3g}", transform=ax.transAxes, ha="left", va="center",
                fontsize=7, gid="peak")
    axes[0].set_title(f"held over time ({unit}), one panel per rank, same scale", fontsize=8, loc="left")


# ----------------------------------------------------------------------------------
# The interactive version


def explore(source, *, applies=None, **controls):
    """Swimlanes with controls; every change re-renders the figure.

    source: a Timeline, or a function returning one, e.g. a schedule simulator; its
      parameters get controls as in ipywidgets.interact: (lo, hi) -> slider, a list
      -> dropdown, a bool -> checkbox, or pass a widget.
    applies: {control name: function(values) -> bool}: show that control only while it
      applies, e.g. {"v": lambda c: c["schedule"] == "interleaved-1f1b"}; `values` holds
      every control's current value.
    The view checkboxes (comm lanes, arrows, memory) show only when the timeline has
    something for them to show; a time-range slider zooms.

    Returns an ipywidgets VBox; `.update()` re-renders, `.figure` is the figure last
    drawn, `.timeline` the timeline it shows, `.error` the error of the last render (if any).

    The figure is shown as a PNG <img> (its title as alt text) in an HTML widget, not
    displayed into an Output widget: a headless runner (nbconvert) answers each output an
    Output widget captures with a message on the kernel's shell channel, sent while it
    waits on that channel for the cell's reply, and can miss the reply and wait forever.
    """
    import base64
    import html
    import io

    import ipywidgets as w

    if isinstance(source, Timeline):
        if controls:
            raise TypeError(f"controls {sorted(controls)} set parameters of a function that builds a Timeline; "
                            f"explore(timeline) takes none")
        make, sig = (lambda: source), None  # noqa: E731
    elif callable(source):
        make = source
        try:
            sig = inspect.signature(source)
            sig.bind_partial(**controls)
        except TypeError as exc:
            raise TypeError(f"explore: {getattr(source, '__name__', 'source')} cannot take the controls "
                            f"{sorted(controls)}: {exc}") from None
        except ValueError:
            sig = None
    else:
        raise TypeError(f"explore needs a pplab.trace.Timeline, or a function returning one; got {type(source).__name__}")
    unknown = sorted(set(applies or {}) - set(controls))
    if unknown:
        raise TypeError(f"explore: applies= names {unknown}, which are not controls ({sorted(controls)})")

    params = {}
    for name, abbrev in controls.items():
        p = sig.parameters.get(name) if sig is not None else None
        default = p.default if p is not None and p.default is not inspect.Parameter.empty else w.interactive.empty
        widget = w.interactive.widget_from_abbrev(abbrev, default)
        if widget is None:
            raise TypeError(f"explore: no control for {name}={abbrev!r}; use (lo, hi), a list, a bool or a widget")
        if hasattr(widget, "description") and not widget.description:
            widget.description = name
        params[name] = widget
    view = {"comm_lanes": w.Checkbox(True, description="comm lanes"),
            "arrows": w.Checkbox(False, description="send → recv arrows"),
            "memory": w.Checkbox(False, description="memory")}
    time = w.FloatRangeSlider(description="time", min=0.0, max=1.0, value=(0.0, 1.0), step=0.002,
                              continuous_update=False, readout_format=".4g")
    shown = [wd for wd in params.values() if isinstance(wd, w.Widget)]      # w.fixed values are not shown
    # Rows, not one long line: a grid of cells at least 260 px wide, as many per row as fit.
    for wd in shown + list(view.values()) + [time]:
        wd.layout.width = "auto"
        if hasattr(wd, "style") and hasattr(wd.style, "description_width"):
            wd.style.description_width = "initial"
    grid = w.GridBox(shown + list(view.values()), layout=w.Layout(
        grid_template_columns="repeat(auto-fill, minmax(260px, 1fr))", grid_gap="2px 18px", width="100%"))
    image = w.HTML()
    message = w.HTML()
    box = w.VBox([grid, time, message, image], layout=w.Layout(width="100%"))
    box.controls = {**params, **view, "time": time}
    box.image = image
    box.figure = box.timeline = box.error = box.png = None
    state = {"stale": True, "quiet": False}

    def values():
        return {n: wd.value for n, wd in params.items()}

    def show_if(widget, visible):
        widget.layout.display = None if visible else "none"

    def update(change=None, raise_errors=False):
        if state["quiet"]:
            return
        try:
            if state["stale"]:                  # a parameter changed: build the timeline again
                now = values()
                for name, rule in (applies or {}).items():
                    show_if(params[name], rule(now))
                tl = make(**now)
                if not isinstance(tl, Timeline):
                    raise TypeError(f"explore: the source function must return a pplab.trace.Timeline, "
                                    f"got {type(tl).__name__}")
                box.timeline, state["stale"] = tl, False
                show_if(view["comm_lanes"], any(e.category == "comm" for e in tl.events)
                        and any(e.category == "compute" for e in tl.events))
                show_if(view["arrows"], bool(tl.messages()))
                show_if(view["memory"], any(e.category == "memory" for e in tl.events))
                span = tl.makespan if tl.makespan > 0 else 1.0
                state["quiet"] = True           # resetting the slider must not re-render twice
                time.description = f"time ({tl.unit})"
                with time.hold_trait_notifications():
                    time.max, time.min = span, 0.0
                    time.step, time.value = span / 500, (0.0, span)
                state["quiet"] = False
            lo, hi = time.value
            zoom = None if (lo, hi) == (time.min, time.max) else (lo, hi)
            shown_view = {n: c.value for n, c in view.items()}
            shown_view["comm_lanes"] = "auto" if shown_view["comm_lanes"] else False   # no empty lanes
            box.figure = draw(box.timeline, time_range=zoom, **shown_view)
            box.error = None
        except (TypeError, ValueError) as exc:
            state["quiet"] = False
            if raise_errors:
                raise
            box.figure, box.error = None, exc
        if box.figure is not None:
            png = io.BytesIO()
            box.figure.savefig(png, format="png", dpi=80, bbox_inches="tight")
            box.png, title = png.getvalue(), html.escape(box.figure.axes[0].get_title(), quote=True)
            image.value = (f'<img style="max-width: 100%; height: auto" alt="{title}" title="{title}" '
                           f'src="data:image/png;base64,{base64.b64encode(box.png).decode()}">')
            message.value = ""
            show_if(image, True)
        else:
            message.value = f"<pre style='color:#b00'>cannot draw: {html.escape(str(box.error))}</pre>"
            show_if(image, False)

    def param_changed(change):
        state["stale"] = True
        update()

    for wd in shown:
        wd.observe(param_changed, names="value")
    for wd in list(view.values()) + [time]:
        wd.observe(update, names="value")
    box.update = update
    update(raise_errors=True)
    return box
