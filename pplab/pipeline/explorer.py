"""An interactive pipeline explorer: pick a schedule and its sizes, see its swimlane.

    from pplab.pipeline import explore
    explore()                  # in a notebook: controls for schedule, p, m, v, t_f, t_b, t_w

Every change re-simulates the schedule and redraws it with the same renderer as a measured
run, with each rank's activations held drawn under the lanes. The title gives the bubble
that was simulated next to the formula (p-1)/(v*m).
"""
from __future__ import annotations

from .schedules import SCHEDULES, make_schedule
from .simulate import bubble_fraction, simulate

_MULTI_CHUNK = {"interleaved-1f1b", "zb-v"}


def pipeline_timeline(schedule="1f1b", p=4, m=8, v=2, t_f=1.0, t_b=2.0, t_w=0.0):
    """Simulate one configuration; the Timeline carries a title with the bubble figures.

    v is used only by the schedules with several chunks per rank (interleaved-1f1b; zb-v
    always has 2); t_w only by those that split backward into I and W (0 = half of t_b).
    """
    chunks = 2 if schedule == "zb-v" else (v if schedule in _MULTI_CHUNK else 1)
    sched = make_schedule(schedule, p, m, chunks=chunks)
    result = simulate(sched, t_f=t_f, t_b=t_b, t_w=(t_w or None))
    ideal = m * (t_f + t_b)                                     # one rank's useful work
    measured = (result.makespan - ideal) / ideal
    tl = result.timeline()
    tl.title = (f"{schedule}: p={p}, m={m}" + (f", v={chunks}" if chunks > 1 else "")
                + f"  |  bubble {measured:.1%} of useful time, (p-1)/(v·m) = "
                f"{bubble_fraction(p, m, chunks):.1%}  |  peak activations {max(result.peak_activations):g}")
    return tl


def explore(schedule="1f1b", p=4, m=8, v=2, t_f=1.0, t_b=2.0, t_w=0.0):
    """A widget: schedule, p, m, v, t_f, t_b, t_w -> swimlane + memory curve + bubble."""
    from .. import swimlane

    def make(schedule=schedule, p=p, m=m, v=v, t_f=t_f, t_b=t_b, t_w=t_w):
        return pipeline_timeline(schedule, p, m, v, t_f, t_b, t_w)

    box = swimlane.explore(make, schedule=sorted(SCHEDULES), p=(1, 16), m=(1, 64), v=(1, 4),
                           t_f=(0.5, 4.0, 0.25), t_b=(0.5, 8.0, 0.25), t_w=(0.0, 4.0, 0.25))
    box.controls["memory"].value = True
    return box
