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
    # the known kinds: each its own colour, none the lane background
    known = list(swimlane.KIND_COLORS.values())
    assert len(set(known)) == len(known) and swimlane.IDLE not in known
    # an unknown kind: PALETTE[crc32(name) % 12], worked out once by hand, so a salted
    # per-process hash() (a different colour in every kernel) would not pass
    assert swimlane.color_of("optimizer") == "#88CCEE"      # crc32 % 12 == 4
    assert swimlane.color_of("loss") == "#661100"           # 5
    assert swimlane.color_of("update") == "#E69F00"         # 8
    tl = Timeline([Event(0, "optimizer", "compute", 0, 1, "opt"), Event(0, "F", "compute", 1, 2, "F0")], unit="units")
    a, b = swimlane.draw(tl), swimlane.draw(tl, colors={"F": "black"})

    def face(fig, kind):
        return tuple(next(c for c in lanes(fig).collections if c.get_gid() == f"box:{kind}").get_facecolor()[0])

    # drawn in those colours, in both figures: an override of F leaves the others alone
    assert face(a, "optimizer") == face(b, "optimizer") == matplotlib.colors.to_rgba("#88CCEE")
    assert face(a, "F") == matplotlib.colors.to_rgba("#0072B2") and face(b, "F") == (0, 0, 0, 1)
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


def test_nodes_mark_the_boundary_and_the_messages_between_nodes():
    # gpipe on 4 ranks as 2 nodes of 2: by hand, the forward sends 1 → 2 (m = 4 of them) and
    # the backward sends 2 → 1 (4 more) cross the boundary; the other 16 stay inside a node
    tl = gpipe()
    fig = swimlane.draw(tl, arrows=True, nodes=2)
    between = [c for c in lanes(fig).collections if c.get_gid() == "arrows:between-nodes"]
    assert len(between) == 1 and between[0].N == 8
    # each arrow leaves at its send's end: F(1, i) ends at i + 2, B(2, j-th) at 7 + 2(1 + j) + 2; a send takes 0.2
    assert sorted(between[0].X) == pytest.approx([i + 2.2 for i in range(4)] + [7 + 2 * (1 + j) + 2.2 for j in range(4)])
    assert sorted(round(v) for v in between[0].V) == [-1] * 4 + [1] * 4
    assert arrows(fig)[0].N == 16                                   # the rest, in the usual colour
    lines = [ln for ln in lanes(fig).get_lines() if ln.get_gid() == "node-boundary"]
    assert [ln.get_ydata()[0] for ln in lines] == pytest.approx([2 - 0.075])   # between rank 1 and rank 2 only
    assert [t.get_text() for t in lanes(fig).get_yticklabels()] == ["node 0  rank 0", "node 0  rank 1",
                                                                     "node 1  rank 2", "node 1  rank 3"]
    assert "message between nodes" in [t.get_text() for t in fig.legends[0].get_texts()]
    # 3 ranks a node on 4 ranks: one boundary, under rank 2; the 2 → 3 and 3 → 2 messages cross
    fig3 = swimlane.draw(tl, arrows=True, nodes=3)
    assert [c.N for c in lanes(fig3).collections if c.get_gid() == "arrows:between-nodes"] == [8]
    assert [ln.get_ydata()[0] for ln in lanes(fig3).get_lines() if ln.get_gid() == "node-boundary"] == pytest.approx([2.925])
    assert not [c for c in lanes(swimlane.draw(tl, arrows=True)).collections if c.get_gid() == "arrows:between-nodes"]


@pytest.mark.parametrize("bad", [0, -2, 1.5, True, "2"])
def test_bad_nodes_is_a_clear_error(bad):
    with pytest.raises(ValueError, match="ranks per node"):
        swimlane.draw(gpipe(), nodes=bad)


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


# ----------------------------------------------------------------------------------
# What a reader sees: checked on the rendered figure (text extents from the renderer)


