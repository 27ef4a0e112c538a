"""pplab.flops against hand counts, torch's own FLOP counter on the real GPT, and Narayanan et al. 2021."""
import math

import pytest
import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from pplab.flops import (Op, attention, block_ops, gpt_ops, roofline_seconds, elementwise, flops_per_token, forward_flops, hfu, layer_norm,
                         matmul, matmul_parameters, megatron_flops, megatron_parameters, mfu, roofline, six_n,
                         step_flops, training_seconds)
from pplab.hardware import A100_80GB, H100_SXM
from pplab.models import GPTConfig, gpt_layers, gpt_loss

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
