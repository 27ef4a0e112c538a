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
    assert names == {(r, 0, "process_name", f"rank {r}") for r in (0, 1)} | \
        {(r, t, "thread_name", n) for r in (0, 1) for t, n in ((0, "compute"), (1, "comm"))}


def test_every_event_is_there_in_microseconds_with_its_bytes(run):
    timeline, doc = run
    boxes = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert len(boxes) == len([e for e in timeline if e.category != "memory"])
    by_rank = {r: sorted((e["tid"], e["name"], e["args"]["kind"]) for e in boxes if e["pid"] == r) for r in (0, 1)}
    assert by_rank[0] == [(0, "F0", "F"), (1, "AR", "all_reduce"), (1, "→1", "send")]
    assert by_rank[1][0] == (0, "F1", "F") and [k for _, _, k in by_rank[1][1:]] == ["all_reduce", "recv"]
    for e in timeline:
        if e.category == "memory":
            continue
        (box,) = [b for b in boxes if b["pid"] == e.rank and b["args"]["kind"] == e.kind]
        assert box["ts"] == pytest.approx(e.start * 1e6) and box["dur"] == pytest.approx(e.duration * 1e6)
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
    # each arrow joins a send to its own receive, not to the next message's; each end in the middle of
    # its slice (send 2-3 ms, receive 1.5-3.5 ms; send 4-5 ms, receive 4-6 ms), where the viewer binds it
    assert sorted(ends.values(), key=lambda d: d["s"]) == [
        {"s": (0, 2500), "f": (1, 2500)}, {"s": (0, 4500), "f": (1, 5000)}]
