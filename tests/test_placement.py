"""pplab.cluster's placement (a mesh laid onto nodes), the planner on a cluster, and the
simulator's per-hop send times.

Groups, nodes spanned and bytes between nodes are checked against values worked out by hand
(an odd cluster, 3 nodes × 2, included); on real ranks, dp=2×tp=2 of the tiny GPT trains like
one process whichever order places it, and the bytes the trace shows crossing between nodes,
dimension by dimension, equal Placement.cross_node_bytes of planner.step_traffic. No time is
asserted: what a placement costs in time follows from those bytes (notebook 10d measures it).
"""
import math

import pytest
import torch.distributed as dist
from torch import nn

import pplab
from pplab import costfit, planner
from pplab.cluster import (Cluster, PlacementError, crossing_time, orders, place, placement_rule,
                           predict_all_reduce, two_tier)
from pplab.hybrid import GPTConfig, train, train_single
from pplab.mesh import Mesh, describe
from pplab.models import parallel_layers
from pplab.pipeline import ScheduleError, make_schedule, simulate

pytestmark = pytest.mark.usefixtures("no_leftover_processes")

CFG = GPTConfig(vocab=32, seq=8, hidden=16, heads=4, ffn=24, layers=2)   # 32 and 24 split evenly over tp = 2
TOL = 1e-10


# ----------------------------------------------------------------------------------
# Placement arithmetic, by hand


def test_groups_and_nodes_on_two_nodes_of_two():
    c = Cluster(2, 2)
    inside = place(c, dp=2, tp=2, order=("dp", "tp"))
    across = place(c, dp=2, tp=2, order=("tp", "dp"))
    assert inside.groups("tp") == [[0, 1], [2, 3]] and inside.groups("dp") == [[0, 2], [1, 3]]
    assert across.groups("tp") == [[0, 2], [1, 3]] and across.groups("dp") == [[0, 1], [2, 3]]
    assert inside.nodes_spanned("tp") == [1, 1] and inside.nodes_spanned("dp") == [2, 2]
    assert across.nodes_spanned("tp") == [2, 2] and across.nodes_spanned("dp") == [1, 1]
    assert place(c, dp=2, tp=2).groups("tp") == [[0, 1], [2, 3]]          # the default: tp innermost
    text = describe(order=("tp", "dp"), dp=2, tp=2)
    assert "dp innermost" in text and "tp groups: [0, 2]  [1, 3]" in text and "dp groups: [0, 1]  [2, 3]" in text
    # a ring of 2: both of its links cross or neither; every rank sends its traffic on one
    traffic = {"tp": 1000, "dp": 30}
    assert inside.cross_node_bytes(traffic) == {"tp": 0, "dp": 4 * 30}
    assert across.cross_node_bytes(traffic) == {"tp": 4 * 1000, "dp": 0}


def test_an_odd_cluster_three_nodes_of_two():
    c = Cluster(3, 2)                                   # nodes {0, 1}, {2, 3}, {4, 5}
    a = place(c, dp=3, tp=2, order=("dp", "tp"))
    b = place(c, dp=3, tp=2, order=("tp", "dp"))        # rank = 3·tp + dp: dp fastest
    assert a.groups("tp") == [[0, 1], [2, 3], [4, 5]] and a.nodes_spanned("tp") == [1, 1, 1]
    assert a.groups("dp") == [[0, 2, 4], [1, 3, 5]] and a.nodes_spanned("dp") == [3, 3]
    assert b.groups("tp") == [[0, 3], [1, 4], [2, 5]] and b.nodes_spanned("tp") == [2, 2, 2]
    assert b.groups("dp") == [[0, 1, 2], [3, 4, 5]] and b.nodes_spanned("dp") == [2, 2]
    T, D = 700, 90
    # a: dp rings 0→2→4→0 and 1→3→5→1, every link between nodes: 6 links × D
    assert a.cross_node_bytes({"tp": T, "dp": D}) == {"tp": 0, "dp": 6 * D}
    # b: tp pairs all cross (6 links); dp ring 0→1→2→0 crosses on 1→2 and 2→0, 3→4→5→3 on 3→4 and 5→3
    assert b.cross_node_bytes({"tp": T, "dp": D}) == {"tp": 6 * T, "dp": 4 * D}
    assert placement_rule({"tp": T, "dp": D}) == ("dp", "tp")
    best = min(orders(dp=3, tp=2), key=lambda o: sum(place(c, dp=3, tp=2, order=o).cross_node_bytes(
        {"tp": T, "dp": D}).values()))
    assert best == placement_rule({"tp": T, "dp": D})


