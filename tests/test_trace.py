"""pplab.trace and pplab.comm: what each rank did, merged onto one clock."""
import pytest
import torch
import torch.distributed as dist

import pplab
from pplab import comm, trace
from pplab.trace import Event, Timeline


def ring_step():
    r, p = dist.get_rank(), dist.get_world_size()
    with trace.span("F", microbatch=r, stage=0):
        x = torch.full((10,), float(r))                  # 40 bytes
    trace.hold(x)
    got = torch.empty(10)
    comm.exchange(x, (r + 1) % p, got, (r - 1) % p)
    trace.release(x)
    s = torch.ones(3, dtype=torch.float64)
    comm.all_reduce(s)
    return got[0].item(), s[0].item()


def test_comm_results_and_exact_bytes():
    out = pplab.launch(ring_step, world_size=3)
    assert out == [(2.0, 3.0), (0.0, 3.0), (1.0, 3.0)]
    tl = out.timeline
    for r in range(3):
        assert tl.bytes_sent(r) == 40 and tl.bytes_received(r) == 40
        (ar,) = tl.select(r, kind="all_reduce")
        assert ar.meta["payload"] == 24 and ar.group == (0, 1, 2) and ar.label == "AR"
        (f,) = tl.select(r, "compute")
        assert f.label == f"F{r}" and f.meta == {"microbatch": r, "stage": 0}
        assert tl.memory_curve(r)[1] == [0, 40, 0] and tl.peak_memory(r) == 40


def test_sends_pair_with_receives_on_one_clock():
    tl = pplab.launch(ring_step, world_size=4).timeline
    pairs = tl.messages()
    assert sorted((s.rank, r.rank) for s, r in pairs) == [(0, 1), (1, 2), (2, 3), (3, 0)]
    for send, recv in pairs:
        assert send.bytes_sent == recv.bytes_recv == 40
        assert recv.end >= send.start               # causality holds on the common clock
    assert min(e.start for e in tl) == 0.0          # time 0 is the first event


def test_gather_inside_ranks_matches_launcher_timeline():
    def f():
        ring_step()
        tl = trace.gather()
        return len(tl), tl.world_size, tl.bytes_sent()

    out = pplab.launch(f, world_size=2)
    assert out[0] == out[1] == (len(out.timeline), 2, 80)


def test_blocking_send_recv_and_async_handles():
    def f():
        r = dist.get_rank()
        t = torch.arange(4, dtype=torch.int64) if r == 0 else torch.zeros(4, dtype=torch.int64)
        if r == 0:
            comm.send(t, 1)
            h = comm.irecv(t, 1)
        else:
            comm.recv(t, 0)
            h = comm.isend(t * 2, 0)
        h.wait()
        end = h.event.end
        h.wait()                                    # a second wait returns at once (gloo's own would block)
        assert h.is_completed() and h.event.end == end
        return t.tolist()

    out = pplab.launch(f, world_size=2, timeout=30)
    assert out == [[0, 2, 4, 6], [0, 1, 2, 3]]
    assert [e.kind for e in out.timeline.select(0, "comm")] == ["send", "recv"]
    assert out.timeline.bytes_sent() == 64


def test_bad_peers_are_explained():
    def f(peer):
        comm.send(torch.zeros(1), peer)

    with pytest.raises(pplab.LaunchError, match="dst=5 is not a rank: ranks are 0..1"):
        pplab.launch(f, 5, world_size=2)
    with pytest.raises(pplab.LaunchError, match="is this rank itself"):
        pplab.launch(lambda: comm.send(torch.zeros(1), dist.get_rank()), world_size=2)
    with pytest.raises(pplab.LaunchError, match="unknown reduce op 'mean'"):
        pplab.launch(lambda: comm.all_reduce(torch.zeros(1), op="mean"), world_size=2)


def test_nested_spans_and_utilisation_by_hand():
    ev = [Event(0, "F", "compute", 0.0, 2.0), Event(0, "inner", "compute", 0.5, 1.0),
          Event(1, "B", "compute", 1.0, 4.0), Event(1, "send", "comm", 4.0, 4.5, bytes_sent=8, peer=0, seq=0)]
    tl = Timeline(ev)
    assert tl.makespan == 4.5
    assert tl.busy(0) == 2.0 and tl.busy(1) == 3.0           # the nested span is counted once
    assert tl.utilization() == pytest.approx(5.0 / (2 * 4.5))
    assert tl.bubble(0) == pytest.approx(2.5)
    assert "overall utilisation 55.6%" in tl.summary()


def test_hold_rejects_what_it_cannot_measure():
    with pytest.raises(TypeError, match="trace.hold/release take a tensor"):
        trace.hold("activations")


def test_a_send_waited_on_late_ends_when_its_receive_did():
    ev = [Event(0, "send", "comm", 0.0, 9.0, bytes_sent=4, peer=1, seq=0),      # waited on at t=9
          Event(1, "recv", "comm", 0.5, 2.0, bytes_recv=4, peer=0, seq=0)]
    (send,) = Timeline(ev).select(0, "comm")
    assert send.end == 2.0