def _box_extents(fig):
    """Every box drawn, as a pixel rectangle (x0, y0, x1, y1)."""
    out = []
    for ax in fig.axes:
        for c in ax.collections:
            if (c.get_gid() or "").startswith("box:"):
                for path in c.get_paths():
                    (x0, y0), (x1, y1) = ax.transData.transform(path.vertices[[0, 2]])
                    out.append((min(x0, x1), min(y0, y1), max(x0, x1), max(y0, y1)))
    return out


def _label_extents(fig):
    fig.canvas.draw()
    return [(t.get_text(), t.get_window_extent()) for ax in fig.axes for t in ax.texts if t.get_gid() == "label"]


def assert_readable(fig):
    """No two labels overlap, and each lies inside the box it names."""
    labels, boxes_px = _label_extents(fig), _box_extents(fig)
    assert labels, "expected some labels"
    for i, (a, bb) in enumerate(labels):
        for b, other in labels[i + 1:]:
            assert not bb.overlaps(other), f"labels {a!r} and {b!r} overlap"
        cx, cy = (bb.x0 + bb.x1) / 2, (bb.y0 + bb.y1) / 2
        home = [r for r in boxes_px if r[0] <= cx <= r[2] and r[1] <= cy <= r[3]]
        assert home, f"label {a!r} is not on a box"
        assert any(bb.x0 >= r[0] - 0.5 and bb.x1 <= r[2] + 0.5 and bb.y0 >= r[1] - 1 and bb.y1 <= r[3] + 1
                   for r in home), f"label {a!r} spills out of its box"


def zb_v_timeline(p=4, m=8):
    from pplab.pipeline import make_schedule, simulate
    return simulate(make_schedule("zb-v", p, m), t_f=1, t_b=2, t_w=1).timeline()


def interleaved_timeline(p=4, m=8):
    from pplab.pipeline import make_schedule, simulate
    return simulate(make_schedule("interleaved-1f1b", p, m, chunks=2), t_f=1, t_b=2).timeline()


def ring_like(p=4, steps=6, size=1000):
    """Comm only: in step k every rank sends `size` bytes right and receives from the left."""
    events = []
    for k in range(steps):
        for r in range(p):
            dst, src = (r + 1) % p, (r - 1) % p
            events.append(Event(r, "send", "comm", k, k + 0.9, f"→{dst}", bytes_sent=size, peer=dst, seq=k))
            events.append(Event(r, "recv", "comm", k, k + 0.9, f"←{src}", bytes_recv=size, peer=src, seq=k))
    return Timeline(events, world_size=p, unit="units")


def overlapping_all_reduces():
    """DDP with small buckets: all-reduces launched back to back overlap each other."""
    events = [Event(0, "B", "compute", 0, 10, "B0"), Event(1, "B", "compute", 0, 10, "B0")]
    for r in range(2):
        events += [Event(r, "all_reduce", "comm", 1 + 0.05 * k, 4 + 0.05 * k, "AR") for k in range(8)]
    return Timeline(events, world_size=2, unit="units")


@pytest.mark.parametrize("make", [gpipe, zb_v_timeline, interleaved_timeline, ring_like, overlapping_all_reduces])
def test_labels_never_overlap_and_stay_inside_their_boxes(make):
    assert_readable(swimlane.draw(make(), arrows=True))
    assert_readable(swimlane.draw(make(), memory=True, figsize=(7, 6)))


def test_narrow_boxes_get_shorter_labels_and_zoom_gives_the_full_ones():
    tl = zb_v_timeline()
    wide = set(texts(swimlane.draw(tl, time_range=(0, 4)), "label"))
    assert "F0.1" in wide                          # room: the whole label, chunk included
    narrow = texts(swimlane.draw(tl, figsize=(8, 3)), "label")
    assert narrow and not any("." in t for t in narrow)          # no room: the chunk goes first
    assert texts(swimlane.draw(tl, figsize=(3, 3)), "label") == [] or \
        all(t.isdigit() for t in texts(swimlane.draw(tl, figsize=(3, 3)), "label"))
    overlapping = texts(swimlane.draw(overlapping_all_reduces()), "label").count("AR")
    assert 2 <= overlapping < 8 * 2               # boxes on top of each other: one label per rank, not a smear