def test_pipeline_chain_and_expert_all_to_all_by_hand():
    c = Cluster(2, 2)
    pp = place(c, pp=4)                                 # stages 0-1 on node 0, 2-3 on node 1
    assert pp.cross_node_bytes({"pp": 50}) == {"pp": 2 * 50}              # hop 1→2: activations and gradients
    ep = place(c, ep=4)                                 # 8 of the 12 ordered pairs cross, each 1/3 of E
    assert ep.cross_node_bytes({"ep": 300}) == {"ep": pytest.approx(8 * 100)}
    three = place(Cluster(2, 4), pp=2, dp=2, tp=2)      # pp outermost: only pp crosses, on its 4 pairs
    assert three.nodes_spanned("pp") == [2, 2, 2, 2] and three.nodes_spanned("tp") == [1] * 4
    assert three.cross_node_bytes({"tp": 9, "dp": 5, "pp": 3}) == {"tp": 0, "dp": 0, "pp": 4 * 2 * 3}
    assert placement_rule({"tp": 9, "dp": 5, "pp": 3}) == ("pp", "dp", "tp")
    assert placement_rule({"tp": 9, "dp": 50, "pp": 3}) == ("pp", "tp", "dp")


def test_bad_layouts_say_what_to_change():
    c = Cluster(2, 2)
    with pytest.raises(PlacementError, match="product is 4"):
        place(c, dp=3)
    with pytest.raises(PlacementError, match="product is 6"):
        place(Cluster(3, 2), dp=2, tp=2)
    with pytest.raises(PlacementError, match="leaves out tp"):
        place(c, dp=2, tp=2, order=("dp",))
    with pytest.raises(PlacementError, match="at most once"):
        place(c, dp=2, tp=2, order=("dp", "tp", "dp"))
    with pytest.raises(PlacementError, match="unknown mesh dimension"):
        place(c, xp=4)
    with pytest.raises(PlacementError, match="Cluster"):
        place((2, 2), dp=4)
    with pytest.raises(PlacementError, match="dimensions are"):
        place(c, dp=4).cross_node_bytes({"zz": 1})
    with pytest.raises(ValueError, match="collective"):
        crossing_time("gather", 4, 1, (0, 0))


def test_crossing_time_is_the_flat_ring_of_predict_all_reduce():
    inter = (1e-5, 1e-8)
    for cluster in (Cluster(2, 2), Cluster(3, 2), Cluster(2, 4)):
        p = cluster.world_size
        assert crossing_time("all_reduce", p, 6e6, inter) == pytest.approx(
            predict_all_reduce(6e6, cluster, (0.0, 0.0), inter))
    assert crossing_time("all_gather", 4, 8e6, inter) == pytest.approx(3 * (1e-5 + 2e6 * 1e-8))
    assert crossing_time("broadcast", 2, 1e6, inter) == pytest.approx(1e-5 + 1e-2)


# ----------------------------------------------------------------------------------
# The simulator: each hop its own send time


def test_simulate_takes_a_send_time_per_hop():
    sched = make_schedule("gpipe", 2, 1)
    same = simulate(sched, 1.0, 2.0, p2p_latency=5.0).makespan
    assert simulate(sched, 1.0, 2.0, p2p_latency=[[0.0, 5.0], [5.0, 0.0]]).makespan == same == 1 + 5 + 1 + 2 + 5 + 2   # F0, hop, F1, B1, hop, B0
    # F0 [0, 1], F1 waits 1 → [2, 3], B1 [3, 5], B0 waits 3 → [8, 10]
    assert simulate(sched, 1.0, 2.0, p2p_latency=[[0.0, 1.0], [3.0, 0.0]]).makespan == 10.0
    with pytest.raises(ScheduleError, match="2 × 2"):
        simulate(sched, 1.0, 2.0, p2p_latency=[[0.0, 1.0]])


# ----------------------------------------------------------------------------------
# The planner on a cluster


def _inputs():
    fit = costfit.Fit(2e-5, 1e-9, 0.0, [1, 2], [2e-5, 2e-5])       # the classic α-β model, inside a node
    return fit, planner.estimate(CFG)


