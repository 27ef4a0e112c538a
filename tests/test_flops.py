"""pplab.flops against hand counts, torch's own FLOP counter on the real GPT, and Narayanan et al. 2021."""
import math

import pytest
import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

import pplab
from pplab import collectives, comm
from pplab.cluster import Cluster, two_tier
from pplab.flops import (Op, StepCount, attention, block_ops, count_step, gpt_ops, mfu_report, roofline_seconds, elementwise,
                         sent_per_rank, flops_per_token, forward_flops, hfu, layer_norm,
                         matmul, matmul_parameters, megatron_flops, megatron_parameters, mfu, roofline, six_n,
                         step_flops, training_seconds)
from pplab.hardware import A100_80GB, H100_SXM
from pplab.models import GPTConfig, gpt_layers, gpt_loss
from pplab.split import ring_sends
from pplab.trace import Event, Timeline

pytestmark = pytest.mark.usefixtures("no_leftover_processes")

ONE_LAYER = GPTConfig(vocab=30, seq=16, hidden=32, heads=4, ffn=64, layers=1)


def test_one_layer_equals_a_hand_count():
    # b = 3 sequences of s = 16 tokens: T = 48 rows of h = 32
    assert forward_flops(ONE_LAYER, batch=3) == {
        "qkv": 2 * 48 * 32 * 96,         # [48, 32] @ [32, 96]   = 294,912
        "scores": 2 * 3 * 4 * 16 * 8 * 16,   # 3 x 4 heads x [16, 8] @ [8, 16] = 49,152
        "attend": 2 * 3 * 4 * 16 * 16 * 8,   # 3 x 4 heads x [16, 16] @ [16, 8]
        "proj": 2 * 48 * 32 * 32,        # 98,304
        "fc1": 2 * 48 * 32 * 64,         # 196,608
        "fc2": 2 * 48 * 64 * 32,
        "head": 2 * 48 * 32 * 30,        # 92,160
    }
    assert sum(forward_flops(ONE_LAYER, batch=3).values()) == 976_896


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_forward_and_backward_equal_torchs_flop_counter_on_the_real_gpt(recompute):
    # two blocks, ffn not 4h, sequences shorter than the position table, a batch of 3
    cfg = GPTConfig(vocab=30, seq=16, hidden=32, heads=4, ffn=48, layers=2)
    model = nn.Sequential(*gpt_layers(cfg, seed=1))
    ids = torch.randint(0, 30, (3, 10), generator=torch.Generator().manual_seed(0))
    # the math kernel spells attention out as batched products, which the counter sees
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as forward:
        logits = model(ids)
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as backward:
        gpt_loss(logits, ids).backward()
    step = step_flops(cfg, batch=3, seq=10, recompute=recompute)
    assert step.forward == forward.get_total_flops() == 994_560
    assert step.backward == backward.get_total_flops() == 2 * 994_560
    assert step.model == 3 * 994_560
    parts = forward_flops(cfg, 3, 10)
    again = {"none": 0, "selective": parts["scores"] + parts["attend"], "full": step.forward - parts["head"]}
    assert step.recomputed == again[recompute] and step.hardware == step.model + again[recompute]


def test_megatron_formula_is_the_same_count_with_full_recomputation():
    # GPT-3 175B's shape (Brown et al. 2020), with the vocabulary of Narayanan et al.'s models
    cfg = GPTConfig(vocab=51200, seq=2048, hidden=12288, heads=96, ffn=4 * 12288, layers=96)
    ours = step_flops(cfg, batch=1536, recompute="full").hardware
    assert math.isclose(ours, megatron_flops(1536, 2048, 96, 12288, 51200), rel_tol=1e-12)
    # ... and close to 8 FLOPs per parameter per token (their training-time estimate's 8TP)
    tokens = 1536 * 2048
    assert 1.0 < ours / (8 * tokens * megatron_parameters(96, 12288, 51200, 2048)) < 1.1


