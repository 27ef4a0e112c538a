"""draw: checks what was asked, makes the figure and its axes (lanes per timeline, memory
panels under them), draws each timeline's lanes, the legend, and the box labels last."""
from __future__ import annotations

from collections import defaultdict

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.ticker import FuncFormatter

from .lanes import _draw_lanes, _draw_path, _place_labels
from .layout import _MEMORY_ROW, _Panel, _auto_figsize, _check_options, _check_timeline, _time_range
from .memory import _draw_memory
from .style import BETWEEN_NODES, HATCHES, IDLE, KIND_COLORS, KIND_NAMES, color_of


def draw(timeline, *, ax=None, comm_lanes="auto", arrows=False, memory=False, time_range=None,
         title=None, titles=None, labels="auto", colors=None, figsize=None, path="auto",
         comm_rows=None, nodes=None) -> Figure:
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
    nodes: ranks per node (ranks numbered node by node, as pplab.cluster.Cluster does): a
      dashed line between nodes, and with arrows=True the messages between nodes drawn in
      red, on their own, so the slow link's traffic stands out.

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
    if nodes is not None and (isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1):
        raise ValueError(f"nodes is the number of ranks per node, a positive int (e.g. nodes=2), got {nodes!r}")
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
    jobs, present, chunks, traced, crossed = [], set(), set(), False, False
    for i, (p, (lane_ax, mem_axes)) in enumerate(zip(panels, layout)):
        head = (titles[i] if titles is not None else None) if stacked else title
        jobs += _draw_lanes(lane_ax, p, t0, t1, head, time_range is not None, colors, arrows, labels, nodes)
        crossed |= any(c.get_gid() == "arrows:between-nodes" for c in lane_ax.collections)
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
    if crossed:
        handles.append(Line2D([], [], color=BETWEEN_NODES, lw=2, label="message between nodes"))
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
