"""pplab.swimlane.to_perfetto: a real traced launch, written as a Chrome trace and read back."""
import json

import pytest
import torch
import torch.distributed as dist

import pplab
from pplab import comm, trace
from pplab.swimlane import to_perfetto
from pplab.trace import Event, Timeline


def step():
    r = dist.get_rank()
    with trace.span("F", microbatch=r):
        x = torch.full((10 + 5 * r,), float(r))          # rank 0: 40 B, rank 1: 60 B
    trace.hold(x)
    if r == 0:
        comm.send(x, dst=1)
    else:
        comm.recv(torch.empty(10), src=0)
    trace.release(x)
    comm.all_reduce(torch.ones(3, dtype=torch.float64))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    timeline = pplab.launch(step, world_size=2).timeline
    path = to_perfetto(timeline, tmp_path_factory.mktemp("trace") / "run.json")
    return timeline, json.loads(path.read_text())


def test_one_process_per_rank_with_compute_and_comm_threads(run):
    _, doc = run
    names = {(e["pid"], e["tid"], e["name"], e["args"]["name"]) for e in doc["traceEvents"] if e["ph"] == "M"
             and e["name"] in ("process_name", "thread_name")}
    # thread ids of their own, never 0 (Perfetto's idle thread) and never shared by two ranks
    assert names == {(r, 1000 * (r + 1), "process_name", f"rank {r}") for r in (0, 1)} | \
        {(r, 1000 * (r + 1) + t, "thread_name", n) for r in (0, 1) for t, n in ((0, "compute"), (100, "comm"))}


def test_every_event_is_there_in_microseconds_with_its_bytes(run):
    timeline, doc = run
    boxes = [e for e in doc["traceEvents"] if e["ph"] == "X" and e["args"]["kind"] != "in_flight"]
    assert len(boxes) == len([e for e in timeline if e.category != "memory"])
    by_rank = {r: sorted((e["tid"], e["name"], e["args"]["kind"]) for e in boxes if e["pid"] == r) for r in (0, 1)}
    assert by_rank[0] == [(1000, "F0", "F"), (1100, "AR", "all_reduce"), (1100, "→1", "send")]
    assert by_rank[1][0] == (2000, "F1", "F") and [(t, k) for t, _, k in by_rank[1][1:]] == \
        [(2100, "all_reduce"), (2100, "recv")]
    for e in timeline:
        if e.category == "memory":
            continue
        (box,) = [b for b in boxes if b["pid"] == e.rank and b["args"]["kind"] == e.kind]
        # whole nanoseconds (start and end each rounded): 0.015 µs for a 15.003 ns box is right
        assert box["ts"] == pytest.approx(e.start * 1e6, abs=0.5e-3) and \
            box["dur"] == pytest.approx(e.duration * 1e6, abs=1.0001e-3)
        assert (box["args"]["bytes_sent"], box["args"]["bytes_recv"]) == (e.bytes_sent, e.bytes_recv)
    send = next(b for b in boxes if b["args"]["kind"] == "send")
    recv = next(b for b in boxes if b["args"]["kind"] == "recv")
    assert (send["args"]["bytes_sent"], send["args"]["peer"], recv["args"]["bytes_recv"], recv["args"]["peer"]) == \
        (40, 1, 40, 0)
    for ar in (b for b in boxes if b["args"]["kind"] == "all_reduce"):
        assert ar["args"]["payload"] == 24 and ar["args"]["group"] == [0, 1]


def test_memory_counters_and_the_message_arrow(run):
    _, doc = run
    held = {r: [e["args"]["bytes"] for e in doc["traceEvents"] if e["ph"] == "C" and e["pid"] == r] for r in (0, 1)}
    assert held == {0: [40, 0], 1: [60, 0]}
    flows = sorted((e["ph"], e["pid"]) for e in doc["traceEvents"] if e["ph"] in "sf")
    assert flows == [("f", 1), ("s", 0)]


def test_a_simulated_timeline_needs_its_unit_in_seconds(tmp_path):
    simulated = Timeline([Event(1, "F", "compute", 0.0, 2.0, "F0")], world_size=2, source="simulated", unit="F")
    with pytest.raises(ValueError, match="seconds_per_unit"):
        to_perfetto(simulated, tmp_path / "sim.json")
    doc = json.loads(to_perfetto(simulated, tmp_path / "sim.json", seconds_per_unit=0.5).read_text())
    (box,) = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert (box["pid"], box["ts"], box["dur"]) == (1, 0.0, 1e6)


