"""The pipeline explorer: controls re-simulate, the title states bubble and memory."""
import pytest

from pplab.pipeline import explore, make_schedule, pipeline_timeline, simulate


def _closed_form(name, p, m, v):
    """(bubble, peak activations in micro-batches) with t_f = 1, t_b = 2, from the schedules'
    definitions. Fill and drain: every rank idles (p-1) slots of a chunk's F+B, i.e. (p-1)/v
    micro-batches' worth, against m of work. Rank 0 holds, at its peak: GPipe all m forwards;
    1F1B its p warm-up forwards (m if fewer); interleaved 1F1B (Megatron) 2(p-1) + (v-1)p
    warm-up chunk forwards and one more before its first backward, 1/v micro-batch each."""
    bubble = (p - 1) / (v * m)
    peak = {"gpipe": m, "1f1b": min(p, m),
            "interleaved-1f1b": (2 * (p - 1) + (v - 1) * p + 1) / v}[name]
    return bubble, peak


@pytest.mark.parametrize("name, p, m, v", [("gpipe", 4, 8, 1), ("1f1b", 4, 4, 1), ("1f1b", 3, 5, 1),
                                           ("interleaved-1f1b", 4, 8, 2), ("interleaved-1f1b", 2, 4, 2)])
def test_title_bubble_and_peak_match_closed_forms(name, p, m, v):
    bubble, peak = _closed_form(name, p, m, v)
    tl = pipeline_timeline(name, p, m, v)
    assert f"bubble {bubble:.1%} of useful time, (p-1)/(v·m) = {bubble:.1%}" in tl.title
    assert f"peak activations {peak:g}" in tl.title
    # the bubble itself, from the simulated makespan: m + (p-1)/v micro-batches of F+B = 3
    result = simulate(make_schedule(name, p, m, chunks=v if v > 1 else None), t_f=1.0, t_b=2.0)
    assert result.makespan == pytest.approx(3 * (m + (p - 1) / v))
    assert max(result.peak_activations) == pytest.approx(peak)


def test_the_title_by_hand():
    assert pipeline_timeline("gpipe", 4, 8, 1).title == (
        "gpipe: p=4, m=8  |  peak activations 8\nbubble 37.5% of useful time, (p-1)/(v·m) = 37.5%")
    assert pipeline_timeline("interleaved-1f1b", 4, 8, 2).title == (      # 3/16; (6 + 4 + 1) / 2
        "interleaved-1f1b: p=4, m=8, v=2  |  peak activations 5.5\nbubble 18.8% of useful time, "
        "(p-1)/(v·m) = 18.8%")


def test_controls_redraw_with_memory_and_report_bad_choices():
    box = explore()
    assert box.controls["memory"].value is True and len(box.figure.axes) >= 2      # lanes + memory
    box.controls["schedule"].value = "gpipe"
    box.controls["m"].value = 4
    assert box.timeline.title.startswith("gpipe: p=4, m=4") and box.error is None
    box.controls["schedule"].value = "interleaved-1f1b"
    box.controls["m"].value = 6                    # m need not be a multiple of p
    assert box.error is None and box.timeline.title.startswith("interleaved-1f1b: p=4, m=6, v=2")
    assert box.controls["v"].min == 2              # interleaving needs two chunks or more
