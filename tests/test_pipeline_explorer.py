"""The pipeline explorer: controls re-simulate, the title states bubble and memory."""
import pytest

from pplab.pipeline import bubble_fraction, explore, pipeline_timeline, simulate, make_schedule


@pytest.mark.parametrize("name, p, m, v", [("gpipe", 4, 8, 1), ("1f1b", 4, 4, 1), ("interleaved-1f1b", 4, 8, 2)])
def test_title_bubble_matches_formula_and_simulation(name, p, m, v):
    tl = pipeline_timeline(name, p, m, v)
    expected = f"(p-1)/(v·m) = {bubble_fraction(p, m, v):.1%}"
    assert expected in tl.title and f"bubble {bubble_fraction(p, m, v):.1%} of useful time" in tl.title
    peak = max(simulate(make_schedule(name, p, m, chunks=v if v > 1 else None)).peak_activations)
    assert f"peak activations {peak:g}" in tl.title


def test_controls_redraw_with_memory_and_report_bad_choices():
    box = explore()
    assert box.controls["memory"].value is True and len(box.figure.axes) >= 2      # lanes + memory
    box.controls["schedule"].value = "gpipe"
    box.controls["m"].value = 4
    assert box.timeline.title.startswith("gpipe: p=4, m=4") and box.error is None
    box.controls["schedule"].value = "interleaved-1f1b"
    box.controls["m"].value = 6                    # m need not be a multiple of p
    assert box.error is None and box.timeline.title.startswith("interleaved-1f1b: p=4, m=6, v=2")
    box.controls["v"].value = 1                    # interleaving needs two chunks or more
    assert box.error is not None and "chunks >= 2" in str(box.error)
