"""The 'your prediction' lines of a cell's source, found in time linear in its length.

    my_bubble = (p - 1) / m    # your prediction: the bubble fraction of GPipe at p = 4, m = 8

`predictions_in(source)` gives {"my_bubble": "(p - 1) / m"}. The grader runs it on every code
cell a student hands in, so it must never take long, whatever the cell holds: a pattern such
as `\\s*=\\s*(.*?)\\s*#` can split a run of spaces between its three parts in n² (or n³) ways,
and a cell `x =` followed by 20,000 spaces then takes days. Here every quantifier is
possessive (`*+`, `++`: it never gives back what it took) and the value is made of pieces that
each begin with a different kind of character, so there is only one way to read a line.

This module imports nothing of pplab (and no torch): the grader's reader runs it on its own.
"""
from __future__ import annotations

import re

# What ends a value: the marker `#  your prediction` (a `#` anywhere else belongs to the value).
_MARKER = r"#[ \t]*+your prediction\b"

# `my_x = <value>   # your prediction...` at the start of a line. The value is a run of
# pieces: a character that is neither blank nor `#`; a `#` that does not start the marker; or
# a run of blanks that is followed by more of the value (not by the marker or the line's end),
# so the value never ends in blanks.
PREDICTION_LINE = re.compile(
    rf"^(?P<name>[A-Za-z_]\w*+)[ \t]*+=[ \t]*+"
    rf"(?P<value>(?:[^ \t\n#]|#(?![ \t]*+your prediction\b)|[ \t]++(?![ \t]|$|{_MARKER}))*+)"
    rf"[ \t]*+{_MARKER}[^\n]*+$", re.M)


def predictions_in(source: str) -> dict[str, str]:
    """The prediction lines of a cell's source: {variable: the value as written}."""
    return {m["name"]: m["value"] for m in PREDICTION_LINE.finditer(source)}
