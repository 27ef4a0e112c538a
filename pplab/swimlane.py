"""Swimlanes: what every rank did, when, on one clock.

    fig = pplab.swimlane.draw(results.timeline)            # a measured run (pplab.launch)
    fig = pplab.swimlane.draw(simulated_timeline, arrows=True, memory=True)
    pplab.swimlane.explore(make_schedule, m=(1, 16), p=(2, 8))   # the same, with controls

How to read one:

* **Lanes.** One horizontal lane per rank, rank 0 at the top; time runs left to right.
  Under each rank a thinner *comm lane* holds its messages and collectives: sends
  fill its upper half and receives its lower half (so the send and the receive of
  a simultaneous ring `exchange` both show), collectives fill all of it.
* **Boxes.** One box per piece of work, labelled with what it was ("F3" = forward of
  micro-batch 3, "B3" backward, "W3"/"I3" weight- and input-gradient halves of a
  split backward, "AR" an all-reduce, "→2" a send to rank 2). One colour per kind,
  the same in every figure (`KIND_COLORS`; other kinds get a fixed colour from their
  name). The text is drawn only where it fits; zoom in with `time_range` to read it.
* **Bubbles.** The grey lane background shows through wherever a rank computed
  nothing: that idle time is the pipeline *bubble* (or time lost waiting for data).
* **Utilisation.** At the right end of each lane: busy / total, the share of the run
  that rank spent computing (communication does not count as busy). In the title:
  the overall figure, busy time summed over ranks / (ranks x makespan).
* **Arrows** (`arrows=True`) join the end of each send to the end of its receive.
  **Memory** (`memory=True`) plots, under the lanes, what each rank holds over time
  (activations kept for the backward pass), from `trace.hold`/`trace.release`.

A simulated schedule and a measured run are both a `pplab.trace.Timeline`, so this
one function draws both: put them side by side to see where reality departs from
the model.
"""
from __future__ import annotations

import inspect
import math
import zlib
from collections import defaultdict

import matplotlib.colors as mcolors
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.figure import Figure
from matplotlib.patches import Patch
from matplotlib.ticker import FuncFormatter
from matplotlib.transforms import blended_transform_factory

from .trace import Timeline

# One colour per kind of work, the same in every figure. Pipeline backward passes
# split into I (gradient w.r.t. the input, needed by the previous stage at once) and
# W (gradient w.r.t. the weights, which can wait), hence two shades near B's green.
KIND_COLORS = {
    "F": "#1f77b4",            # forward: blue
    "B": "#2ca02c",            # backward: green
    "I": "#98df8a",            # backward, input gradient: light green
    "W": "#17becf",            # backward, weight gradient: teal
    "send": "#ff7f0e",         # point-to-point: orange (send) and light orange (recv)
    "recv": "#ffbb78",
    "all_reduce": "#9467bd",   # collectives: purples, browns, pinks
    "reduce_scatter": "#c5b0d5",
    "all_gather": "#e377c2",
    "broadcast": "#8c564b",
    "reduce": "#c49c94",
    "barrier": "#7f7f7f",
}
KIND_NAMES = {"F": "F forward", "B": "B backward", "I": "I input grad", "W": "W weight grad"}
# Kinds not listed above take a colour from here, chosen by a hash of their name
# (crc32, not Python's per-process salted hash) so a kind keeps its colour everywhere.
PALETTE = ["#d62728", "#bcbd22", "#aec7e8", "#ff9896", "#f7b6d2", "#dbdb8d", "#9edae5",
           "#393b79", "#637939", "#8c6d31", "#843c39", "#7b4173"]
IDLE = "#e4e4e4"           # compute-lane background: what shows through is a bubble
COMM_IDLE = "#f2f2f2"

