"""The memory panels (memory=True): small multiples, one per rank, of what it holds over
time (trace.hold / trace.release), on the lanes' time axis and one shared scale."""
from __future__ import annotations


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
