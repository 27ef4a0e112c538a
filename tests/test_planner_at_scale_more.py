"""The planner at scale's closed forms, each term against a hand value: the ones a one-operator slip
could change without moving any published row by more than its tolerance (found by planting such
slips one at a time in pplab/planner/closed_forms.py and at_scale.py)."""
import dataclasses

import numpy as np
import pytest

from pplab.hardware import H100_SXM
from pplab.memory import activation_bytes_formula
from pplab.pipeline import make_schedule, simulate
from pplab.planner import at_scale
from pplab.planner.at_scale import AtScaleError, GPUCluster, Layout, Transformer, estimate, search
from pplab.planner.closed_forms import _heaviest_rank, layer_activation_bytes, pipeline_steps

PEAK = H100_SXM.peak("bf16")
ONE_NODE = GPUCluster(H100_SXM, nodes=1, gpus_per_node=8)
TWO_NODES = GPUCluster(H100_SXM, nodes=2, gpus_per_node=8)


def test_key_value_heads_when_tp_exceeds_them():
    """GQA with 2 key/value heads of d = 16 on tp = 4: each rank keeps a copy of one head, so k and v
    are 2 × 2 bytes × 16 a token; on tp = 2, one head each, the same; on tp = 1, both heads. The rest,
    split t ways by sequence parallelism: norms 4h, attention's input, q and output 2h each, the MLP's
    input 2h and its GeLU's input and output 2 × 2 × 4h."""
    gqa = Transformer("gqa", layers=2, hidden=128, heads=8, vocab=100, seq=32, kv_heads=2)
    per_token = {t: (4 + 2 + 2 + 2 + 2 + 16) * 128 / t for t in (1, 2, 4)}
    for t, kv_heads in ((1, 2), (2, 1), (4, 1)):
        hand = 32 * (per_token[t] + 2 * 2 * kv_heads * 16)        # SP: everything else split t ways
        assert layer_activation_bytes(gqa, 1, t, 1, True, "none") == pytest.approx(hand), t


def test_interleaved_with_fewer_microbatches_than_stages_matches_the_simulator():
    """m < p: each of the v − 1 turns between chunks waits p − m chunk-times (bubble_fraction)."""
    for p, m, v in ((4, 2, 2), (4, 3, 2), (6, 4, 3)):
        r = simulate(make_schedule("interleaved-1f1b", p, m, chunks=v), t_f=1.0, t_b=2.0)
        assert r.makespan == pytest.approx(3.0 * pipeline_steps(p, m, v)), (p, m, v)
    assert pipeline_steps(4, 2, 2) == 2 + 3 / 2 + 1 * 2 / 2


def test_zero3_gathers_and_scatters_every_micro_batch():
    """dp = 2 across 2 nodes, tp = 8 in each: ZeRO-3 all-gathers the weights forward and backward and
    reduce-scatters the gradients, each half an all-reduce, for each of m = 4 micro-batches: 1.5 × 4
    all-reduces of 2 bytes × the GPU's Ψ, each 2(n−1)(α + N/n/β) across n = 2 nodes."""
    m = Transformer("m", layers=4, hidden=4096, heads=32, vocab=1000, seq=2048)
    psi = 4 * 12 * 4096 ** 2 / 8 + 1000 * 4096 / 8
    ring = 2 * (at_scale.NETWORK_LATENCY + 2 * psi / 2 / H100_SXM.network)
    for zero, hand in ((1, ring), (2, ring), (3, 1.5 * 4 * ring)):
        e = estimate(m, TWO_NODES, 8, Layout(dp=2, tp=8, zero=zero, recompute="none"))
        assert e.time["dp"] == pytest.approx(hand), zero


def test_zero_shards_over_dp_times_cp():
    """Context-parallel ranks hold the same weights, so ZeRO shards them over dp × cp = 4 ranks."""
    m = Transformer("m", layers=2, hidden=1024, heads=8, vocab=1000, seq=4096)
    e = estimate(m, ONE_NODE, 4, Layout(dp=2, tp=2, cp=2, zero=3, recompute="none"))
    psi = 2 * 12 * 1024 ** 2 / 2 + 1000 * 1024 / 2
    assert e.memory["params"] == pytest.approx(2 * psi / 4)
    assert e.memory["optimizer"] == pytest.approx(12 * psi / 4)


