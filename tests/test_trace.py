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
            h.wait()
        else:
            comm.recv(t, 0)
            comm.isend(t * 2, 0).wait()
        return t.tolist()

    out = pplab.launch(f, world_size=2)
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