def test_predict_adds_the_slow_tier_to_the_groups_that_cross():
    fit, times = _inputs()
    c, inter = Cluster(2, 2), (1e-3, 1 / 20e6)
    a, b = inter
    mb, s, h, L = 4, CFG.seq, CFG.hidden, CFG.layers
    inside = planner.predict(CFG, planner.Layout(2, 2, 1, order=("dp", "tp")), 8, fit, times, cluster=c, inter=inter)
    across = planner.predict(CFG, planner.Layout(2, 2, 1, order=("tp", "dp")), 8, fit, times, cluster=c, inter=inter)
    plain = planner.predict(CFG, planner.Layout(2, 2, 1), 8, fit, times)
    act = mb * s * h * 4
    # a 2-rank all-reduce across: 2 steps of (α + N/2 β); TP's: 4L + 2 of an activation, the loss's 2 of [2, b, s]
    tp_extra = (4 * L + 2) * (2 * a + act * b) + 2 * (2 * a + 2 * mb * s * 4 * b)
    grads = sum(planner.layer_params(CFG, 2)) * 4                 # pp = 1: every layer's tp shard, fp32
    dp_extra = (2 * a + grads * b) + (a + 8 * b)             # DDP's all-reduce and its all-gather of 2 counts
    assert across.time["tp"] - plain.time["tp"] == pytest.approx(tp_extra)
    assert inside.time["tp"] == pytest.approx(plain.time["tp"]) and across.time["dp"] == pytest.approx(plain.time["dp"])
    assert inside.time["dp"] - plain.time["dp"] == pytest.approx(dp_extra)
    assert inside.time["total"] < across.time["total"]


def test_predict_prices_a_pipeline_hop_between_nodes_at_the_slow_tier():
    fit, times = _inputs()
    c, inter = Cluster(2, 2), (1e-2, 0.0)                     # 10 ms a message between nodes
    across = planner.predict(CFG, planner.Layout(1, 2, 2, m=1, order=("pp", "tp")), 8, fit, times, cluster=c, inter=inter)
    inside = planner.predict(CFG, planner.Layout(1, 2, 2, m=1, order=("tp", "pp")), 8, fit, times, cluster=c, inter=inter)
    plain = planner.predict(CFG, planner.Layout(1, 2, 2, m=1), 8, fit, times)
    # m = 1: the activation goes over once and its gradient comes back once, each 10 ms more
    assert across.time["pp_send"] - plain.time["pp_send"] == pytest.approx(2e-2)
    assert inside.time["pp_send"] == pytest.approx(plain.time["pp_send"])
    assert inside.time["tp"] > plain.time["tp"]                  # there, tp crosses instead


def test_plan_on_a_cluster_tries_every_order_and_puts_tp_inside():
    fit, times = _inputs()
    c = Cluster(2, 2)
    best = planner.plan(CFG, 8, 4, 1e9, fit, times, zero_stages=(0,), cluster=c, inter=(1e-3, 1 / 20e6))
    names = {p.layout.name for p in best.ranked}
    assert "dp=2×tp=2, order dp>tp" in names and "dp=2×tp=2, order tp>dp" in names
    tp2 = [p for p in best.ranked if p.layout.tp == 2 and p.layout.dp == 2]
    assert tp2[0].layout.order == ("dp", "tp")
    with pytest.raises(planner.PlanError, match="cluster="):
        planner.predict(CFG, planner.Layout(2, 2, 1), 8, fit, times, inter=(0, 0))
    with pytest.raises(planner.PlanError, match="product is 6"):
        planner.predict(CFG, planner.Layout(2, 2, 1), 8, fit, times, cluster=Cluster(3, 2), inter=(0, 0))
    with pytest.raises(planner.PlanError, match="inter"):
        planner.plan(CFG, 8, 4, 1e9, fit, times, cluster=c)


def test_step_traffic_by_hand():
    t = planner.step_traffic(CFG, planner.Layout(2, 2, 1), 8, dtype_bytes=8)
    act = 4 * CFG.seq * CFG.hidden * 8
    assert t["tp"] == (4 * CFG.layers + 2) * act + 4 * CFG.seq * 8 + 2 * 4 * CFG.seq * 8    # 2(g-1)/g = 1 at g = 2
    assert t["dp"] == sum(planner.layer_params(CFG, 2)) * 8 + 8 and t["pp"] == 0
    p = planner.step_traffic(CFG, planner.Layout(1, 1, 2, m=4), 8, dtype_bytes=4)
    assert p == {"tp": 0.0, "dp": 0.0, "pp": 4 * 2 * CFG.seq * CFG.hidden * 4}


# ----------------------------------------------------------------------------------
# On real ranks: both placements train like one process, and cross as the formula says


