"""What every swimlane figure shares: one colour per kind of work (the same in every
figure, told apart with any colour vision), the lane backgrounds, the chunk hatches, and
the ink that reads on a box of a given colour."""
from __future__ import annotations

import zlib

import matplotlib.colors as mcolors

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
BETWEEN_NODES = "#CC3311"  # a message over the slow link between nodes (figure: nodes=)
HATCHES = ["", "///", "...", "xxx", "\\\\\\"]     # chunk 0, 1, 2, ... of a rank


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



def _fmt_bytes(n: float) -> str:
    for factor, name in ((1e9, "GB"), (1e6, "MB"), (1e3, "kB")):
        if n >= factor:
            return f"{n / factor:.3g} {name}"
    return f"{n:g} B"