# Narayanan et al. 2021, Table 1: (billions of parameters as printed, heads, hidden, layers); V = 51200, s = 2048
TABLE_1 = [(1.7, 24, 2304, 24), (3.6, 32, 3072, 30), (7.5, 32, 4096, 36), (18.4, 48, 6144, 40),
           (39.1, 64, 8192, 48), (76.1, 80, 10240, 60), (145.6, 96, 12288, 80), (310.1, 128, 16384, 96),
           (529.6, 128, 20480, 105), (1008.0, 160, 25600, 128)]


@pytest.mark.parametrize("published, heads, hidden, layers", TABLE_1)
def test_parameter_count_reproduces_table_1(published, heads, hidden, layers):
    assert round(megatron_parameters(layers, hidden, 51200, 2048) / 1e9, 1) == published


def test_training_time_reproduces_the_papers_estimates():
    day = 86400
    # GPT-3: 175B parameters, 300B tokens, 1024 A100s at 140 TFLOP/s each: "34 days"
    assert round(training_seconds(300e9, 175e9, 1024, 140e12) / day) == 34
    # 1T parameters, 450B tokens, 3072 A100s at 163 TFLOP/s: "84 days" (the formula gives 83.2)
    assert math.isclose(training_seconds(450e9, 1e12, 3072, 163e12) / day, 84, rel_tol=0.02)
    with pytest.raises(ValueError, match="at least one GPU"):
        training_seconds(1e9, 1e9, 0, 1e12)


def test_six_n_and_the_attention_term_per_token():
    cfg = GPTConfig(vocab=30, seq=16, hidden=32, heads=4, ffn=48, layers=2)
    assert matmul_parameters(cfg) == 2 * (4 * 32 * 32 + 2 * 32 * 48) + 32 * 30 == 15_296
    assert six_n(cfg) == 6 * 15_296
    assert flops_per_token(cfg) == 6 * 15_296 + 12 * 2 * 16 * 32
    assert flops_per_token(cfg, seq=10) * 3 * 10 == step_flops(cfg, 3, 10).model    # per token x tokens = per step
    assert flops_per_token(cfg, causal=True) == 6 * 15_296 + 6 * 2 * 16 * 32        # half the scores, by hand
    assert flops_per_token(cfg, seq=10, causal=True) == 6 * 15_296 + 6 * 2 * 10 * 32


def test_mfu_and_hfu_by_hand():
    cfg = GPTConfig(vocab=30, seq=16, hidden=32, heads=4, ffn=48, layers=2)
    step = step_flops(cfg, 3, 10, recompute="full")
    peak = 2 * step.model                       # the step took 2 s on a device that could do it 4 times a second
    assert mfu(step, 2.0, peak) == pytest.approx(1 / 4)
    assert mfu(step, 2.0, peak, devices=4) == pytest.approx(1 / 16)
    assert hfu(step, 2.0, peak) == pytest.approx(1 / 4 * step.hardware / step.model)
    assert hfu(step, 1.0, 1.0) > mfu(step, 1.0, 1.0)
    with pytest.raises(ValueError, match="must be positive"):
        mfu(step, 0.0, 1e12)


def test_bad_shapes_and_options_are_named():
    with pytest.raises(ValueError, match="recompute must be one of"):
        step_flops(ONE_LAYER, 3, recompute="some")
    with pytest.raises(ValueError, match="batch must be a positive whole number"):
        forward_flops(ONE_LAYER, 0)
    with pytest.raises(ValueError, match="seq must be"):
        forward_flops(ONE_LAYER, 2, seq=2.5)