def test_optimizer_step_reads_its_shard_once():
    """28 bytes touched a parameter the rank owns, at HBM bandwidth: all of Ψ without ZeRO, Ψ/8 from ZeRO-1."""
    m = Transformer("m", layers=2, hidden=1024, heads=8, vocab=1000, seq=512)
    psi = 2 * 12 * 1024 ** 2 + 1000 * 1024
    for zero, owned in ((0, psi), (1, psi / 8), (3, psi / 8)):
        e = estimate(m, ONE_NODE, 8, Layout(dp=8, zero=zero, recompute="none"))
        assert e.time["optimizer_step"] == pytest.approx(owned * 28 / H100_SXM.memory_bandwidth), zero


def test_output_layer_costs_three_products():
    """A larger vocabulary adds only the output layer's forward and 2 backward products, 3 × 2·T·h·ΔV
    FLOPs a micro-batch at EFFICIENCY × peak (compute-bound at T = 4,096 tokens, h = 4,096)."""
    def compute(vocab):
        m = Transformer("m", layers=1, hidden=4096, heads=32, vocab=vocab, seq=4096)
        return estimate(m, GPUCluster(H100_SXM, 1, 1), 2, Layout(dp=1, zero=0, recompute="none")).time["compute"]
    hand = 2 * 3 * 2 * 4096 * 4096 * (64000 - 32000) / (at_scale.EFFICIENCY * PEAK)     # m = 2 micro-batches
    assert compute(64000) - compute(32000) == pytest.approx(hand, rel=1e-9)


def test_selective_recomputation_runs_attention_again():
    """Selective: one more attention forward a layer and micro-batch; FlashAttention's causal half
    4·b·a·s²·d / 2 FLOPs at FLASH_UTILIZATION × peak."""
    m = Transformer("m", layers=3, hidden=1024, heads=8, vocab=1000, seq=4096)
    times = {r: estimate(m, GPUCluster(H100_SXM, 1, 1), 2, Layout(dp=1, zero=0, recompute=r)).time["compute"]
             for r in ("none", "selective")}
    hand = 2 * 3 * 0.5 * 4 * 1 * 8 * 4096 ** 2 * 128 / (at_scale.FLASH_UTILIZATION * PEAK)
    assert times["selective"] - times["none"] == pytest.approx(hand, rel=1e-9)


def test_recomputation_adds_one_layers_working_set():
    """Full recomputation keeps each layer's input (2·s·b·h) and, while a layer is redone, that
    layer's whole activations (Korthikanti et al.'s s·b·h·(34 + 5as/h), scores and dropout kept)."""
    m = Transformer("m", layers=3, hidden=96, heads=6, vocab=500, seq=64, flash=False, dropout=True)
    e = estimate(m, GPUCluster(H100_SXM, 1, 1), 4, Layout(dp=1, zero=0, recompute="full", micro_batch=2))
    hand = 3 * 2 * 64 * 2 * 96 + activation_bytes_formula(64, 2, 96, 6, 1, False, "none")
    assert e.memory["activations"] == pytest.approx(hand)
    # selective keeps 34·s·b·h a layer and brings back one layer's scores, 5·a·s²·b
    e = estimate(m, GPUCluster(H100_SXM, 1, 1), 4, Layout(dp=1, zero=0, recompute="selective", micro_batch=2))
    assert e.memory["activations"] == pytest.approx(3 * 34 * 64 * 2 * 96 + 5 * 6 * 64 * 64 * 2)


def test_full_recomputation_repeats_tensor_parallel_all_reduces():
    """tp = 8 in the node: 4 all-reduces a layer and micro-batch of 2·s·b·h bytes, 6 with full recomputation."""
    m = Transformer("m", layers=4, hidden=4096, heads=32, vocab=1000, seq=2048)
    per = 2 * 7 * (2 * 2048 * 4096 / 8) / H100_SXM.nvlink
    for recompute, count in (("none", 4), ("selective", 4), ("full", 6)):
        e = estimate(m, TWO_NODES, 8, Layout(dp=2, tp=8, zero=1, recompute=recompute))
        assert e.time["tp"] == pytest.approx(count * per * 4 * 4), recompute   # 4 layers, m = 4