def test_chunks_are_hatched_the_lanes_name_their_stages_and_the_v_shows():
    p, m = 4, 4
    tl = zb_v_timeline(p, m)
    fig = swimlane.draw(tl)
    ax = lanes(fig)
    hatched = sum(len(c.get_paths()) for c in ax.collections if c.get_gid() == "chunk:1")
    assert hatched == sum(1 for e in tl.events if e.category == "compute" and e.meta["chunk"] == 1)
    # ZB-V's placement: chunk 0 of rank r is stage r, chunk 1 is stage 2p-1-r
    assert [t.get_text() for t in ax.get_yticklabels()] == [f"rank {r}\nstages {r}, {2 * p - 1 - r}" for r in range(p)]
    (line,) = [ln for ln in ax.get_lines() if ln.get_gid() == "path"]
    ys = line.get_ydata()
    down_and_up = [s if s < p else 2 * p - 1 - s for s in range(2 * p)]       # 0 1 2 3 3 2 1 0: the V
    assert [math.floor(y) for y in ys] == down_and_up
    assert list(line.get_xdata()) == sorted(line.get_xdata())                 # in time order too
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert "chunk 1" in legend and "micro-batch 0, stage by stage" in legend
    assert not [ln for ln in lanes(swimlane.draw(gpipe())).get_lines() if ln.get_gid() == "path"]


# Machado, Oliveira & Fernandes (2009), severity 1: linear RGB -> what a dichromat sees.
_CVD = {"normal": [[1, 0, 0], [0, 1, 0], [0, 0, 1]],
        "protanopia": [[0.152286, 1.052583, -0.204868], [0.114503, 0.786281, 0.099216], [-0.003882, -0.048116, 1.051998]],
        "deuteranopia": [[0.367322, 0.860646, -0.227968], [0.280085, 0.672501, 0.047413], [-0.011820, 0.042940, 0.968881]],
        "tritanopia": [[1.255528, -0.076749, -0.178779], [-0.078411, 0.930809, 0.147602], [0.004733, 0.691367, 0.303900]]}


def _lab(color, vision):
    """CIELAB (D65) of `color` as seen with `vision`."""
    import numpy as np
    srgb = np.array(matplotlib.colors.to_rgb(color))
    linear = np.where(srgb <= 0.04045, srgb / 12.92, ((srgb + 0.055) / 1.055) ** 2.4)
    linear = np.clip(np.array(_CVD[vision]) @ linear, 0, 1)
    xyz = np.array([[0.4124, 0.3576, 0.1805], [0.2126, 0.7152, 0.0722], [0.0193, 0.1192, 0.9505]]) @ linear
    f = [v ** (1 / 3) if v > 0.008856 else 7.787 * v + 16 / 116 for v in xyz / [0.95047, 1.0, 1.08883]]
    return np.array([116 * f[1] - 16, 500 * (f[0] - f[1]), 200 * (f[1] - f[2])])


@pytest.mark.parametrize("vision", list(_CVD))
def test_f_b_i_w_colours_stay_apart_for_every_colour_vision(vision):
    import itertools
    import numpy as np
    for a, b in itertools.combinations("FBIW", 2):
        delta = np.linalg.norm(_lab(swimlane.KIND_COLORS[a], vision) - _lab(swimlane.KIND_COLORS[b], vision))
        assert delta > 20, f"{a} and {b} are only ΔE {delta:.0f} apart with {vision}"


def test_a_run_that_only_communicates_gets_comm_lanes_alone_and_numbered_steps():
    p = 4
    tl = ring_like(p, steps=6, size=1000)
    fig = swimlane.draw(tl, arrows=True)
    ax = lanes(fig)
    assert sum(c.get_gid() == "idle" for c in ax.collections) == p           # one lane per rank, no compute lane
    assert texts(fig, "util") == [] and "utilisation" not in ax.get_title()
    assert texts(fig, "sent") == ["6 kB"] * p                                 # 6 steps x 1000 B
    assert "communication only: 24 sends" in ax.get_title()
    assert [t.get_text() for t in ax.get_yticklabels(minor=True)] == []        # no "comm" sub-lanes
    sends = {}
    for t in ax.texts:
        if t.get_gid() == "label" and "→" in t.get_text() or (t.get_gid() == "label" and t.get_text().isdigit()):
            row = math.floor(t.get_position()[1])
            sends.setdefault(row, []).append((t.get_position()[0], t.get_text()))
    for r in range(p):
        numbers = [int(text.replace("step ", "").split()[0]) for _, text in sorted(sends[r])]
        assert numbers == list(range(1, 7)), f"rank {r}'s steps are numbered {numbers}"
    # a timeline with compute keeps its compute lanes and utilisation
    assert texts(swimlane.draw(gpipe()), "util") == ["57.1%"] * 4


