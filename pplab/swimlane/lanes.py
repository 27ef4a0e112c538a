"""One timeline's lanes: the idle backgrounds (bubbles show through), the boxes, send ->
receive arrows, lane names and the utilisation column, the title; then the box labels,
fitted into their boxes once the layout is known; and the line that follows one
micro-batch's forward through the stages."""
from __future__ import annotations

import string
from collections import defaultdict

import matplotlib.colors as mcolors
import numpy as np
from matplotlib import patheffects
from matplotlib.transforms import Bbox, blended_transform_factory

from .layout import _LABEL_PT, _row
from .style import BETWEEN_NODES, COMM_IDLE, HATCHES, IDLE, _fmt_bytes, _ink, color_of


def _draw_lanes(ax, p, t0, t1, head, zoomed, colors, arrows, labels, nodes=None):
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
        segs = {False: [], True: []}       # by "between nodes?"
        for s, rv in tl.messages():
            if max(s.end, rv.end) < t0 or min(s.end, rv.end) > t1:
                continue
            ys = _row(p, s) if comm else (s.rank + main[0], main[1])
            yr = _row(p, rv) if comm else (rv.rank + main[0], main[1])
            between = nodes is not None and s.rank // nodes != rv.rank // nodes
            segs[between].append((s.end, ys[0] + ys[1] / 2, rv.end, yr[0] + yr[1] / 2))
        for between, gid, color, width in ((False, "arrows", "#333333", 1.1),
                                           (True, "arrows:between-nodes", BETWEEN_NODES, 2.0)):
            if segs[between]:
                x, y, x2, y2 = np.array(segs[between]).T
                ax.quiver(x, y, x2 - x, y2 - y, angles="xy", scale_units="xy", scale=1, color=color, alpha=0.75,
                          units="dots", width=width, headwidth=4.5, headlength=5.5, headaxislength=5, zorder=4,
                          gid=gid)

    # -- node boundaries: a dashed line under the last rank of each node but the last ------
    if nodes is not None:
        for k in range(nodes, n, nodes):
            ax.axhline(k - 0.075, color=BETWEEN_NODES, lw=1.0, ls="--", zorder=3, gid="node-boundary")

    # -- lane names (with the stages a rank holds), the right-hand column, the title ---
    names = [f"rank {r}" for r in range(n)]
    if p.chunked:
        stages = defaultdict(set)
        for e in tl.events:
            if e.category == "compute" and "stage" in e.meta:
                stages[e.rank].add(e.meta["stage"])
        names = [f"rank {r}\nstages {', '.join(map(str, sorted(stages[r])))}" if stages[r] else names[r]
                 for r in range(n)]
    if nodes is not None:
        names = [f"node {r // nodes}  {name}" for r, name in enumerate(names)]
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