def _placed_job(n_nodes, ranks_per_node, sizes, order, batch):
    cluster = Cluster(n_nodes, ranks_per_node)
    mesh = Mesh(order=order, **sizes)
    with two_tier(cluster, bandwidth=math.inf):              # count only: every message in the trace
        out = train(CFG, mesh, steps=2, batch_size=batch, trace_steps={1})
    ref_losses, ref_layers = train_single(CFG, steps=2, batch_size=batch)
    expect = dict(nn.Sequential(*parallel_layers(ref_layers, mesh.tp_group)).named_parameters())
    return {"losses": out["losses"], "ref": ref_losses, "tp": mesh.ranks("tp"),
            "diff": max((p - expect[n]).abs().max().item() for n, p in out["params"].items())}


@pytest.mark.parametrize("n_nodes, ranks_per_node, sizes, order, batch", [
    (2, 2, {"dp": 2, "tp": 2}, ("dp", "tp"), 8),             # tp inside a node
    (2, 2, {"dp": 2, "tp": 2}, ("tp", "dp"), 8),             # tp across nodes
    (3, 2, {"dp": 3, "tp": 2}, ("dp", "tp"), 6)])            # an odd cluster: dp's rings of 3 cross
def test_placed_training_equals_one_process_and_crosses_as_the_formula_says(n_nodes, ranks_per_node, sizes, order,
                                                                           batch):
    results = pplab.launch(_placed_job, n_nodes, ranks_per_node, sizes, order, batch, world_size=n_nodes * ranks_per_node)
    placement = place(Cluster(n_nodes, ranks_per_node), order=order, **sizes)
    for r, res in enumerate(results):
        assert all(abs(a - b) <= TOL for a, b in zip(res["losses"], res["ref"])), (r, res["losses"], res["ref"])
        assert res["diff"] <= TOL, (r, res["diff"])
        assert [res["tp"]] == [g for g in placement.groups("tp") if r in g]       # the mesh is the placement
    traffic = planner.step_traffic(CFG, planner.Layout(sizes["dp"], sizes["tp"], 1), batch, dtype_bytes=8)
    expect = {d: b for d, b in placement.cross_node_bytes(traffic).items() if b}
    assert placement.measured_cross_node_bytes(results.timeline) == pytest.approx(expect, rel=1e-12)


# -- placement against independent references -----------------------------------------------------------
# Megatron-LM's own hand-drawn groups (the docstring of initialize_model_parallel, 16 GPUs on 2
# boxes of 8), torch's init_device_mesh in another order on an odd cluster, and hand counts of ties,
# reduce-scatters, and the dimension two ranks differ along.


def test_megatron_lms_sixteen_gpus_on_two_boxes():
    # Megatron-LM (megatron/core/parallel_state.py, initialize_model_parallel): tp = 2, pp = 4 on 16 GPUs,
    # ranks 0-7 in the first box, 8-15 in the second
    p = place(Cluster(2, 8), pp=4, dp=2, tp=2)
    assert p.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]]
    assert p.groups("dp") == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]]
    assert p.groups("pp") == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]
    assert p.nodes_spanned("pp") == [2] * 4 and p.nodes_spanned("tp") == p.nodes_spanned("dp") == [1] * 8
    # only each chain's hop 4 -> 8 (5 -> 9, ...) crosses: one activation over, one gradient back
    assert p.cross_node_bytes({"tp": 100, "dp": 10, "pp": 7}) == {"tp": 0, "dp": 0, "pp": 4 * 2 * 7}


def test_the_rule_keeps_the_mesh_order_on_ties():
    assert placement_rule({"tp": 5, "dp": 5}) == ("dp", "tp")
    assert placement_rule({"tp": 1, "dp": 1, "pp": 1}) == ("pp", "dp", "tp")
    assert placement_rule({"tp": 9, "dp": 1, "pp": 1}) == ("pp", "dp", "tp")


def test_crossing_time_of_a_reduce_scatter_and_a_broadcast_by_hand():
    inter = (2e-5, 1e-9)
    # 3 ranks, 3 MB in all: 2 steps of 1 MB each
    assert crossing_time("reduce_scatter", 3, 3e6, inter) == pytest.approx(2 * (2e-5 + 1e6 * 1e-9))
    assert crossing_time("broadcast", 5, 3e6, inter) == pytest.approx(2e-5 + 3e6 * 1e-9)
    assert crossing_time("all_reduce", 1, 3e6, inter) == 0.0