# Vertical layout, in units of one rank's row (rank r occupies r .. r+1, top to bottom).
_COMPUTE, _COMM = (0.0, 0.56), (0.60, 0.30)
_COMPUTE_ONLY = (0.0, 0.82)
_LABEL_PT = 7.0            # font size of box labels, in points
_MAX_AUTO_WIDTH = 20.0     # inches: wider figures get shrunk to fit a notebook cell anyway


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


def _row(rank: int, e, comm_lanes: bool) -> tuple[float, float]:
    """(top, height) of the strip that event e is drawn in."""
    if e.category == "compute":
        y, h = _COMPUTE if comm_lanes else _COMPUTE_ONLY
    elif e.kind == "send":
        y, h = _COMM[0], _COMM[1] / 2
    elif e.kind == "recv":
        y, h = _COMM[0] + _COMM[1] / 2, _COMM[1] / 2
    else:
        y, h = _COMM
    return rank + y, h


def _check(timeline, time_range, labels, colors):
    """Clear errors for bad input; returns the time range to show."""
    if not isinstance(timeline, Timeline):
        hint = " (a pplab.launch result: pass results.timeline)" if hasattr(timeline, "timeline") else ""
        raise TypeError(f"swimlane.draw needs a pplab.trace.Timeline, e.g. results.timeline from "
                        f"pplab.launch or a simulated schedule; got {type(timeline).__name__}{hint}")
    if labels not in ("auto", True, False):
        raise ValueError(f"labels must be 'auto', True or False, got {labels!r}")
    for kind, c in (colors or {}).items():
        if not mcolors.is_color_like(c):
            raise ValueError(f"colors[{kind!r}] = {c!r} is not a matplotlib colour (try '#1f77b4' or 'tab:blue')")
    makespan = timeline.makespan
    if time_range is None:
        return 0.0, (makespan if makespan > 0 else 1.0)
    try:
        t0, t1 = (float(t) for t in time_range)
    except (TypeError, ValueError):
        raise ValueError(f"time_range must be (start, end) in {timeline.unit}, got {time_range!r}") from None
    if not (math.isfinite(t0) and math.isfinite(t1) and t0 < t1):
        raise ValueError(f"time_range=({t0:g}, {t1:g}) is empty or reversed: give (start, end) with "
                         f"start < end, e.g. (0, {makespan:.4g}) for the whole run")
    return t0, t1


def _auto_figsize(n_lanes, comm_lanes, memory, boxes_per_lane):
    width = min(max(8.0, 3.0 + 0.13 * boxes_per_lane), _MAX_AUTO_WIDTH)
    height = 1.7 + n_lanes * (0.5 if comm_lanes else 0.34) + (1.8 if memory else 0.0)
    return width, height


def _memory_scale(unit: str, peak: float):
    """Bytes are shown in kB/MB/GB once large; other units (e.g. micro-batches) as they are."""
    if unit != "B":
        return 1.0, unit
    for factor, name in ((1e9, "GB"), (1e6, "MB"), (1e3, "kB")):
        if peak >= factor:
            return factor, name
    return 1.0, "B"


