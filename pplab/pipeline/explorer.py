"""An interactive pipeline explorer: pick a schedule and its sizes, see its swimlane.

    from pplab.pipeline import explore
    explore()                  # in a notebook: schedule, p, m, t_f, t_b (+ v, t_w where they apply)

Every change re-simulates the schedule and redraws it with the same renderer as a measured
run, each rank's activations held in a panel of its own under the lanes. The title gives
the bubble measured on the simulation next to the formula that applies to the schedule:
(p-1)/(v·m) for GPipe, 1F1B, interleaved 1F1B and Looped BFS, p-1 for naive model parallelism,
(p-1)(t_f+t_I-t_W)/(v·m(t_f+t_b)) for ZB-H1 (v = 1) and interleaved zero bubble (saying so
where these times or m < p break it); ZB-V has
none that holds for every t_f, t_I, t_W, so its title compares it with 1F1B's bubble.
Chimera, DualPipe and DualPipeV (bidirectional.py) are listed too, with Chimera's (p-2)/(2m)
and the DualPipe README's (PP/2-1)(F&B+B-3W), F&B taken as t_f + t_b.
"""
from __future__ import annotations

from .schedules import SCHEDULES, make_schedule
from .simulate import bubble_fraction, simulate

_INTERLEAVED = {name for name, recipe in SCHEDULES.items() if recipe.least_chunks}   # v is a choice here
_SPLIT = {name for name, recipe in SCHEDULES.items() if recipe.backward != "B"}      # t_w applies


def _chunks(schedule, v):
    return v if schedule in _INTERLEAVED else SCHEDULES[schedule].chunks


def pipeline_timeline(schedule="1f1b", p=4, m=8, v=2, t_f=1.0, t_b=2.0, t_w=0.0):
    """Simulate one configuration; the Timeline carries a title with the bubble figures.

    v is used only by interleaved-1f1b (zb-v always has 2 chunks); t_w only by the
    schedules that split backward into I and W (0 = half of t_b).
    """
    chunks = _chunks(schedule, v)
    sched = make_schedule(schedule, p, m, chunks=chunks)
    result = simulate(sched, t_f=t_f, t_b=t_b, t_w=(t_w or None))
    useful = m * (t_f + t_b)                                    # one rank's work: m forwards and backwards
    bubble = (result.makespan - useful) / useful                # idle time / useful time, from the simulation
    head = f"{schedule}: p={p}, m={m}" + (f", v={chunks}" if chunks > 1 else "")
    if schedule in _SPLIT:
        w = t_w or t_b / 2
        head += f", t_f={t_f:g}, t_I={t_b - w:g}, t_W={w:g}"
    tl = result.timeline()
    tl.title = (f"{head}  |  peak activations {max(result.peak_activations):g}\n"
                + _bubble_line(schedule, p, m, chunks, bubble, t_f, t_b, t_w or t_b / 2))
    return tl


def _bubble_line(schedule, p, m, chunks, bubble, t_f, t_b, t_w):
    """What the simulation idled, and the closed form that applies to this schedule (if one does)."""
    said = f"bubble {bubble:.1%} of useful time"
    if schedule == "naive":                       # one micro-batch at a time: p-1 ranks idle while one works
        formula, value = "p-1", float(p - 1)
    elif schedule == "chimera":                   # the paper's p-2 idle slots, F and B one slot each
        formula, value = "(p-2)/(2m), t_f = t_b, m = p", (p - 2) / (2 * m)
    elif schedule in ("dualpipe", "dualpipev"):   # DualPipe's README with F&B = F + B; DualPipeV: 2p stages
        pp, scale = (p, 1.0) if schedule == "dualpipe" else (2 * p, 0.5)
        formula = "(PP/2-1)(t_f+2t_b-3t_W)/(m(t_f+t_b))" + ("" if schedule == "dualpipe" else ", PP = 2p")
        value = (pp // 2 - 1) * scale * (t_f + 2 * t_b - 3 * t_w) / (m * (t_f + t_b))
    elif schedule in ("zb-h1", "interleaved-zb"):   # the paper's makespan m(F+I+W) + (p-1)(F+I-W), chunks 1/v
        formula = "(p-1)(t_f+t_I-t_W)/(" + ("v·" if chunks > 1 else "") + "m·(t_f+t_b))"
        value = (p - 1) * (t_f + t_b - 2 * t_w) / (chunks * m * (t_f + t_b))
    elif schedule.startswith("pipedream"):      # never flushed: this fill and drain is paid once per run, not per step
        formula, value = "(p-1)/m, m = the whole stream", bubble_fraction(p, m)
    elif schedule in _SPLIT:
        return (f"{said} (no closed form for ZB-V that holds for every t_f, t_I, t_W; "
                f"1F1B would idle (p-1)/m = {bubble_fraction(p, m):.1%})")
    elif chunks > 1 and m < p:                   # interleaved with fewer micro-batches than ranks
        formula, value = "((p-1)+(v-1)(p-m))/(v·m)", bubble_fraction(p, m, chunks)
    else:
        formula, value = "(p-1)/(v·m)", bubble_fraction(p, m, chunks)
    agrees = abs(value - bubble) < 1e-9
    return f"{said}, {formula} = {value:.1%}" + ("" if agrees else " (the formula does not hold here)")


def explore(schedule="1f1b", p=4, m=8, v=2, t_f=1.0, t_b=2.0, t_w=0.0):
    """A widget: schedule, p, m, t_f, t_b (v, t_w where they apply) -> swimlane + memory + bubble."""
    from .. import swimlane

    def make(schedule=schedule, p=p, m=m, v=v, t_f=t_f, t_b=t_b, t_w=t_w):
        return pipeline_timeline(schedule, p, m, v, t_f, t_b, t_w)

    box = swimlane.explore(
        make, applies={"v": lambda c: c["schedule"] in _INTERLEAVED, "t_w": lambda c: c["schedule"] in _SPLIT},
        schedule=list(SCHEDULES), p=(1, 16), m=(1, 64), v=(2, 4),
        t_f=(0.5, 4.0, 0.25), t_b=(0.5, 8.0, 0.25), t_w=(0.0, 4.0, 0.25))
    box.controls["t_w"].description = "t_w (0: t_b/2)"
    box.controls["memory"].value = True
    return box
