"""pplab.flops.sent_per_rank and pplab.split.ring_sends beyond tests/test_flops.py: an all-reduce the
ranks do not divide, collectives run over point-to-point sends (pplab.cluster.two_tier), every
kind's ring count against bytes traced by pplab.collectives' own rings or worked out by hand."""
import math

import pytest
import torch

import pplab
from pplab import collectives, comm
from pplab.cluster import Cluster, two_tier
from pplab.flops import Op, StepCount, mfu_report, sent_per_rank
from pplab.split import ring_sends
from pplab.trace import Event, Timeline

pytestmark = pytest.mark.usefixtures("no_leftover_processes")


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