def test_heaviest_rank_by_hand():
    """A layer takes 1, the output layer 0.5 on the last rank. 8 layers: 8.5 on one rank; on 2, 4 + 4
    layers (4.5); on 4, 2 each (2.5): moving a layer off the last rank would put 3 on another, more
    than the first rank's memory counts. 6 layers, balanced on 4 (Llama 3): 1 + head, 2, 2, 1 + embedding."""
    pp = np.array([1, 2, 4])
    assert _heaviest_rank(1.0, 0.5, 8, pp, np.array([False] * 3)).tolist() == [8.5, 4.5, 2.5]
    assert _heaviest_rank(1.0, 3.0, 8, pp, np.array([False] * 3)).tolist() == [11.0, 4.0 + 3.0, 2.0 + 3.0]
    assert _heaviest_rank(1.0, 0.5, 6, np.array([4]), np.array([True])).tolist() == [2.0]
    # 7 layers on 3 ranks, a heavy head: 3, 3, 1 + head = 4.5, not 4, 3, head = 4 (memory counts 3 on a rank)
    assert _heaviest_rank(1.0, 3.5, 7, np.array([3]), np.array([False])).tolist() == [4.5]


def test_uneven_split_memory_counts_the_layers_the_time_puts_there():
    """7 layers on pp = 3 with a large vocabulary: the first rank holds ceil(7/3) = 3 layers + the embedding."""
    m = Transformer("m", layers=7, hidden=1024, heads=8, vocab=200000, seq=512, tied=False)
    e = estimate(m, GPUCluster(H100_SXM, 1, 3), 3, Layout(dp=1, pp=3, zero=0, recompute="none"))
    assert e.memory["params"] == pytest.approx(2 * (3 * 12 * 1024 ** 2 + 200000 * 1024))


def test_every_bad_layout_says_what_to_change():
    moe = Transformer("moe", layers=4, hidden=96, heads=6, vocab=500, seq=64, experts=4)
    gqa = Transformer("gqa", layers=4, hidden=96, heads=6, vocab=500, seq=64, kv_heads=2)
    dense = Transformer("dense", layers=4, hidden=96, heads=6, vocab=500, seq=64)
    c = GPUCluster(H100_SXM, 1, 6)
    cases = [(dense, Layout(dp=2, cp=3), "cp = 3 must divide the sequence of 64"),
             (dense, Layout(dp=3, ep=2), "needs a mixture of experts"),
             (moe, Layout(dp=2, ep=3), "ep = 3 must divide the 4 experts"),
             (gqa, Layout(dp=2, tp=3), "must divide the 2 key/value heads, or be a multiple"),
             (dense, Layout(dp=1, pp=6), "pp = 6 stages for 4 layers"),
             (dense, Layout(dp=6, zero=4), "zero must be 0"),
             (dense, Layout(dp=6, recompute="some"), "recompute must be one of"),
             (dense, Layout(dp=2, pp=3, v=3), "v = 3 chunks must divide the 2 layer slots")]
    for model, layout, message in cases:
        with pytest.raises(AtScaleError, match=message):
            estimate(model, c, 12, layout)
    assert estimate(gqa, c, 12, Layout(dp=3, tp=2)).fits                  # one key/value head a rank
    assert estimate(gqa, c, 12, Layout(dp=1, tp=6)).fits                  # one copy of one a rank
    plan = search(gqa, c, 12)
    assert set(plan.x["tp"]) == {1, 2, 6}                                  # 3 would split a head in two


def test_estimate_is_what_the_search_ranked():
    """estimate() of a layout evaluates the same closed forms as search() did for it."""
    m = dataclasses.replace(Transformer("m", layers=6, hidden=256, heads=8, vocab=1000, seq=512), kv_heads=2)
    plan = search(m, GPUCluster(H100_SXM, 2, 4), 16)
    for e in plan.top(3):
        again = estimate(m, plan.cluster, 16, e.layout)
        assert again.time == pytest.approx(e.time) and again.memory == pytest.approx(e.memory)


# ----------------------------------------------------------------------------------
# the exercise's checker (pplab/checks/ch10_at_scale/find_layout.py)

def test_every_seed_has_a_problem_that_each_slip_gets_wrong():
    from pplab.checks.ch10_at_scale.find_layout import SLIPS, problems, reference
    for seed in range(40):
        cases = problems(seed)
        for slip in SLIPS:
            assert any(abs(sum(reference(p, slip)) / right - 1) > 0.01 for p, right in cases), (seed, slip)


