"""pplab.cluster: two tiers of network emulated on real ranks.

Results are checked against torch.distributed's own all-reduce and against single-process
training; bytes between nodes are read from the trace (pplab.comm's send events, which the
emulation does not write) and compared with closed forms worked out here by hand.
"""
import math

import pytest
import torch
import torch.distributed as dist
from torch import nn

import pplab
from pplab import collectives, trace
from pplab.cluster import (Cluster, cross_node_bytes, hierarchical_all_reduce, hsdp_average_gradients,
                           predict_all_reduce, two_tier)
from pplab.zero import FullyShardedModule

N_ELEMENTS = 1200                 # divides by 4, 3, and by 2 after a split over 2


def test_cluster_layout_and_bad_input():
    c = Cluster(n_nodes=3, ranks_per_node=2)
    assert c.world_size == 6
    assert [c.node_of(r) for r in range(6)] == [0, 0, 1, 1, 2, 2]
    assert c.node_ranks(2) == [4, 5] and c.rail_ranks(1) == [1, 3, 5]
    assert c.crosses(1, 2) and not c.crosses(2, 3)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="whole number"):
            Cluster(bad, 2)
    with pytest.raises(ValueError, match="algorithm"):
        predict_all_reduce(1, c, (0, 0), (0, 0), algorithm="tree")


def test_predict_all_reduce_by_hand():
    c = Cluster(2, 4)                                   # p = 8
    intra, inter = (1e-6, 1e-9), (1e-5, 1e-8)           # the network 10x slower than the node
    n = 8e6
    # flat: 14 steps of (1e-5 + 1e6 * 1e-8) = 14 * 0.01001
    assert predict_all_reduce(n, c, intra, inter) == pytest.approx(14 * 0.01001)
    # hierarchical: 2 * 3 * (1e-6 + 2e6 * 1e-9) + 2 * 1 * (1e-5 + 1e6 * 1e-8)
    assert predict_all_reduce(n, c, intra, inter, "hierarchical") == pytest.approx(6 * 0.002001 + 2 * 0.01001)
    # one node: both are a ring over the fast links alone
    one = Cluster(1, 4)
    assert predict_all_reduce(n, one, intra, inter) == pytest.approx(6 * (1e-6 + 2e6 * 1e-9))
    assert predict_all_reduce(n, one, intra, inter, "hierarchical") == pytest.approx(6 * (1e-6 + 2e6 * 1e-9))


def _all_reduce_three_ways(n_nodes, ranks_per_node, numel, op):
    c = Cluster(n_nodes, ranks_per_node)
    rank = dist.get_rank()
    torch.manual_seed(100 + rank)                       # different data on every rank
    x = torch.randn(numel, dtype=torch.float64)
    reference = x.clone()
    dist.all_reduce(reference, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op])
    c.groups()
    flat, hier = x.clone(), x.clone()
    with two_tier(c, bandwidth=math.inf):
        with trace.span("flat"):
            collectives.all_reduce(flat, op=op)
        with trace.span("hierarchical"):
            hierarchical_all_reduce(hier, c, op=op)
    return flat, hier, reference