def test_stacked_timelines_share_one_time_axis_and_one_memory_scale():
    from pplab.pipeline import make_schedule, simulate
    g = simulate(make_schedule("gpipe", 4, 8), t_f=1, t_b=2).timeline()
    o = simulate(make_schedule("1f1b", 4, 8), t_f=1, t_b=2).timeline()
    fig = swimlane.draw([g, o], titles=["GPipe", "1F1B"], title="same work, less memory", memory=True)
    top, bottom = [a for a in fig.axes if a.get_label() == "swimlanes"]
    assert top.get_shared_x_axes().joined(top, bottom) and top.get_xlim() == bottom.get_xlim() == (0, 33)
    assert top.get_title().startswith("GPipe\n") and bottom.get_title().startswith("1F1B\n")
    assert fig.get_suptitle() == "same work, less memory"
    panels = memory_panels(fig)
    assert len(panels) == 8 and len({a.get_ylim() for a in panels}) == 1      # one scale for both
    peaks = [max(a.get_lines()[0].get_ydata()) for a in panels]
    assert peaks == [8, 8, 8, 8, 4, 3, 2, 1]                                  # GPipe holds m, 1F1B p - r
    assert_readable(fig)
    with pytest.raises(ValueError, match="one per timeline"):
        swimlane.draw([g, o], titles=["GPipe"])
    with pytest.raises(ValueError, match="figure of its own"):
        swimlane.draw([g, o], ax=Figure().subplots())
    with pytest.raises(ValueError, match="share a time axis"):
        swimlane.draw([g, Timeline([Event(0, "F", "compute", 0, 1)])])
    with pytest.raises(ValueError, match="titles= goes with a list"):
        swimlane.draw(g, titles=["GPipe"])


# ----------------------------------------------------------------------------------
# The pipeline explorer


def _visible(widget):
    return widget.layout.display != "none"


def _tree(widget):
    yield widget
    for child in getattr(widget, "children", ()):
        yield from _tree(child)


def test_explorer_lays_controls_out_in_rows_and_shows_only_those_that_apply():
    import ipywidgets as w
    from pplab.pipeline import explore
    box = explore()
    grid = box.children[0]
    assert isinstance(grid, w.GridBox) and "minmax" in grid.layout.grid_template_columns   # wraps into rows
    c = box.controls
    assert all(c[n] in grid.children for n in ("schedule", "p", "m", "v", "t_f", "t_b", "t_w", "memory"))
    assert c["time"] not in grid.children                                   # the zoom slider: a row of its own
    shown = lambda: {n for n, wd in c.items() if _visible(wd)}             # noqa: E731
    # a simulation has no messages: no "comm lanes" or "arrows" boxes that would do nothing
    assert shown() == {"schedule", "p", "m", "t_f", "t_b", "memory", "time"}
    c["schedule"].value = "interleaved-1f1b"
    assert shown() == {"schedule", "p", "m", "v", "t_f", "t_b", "memory", "time"}
    c["schedule"].value = "zb-v"                                           # always 2 chunks: v does nothing
    assert shown() == {"schedule", "p", "m", "t_f", "t_b", "t_w", "memory", "time"}
    c["schedule"].value = "zb-h1"
    assert "t_w" in shown() and "v" not in shown()
    # a measured run with messages gets them
    ring = swimlane.explore(gpipe())
    assert _visible(ring.controls["comm_lanes"]) and _visible(ring.controls["arrows"])