def test_hand_built_timeline_every_timestamp_in_microseconds_and_arrows_pair_up(tmp_path):
    # by hand, in seconds: rank 0 computes 0-2 ms, then sends twice to rank 1; rank 1 holds
    # the first message from 3.5 ms. Perfetto shows ranks top to bottom by sort_index.
    ev = [Event(0, "F", "compute", 0.0, 0.002, "F0"),
          Event(0, "send", "comm", 0.002, 0.003, bytes_sent=8, peer=1, seq=0),
          Event(1, "recv", "comm", 0.0015, 0.0035, bytes_recv=8, peer=0, seq=0),
          Event(1, "memory", "memory", 0.0035, 0.0035, value=8),
          Event(0, "send", "comm", 0.004, 0.005, bytes_sent=16, peer=1, seq=1),
          Event(1, "recv", "comm", 0.004, 0.006, bytes_recv=16, peer=0, seq=1)]
    doc = json.loads(to_perfetto(Timeline(ev, world_size=2), tmp_path / "hand.json").read_text())
    events = doc["traceEvents"]
    assert {e["pid"]: e["args"]["sort_index"] for e in events if e["name"] == "process_sort_index"} == {0: 0, 1: 1}
    assert [(e["pid"], e["ts"], e["args"]["bytes"]) for e in events if e["ph"] == "C"] == [(1, pytest.approx(3500), 8)]
    ends = {}                                         # flow id -> {"s": (pid, ts µs), "f": (pid, ts µs)}
    for e in events:
        if e["ph"] in "sf":
            ends.setdefault(e["id"], {})[e["ph"]] = (e["pid"], round(e["ts"], 3))
    # each arrow joins a send to its own receive, not to the next message's; each end inside its slice
    # (send 2-3 ms, receive 1.5-3.5 ms; send 4-5 ms, receive 4-6 ms), where the viewer binds it: the
    # start in the middle of the send, the end in the middle of the receive's part after it (an end
    # before its start is dropped by the viewer)
    assert sorted(ends.values(), key=lambda d: d["s"]) == [
        {"s": (0, 2500), "f": (1, 3000)}, {"s": (0, 4500), "f": (1, 5250)}]


# ----------------------------------------------------------------------------------
# Perfetto's rules (tests/browser/test_perfetto_in_chromium.py loads real runs into Perfetto itself):
# broken, each silently loses data in the viewer. Checked here on the JSON, cheaply.

def ns(us):
    return round(us * 1000)


def follows_perfettos_rules(doc):
    """Thread ids of their own and never 0; on each thread, boxes one after another or nested; each
    arrow from inside a send to inside its receive, its end after its start, and into a box that
    starts after the send's (Perfetto points an arrow from the box that starts first)."""
    events = doc["traceEvents"]
    named = {(e["pid"], e["tid"]) for e in events if e["name"] == "thread_name"}
    assert all(t != 0 for _, t in named) and len({t for _, t in named}) == len(named)   # no tid in two ranks
    lanes = {}
    for e in events:
        if e["ph"] == "X":
            assert (e["pid"], e["tid"]) in named
            lanes.setdefault(e["tid"], []).append((ns(e["ts"]), ns(e["ts"]) + ns(e["dur"]), e))
    for boxes in lanes.values():
        boxes.sort(key=lambda b: (b[0], -b[1]))
        open_ = []                                            # the boxes enclosing the current one
        for box in boxes:
            while open_ and open_[-1][1] <= box[0]:
                open_.pop()
            assert not open_ or box[1] <= open_[-1][1], "two boxes overlap on one thread without nesting"
            assert box[2]["args"]["kind"] != "in_flight" or (open_ and open_[-1][2]["args"]["kind"] == "recv")
            open_.append(box)
    ends = {}
    for e in events:
        if e["ph"] in "sf":
            inside = [b for b in lanes[e["tid"]] if b[0] < ns(e["ts"]) < b[1]]     # strictly inside
            box = min(inside, key=lambda b: b[1] - b[0])                           # the innermost
            ends.setdefault(e["id"], {})[e["ph"]] = (ns(e["ts"]), box)
    for end in ends.values():
        (s, (send_start, _, send)), (f, (recv_start, recv_end, recv)) = end["s"], end["f"]
        assert f > s and recv_start > send_start and send["args"]["kind"] == "send"
        if recv["args"]["kind"] == "in_flight":
            recv = next(b[2] for b in lanes[recv["tid"]] if b[2]["args"]["kind"] == "recv" and b[0] < recv_start
                        and recv_end == b[1])
        assert recv["args"]["kind"] == "recv"
        assert (send["pid"], send["args"]["peer"]) == (recv["args"]["peer"], recv["pid"])
    return lanes, ends


def test_the_real_run_follows_perfettos_rules(run):
    timeline, doc = run
    _, ends = follows_perfettos_rules(doc)
    assert len(ends) == len(timeline.messages()) == doc["otherData"]["messages"] == 1
    assert doc["otherData"]["messages_without_arrow"] == 0