def draw(timeline, *, ax=None, comm_lanes="auto", arrows=False, memory=False, time_range=None,
         title=None, labels="auto", colors=None, figsize=None) -> Figure:
    """Draw `timeline` (a pplab.trace.Timeline) as swimlanes; return the figure.

    ax: draw into this Axes (or, with memory=True, a pair (lanes_ax, memory_ax));
      default: a new figure sized to the number of ranks and boxes.
    comm_lanes: a comm lane under each rank (False: messages are not drawn; "auto":
      only if the timeline has communication, so simulated schedules get no empty lanes).
    arrows: an arrow from the end of each send to the end of its receive.
    memory: a curve of what each rank holds, under the lanes, on the same time axis.
    time_range: (start, end) to zoom in, in timeline.unit.
    labels: "auto" (text only in boxes wide enough for it), True or False.
    colors: {kind: colour} overriding KIND_COLORS.
    title: the first title line (default: timeline.title if set, else what the timeline is).

    A figure draw makes is closed in pyplot before it is returned: in a notebook it
    shows as the value of a cell (or with display(fig)); in a script, fig.savefig(...).
    """
    t0, t1 = _check(timeline, time_range, labels, colors)
    if comm_lanes == "auto":
        comm_lanes = any(e.category == "comm" for e in timeline.events)
    tl, comm_lanes, makespan = timeline, bool(comm_lanes), timeline.makespan
    shown = [e for e in tl.events if e.category == "compute" or (comm_lanes and e.category == "comm")]
    shown = [e for e in shown if (e.end > t0 and e.start < t1) or (e.start == e.end and t0 <= e.start <= t1)]
    n_lanes = max([tl.world_size] + [e.rank + 1 for e in tl.events])

    # -- the figure and its axes ---------------------------------------------------
    own_figure = ax is None
    if own_figure:
        per_lane = defaultdict(int)
        for e in shown:
            per_lane[e.rank] += e.category == "compute"
        # Made with pyplot (which sets up a notebook's inline display), then closed at the
        # end: pyplot keeps no reference, and the figure shows once, as the cell's value.
        fig = plt.figure(figsize=figsize or _auto_figsize(n_lanes, comm_lanes, memory, max(per_lane.values(), default=0)),
                         layout="constrained")
        if memory:
            ax, mem_ax = fig.subplots(2, 1, sharex=True, height_ratios=[n_lanes * (0.5 if comm_lanes else 0.34), 1.4])
        else:
            ax, mem_ax = fig.subplots(), None
    else:
        if figsize is not None:
            raise ValueError("figsize applies only when draw makes the figure (ax=None); size your own figure instead")
        if memory:
            if not (isinstance(ax, (tuple, list)) and len(ax) == 2):
                raise ValueError("memory=True draws into two axes: pass ax=(lanes_ax, memory_ax), or leave ax=None")
            ax, mem_ax = ax
        else:
            mem_ax = None
        if not all(hasattr(a, "broken_barh") for a in (ax, mem_ax) if a is not None):
            raise TypeError(f"ax must be a matplotlib Axes (e.g. from fig.subplots()), got {type(ax).__name__}")
        fig = ax.figure
    ax.set_label("swimlanes")
    ax.set_xlim(t0, t1)
    ax.set_ylim(n_lanes, -0.15)            # inverted: rank 0 at the top

    # -- lane backgrounds: idle time shows through as grey -------------------------
    lane_span = [(0.0, max(makespan, t1))]
    compute_row = _COMPUTE if comm_lanes else _COMPUTE_ONLY
    for r in range(n_lanes):
        ax.broken_barh(lane_span, (r + compute_row[0], compute_row[1]), facecolors=IDLE, zorder=0, gid="idle")
        if comm_lanes:
            ax.broken_barh(lane_span, (r + _COMM[0], _COMM[1]), facecolors=COMM_IDLE, zorder=0, gid="idle")

    # -- the boxes: one collection per (rank, strip, kind) keeps 10,000 boxes fast ---
    axes_w_pt = ax.get_position().width * fig.get_figwidth() * 72
    axes_h_pt = ax.get_position().height * fig.get_figheight() * 72
    pt_per_unit, pt_per_row = axes_w_pt / (t1 - t0), axes_h_pt / (n_lanes + 0.15)
    groups = defaultdict(list)
    for e in shown:
        groups[(_row(e.rank, e, comm_lanes), e.kind)].append((e.start, e.end - e.start))
    for ((y, h), kind), spans in groups.items():
        thin = np.median([d for _, d in spans]) * pt_per_unit < 3      # white edges would hide them
        ax.broken_barh(spans, (y, h), facecolors=color_of(kind, colors), zorder=2,
                       edgecolors="white", linewidths=0 if thin else 0.6, gid=f"box:{kind}")

    # -- labels inside the boxes, where they fit -----------------------------------
    if labels:
        for e in shown:
            text = e.label or e.kind
            y, h = _row(e.rank, e, comm_lanes)
            a, b = max(e.start, t0), min(e.end, t1)
            size = _LABEL_PT if e.category == "compute" else _LABEL_PT - 1
            fits = (b - a) * pt_per_unit >= 0.6 * size * len(text) + 2 and h * pt_per_row >= 1.15 * size
            if labels is True or fits:
                ax.text((a + b) / 2, y + h / 2, text, ha="center", va="center", fontsize=size,
                        color=_ink(color_of(e.kind, colors)), clip_on=True, zorder=3, gid="label")

    # -- arrows from each send to its receive --------------------------------------
    if arrows and tl.events:
        segs = []
        for s, rv in tl.messages():
            if max(s.end, rv.end) < t0 or min(s.end, rv.end) > t1:
                continue
            ys = _row(s.rank, s, comm_lanes) if comm_lanes else (s.rank + compute_row[0], compute_row[1])
            yr = _row(rv.rank, rv, comm_lanes) if comm_lanes else (rv.rank + compute_row[0], compute_row[1])
            segs.append((s.end, ys[0] + ys[1] / 2, rv.end, yr[0] + yr[1] / 2))
        if segs:
            x, y, x2, y2 = np.array(segs).T
            ax.quiver(x, y, x2 - x, y2 - y, angles="xy", scale_units="xy", scale=1, color="#333333",
                      width=0.0012, headwidth=5, headlength=6, headaxislength=5, zorder=4, gid="arrows")

    # -- axes, utilisation, title, legend -----------------------------------------
    ax.set_yticks([r + compute_row[0] + compute_row[1] / 2 for r in range(n_lanes)],
                  [f"rank {r}" for r in range(n_lanes)])
    if comm_lanes:
        ax.set_yticks([r + _COMM[0] + _COMM[1] / 2 for r in range(n_lanes)], ["comm"] * n_lanes, minor=True)
        ax.tick_params(axis="y", which="minor", labelsize=6, labelcolor="#777777", length=0)
    ax.tick_params(axis="y", which="major", length=0, labelsize=8 if n_lanes <= 16 else 6)
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    right = blended_transform_factory(ax.transAxes, ax.transData)
    ax.text(1.005, -0.15, "busy", transform=right, ha="left", va="bottom", fontsize=7, color="#555555")
    busy = [tl.busy(r) for r in range(n_lanes)]       # utilisation = busy / makespan, as tl.utilization(r)
    for r in range(n_lanes):
        ax.text(1.005, r + compute_row[0] + compute_row[1] / 2, f"{busy[r] / makespan if makespan else 0:.1%}",
                transform=right, ha="left", va="center", fontsize=8 if n_lanes <= 16 else 6, gid="util")

    # Times stay in timeline.unit (time_range too); a measured run under 1 s is *shown* in ms.
    scale, unit = (1e3, "ms") if tl.unit == "s" and 0 < max(makespan, t1) < 1 else (1.0, tl.unit)
    time_ax = mem_ax if mem_ax is not None else ax
    time_ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v * scale:g}"))
    time_ax.set_xlabel(f"time ({unit})")

    total, busy = tl.world_size * makespan, sum(busy[:tl.world_size])
    default = f"{tl.source.capitalize()} timeline: {n_lanes} rank{'s' * (n_lanes != 1)}" + \
        (f", makespan {makespan * scale:.4g} {unit}" if tl.events else " (no events)")
    util = (f"utilisation {busy / total if total else 0:.1%} (busy {busy * scale:.4g} of {total * scale:.4g} "
            f"rank-{unit})") + (f", showing {t0 * scale:.4g} to {t1 * scale:.4g} {unit}" if time_range is not None else "")
    head = title or getattr(timeline, "title", None) or default
    ax.set_title(f"{head}\n{util}", fontsize=10)

    present = {e.kind for e in shown}
    order = [k for k in KIND_COLORS if k in present] + sorted(present - set(KIND_COLORS))
    handles = [Patch(facecolor=color_of(k, colors), label=KIND_NAMES.get(k, k)) for k in order]
    handles.append(Patch(facecolor=IDLE, label="idle (bubble)"))
    if own_figure:
        fig.legend(handles=handles, loc="outside lower center", ncols=min(len(handles), 10), fontsize=8, frameon=False)
    else:
        ax.legend(handles=handles, loc="upper right", fontsize=7, framealpha=0.9)

    if mem_ax is not None:
        _draw_memory(mem_ax, tl, n_lanes)
    if own_figure:
        plt.close(fig)
    return fig