def test_the_dimension_two_ranks_differ_along():
    p = place(Cluster(3, 3), dp=3, tp=3, order=("tp", "dp"))      # rank = 3·tp + dp
    assert p.dim_between(0, 1) == "dp" and p.dim_between(0, 3) == "tp"
    assert p.dim_between(0, 4) is None                              # dp and tp both differ


def test_an_unknown_dimension_in_the_order_is_named():
    with pytest.raises(PlacementError, match=r"unknown dimension\(s\) \['xx'\]"):
        place(Cluster(2, 2), dp=4, order=("dp", "xx"))


def _torch_groups():
    dm = Mesh(order=("tp", "dp"), dp=3, tp=2).device_mesh()
    from torch.distributed.device_mesh import init_device_mesh
    ref = init_device_mesh("cpu", (2, 3), mesh_dim_names=("tp", "dp"))       # torch's, row-major in (tp, dp)
    return {d: (dist.get_process_group_ranks(dm.get_group(d)), dist.get_process_group_ranks(ref.get_group(d)))
            for d in ("tp", "dp")}, Mesh.from_device_mesh(ref).ranks("tp")


def test_placement_groups_are_torchs_device_mesh_in_another_order():
    results = pplab.launch(_torch_groups, world_size=6)
    p = place(Cluster(3, 2), dp=3, tp=2, order=("tp", "dp"))
    for rank, (groups, back) in enumerate(results):
        for d, (ours, torchs) in groups.items():
            assert ours == torchs == next(g for g in p.groups(d) if rank in g), (rank, d)
        assert back == next(g for g in p.groups("tp") if rank in g)


def test_predict_prices_tp_when_only_some_of_its_groups_cross():
    from pplab import costfit, planner
    from pplab.hybrid import GPTConfig
    cfg = GPTConfig(vocab=32, seq=8, hidden=16, heads=4, ffn=24, layers=2)
    fit, times = costfit.Fit(2e-5, 1e-9, 0.0, [1, 2], [2e-5, 2e-5]), planner.estimate(cfg)
    c, (a, b) = Cluster(2, 3), (1e-3, 1 / 20e6)
    layout = planner.Layout(3, 2, 1, order=("dp", "tp"))
    assert place(c, dp=3, tp=2, order=("dp", "tp")).nodes_spanned("tp") == [1, 2, 1]    # pair [2, 3] crosses
    placed = planner.predict(cfg, layout, 6, fit, times, cluster=c, inter=(a, b))
    plain = planner.predict(cfg, planner.Layout(3, 2, 1), 6, fit, times)
    mb, s, h, L = 2, cfg.seq, cfg.hidden, cfg.layers
    # every tp all-reduce waits for the pair that crosses: 2 steps of (α + N/2 β) each, as in test_placement
    extra = (4 * L + 2) * (2 * a + mb * s * h * 4 * b) + 2 * (2 * a + 2 * mb * s * 4 * b)
    assert placed.time["tp"] - plain.time["tp"] == pytest.approx(extra)


def test_step_traffic_of_zero_recomputation_and_wider_rings_by_hand():
    from pplab import planner
    from pplab.hybrid import GPTConfig
    cfg = GPTConfig(vocab=32, seq=8, hidden=16, heads=4, ffn=24, layers=2)
    N = sum(planner.layer_params(cfg, 1)) * 4                  # every parameter's gradient, fp32
    dp = {z: planner.step_traffic(cfg, planner.Layout(2, 1, 1, zero=z), 8)["dp"] for z in (1, 2, 3)}
    # 2 ranks: a reduce-scatter or an all-gather sends N/2. ZeRO-1, -2: one of each; ZeRO-3: two gathers
    assert dp == {1: N, 2: N, 3: 1.5 * N}
    # 4 ranks, ZeRO-3: three passes of 3/4 N each
    assert planner.step_traffic(cfg, planner.Layout(4, 1, 1, zero=3), 8)["dp"] == pytest.approx(3 * 0.75 * N)
    # tp = 4: each all-reduce of n sends 2·3/4·n; recomputation adds 2 per block
    act = 8 * cfg.seq * cfg.hidden * 4                        # one micro-batch of 8 sequences
    plain = planner.step_traffic(cfg, planner.Layout(1, 4, 1), 8)["tp"]
    again = planner.step_traffic(cfg, planner.Layout(1, 4, 1, recompute=True), 8)["tp"]
    assert plain == pytest.approx(1.5 * ((4 * cfg.layers + 2) * act + 8 * cfg.seq * 4 + 2 * 8 * cfg.seq * 4))
    assert again - plain == pytest.approx(1.5 * 2 * cfg.layers * act)