def test_a_right_answer_written_with_numpy_passes():
    """The rule in another order and with other types: numpy arrays, the state as one sum over a
    vector of byte counts, a numpy integer returned."""
    from pplab.checks import run_check

    def memory_per_gpu(p):
        import numpy as np
        s, b, h, a, tp = p["seq"], p["micro_batch"], p["hidden"], p["heads"], p["tp"]
        layers_here = p["layers"] // p["pp"]
        act = {"full": 2.0, "selective": 34.0, "none": 34 + 5 * a * s / h}[p["recompute"]] * s * b * h / tp
        psi = np.int64(12 * h * h * layers_here + p["vocab"] * h) // tp
        split = np.where(np.array([3, 2, 1]) <= p["zero"], p["dp"], 1)
        return np.int64(round(min(p["m"], p["pp"]) * layers_here * act + np.sum(np.array([2, 2, 12]) * psi / split)))
    for seed in (7, 8):
        result = run_check("find_layout", memory_per_gpu, seed=seed)
        assert result, result.message


def test_expert_parallel_ranks_read_their_own_data():
    """Mixture of 8 experts, top 2, on 8 GPUs: ep = 8 ranks each hold one expert and read their own
    sequences, as dp = 8 ranks would; per GPU the same work (m = 1 micro-batch each), plus ep's
    dispatch and combine, forward and backward: 2 all-reduces' worth of T·k·h·2 bytes a layer. The
    attention and the embedding are replicated over all 8 ranks and sharded by ZeRO over them; each
    expert has one copy, so ZeRO cannot shard it, and only the shared weights' gradients are reduced."""
    moe = Transformer("moe", layers=2, hidden=1024, heads=8, vocab=1000, seq=512, experts=8, top_k=2)
    h = 1024
    by_ep = {ep: estimate(moe, ONE_NODE, 8, Layout(dp=8 // ep, ep=ep, zero=1, recompute="none")) for ep in (1, 8)}
    a2a = 2 * 7 * (512 * 2 * h * 2 / 8) / H100_SXM.nvlink                   # one all-reduce's worth in the node
    assert by_ep[8].time["compute"] - by_ep[1].time["compute"] == pytest.approx(2 * 2 * a2a)   # 2 layers, m = 1
    shared, expert = 2 * 4 * h * h + 1000 * h, 2 * 2 * h * 4 * h        # 2 layers: attention, one expert's MLP
    assert by_ep[8].memory["optimizer"] == pytest.approx(12 * (shared / 8 + expert))
    assert by_ep[1].memory["optimizer"] == pytest.approx(12 * (shared + 8 * expert) / 8)
    assert by_ep[8].time["dp"] == pytest.approx(2 * 7 * (2 * shared / 8) / H100_SXM.nvlink)
    with pytest.raises(AtScaleError, match="dp × ep = 8 replicas"):
        estimate(moe, ONE_NODE, 4, Layout(dp=1, ep=8))


def test_collectives_are_pplab_costmodels():
    """Each collective the planner charges, by chapter 1's α-β cost model (pplab.costmodel): tp's
    all-reduce of [s, b, h] as a ring over NVLink (no α inside a node); dp's gradients as a ring
    across 2 nodes, α = NETWORK_LATENCY; ep's dispatch and combine, forward and backward, as 4
    pairwise all-to-alls of the T·k·h tokens a rank routes."""
    from pplab.costmodel import predict
    dense = Transformer("m", layers=4, hidden=4096, heads=32, vocab=1000, seq=2048)
    e = estimate(dense, TWO_NODES, 8, Layout(dp=2, tp=8, zero=1, recompute="none"))
    per_tp = predict("all_reduce", "ring", 8, 2 * 2048 * 4096, 0.0, 1 / H100_SXM.nvlink)
    assert e.time["tp"] == pytest.approx(4 * per_tp * 4 * 4)                      # 4 a layer, 4 layers, m = 4
    psi = 4 * 12 * 4096 ** 2 / 8 + 1000 * 4096 / 8
    assert e.time["dp"] == pytest.approx(predict("all_reduce", "ring", 2, 2 * psi, at_scale.NETWORK_LATENCY,
                                                 1 / H100_SXM.network))
    moe = Transformer("moe", layers=2, hidden=1024, heads=8, vocab=1000, seq=512, experts=8, top_k=2)
    by_ep = {ep: estimate(moe, ONE_NODE, 8, Layout(dp=8 // ep, ep=ep, zero=1, recompute="none")) for ep in (1, 8)}
    a2a = predict("all_to_all", "pairwise", 8, 512 * 2 * 1024 * 2, 0.0, 1 / H100_SXM.nvlink)
    assert by_ep[8].time["compute"] - by_ep[1].time["compute"] == pytest.approx(2 * 4 * a2a)   # 2 layers, m = 1