def test_explorer_titles_state_the_simulated_bubble_and_the_formula_that_applies():
    from pplab.pipeline import SCHEDULES, pipeline_timeline
    p, m, t_f, t_b = 4, 8, 1.0, 2.0
    for name in SCHEDULES:
        tl = pipeline_timeline(name, p, m, 2, t_f, t_b)
        useful = m * (t_f + t_b)                                   # one rank's forwards and backwards
        idle = max(e.end for e in tl.events if e.category == "compute") - useful
        assert f"bubble {idle / useful:.1%} of useful time" in tl.title, name
        if name in ("zb-h1", "zb-v"):
            assert "(p-1)/(v·m)" not in tl.title
    # ZB-H1: makespan m(F+I+W) + (p-1)(F+I-W), I = t_b - t_W (the zero-bubble paper's, for W <= I)
    zb = pipeline_timeline("zb-h1", 4, 8, t_f=1, t_b=2, t_w=0.5)
    assert f"(p-1)(t_f+t_I-t_W)/(m·(t_f+t_b)) = {3 * (1 + 1.5 - 0.5) / (8 * 3):.1%}" in zb.title
    assert "does not hold" not in zb.title
    assert "does not hold" in pipeline_timeline("zb-h1", 4, 8, t_f=1, t_b=2, t_w=1.5).title     # W > I
    zbv = pipeline_timeline("zb-v", 4, 8).title
    assert "no closed form" in zbv and f"1F1B would idle (p-1)/m = {3 / 8:.1%}" in zbv
    assert "(p-1)/(v·m) = 18.8%" in pipeline_timeline("interleaved-1f1b", 4, 8, 2).title     # 3/16
    assert "p-1 = 300.0%" in pipeline_timeline("naive", 4, 8).title
    assert "t_I=1.5, t_W=0.5" in pipeline_timeline("zb-v", 4, 8, t_b=2, t_w=0.5).title


def test_explorer_redraws_an_image_when_schedule_or_m_change():
    import ipywidgets as w
    from pplab.pipeline import explore
    box = explore()
    assert not any(isinstance(x, w.Output) for x in _tree(box))      # see the next test for why
    first = box.image.value
    assert first.startswith("<img") and 'alt="1f1b: p=4, m=8' in first and box.png[:8] == b"\x89PNG\r\n\x1a\n"
    box.controls["m"].value = 4
    assert box.image.value != first and box.timeline.title.startswith("1f1b: p=4, m=4")
    second = box.image.value
    box.controls["schedule"].value = "gpipe"
    assert box.image.value != second and box.timeline.title.startswith("gpipe: p=4, m=4")
    box.controls["schedule"].value = "interleaved-1f1b"
    third = box.image.value
    box.controls["m"].value = 6                                      # not a multiple of p: fine, as in torch
    assert box.image.value != third and box.timeline.title.startswith("interleaved-1f1b: p=4, m=6")


def _shell_messages_sent(source, timeout):
    """Run `source` as a notebook cell under nbclient (what nbconvert --execute uses) and
    return the message types the client sent on the kernel's shell channel meanwhile, then
    "hung" if the client was still awaiting the cell's reply after `timeout` seconds."""
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellTimeoutError

    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(source)])
    client = NotebookClient(nb, timeout=timeout, kernel_name="python3")
    sent = []
    with client.setup_kernel():
        send = client.kc.shell_channel.send
        client.kc.shell_channel.send = lambda msg: (sent.append(msg["header"]["msg_type"]), send(msg))[1]
        try:
            client.execute_cell(nb.cells[0], 0)
        except CellTimeoutError:
            sent.append("hung")
    return sent


def test_explorer_under_nbconvert_sends_nothing_back_while_the_cell_runs():
    """Why 04_pipeline once hung under nbconvert at the explorer cell. nbclient mimics an
    Output widget: every output captured by one is answered with a comm_msg on the shell
    channel, sent while the client is awaiting that channel's execute_reply. When the
    reply has just arrived (likelier on a loaded machine), the send drains the socket's
    edge-triggered wake-up and the wait never ends. The explorer now shows its figure as
    an Image widget, so the client has nothing to send."""
    assert _shell_messages_sent("from pplab.pipeline import explore\nexplore(m=4)", timeout=120) == ["execute_request"]
    # the mechanism, with an Output widget: the client does send while awaiting the reply, and
    # may then hang there (on a loaded machine, as under pytest -n 3). The send comes as soon as
    # the figure is captured, so a short wait shows it; whether it then hangs does not matter
    output = ("import ipywidgets as w\nfrom IPython.display import display\nout = w.Output()\n"
              "with out:\n    display('a figure')\nout")
    assert "comm_msg" in _shell_messages_sent(output, timeout=10)


