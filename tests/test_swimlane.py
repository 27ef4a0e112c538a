"""pplab.swimlane: simulated and measured Timelines drawn by the same code.

The schedules here are worked out by hand (plain arithmetic on t_f and t_b), and
the checks read what was actually drawn: the boxes in each collection, the texts,
the arrows, the axes.
"""
import math

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402
import torch  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

import pplab  # noqa: E402
from pplab import comm, swimlane, trace  # noqa: E402
from pplab.trace import Event, Timeline  # noqa: E402


# ----------------------------------------------------------------------------------
# Hand-built schedules


def gpipe(p=4, m=4, t_f=1.0, t_b=2.0):
    """GPipe: all forwards, then all backwards. F(s, i) starts at (i + s) t_f; the
    backward wave starts when the last forward ends, at (m + p - 1) t_f, and B(s, i)
    runs in reverse micro-batch order, the last stage first. Each F sends its output to
    the next stage, each B its gradient to the one before (taking 0.2, in the comm lane).
    Activations held: +1 per F, -1 per B."""
    events, f_end = [], (m + p - 1) * t_f
    for s in range(p):
        held = 0
        for i in range(m):
            a = (i + s) * t_f
            events.append(Event(s, "F", "compute", a, a + t_f, f"F{i}"))
            held += 1
            events.append(Event(s, "memory", "memory", a + t_f, a + t_f, value=held))
            if s < p - 1:
                events.append(Event(s, "send", "comm", a + t_f, a + t_f + 0.2, f"→{s+1}", bytes_sent=4, peer=s + 1, seq=i))
                events.append(Event(s + 1, "recv", "comm", a + t_f, a + t_f + 0.2, f"←{s}", bytes_recv=4, peer=s, seq=i))
        for j in range(m):
            i, a = m - 1 - j, f_end + (p - 1 - s + j) * t_b
            events.append(Event(s, "B", "compute", a, a + t_b, f"B{i}"))
            held -= 1
            events.append(Event(s, "memory", "memory", a + t_b, a + t_b, value=held))
            if s > 0:
                events.append(Event(s, "send", "comm", a + t_b, a + t_b + 0.2, f"→{s-1}", bytes_sent=4, peer=s - 1, seq=m + j))
                events.append(Event(s - 1, "recv", "comm", a + t_b, a + t_b + 0.2, f"←{s}", bytes_recv=4, peer=s, seq=m + j))
    return Timeline(events, world_size=p, source="simulated", unit="units", memory_unit="micro-batches")


def naive(p=4, t_f=1.0, t_b=2.0):
    """Naive model parallelism, one batch: stage s forwards at s t_f, backwards in reverse."""
    events = [Event(s, "F", "compute", s * t_f, (s + 1) * t_f, "F0") for s in range(p)]
    events += [Event(s, "B", "compute", p * t_f + (p - 1 - s) * t_b, p * t_f + (p - s) * t_b, "B0") for s in range(p)]
    return Timeline(events, world_size=p, source="simulated", unit="units")


def boxes(fig):
    """{kind: number of boxes drawn}, read from the collections draw() made."""
    counts = {}
    for ax in fig.axes:
        for c in ax.collections:
            gid = c.get_gid() or ""
            if gid.startswith("box:"):
                counts[gid[4:]] = counts.get(gid[4:], 0) + len(c.get_paths())
    return counts


def texts(fig, gid):
    return [t.get_text() for ax in fig.axes for t in ax.texts if t.get_gid() == gid]


def lanes(fig):
    return next(a for a in fig.axes if a.get_label() == "swimlanes")


def arrows(fig):
    return [c for c in lanes(fig).collections if c.get_gid() == "arrows"]


# ----------------------------------------------------------------------------------
# Static figures


def test_gpipe_boxes_colours_and_utilisation():
    tl = gpipe()
    assert tl.utilization() == pytest.approx(48 / 84)
    fig = swimlane.draw(tl)
    assert isinstance(fig, Figure)
    assert boxes(fig) == {"F": 16, "B": 16, "send": 24, "recv": 24}
    assert texts(fig, "util") == ["57.1%"] * 4
    assert "utilisation 57.1% (busy 48 of 84 rank-units)" in lanes(fig).get_title()
    # one colour per kind, the documented one
    by_kind = {c.get_gid()[4:]: c.get_facecolor()[0][:3] for c in lanes(fig).collections
               if (c.get_gid() or "").startswith("box:")}
    assert by_kind["F"] == pytest.approx(matplotlib.colors.to_rgb(swimlane.KIND_COLORS["F"]))
    assert by_kind["B"] == pytest.approx(matplotlib.colors.to_rgb(swimlane.KIND_COLORS["B"]))
    # a grey background per compute lane and per comm lane: bubbles show through
    assert sum(c.get_gid() == "idle" for c in lanes(fig).collections) == 8
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert legend == ["F forward", "B backward", "send", "recv", "idle (bubble)"]
    # rank 0 at the top: its F0 box (row 0) is above rank 3's (y axis inverted)
    assert lanes(fig).yaxis_inverted()