def test_roofline_against_hand_intensities():
    big = matmul(4096, 4096, 4096)                       # bf16: 2n³ / (2 bytes x 3n²) = n/3
    assert big.intensity == pytest.approx(4096 / 3)
    small = matmul(48, 32, 96, name="qkv")               # the tiny GPT's qkv: 294,912 / (2 x 9,216)
    assert small.intensity == pytest.approx(16.0)
    assert layer_norm(48, 32).intensity == pytest.approx(7 / 4)
    assert elementwise(1000, inputs=2).intensity == pytest.approx(1 / 6)
    assert elementwise(1000, 1, 8, dtype_bytes=4).intensity == pytest.approx(1.0)
    assert attention(1, 1, 2048, 128).intensity == pytest.approx(1024)                 # s/2 when fused
    unfused = attention(1, 1, 2048, 128, fused=False)                                  # the [s, s] scores go to memory
    assert unfused.intensity == pytest.approx(4 * 2048 ** 2 * 128 / (2 * (4 * 2048 * 128 + 4 * 2048 ** 2)))

    ridge = 989.5e12 / 3.35e12                           # H100 SXM, bf16: about 295 FLOPs per byte
    for op, bound in [(big, "compute"), (small, "memory"), (layer_norm(48, 32), "memory"),
                      (attention(1, 1, 2048, 128), "compute"), (unfused, "memory")]:
        point = roofline(op, H100_SXM)
        assert point.ridge == pytest.approx(ridge) and point.bound == bound, op.name
        assert point.attainable == pytest.approx(min(989.5e12, op.intensity * 3.35e12))
    # fp32 on an A100: ridge 19.5e12 / 2.039e12 = 9.6, so the tiny qkv (intensity 8 in fp32) is still memory-bound
    assert roofline(matmul(48, 32, 96, dtype_bytes=4), A100_80GB, "fp32").bound == "memory"
    assert roofline(Op("x", 100.0, 1.0), A100_80GB, "fp32").bound == "compute"


def test_block_ops_add_up_to_the_forward_count():
    cfg = GPTConfig(vocab=30, seq=16, hidden=32, heads=4, ffn=48, layers=1)
    ops = {op.name: op for op in block_ops(cfg, batch=3)}
    parts = forward_flops(cfg, 3)
    products = ops["qkv"].flops + ops["attention"].flops + ops["proj"].flops + ops["fc1"].flops + ops["fc2"].flops
    assert products == sum(parts.values()) - parts["head"]
    assert [op.name for op in block_ops(cfg, 3)][:3] == ["ln1", "qkv", "attention"]


def test_gpt_ops_and_the_roofline_time_by_hand():
    cfg = GPTConfig(vocab=30, seq=16, hidden=32, heads=4, ffn=48, layers=2)
    ops = gpt_ops(cfg, batch=3, seq=10)
    assert [op.name for op in ops[-2:]] == ["ln_f", "head"] and len(ops) == 2 * 10 + 2
    assert sum(op.flops for op in ops if op.name in ("qkv", "attention", "proj", "fc1", "fc2", "head")) == \
        sum(forward_flops(cfg, 3, 10).values())
    # two ops on the A100 in fp32 (19.5e12 FLOP/s, 2.039e12 B/s): one memory-bound, one compute-bound
    two = [Op("a", 1e6, 1e6), Op("b", 1e9, 1e6)]
    assert roofline_seconds(two, A100_80GB, "fp32") == pytest.approx(1e6 / 2.039e12 + 1e9 / 19.5e12)


# ----------------------------------------------------------------------------------
# A chapter's run reported: count_step, sent_per_rank, mfu_report

def test_count_step_counts_an_mlp_by_hand_and_leaves_the_model_alone():
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(12, 20), nn.Tanh(), nn.Linear(20, 7, bias=False))
    x = torch.randn(5, 12)
    mlp(x).sum().backward()                                   # a gradient the count must not touch
    before = [w.grad.clone() for w in mlp.parameters()], [w.detach().clone() for w in mlp.parameters()]
    rng = torch.get_rng_state()
    step = count_step(mlp, x)
    assert torch.equal(torch.get_rng_state(), rng)
    for w, grad, value in zip(mlp.parameters(), *before):
        assert torch.equal(w.grad, grad) and torch.equal(w.detach(), value)
    # forward: 2·5·12·20 + 2·5·20·7; backward: both weights' gradients, and only the second layer's
    # input gradient (the first layer's input is data: nobody asks for its gradient)
    forward = 2 * 5 * 12 * 20 + 2 * 5 * 20 * 7
    assert step.flops == forward + forward + 2 * 5 * 7 * 20 == 9_000
    with FlopCounterMode(display=False) as counter:
        mlp(x).sum().backward()
    assert step.flops == counter.get_total_flops()
    assert step.dtype == "fp32" and [op.name for op in step.ops][:2] == ["addmm", "mm"]
    # addmm(bias [20], x [5, 12], weightᵀ [12, 20]) -> [5, 20], float32: every tensor read or written once
    assert step.ops[0] == Op("addmm", 2 * 5 * 12 * 20, 4 * (20 + 5 * 12 + 12 * 20 + 5 * 20))
    assert count_step(mlp.double(), x.double(), loss=lambda y: y.square().mean()).dtype == "fp64"
    with pytest.raises(TypeError, match="takes an nn.Module"):
        count_step(lambda t: t, x)
    with pytest.raises(ValueError, match="no matrix product"):
        count_step(nn.Sequential(nn.LayerNorm(12)), x)