# ----------------------------------------------------------------------------------
# Where each box sits, checked against hand positions (session 9's mutation review)


def _spans(fig, kind):
    """(rank, top within the row, height, start, end) of every box of `kind` drawn."""
    out = []
    for c in lanes(fig).collections:
        if c.get_gid() == f"box:{kind}":
            for path in c.get_paths():
                (x0, y0), (x1, y1) = path.vertices.min(0), path.vertices.max(0)
                out.append((math.floor(y0), round(y0 % 1, 3), round(y1 - y0, 3), x0, x1))
    return sorted(out)


def test_sends_in_the_upper_half_of_the_comm_lane_receives_in_the_lower():
    fig = swimlane.draw(gpipe())
    # "both": the comm strip is 0.60 .. 0.90 of a rank's row; sends take its upper half
    sends, recvs = _spans(fig, "send"), _spans(fig, "recv")
    assert {(top, h) for _, top, h, _, _ in sends} == {(0.6, 0.15)}
    assert {(top, h) for _, top, h, _, _ in recvs} == {(0.75, 0.15)}
    # rank s sends its forward at (i + s) + 1 for i < 4: rank 0's sends start at 1, 2, 3, 4
    assert [a for r, _, _, a, _ in sends if r == 0] == [1.0, 2.0, 3.0, 4.0]


def test_zoom_keeps_a_box_that_started_before_the_range():
    fig = swimlane.draw(gpipe(), time_range=(2.5, 6), comm_lanes=False)
    # F(s, i) runs from i + s to i + s + 1: on screen when i + s + 1 > 2.5 and i + s < 6
    assert len(_spans(fig, "F")) == sum(1 for s in range(4) for i in range(4) if 2 <= i + s <= 5) == 12
    # the title's utilisation stays the whole run's: 16 F of 1 and 16 B of 2 over 4 ranks x 21
    assert "utilisation 57.1% (busy 48 of 84 rank-units), showing 2.5 to 6 units" in lanes(fig).get_title()


def test_a_one_sided_run_shows_what_each_rank_sent():
    # a gather by hand: ranks 1, 2, 3 each send 1000 B to rank 0, which sends nothing
    ev = [e for r in (1, 2, 3) for e in (
        Event(r, "send", "comm", r - 1, r - 0.1, "→0", bytes_sent=1000, peer=0, seq=0),
        Event(0, "recv", "comm", r - 1, r - 0.1, f"←{r}", bytes_recv=1000, peer=r, seq=0))]
    fig = swimlane.draw(Timeline(ev, world_size=4, unit="units"))
    assert texts(fig, "sent") == ["0 B", "1 kB", "1 kB", "1 kB"]
    assert "communication only: 3 sends, 3 kB in all" in lanes(fig).get_title()


def test_every_memory_panel_fits_its_rank_under_the_shared_scale():
    # the largest peak is the last rank's: the shared scale must include it
    stairs = Timeline([Event(r, "F", "compute", 0, 3, "F0") for r in range(3)] +
                      [Event(r, "memory", "memory", 1, 1, value=r + 1) for r in range(3)], memory_unit="micro-batches")
    panels = memory_panels(swimlane.draw(stairs, memory=True))
    assert [a.get_ylim() for a in panels] == [(0, 3 * 1.25)] * 3


def test_explore_says_zoomed_only_once_the_time_slider_moved():
    box = swimlane.explore(gpipe())
    assert "showing" not in lanes(box.figure).get_title()
    box.controls["time"].value = (0, 4)
    assert "showing 0 to 4 units" in lanes(box.figure).get_title()