@pytest.mark.parametrize("n_nodes, ranks_per_node", [(2, 2), (3, 1), (1, 3)])
def test_hierarchical_all_reduce_equals_flat_and_torch_and_crosses_less(n_nodes, ranks_per_node):
    p, N = n_nodes * ranks_per_node, N_ELEMENTS * 8
    results = pplab.launch(_all_reduce_three_ways, n_nodes, ranks_per_node, N_ELEMENTS, "sum", world_size=p)
    c = Cluster(n_nodes, ranks_per_node)
    for rank, (flat, hier, reference) in enumerate(results):
        assert torch.allclose(flat, reference, rtol=1e-12, atol=1e-12), f"rank {rank}: flat ring != torch"
        assert torch.allclose(hier, reference, rtol=1e-12, atol=1e-12), f"rank {rank}: hierarchical != torch"
    tl = results.timeline
    for rank in range(p):
        spans = {e.kind: e for e in tl.select(rank, "compute")}
        flat_sent = sum(e.bytes_sent for e in tl.select(rank, "comm", "send")
                        if spans["flat"].start <= e.start <= spans["flat"].end and c.crosses(rank, e.peer))
        hier_sent = sum(e.bytes_sent for e in tl.select(rank, "comm", "send")
                        if spans["hierarchical"].start <= e.start and c.crosses(rank, e.peer))
        # flat ring 0→1→...→p-1→0: only the last rank of a node sends to another node, all 2(p-1)/p·N of its bytes
        last_of_node = rank % ranks_per_node == ranks_per_node - 1 and n_nodes > 1
        assert flat_sent == (2 * (p - 1) * N // p if last_of_node else 0), f"rank {rank}: flat ring"
        # hierarchical: every rank sends 2(n-1)/n of its 1/r piece, all of it to other nodes
        assert hier_sent == 2 * (n_nodes - 1) * N // (n_nodes * ranks_per_node), f"rank {rank}: hierarchical"
    crossing_links = n_nodes if n_nodes > 1 else 0      # one node: the ring never leaves it
    assert cross_node_bytes(tl, c) == crossing_links * 2 * (p - 1) * N // p + p * 2 * (n_nodes - 1) * N // p


def test_hierarchical_all_reduce_uneven_size_and_max():
    results = pplab.launch(_all_reduce_three_ways, 2, 2, 1001, "max", world_size=4)
    for rank, (flat, hier, reference) in enumerate(results):
        assert torch.equal(hier, reference) and torch.equal(flat, reference), f"rank {rank}"


def _one_message(nbytes, bandwidth, latency):
    c = Cluster(2, 2)
    with two_tier(c, bandwidth=bandwidth, latency=latency):
        t = torch.zeros(nbytes // 4, dtype=torch.float32)
        me = dist.get_rank()
        if me == 0:
            pplab.comm.send(t, 1)                       # inside node 0
        elif me == 1:
            pplab.comm.recv(t, 0)
            pplab.comm.send(t, 2)                       # from node 0 to node 1
        elif me == 2:
            pplab.comm.recv(t, 1)
        dist.barrier()


def test_throttle_holds_back_messages_between_nodes_only():
    nbytes, bandwidth, latency = 400_000, 4e6, 0.02           # 0.1 s on the wire + 0.02 s
    tl = pplab.launch(_one_message, nbytes, bandwidth, latency, world_size=4, timeout=20).timeline
    inside, = tl.select(0, "comm", "send")
    between, = tl.select(1, "comm", "send")
    assert between.meta.get("cross_node") and not inside.meta.get("cross_node")
    # a lower bound the sleep guarantees, whatever the load (never an upper bound)
    arrived, = tl.select(2, "comm", "recv")
    assert between.duration >= latency + nbytes / bandwidth
    assert arrived.end - between.start >= latency + nbytes / bandwidth, "the data arrives no sooner"
    assert cross_node_bytes(tl, Cluster(2, 2)) == nbytes and cross_node_bytes(tl, Cluster(2, 2), rank=0) == 0


def _inside_one_node():
    with two_tier(Cluster(1, 2), bandwidth=1e-3, latency=1e6):   # a message held back would take days
        t = torch.zeros(1000)
        pplab.comm.send(t, 1) if dist.get_rank() == 0 else pplab.comm.recv(t, 0)


def test_messages_inside_a_node_are_not_held_back():
    tl = pplab.launch(_inside_one_node, world_size=2, timeout=10).timeline       # a hold would time out
    assert cross_node_bytes(tl, Cluster(1, 2)) == 0 and tl.bytes_sent(0) == 4000


def test_two_tier_bad_input():
    with pytest.raises(ValueError, match="bandwidth"):
        with two_tier(Cluster(2, 2), bandwidth=0):
            pass
    with pytest.raises(ValueError, match="world_size=4"):
        with two_tier(Cluster(2, 2), bandwidth=1e9):
            pass


# ----------------------------------------------------------------------------------
# HSDP vs ZeRO-3


SIZES = [(5, 7), (7, 6)]                                  # units of 42 and 48 parameters
ROWS, LR, STEPS = 8, 0.1, 2


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 6)).double()


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(ROWS, 5, generator=g, dtype=torch.float64), torch.randn(ROWS, 6, generator=g, dtype=torch.float64)