class _KeepsItsLoss(nn.Linear):
    def forward(self, x):
        y = super().forward(x)
        self.aux_loss = y.square().mean()           # kept from the forward: a tensor that is no leaf
        return y


def test_count_step_on_a_model_that_keeps_a_tensor_of_its_last_forward():
    model = _KeepsItsLoss(3, 2)
    model(torch.ones(4, 3))
    kept = model.aux_loss
    assert count_step(model, torch.ones(4, 3)).flops == 2 * (2 * 4 * 3 * 2) and model.aux_loss is kept


def test_count_step_on_the_gpt_is_the_hand_count():
    cfg = GPTConfig(vocab=30, seq=16, hidden=32, heads=4, ffn=48, layers=2)
    ids = torch.randint(0, 30, (3, 10), generator=torch.Generator().manual_seed(0))
    step = count_step(nn.Sequential(*gpt_layers(cfg, seed=1)), ids, loss=lambda logits: gpt_loss(logits, ids))
    assert step.flops == step_flops(cfg, 3, 10).model == 3 * 994_560 and step.dtype == "fp64"


def test_mfu_report_by_hand():
    # two products of a step in float32: one compute-bound on an H100, one memory-bound
    big, small = Op("mm", 2 * 4096 ** 3, 4 * 3 * 4096 ** 2), Op("mm", 2 * 64 * 64 * 64, 4 * 3 * 64 * 64)
    step = StepCount((big, small), "fp32")
    report = mfu_report(step, seconds=0.5, ranks=4, sent_bytes=9e6, peak=2e12)
    flops = big.flops + small.flops
    assert report.mfu_here == pytest.approx(flops / (0.5 * 2e12))           # 4 ranks, one machine: one peak
    # on 4 H100s in bf16 the bytes halve: big moves 2·3·4096² B, small 2·3·64² B
    peak, hbm = 989.5e12, 3.35e12
    compute = (2 * 4096 ** 3 / peak + 2 * 3 * 64 * 64 / hbm) / 4               # big at its peak, small at HBM's speed
    assert report.compute_seconds == pytest.approx(compute)
    assert report.memory_bound == pytest.approx(2 * 3 * 64 * 64 / hbm / 4 / compute)
    assert report.comm_seconds == pytest.approx(4.5e6 / 450e9)                 # 9 MB in fp32, 4.5 MB in bf16, NVLink
    assert report.mfu_preset == pytest.approx(flops / (4 * (compute + 4.5e6 / 450e9) * peak))
    text = str(report)
    assert f"MFU {100 * flops / 1e12:.3g}%" in text and "predicted from the roofline, not measured" in text
    assert f"MFU at most {100 * report.mfu_preset:.3g}%" in text and "4 x H100 SXM in bf16" in text

    # no op list: the FLOPs at the preset's peak; another preset, dtype and link
    by_count = mfu_report(6e9, seconds=0.1, ranks=3, sent_bytes=None, dtype="fp64", peak=1e11, preset=A100_80GB,
                          preset_dtype="fp32", link_bandwidth=25e9)
    assert by_count.mfu_here == pytest.approx(0.6) and by_count.memory_bound is None
    assert by_count.compute_seconds == pytest.approx(2e9 / 19.5e12) and by_count.comm_seconds == 0
    assert by_count.mfu_preset == pytest.approx(1.0) and "sends not traced" in str(by_count)
    gpt = step_flops(GPTConfig(vocab=30, seq=16, hidden=32, heads=4, ffn=48, layers=2), 3, 10)
    assert mfu_report(gpt, 1.0, peak=4 * gpt.model).mfu_here == pytest.approx(0.25)