def test_naive_model_parallel_is_25_percent_and_boxes_sit_where_scheduled():
    tl = naive()
    fig = swimlane.draw(tl, comm_lanes=False)
    assert texts(fig, "util") == ["25.0%"] * 4
    assert "utilisation 25.0% (busy 12 of 48 rank-units)" in lanes(fig).get_title()
    f = next(c for c in lanes(fig).collections if c.get_gid() == "box:F" and c.get_paths()[0].vertices[:, 1].min() == 2)
    xs = f.get_paths()[0].vertices[:, 0]            # rank 2's forward runs from 2 to 3
    assert (xs.min(), xs.max()) == (2.0, 3.0)
    assert sum(c.get_gid() == "idle" for c in lanes(fig).collections) == 4     # no comm lanes


def test_per_lane_utilisation_differs_per_rank():
    tl = Timeline([Event(0, "F", "compute", 0, 4, "F0"), Event(1, "F", "compute", 0, 1, "F0")],
                  world_size=3, unit="units")
    fig = swimlane.draw(tl)
    assert texts(fig, "util") == ["100.0%", "25.0%", "0.0%"]
    assert "utilisation 41.7% (busy 5 of 12 rank-units)" in lanes(fig).get_title()


def test_comm_lanes_off_hides_messages():
    fig = swimlane.draw(gpipe(), comm_lanes=False)
    assert boxes(fig) == {"F": 16, "B": 16}
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["F forward", "B backward", "idle (bubble)"]


def test_unknown_kinds_get_a_stable_colour_and_overrides_apply():
    assert swimlane.color_of("optimizer") == swimlane.color_of("optimizer")
    assert swimlane.color_of("optimizer") in swimlane.PALETTE
    tl = Timeline([Event(0, "optimizer", "compute", 0, 1, "opt"), Event(0, "F", "compute", 1, 2, "F0")], unit="units")
    a, b = swimlane.draw(tl), swimlane.draw(tl, colors={"F": "black"})

    def face(fig, kind):
        return tuple(next(c for c in lanes(fig).collections if c.get_gid() == f"box:{kind}").get_facecolor()[0])

    assert face(a, "optimizer") == face(b, "optimizer")
    assert face(b, "F") == (0, 0, 0, 1)
    with pytest.raises(ValueError, match="not a matplotlib colour"):
        swimlane.draw(tl, colors={"F": "notacolour"})


# ----------------------------------------------------------------------------------
# Labels


def test_labels_shown_where_they_fit():
    fig = swimlane.draw(gpipe())               # 21 units over an 8-inch figure: ~20 pt per unit
    assert sorted(texts(fig, "label")) == sorted([f"F{i}" for i in range(4)] * 4 + [f"B{i}" for i in range(4)] * 4)
    assert texts(swimlane.draw(gpipe(), labels=False), "label") == []


def test_labels_hidden_when_too_narrow_shown_when_forced_or_zoomed():
    narrow = [Event(0, "F", "compute", i, i + 1, f"F{i}") for i in range(400)]
    tl = Timeline(narrow + [Event(0, "B", "compute", 400, 600, "B-wide")], unit="units")
    fig = swimlane.draw(tl, figsize=(6, 2))    # 600 units over < 6 in: a 1-unit box is < 1 pt
    assert texts(fig, "label") == ["B-wide"]
    assert len(texts(swimlane.draw(tl, figsize=(6, 2), labels=True), "label")) == 401
    zoomed = swimlane.draw(tl, figsize=(6, 2), time_range=(10, 15))
    assert sorted(texts(zoomed, "label")) == ["F10", "F11", "F12", "F13", "F14"]
    with pytest.raises(ValueError, match="labels must be"):
        swimlane.draw(tl, labels="yes")


# ----------------------------------------------------------------------------------
# Arrows, memory, zoom


def test_arrows_one_per_message_from_send_end_to_recv_end():
    tl = gpipe()
    pairs = tl.messages()
    assert len(pairs) == 24
    for comm_lanes in (True, False):
        q = arrows(swimlane.draw(tl, arrows=True, comm_lanes=comm_lanes))
        assert len(q) == 1 and q[0].N == len(pairs)
        assert sorted(q[0].X) == pytest.approx(sorted(s.end for s, _ in pairs))
        assert sorted(q[0].X + q[0].U) == pytest.approx(sorted(r.end for _, r in pairs))
        # from the sender's row to the receiver's: down for forward sends, up for backward
        assert sorted(round(v) for v in q[0].V) == sorted(r.rank - s.rank for s, r in pairs)
    assert arrows(swimlane.draw(tl)) == []