def test_operations_in_flight_together_get_a_lane_each(tmp_path):
    # three all-reduces in flight at once on rank 0 (DDP's buckets, FSDP's prefetched all-gathers):
    # on one thread they would overlap without nesting, and Perfetto would drop two of them
    ms = 1e-3
    ev = [Event(0, "all_reduce", "comm", 0 * ms, 3 * ms, "AR0"), Event(0, "all_reduce", "comm", 1 * ms, 4 * ms, "AR1"),
          Event(0, "all_reduce", "comm", 2 * ms, 2.5 * ms, "AR2"), Event(0, "all_reduce", "comm", 3 * ms, 5 * ms, "AR3"),
          Event(0, "F", "compute", 0, 1 * ms, "F0"), Event(0, "F", "compute", 1 * ms, 2 * ms, "F1"),   # touching: one lane
          Event(1, "F", "compute", 0, 1 * ms, "F0")]
    doc = json.loads(to_perfetto(Timeline(ev, world_size=2), tmp_path / "t.json").read_text())
    lanes, _ = follows_perfettos_rules(doc)
    threads = {e["tid"]: e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "thread_name"}
    assert threads == {1000: "compute", 1100: "comm", 1101: "comm 2", 1102: "comm 3", 2000: "compute", 2100: "comm"}
    names = {tid: [b[2]["name"] for b in boxes] for tid, boxes in lanes.items()}
    assert names == {1000: ["F0", "F1"], 1100: ["AR0", "AR3"], 1101: ["AR1"], 1102: ["AR2"], 2000: ["F0"]}


def test_lanes_are_as_many_as_operations_in_flight_at_once():
    import random
    from pplab.swimlane.perfetto import assign_lanes
    rng = random.Random(0)
    for _ in range(200):
        spans = [(s, s + rng.choice([0, rng.randint(1, 30)])) for s in (rng.randint(0, 60) for _ in range(rng.randint(1, 12)))]
        lanes = assign_lanes(spans)
        for k in set(lanes):
            mine = sorted(sp for sp, lane in zip(spans, lanes) if lane == k)
            assert all(b[0] >= a[1] for a, b in zip(mine, mine[1:]))
        # the most in flight at one instant t, some span's start: those begun and not ended (one ending
        # at t has made room); spans of length 0 at t take one lane, free of those running across t
        in_flight = max(max(sum(s <= t < e for s, e in spans),
                            sum(s < t < e for s, e in spans) + ((t, t) in spans)) for t, _ in spans)
        assert 1 + max(lanes) == in_flight


def test_a_receive_posted_long_before_its_send_keeps_its_arrow(tmp_path):
    # the receive waits from 0 to 10 ms, the send runs 8-9 ms: the receive's middle (5 ms) lies before
    # the send's, and an arrow from 8.5 ms back to 5 ms is one Perfetto drops. Its end goes after the start.
    ms = 1e-3
    ev = [Event(1, "recv", "comm", 0, 10 * ms, "←0", bytes_recv=8, peer=0, seq=0),
          Event(0, "send", "comm", 8 * ms, 9 * ms, bytes_sent=8, peer=1, seq=0)]
    doc = json.loads(to_perfetto(Timeline(ev, world_size=2), tmp_path / "t.json").read_text())
    lanes, ends = follows_perfettos_rules(doc)
    assert [(s, f) for (s, _), (f, _) in ((e["s"], e["f"]) for e in ends.values())] == [(8_500_000, 9_250_000)]
    # and Perfetto would point it from the receive, which starts first, back to the send: the arrow
    # ends in the receive's part after the send began, a slice of its own
    assert [(b[0], b[1], b[2]["name"]) for b in lanes[2100]] == [(0, 10_000_000, "←0"), (8_000_001, 10_000_000, "in flight")]


def test_an_arrow_that_clocks_out_of_step_make_impossible_is_counted_not_written(tmp_path):
    # ranks on two machines whose clocks the gather aligned badly: the receive ended before its
    # send began. No arrow can bind to both and run forward in time: none is written, and the count says so.
    ms = 1e-3
    ev = [Event(1, "recv", "comm", 0, 1 * ms, bytes_recv=8, peer=0, seq=0),
          Event(0, "send", "comm", 2 * ms, 3 * ms, bytes_sent=8, peer=1, seq=0),
          Event(0, "send", "comm", 4 * ms, 5 * ms, bytes_sent=8, peer=1, seq=1),
          Event(1, "recv", "comm", 4.5 * ms, 6 * ms, bytes_recv=8, peer=0, seq=1)]
    doc = json.loads(to_perfetto(Timeline(ev, world_size=2), tmp_path / "t.json").read_text())
    _, ends = follows_perfettos_rules(doc)
    assert len(ends) == 1 and doc["otherData"] == {**doc["otherData"], "messages": 2, "messages_without_arrow": 1}


def test_names_are_written_in_utf8_not_escaped(tmp_path):
    # Perfetto does not decode JSON's \u escapes: "\u2192" would show as six characters, not "→"
    ev = [Event(0, "send", "comm", 0.0, 1e-3, "→1", bytes_sent=8, peer=1, seq=0),
          Event(1, "recv", "comm", 0.0, 2e-3, "←0", bytes_recv=8, peer=0, seq=0)]
    text = to_perfetto(Timeline(ev, world_size=2), tmp_path / "t.json").read_bytes().decode("utf-8")
    assert '"→1"' in text and '"←0"' in text and "\\u" not in text