def test_mfu_report_names_what_is_wrong():
    step = StepCount((Op("mm", 100, 40),), "fp32")
    for kwargs, message in [({"seconds": 0}, "measured seconds per step"), ({"ranks": 0}, "ranks must be"),
                            ({"ranks": 2.0}, "ranks must be"), ({"sent_bytes": -1}, "sent_bytes must be"),
                            ({"dtype": "fp8"}, "dtype must be one of"), ({"preset_dtype": "int8"}, "preset_dtype"),
                            ({"ranks": 16}, "do not fit one node of 8 GPUs")]:
        with pytest.raises(ValueError, match=message):
            mfu_report(step, **{"seconds": 1.0, "peak": 1e9, **kwargs})
    with pytest.raises(ValueError, match="work must be a StepCount"):
        mfu_report(-5, 1.0, peak=1e9)
    assert mfu_report(step, 1.0, ranks=16, peak=1e9, link_bandwidth=50e9).ranks == 16


def _every_collective(use_rings):
    from pplab import collectives, comm
    rank, p = comm.rank(), comm.world_size()
    x = torch.arange(12.0) + rank                              # 48 bytes, a multiple of 3 pieces
    out = torch.empty(36)
    if use_rings:                                              # pplab.collectives: rings of traced sends
        collectives.all_reduce(x.clone(), algorithm="ring")
        collectives.all_gather_into_tensor(out, x)
        collectives.reduce_scatter_tensor(torch.empty(4), x)
        collectives.all_to_all_single(torch.empty(12), x)
    else:                                                      # the backend's: the trace holds payloads
        comm.all_reduce(x.clone())
        comm.all_gather_into_tensor(out, x)
        comm.reduce_scatter_tensor(torch.empty(4), x)
        comm.all_to_all_single(torch.empty(12), x)
    if rank == 1:                                              # and one point-to-point message
        comm.send(torch.ones(5), dst=2)
    elif rank == 2:
        comm.recv(torch.empty(5), src=1)


def test_sent_per_rank_counts_what_rings_send():
    import pplab

    backend = pplab.launch(_every_collective, False, world_size=3).timeline
    rings = pplab.launch(_every_collective, True, world_size=3).timeline
    # 3 ranks, 48 bytes: all-reduce 2·(2/3)·48, all-gather 2·48, reduce-scatter and all-to-all (2/3)·48 each;
    # rank 1 also sends 20 bytes
    assert sent_per_rank(backend) == pytest.approx(64 + 96 + 32 + 32 + 20)
    assert max(rings.bytes_sent(r) for r in range(3)) == sent_per_rank(rings) == sent_per_rank(backend)
    assert sent_per_rank(backend, steps=4) == pytest.approx(244 / 4)
    with pytest.raises(ValueError, match="steps must be"):
        sent_per_rank(backend, steps=0)


def test_sent_per_rank_refuses_what_it_cannot_count():
    from pplab.trace import Event, Timeline
    odd = Timeline([Event(0, "all_gather_object", "comm", 0.0, 1.0, group=(0, 1), meta={"payload": 8})], world_size=2)
    with pytest.raises(ValueError, match="'all_gather_object' whose bytes"):
        sent_per_rank(odd)
    disk = Timeline([Event(0, "disk_read", "comm", 0.0, 1.0, meta={"payload": 8}),
                     Event(1, "send", "comm", 0.0, 1.0, bytes_sent=12, peer=0, seq=0)], world_size=2)
    assert sent_per_rank(disk, skip=("disk_read",)) == 12


def test_a_step_count_repeated():
    one = StepCount((Op("mm", 10, 4), Op("bmm", 6, 2)), "bf16")
    assert (one * 3).flops == 48 and (one * 3).ops == one.ops * 3 and (one * 3).dtype == "bf16"
    with pytest.raises(ValueError, match="positive whole number"):
        one * 0