def memory_panels(fig):
    return [a for a in fig.axes if a.get_label().startswith("memory:")]


def test_memory_one_panel_per_rank_on_one_scale():
    tl = gpipe()
    fig = swimlane.draw(tl, memory=True)
    panels = memory_panels(fig)
    assert [a.get_label() for a in panels] == [f"memory:{r}" for r in range(4)]
    for a in panels:
        assert len(a.get_lines()) == 1                                   # one rank per panel
        assert max(a.get_lines()[0].get_ydata()) == 4                    # GPipe holds all m=4
        assert a.get_shared_x_axes().joined(a, lanes(fig))
    assert len({a.get_ylim() for a in panels}) == 1                      # the same scale: heights compare
    assert "held over time (micro-batches)" in panels[0].get_title(loc="left")
    assert len(swimlane.draw(tl).axes) == 1

    # rank r holds r + 1 micro-batches at its peak: each panel shows its own rank's
    stairs = Timeline([Event(r, "F", "compute", 0, 3, "F0") for r in range(3)] +
                      [Event(r, "memory", "memory", 1, 1, value=r + 1) for r in range(3)] +
                      [Event(r, "memory", "memory", 2, 2, value=0) for r in range(3)], memory_unit="micro-batches")
    fig = swimlane.draw(stairs, memory=True)
    assert [max(a.get_lines()[0].get_ydata()) for a in memory_panels(fig)] == [1, 2, 3]
    assert texts(fig, "peak") == ["peak 1", "peak 2", "peak 3"]

    in_bytes = Timeline([Event(0, "F", "compute", 0, 1, "F0"),
                         Event(0, "memory", "memory", 0.5, 0.5, value=3_000_000)])
    (mem,) = memory_panels(swimlane.draw(in_bytes, memory=True))
    assert "(MB)" in mem.get_title(loc="left") and mem.get_ylabel() == "rank 0"
    assert max(mem.get_lines()[0].get_ydata()) == pytest.approx(3.0)

    with pytest.raises(ValueError, match="one panel per rank"):
        swimlane.draw(tl, memory=True, ax=Figure().subplots())
    fig = Figure()
    axes = fig.subplots(5, 1)
    assert swimlane.draw(tl, memory=True, ax=(axes[0], axes[1:])) is fig
    assert len(memory_panels(fig)) == 4


def test_memory_changes_at_one_instant_draw_no_spike():
    # at t=1 one micro-batch is released and another held: the curve stays at 1, no dip to 0
    tl = Timeline([Event(0, "F", "compute", 0, 2, "F0"), Event(0, "memory", "memory", 0, 0, value=1),
                   Event(0, "memory", "memory", 1, 1, value=0), Event(0, "memory", "memory", 1, 1, value=1)])
    (mem,) = memory_panels(swimlane.draw(tl, memory=True))
    assert min(mem.get_lines()[0].get_ydata()) == 1


def test_time_range_zooms_and_draws_only_what_is_in_it():
    fig = swimlane.draw(gpipe(), time_range=(0, 4))
    assert lanes(fig).get_xlim() == (0, 4)
    # forwards F(s, i) start at i + s: those starting before 4 have i + s <= 3
    assert boxes(fig)["F"] == sum(1 for s in range(4) for i in range(4) if i + s <= 3)
    assert "B" not in boxes(fig)
    assert "showing 0 to 4 units" in lanes(fig).get_title()
    assert texts(fig, "util") == ["57.1%"] * 4        # utilisation stays that of the whole run


@pytest.mark.parametrize("bad", [(5, 2), (3, 3), (0, math.nan), ("a", "b"), (1,)])
def test_bad_time_range_is_a_clear_error(bad):
    with pytest.raises(ValueError, match="time_range"):
        swimlane.draw(gpipe(), time_range=bad)


def test_non_timeline_input_says_what_to_pass():
    with pytest.raises(TypeError, match="pplab.trace.Timeline"):
        swimlane.draw([Event(0, "F", "compute", 0, 1)])

    class FakeResult(list):
        timeline = None

    with pytest.raises(TypeError, match="results.timeline"):
        swimlane.draw(FakeResult())


def test_empty_timeline_draws_a_labelled_empty_figure():
    fig = swimlane.draw(Timeline([]), arrows=True, memory=True)
    assert boxes(fig) == {}
    assert "(no events)" in lanes(fig).get_title()
    assert texts(fig, "util") == ["0.0%"]
    fig.savefig(__import__("io").BytesIO(), format="png")


