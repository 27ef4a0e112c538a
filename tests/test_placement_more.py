"""Placement beyond tests/test_placement.py, against independent references: Megatron-LM's own
hand-drawn groups (the docstring of initialize_model_parallel, 16 GPUs on 2 boxes of 8), torch's
init_device_mesh in another order on an odd cluster, and hand counts of ties, reduce-scatters,
and the dimension two ranks differ along."""
import pytest
import torch.distributed as dist

import pplab
from pplab.cluster import Cluster, PlacementError, crossing_time, place, placement_rule
from pplab.mesh import Mesh

pytestmark = pytest.mark.usefixtures("no_leftover_processes")


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