def test_this_machines_peak_is_fitted_once():
    from pplab.hardware import peak_here
    threads = torch.get_num_threads()
    first = peak_here("fp64")
    assert math.isfinite(first) and first > 0 and peak_here("fp64") == first        # kept, not fitted again
    assert torch.get_num_threads() == threads, "the fit runs on one thread, then gives torch its threads back"


# -- sent_per_rank and pplab.split.ring_sends -----------------------------------------------------------
# An all-reduce the ranks do not divide, collectives run over point-to-point sends
# (pplab.cluster.two_tier), every kind's ring count against bytes traced by pplab.collectives' own
# rings or worked out by hand.


def test_ring_sends_by_hand():
    # 10 things on 4 ranks, chunks [3, 3, 2, 2]: rank 0 sends all but its 3, then all but rank 1's 3
    assert [ring_sends("all_reduce", 10, 4, me) for me in range(4)] == [14, 15, 16, 15]
    assert ring_sends("all_gather", 12, 3, 2) == ring_sends("reduce_scatter", 12, 3, 0) == 8
    assert ring_sends("all_to_all", 12, 3, 1) == 8 and ring_sends("all_reduce", 12, 1, 0) == 0
    with pytest.raises(ValueError, match="ring_sends knows"):
        ring_sends("broadcast", 12, 3, 0)


def _uneven(how):
    """An all-reduce of 10 one-byte numbers on 3 ranks: the backend's, pplab's ring, or under two_tier."""
    x = torch.arange(10, dtype=torch.uint8) + comm.rank()
    if how == "backend":
        comm.all_reduce(x)
    elif how == "ring":
        collectives.all_reduce(x, algorithm="ring")
    else:
        with two_tier(Cluster(3, 1), bandwidth=math.inf):       # comm.all_reduce runs as pplab's ring
            comm.all_reduce(x)
    return x


def test_sent_per_rank_for_an_uneven_all_reduce_and_over_point_to_point():
    runs = {how: pplab.launch(_uneven, how, world_size=3) for how in ("backend", "ring", "two_tier")}
    for how, res in runs.items():
        assert all(torch.equal(x, torch.arange(10, dtype=torch.uint8) * 3 + 3) for x in res), how
    ring = runs["ring"].timeline
    # chunks [4, 3, 3]: rank 1 sends 20 - 3 - 3 = 14 bytes, ranks 0 and 2 13, as the rings' traced sends say
    assert [ring.bytes_sent(r) for r in range(3)] == [13, 14, 13]
    assert sent_per_rank(runs["backend"].timeline) == 14
    # under two_tier the all-reduce's sends are in the trace, beside the box that says it ran: counted once
    tiered = runs["two_tier"].timeline
    assert max(tiered.bytes_sent(r) for r in range(3)) == sent_per_rank(tiered) == 14


def test_sent_per_rank_for_the_kinds_sent_as_chains():
    # a broadcast of 40 bytes, a reduce of 40, a scatter of 8-byte pieces, a gather of 8-byte pieces,
    # a barrier, over 4 ranks: NCCL's chains send the payload once per rank, a scatter's root 3 pieces
    events = [Event(0, kind, "comm", 0.0, 1.0, group=(0, 1, 2, 3), meta={"payload": n})
              for kind, n in (("broadcast", 40), ("reduce", 40), ("scatter", 8), ("gather", 8), ("barrier", 0))]
    assert sent_per_rank(Timeline(events, world_size=4)) == 40 + 40 + 3 * 8 + 8


def test_mfu_report_on_eight_ranks_uses_the_node_link():
    report = mfu_report(StepCount((Op("mm", 1e9, 1e6),), "fp32"), 1.0, ranks=8, sent_bytes=0, peak=1e9)
    assert report.link_bandwidth == report.preset.nvlink


def test_count_step_of_a_strided_cnn_is_torchs_flop_counter():
    from torch import nn
    from torch.utils.flop_counter import FlopCounterMode

    from pplab.flops import count_step
    torch.manual_seed(0)
    cnn = nn.Sequential(nn.Conv2d(3, 5, 3, padding=1), nn.ReLU(), nn.Conv2d(5, 4, 3, stride=2), nn.Flatten(),
                        nn.Linear(4 * 3 * 3, 2))
    x = torch.randn(2, 3, 8, 8)
    with FlopCounterMode(display=False) as counter:
        cnn(x).sum().backward()
    assert count_step(cnn, x).flops == counter.get_total_flops() == 89_424


