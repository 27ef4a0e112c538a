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

`to_perfetto(timeline, "run.json")` writes the same run in the Chrome trace format, to open in
ui.perfetto.dev next to `torch.profiler` traces (one process per rank, compute and comm threads,
a comm thread more for each operation in flight at once).
"""
# Where each part lives: style.py (colours), layout.py (what a panel shows and where: lanes,
# comm rows, figure size), figure.py (draw), lanes.py (boxes, arrows, labels, the path),
# memory.py (the memory panels), widget.py (explore), perfetto.py (the Chrome trace export).
from .figure import draw
from .layout import _Panel  # noqa: F401 - tests build a panel to check its comm rows
from .style import COMM_IDLE, HATCHES, IDLE, KIND_COLORS, KIND_NAMES, PALETTE, color_of
from .perfetto import to_perfetto, trace_events
from .widget import explore

__all__ = ["draw", "explore", "to_perfetto", "trace_events", "color_of", "KIND_COLORS", "KIND_NAMES", "PALETTE", "IDLE", "COMM_IDLE", "HATCHES"]