def test_draws_into_given_axes():
    fig = Figure()
    ax = fig.subplots()
    assert swimlane.draw(naive(), ax=ax) is fig
    assert boxes(fig) == {"F": 4, "B": 4}
    with pytest.raises(ValueError, match="figsize"):
        swimlane.draw(naive(), ax=ax, figsize=(4, 4))


# ----------------------------------------------------------------------------------
# A measured run: the same code draws what real processes did


def _two_ranks():
    r = comm.rank()
    x = torch.randn(64, 64)
    with trace.span("F", microbatch=0):
        y = x @ x
    trace.hold(y)
    got = torch.empty_like(y)
    comm.exchange(y, 1 - r, got, 1 - r)
    with trace.span("B", microbatch=0):
        (got @ x).sum()
    trace.release(y)
    return r


def test_measured_run_from_launch():
    results = pplab.launch(_two_ranks, world_size=2, backend="gloo", timeout=60)
    tl = results.timeline
    fig = swimlane.draw(tl, arrows=True, memory=True)
    assert boxes(fig) == {"F": 2, "B": 2, "send": 2, "recv": 2}
    assert texts(fig, "util") == [f"{tl.utilization(r):.1%}" for r in range(2)]
    assert lanes(fig).get_title().startswith("Measured timeline: 2 ranks")
    assert f"utilisation {tl.utilization():.1%}" in lanes(fig).get_title()
    assert "rank-ms)" in lanes(fig).get_title()           # a run under 1 s is shown in ms
    assert arrows(fig)[0].N == len(tl.messages()) == 2
    mem = memory_panels(fig)
    assert [max(a.get_lines()[0].get_ydata()) for a in mem] == pytest.approx([64 * 64 * 4 / 1e3] * 2)  # 16.384 kB
    assert "(kB)" in mem[0].get_title(loc="left") and mem[-1].get_xlabel() == "time (ms)"
    with pytest.raises(TypeError, match="results.timeline"):
        swimlane.draw(results)


# ----------------------------------------------------------------------------------
# The widget


def test_explore_a_timeline_rerenders_on_each_control():
    box = swimlane.explore(gpipe())
    first = box.figure
    assert boxes(first) == {"F": 16, "B": 16, "send": 24, "recv": 24} and arrows(first) == []

    box.controls["arrows"].value = True
    assert box.figure is not first and arrows(box.figure)[0].N == 24

    box.controls["comm_lanes"].value = False
    assert boxes(box.figure) == {"F": 16, "B": 16}

    box.controls["memory"].value = True
    assert len(memory_panels(box.figure)) == 4

    assert (box.controls["time"].min, box.controls["time"].max) == (0, 21)
    box.controls["time"].value = (0, 4)
    assert lanes(box.figure).get_xlim() == (0, 4)
    with pytest.raises(TypeError, match="takes none"):
        swimlane.explore(gpipe(), m=(1, 4))


def test_explore_a_schedule_function_rebuilds_on_parameter_change():
    calls = []

    def make(p=4, m=4, kind="gpipe"):
        calls.append((p, m, kind))
        if m == 3:
            raise ValueError("m=3 is not allowed here")
        return gpipe(p, m) if kind == "gpipe" else naive(p)

    box = swimlane.explore(make, p=(2, 6), m=(1, 8), kind=["gpipe", "naive"])
    assert calls == [(4, 4, "gpipe")]                  # defaults come from the function
    assert boxes(box.figure)["F"] == 16

    box.controls["m"].value = 8
    assert calls[-1] == (4, 8, "gpipe")
    assert boxes(box.figure)["F"] == 32
    assert box.controls["time"].max == (8 + 4 - 1) * 3          # the slider follows the new makespan
    assert f"utilisation {32 * 3 / (4 * 33):.1%}" in lanes(box.figure).get_title()

    box.controls["kind"].value = "naive"
    assert texts(box.figure, "util") == ["25.0%"] * 4

    n = len(calls)
    box.controls["arrows"].value = True                # a view change does not rebuild the schedule
    assert len(calls) == n

    box.controls["m"].value = 3                        # an error is shown, not raised in a callback
    assert box.figure is None and "m=3" in str(box.error)

    with pytest.raises(TypeError, match="cannot take the controls"):
        swimlane.explore(make, stages=(1, 4))
    with pytest.raises(TypeError, match="must return a pplab.trace.Timeline"):
        swimlane.explore(lambda n=1: [n], n=(1, 3))
    with pytest.raises(TypeError, match="Timeline"):
        swimlane.explore(42)