# ----------------------------------------------------------------------------------
# One-sided traffic: bytes sent and bytes received differ per rank, so mixing them up shows.
# (A ring sends what it receives on every rank: it cannot tell the two counts apart.)


def test_bytes_sent_and_received_are_counted_separately_by_hand():
    ev = [Event(0, "send", "comm", 0.0, 1.0, bytes_sent=12, peer=1, seq=0),
          Event(1, "recv", "comm", 0.0, 1.0, bytes_recv=12, peer=0, seq=0),
          Event(0, "send", "comm", 1.0, 2.0, bytes_sent=30, peer=2, seq=0),
          Event(2, "recv", "comm", 1.0, 2.0, bytes_recv=30, peer=0, seq=0)]
    tl = Timeline(ev)
    assert [tl.bytes_sent(r) for r in range(3)] == [42, 0, 0]
    assert [tl.bytes_received(r) for r in range(3)] == [0, 12, 30]
    assert tl.bytes_sent() == tl.bytes_received() == 42


def _one_sided(pattern):
    """p = 3, float32 (4 bytes), each pattern's messages from pplab.comm's traced sends."""
    rank = dist.get_rank()
    if pattern == "broadcast":             # rank 0 sends its 5 elements to 1 and 2, one after the other
        x = torch.arange(5.0) if rank == 0 else torch.empty(5)
        if rank == 0:
            comm.send(x, 1)
            comm.send(x, 2)
        else:
            comm.recv(x, 0)
        return x.tolist()
    if pattern == "gather":                # ranks 0 and 1 send 1 and 2 elements to 2
        if rank == 2:
            got = [torch.empty(1), torch.empty(2)]
            handles = [comm.irecv(got[0], 0), comm.irecv(got[1], 1)]
            for h in handles:
                h.wait()
            return [t.tolist() for t in got]
        comm.send(torch.full((rank + 1,), float(rank)), 2)
        return None
    # "push": parameter-server workers 1 and 2 push a gradient of 6 float64 (48 bytes) to server 0
    if rank == 0:
        total = torch.zeros(6, dtype=torch.float64)
        for w in (1, 2):
            g = torch.empty(6, dtype=torch.float64)
            comm.recv(g, w)
            total += g
        return total.tolist()
    comm.isend(torch.full((6,), float(rank), dtype=torch.float64), 0).wait()
    return None


@pytest.mark.parametrize("pattern, sent, received", [
    ("broadcast", [40, 0, 0], [0, 20, 20]),      # the root only sends: 2 × 20 B
    ("gather", [4, 8, 0], [0, 0, 12]),           # the root only receives: 4 + 8 B
    ("push", [0, 48, 48], [96, 0, 0]),           # the server only receives: 2 × 48 B
])
def test_one_sided_traffic_bytes_per_rank_by_hand(pattern, sent, received):
    out = pplab.launch(_one_sided, pattern, world_size=3, timeout=30)
    tl = out.timeline
    assert [tl.bytes_sent(r) for r in range(3)] == sent, pattern
    assert [tl.bytes_received(r) for r in range(3)] == received, pattern
    assert sum(sent) == sum(received) == tl.bytes_sent() == tl.bytes_received()
    assert len(tl.messages()) == sum(1 for e in tl.select(category="comm") if e.bytes_sent)   # every send paired
    if pattern == "push":
        assert out[0] == [3.0] * 6               # 1 + 2: both workers' gradients arrived


def test_hold_counts_each_dtype_at_its_own_size():
    trace.reset(0)
    trace.hold(torch.zeros(3, dtype=torch.float64))                        # 24 B
    trace.hold([torch.zeros(4, dtype=torch.bfloat16), torch.zeros(5, dtype=torch.int8)])   # 8 + 5 B
    assert trace.held() == 37
    trace.release(torch.zeros(3, dtype=torch.float64))
    assert trace.held() == 13
    trace.reset(0)


def test_memory_events_do_not_lengthen_the_run_and_the_curve_keeps_every_change():
    ev = [Event(0, "F", "compute", 0.0, 1.0), Event(0, "memory", "memory", 0.5, 0.5, value=3),
          Event(0, "memory", "memory", 0.8, 0.8, value=1), Event(1, "B", "compute", 0.5, 2.0),
          Event(1, "memory", "memory", 5.0, 5.0, value=7)]          # rank 1's release logged late
    tl = Timeline(ev)
    assert tl.makespan == 2.0 and tl.utilization(0) == 0.5
    assert tl.memory_curve(0) == ([0.0, 0.5, 0.8], [0, 3, 1]) and tl.peak_memory(1) == 7


def test_a_send_done_before_its_receive_keeps_its_own_end():
    ev = [Event(0, "send", "comm", 0.0, 1.0, bytes_sent=4, peer=1, seq=0),      # buffered: done at t=1
          Event(1, "recv", "comm", 0.5, 3.0, bytes_recv=4, peer=0, seq=0)]
    (send,) = Timeline(ev).select(0, "comm")
    assert send.end == 1.0