def _draw_memory(ax, tl, n_lanes):
    """Step curves of what each rank holds over time (trace.hold / trace.release)."""
    ax.set_label("memory")
    curves = [tl.memory_curve(r) for r in range(n_lanes)]
    peak = max((max(v) for _, v in curves), default=0)
    factor, unit = _memory_scale(tl.memory_unit, peak)
    end = tl.makespan
    cmap = mcolors.LinearSegmentedColormap.from_list("ranks", ["#1f3b73", "#2ca02c", "#d4b000"])
    for r, (t, v) in enumerate(curves):
        label = f"rank {r}" if n_lanes <= 8 or r in (0, n_lanes - 1) else "_nolegend_"
        ax.step(list(t) + [max(end, t[-1])], [x / factor for x in v] + [v[-1] / factor], where="post",
                color=cmap(r / max(n_lanes - 1, 1)), linewidth=1.2, label=label)
    ax.set_ylabel(f"held ({unit})")
    ax.set_ylim(bottom=0)
    ax.grid(axis="y", color="#dddddd", linewidth=0.5)
    ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=7, frameon=False,
              title="rank", title_fontsize=7)


# ----------------------------------------------------------------------------------
# The interactive version


def explore(source, **controls):
    """Swimlanes with controls; every change re-renders the figure.

    source: a Timeline, or a function returning one, e.g. a schedule simulator; its
      parameters get controls as in ipywidgets.interact: (lo, hi) -> slider, a list
      -> dropdown, a bool -> checkbox, or pass a widget.
    Checkboxes for comm lanes / arrows / memory and a time-range slider are always there.

    Returns an ipywidgets VBox; `.update()` re-renders, `.figure` is the figure last
    drawn, `.timeline` the timeline it shows, `.error` the error of the last render (if any).
    """
    import ipywidgets as w
    from IPython.display import display

    if isinstance(source, Timeline):
        if controls:
            raise TypeError(f"controls {sorted(controls)} set parameters of a function that builds a Timeline; "
                            f"explore(timeline) takes none")
        make = lambda: source  # noqa: E731
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
                              continuous_update=False, readout_format=".4g", layout=w.Layout(width="95%"))
    out = w.Output()
    shown = [wd for wd in params.values() if isinstance(wd, w.Widget)]      # w.fixed values are not shown
    box = w.VBox([w.HBox(shown), w.HBox(list(view.values())), time, out])
    box.controls = {**params, **view, "time": time}
    box.figure = box.timeline = box.error = None
    state = {"stale": True, "quiet": False}

    def update(change=None, raise_errors=False):
        if state["quiet"]:
            return
        try:
            if state["stale"]:                  # a parameter changed: build the timeline again
                tl = make(**{n: wd.value for n, wd in params.items()})
                if not isinstance(tl, Timeline):
                    raise TypeError(f"explore: the source function must return a pplab.trace.Timeline, "
                                    f"got {type(tl).__name__}")
                box.timeline, state["stale"] = tl, False
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
        with out:
            out.clear_output(wait=True)
            if box.figure is not None:
                display(box.figure)
            else:
                print(f"cannot draw: {box.error}")

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