def _train(hsdp):
    c = Cluster(2, 2)
    node, _ = c.groups()
    fsdp = FullyShardedModule(_model(), group=node if hsdp else None, prefetch=False)
    opt = torch.optim.SGD(fsdp.parameters(), lr=LR)
    x, y = _data()
    share = slice(2 * dist.get_rank(), 2 * dist.get_rank() + 2)
    with two_tier(c, bandwidth=math.inf):
        for _ in range(STEPS):
            nn.functional.mse_loss(fsdp(x[share]), y[share]).backward()
            if hsdp:
                hsdp_average_gradients(fsdp, c)
            opt.step()
            opt.zero_grad()
    with fsdp.full_parameters() as model:
        return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("hsdp", [True, False], ids=["hsdp", "zero3"])
def test_hsdp_and_zero3_train_like_one_process_and_cross_nodes_as_the_formula_says(hsdp):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    x, y = _data()
    for _ in range(STEPS):
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    results = pplab.launch(_train, hsdp, world_size=4)
    for rank, params in enumerate(results):
        for got, want in zip(params, model.parameters()):
            assert torch.allclose(got, want, rtol=1e-10, atol=1e-12), f"rank {rank}"
    units = [i * o + o for i, o in SIZES]                # 42, 48 parameters, 8 bytes each
    if hsdp:
        # shards of 21 and 24 elements; each of 4 ranks sends all of its shard across (ring of 2 nodes)
        per_step = 4 * sum(u // 2 for u in units) * 8
    else:
        # padded to 44, 48. Two ring all-gathers per unit (forward, backward): the 2 links between
        # nodes carry 3/4 of N each; the pairwise reduce-scatter: each rank sends 2 of its 4 pieces across
        padded = [math.ceil(u / 4) * 4 * 8 for u in units]
        per_step = sum(2 * (2 * 3 * n // 4) + 4 * (2 * n // 4) for n in padded)
    assert cross_node_bytes(results.timeline, Cluster(2, 2)) == STEPS * per_step


def _hsdp_step(n_nodes, ranks_per_node):
    """One HSDP step, 2 rows per rank: the nodes' shards averaged over the rails."""
    c = Cluster(n_nodes, ranks_per_node)
    node, _ = c.groups()
    fsdp = FullyShardedModule(_model(), group=node, prefetch=False)
    opt = torch.optim.SGD(fsdp.parameters(), lr=LR)
    x, y = _data()
    share = slice(2 * dist.get_rank(), 2 * dist.get_rank() + 2)
    with two_tier(c, bandwidth=math.inf):
        nn.functional.mse_loss(fsdp(x[share]), y[share]).backward()
        hsdp_average_gradients(fsdp, c)
        opt.step()
    with fsdp.full_parameters() as model:
        return [p.detach().clone() for p in model.parameters()]


def test_hsdp_over_three_nodes_of_one_rank_divides_by_the_nodes():
    """3 nodes of 1 rank (not 2 x 2, where nodes and ranks per node are the same number): the
    gradient summed over 3 rails is divided by 3, as one process on the 6 rows computes it."""
    model = _model()
    x, y = _data()
    nn.functional.mse_loss(model(x[:6]), y[:6]).backward()
    torch.optim.SGD(model.parameters(), lr=LR).step()
    for rank, params in enumerate(pplab.launch(_hsdp_step, 3, 1, world_size=3)):
        for got, want in zip(params, model.parameters()):
            assert torch.allclose(got, want, rtol=1e-10, atol=1e-12), f"rank {rank}"