class _Attention(torch.nn.Module):
    """One fused qkv layer and torch's scaled_dot_product_attention, 4 heads of 4 on [2, 7, 16]."""

    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(16, 48)

    def forward(self, x):
        q, k, v = self.qkv(x).view(2, 7, 3, 4, 4).permute(2, 0, 3, 1, 4)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


def test_count_step_counts_fused_attention_as_its_products_by_hand():
    from pplab.flops import count_step
    # qkv: forward 2·14·16·48 and its weight's gradient as much (x is data); attention: q·kᵀ and ·v,
    # 2 · 2·b·heads·s²·d forward, twice that backward (every score counted, as the published counts do)
    attention = 2 * 2 * 2 * 4 * 7 * 7 * 4
    assert count_step(_Attention(), torch.randn(2, 7, 16)).flops == 2 * (2 * 14 * 16 * 48) + 3 * attention


def test_count_step_reports_the_dtype_that_ran_most_flops():
    from torch import nn

    from pplab.flops import count_step

    class Widen(nn.Module):                    # bf16 in, a wide bf16 product, then a small fp32 one
        def __init__(self):
            super().__init__()
            self.big, self.small = nn.Linear(8, 32).bfloat16(), nn.Linear(32, 2)

        def forward(self, x):
            return self.small(self.big(x.bfloat16()).float())
    step = count_step(Widen(), torch.randn(4, 8))
    # big: 2·4·8·32 forward and its weight's gradient (its input is data); small: 2·4·32·2, three times
    assert step.flops == 2 * (2 * 4 * 8 * 32) + 3 * (2 * 4 * 32 * 2) and step.dtype == "bf16"


def test_hfu_on_several_devices_by_hand():
    from pplab.flops import hfu, step_flops
    from pplab.models import GPTConfig
    step = step_flops(GPTConfig(vocab=30, seq=16, hidden=32, heads=4, ffn=48, layers=2), 3, 10, recompute="full")
    # 3 devices at 1e9 FLOP/s for 2 s could run 6e9 FLOPs: HFU is the hardware's FLOPs over that
    assert hfu(step, 2.0, 1e9, devices=3) == pytest.approx(step.hardware / 6e9)


def test_block_ops_by_hand():
    """One block of h = 32, f = 48, 4 heads of 8, on b = 3 sequences of s = 10 (T = 30 tokens), bf16:
    every op's FLOPs and the bytes it reads and writes, worked out here."""
    from pplab.flops import block_ops
    from pplab.models import GPTConfig
    cfg = GPTConfig(vocab=30, seq=16, hidden=32, heads=4, ffn=48, layers=1)
    assert [(op.name, op.flops, op.bytes) for op in block_ops(cfg, batch=3, seq=10)] == [
        ("ln1", 7 * 960, 2 * 2 * 960),                                  # [30, 32]: 960 elements in, 960 out
        ("qkv", 2 * 30 * 32 * 96, 2 * (30 * 32 + 32 * 96 + 30 * 96)),    # [30, 32] @ [32, 96]
        ("attention", 4 * 3 * 4 * 10 * 10 * 8, 2 * 4 * 3 * 4 * 10 * 8),  # fused: q, k, v read, out written
        ("proj", 2 * 30 * 32 * 32, 2 * (30 * 32 + 32 * 32 + 30 * 32)),
        ("residual add", 960, 2 * 3 * 960),                             # two inputs, one output
        ("ln2", 7 * 960, 2 * 2 * 960),
        ("fc1", 2 * 30 * 32 * 48, 2 * (30 * 32 + 32 * 48 + 30 * 48)),
        ("gelu", 8 * 1440, 2 * 2 * 1440),                               # over the f-wide [30, 48]
        ("fc2", 2 * 30 * 48 * 32, 2 * (30 * 48 + 48 * 32 + 30 * 32)),
        ("residual add", 960, 2 * 3 * 960)]
