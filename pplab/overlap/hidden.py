"""How much communication hid under computation, read from the trace; and a stand-in compute span.

    with stand_in_span("F", 0.03, microbatch=1):     # real work, then wait until 30 ms have passed
        y = layer(x)
    ...
    hidden_fraction(results.timeline, rank=1)       # 0.0 (nothing hidden) ... 1.0 (all hidden)

"Hidden" is communication time that lies under a compute span *of the same rank*: while the
rank's message or collective was in flight (from the call that started it to the wait that
ended it), the rank was computing something else. A blocking send has nothing under it; an
isend posted before a forward and waited for after it has the whole forward under it. The
function takes the union of the rank's communication intervals and the union of its compute
intervals and measures their intersection, so two messages in flight at once count once.

Which end a send has depends on the timeline. A launch's merged timeline ends an isend when its
receive ended, if that came before the sender's wait (the message cannot be in flight after it
arrived): the time really in flight, which depends on the other rank's pace. A timeline of one
rank's own events (`Timeline(trace.events())` inside the rank) keeps the sender's wait: the time
the rank had the send outstanding, which only its own code decides.

Why a stand-in. On this CPU a rank's compute and the backend's threads share two cores, so a
transfer "under" a matmul slows the matmul down: nothing is really hidden. A GPU computes on its
own silicon while the NIC moves bytes. `stand_in_span` plays the GPU: the work is done for real
(the numbers are right) and the rank then sleeps until the span has lasted `seconds`, leaving the
cores to the communication threads, as chapter 2's `stand_in_compute` does for a whole model.
"""
from __future__ import annotations

import contextlib
import time

from .. import trace
from ..trace import union_length


@contextlib.contextmanager
def stand_in_span(kind: str, seconds: float, label: str | None = None, **meta):
    """A compute span (trace.span) that lasts at least `seconds`: the work inside, then a wait."""
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or seconds < 0:
        raise ValueError(f"stand_in_span: seconds must be a number >= 0 (the stand-in accelerator's time for "
                         f"this piece of work), got {seconds!r}")
    with trace.span(kind, label, **meta) as event:
        yield event
        time.sleep(max(0.0, event.start + seconds - trace.now()))


def _merged(intervals) -> list[tuple[float, float]]:
    """Sorted, disjoint intervals covering the same time as `intervals`."""
    out: list[list[float]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def _intersection_length(a, b) -> float:
    """Time covered by both unions (a and b each sorted and disjoint): walk them side by side."""
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        total += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def _rank_events(timeline, rank, kinds, start, end):
    if not hasattr(timeline, "select") or not hasattr(timeline, "world_size"):
        raise TypeError(f"hidden_time takes a pplab.trace.Timeline (results.timeline of a launch), "
                        f"got {type(timeline).__name__}")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < timeline.world_size:
        raise ValueError(f"rank={rank!r} is not a rank of this timeline: use 0..{timeline.world_size - 1}")

    def inside(e):
        return (start is None or e.start >= start) and (end is None or e.start < end)
    comm = [e for e in timeline.select(rank, "comm", kinds) if inside(e) and e.kind != "barrier"]
    compute = [e for e in timeline.select(rank, "compute")]
    return comm, compute


def hidden_time(timeline, rank: int, kinds=None, start: float | None = None,
                end: float | None = None) -> tuple[float, float]:
    """(seconds `rank` had communication in flight, of which seconds it was also computing).

    kinds: only these communication kinds ("send", "recv", "all_gather", ...; default all but
    barriers); start/end: only communication that started in [start, end) (timeline seconds),
    e.g. one step of several. Compute spans count wherever they lie.
    """
    comm, compute = _rank_events(timeline, rank, kinds, start, end)
    flight = _merged((e.start, e.end) for e in comm)
    busy = _merged((e.start, e.end) for e in compute)
    return union_length(flight), _intersection_length(flight, busy)


def hidden_fraction(timeline, rank: int, kinds=None, start: float | None = None,
                    end: float | None = None) -> float:
    """The fraction of `rank`'s communication time that lay under its own compute (0..1).

    Raises ValueError when the rank recorded no communication in the window: a fraction of
    nothing would read as "nothing hidden" and hide a run that never communicated."""
    flight, hidden = hidden_time(timeline, rank, kinds, start, end)
    if flight <= 0:
        raise ValueError(f"rank {rank} recorded no communication{'' if kinds is None else f' of kinds {kinds}'} "
                         f"in this window: communicate through pplab.comm (it records every call), or pick "
                         f"another rank or window")
    return hidden / flight
