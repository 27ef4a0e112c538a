"""ZeRO++ (pplab/zero/plusplus.py) beyond tests/test_zero_plus_plus.py: what the swimlane's boxes say
each rank handed its collectives (worked out by hand), a forward with no backward after it, and
bad input on ranks."""
import pytest
import torch
import torch.distributed as dist
from torch import nn

import pplab
from pplab import collectives, trace
from pplab.cluster import Cluster
from pplab.flops import sent_per_rank
from pplab.trace import Timeline
from pplab.zero.plusplus import ZeroPlusPlus, dequantize, quantised_all_gather, quantised_reduce_scatter

pytestmark = pytest.mark.usefixtures("no_leftover_processes")


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 9), nn.Tanh(), nn.Linear(9, 5))         # units of 63 and 50 parameters


def _job():
    c, me = Cluster(2, 2), dist.get_rank()
    x = torch.randn(3, 6, generator=torch.Generator().manual_seed(me))
    errors = []
    for call in (lambda: ZeroPlusPlus(_model(), c, block=0),
                 lambda: quantised_reduce_scatter(torch.empty(3), torch.empty(10), c),
                 lambda: quantised_all_gather(torch.empty(5), torch.empty(2))):
        try:
            call()
        except ValueError as err:
            errors.append(str(err))
    # the boxes of one step, all off and all on (blocks of 5)
    boxes, sent = {}, {}
    for name, flags in (("off", dict(qwz=False, hpz=False, qgz=False)), ("all", {})):
        z = ZeroPlusPlus(_model(), c, block=5, **flags)
        trace.reset(me)
        with collectives.unchecked():
            z(x).sum().backward()
        events = trace.events()
        boxes[name] = {e.label: e.meta["payload"] for e in events if e.category == "comm" and e.kind != "send"
                       and e.kind != "recv"}
        sent[name] = events
    # hpZ: a forward with no backward, the masters changed, a forward again: it must use the new weights
    z = ZeroPlusPlus(_model(), c, qwz=False, hpz=True, qgz=False)
    with collectives.unchecked():
        start = trace.held()
        with torch.no_grad():                       # no backward can come: no secondary kept
            z(x)
        held = [trace.held() - start]
        z(x)
        held.append(trace.held() - start)
        with torch.no_grad():
            for shard in z.parameters():
                shard += 0.5
        again = z(x).detach()
    return errors, boxes, sent, again, held


def test_boxes_payloads_a_forward_without_backward_and_bad_input():
    results = pplab.launch(_job, world_size=4)
    ref = _model()
    with torch.no_grad():
        for w in ref.parameters():
            w += 0.5
    for rank, (errors, boxes, sent, again, held) in enumerate(results):
        assert len(errors) == 3 and "block must be" in errors[0] and "expected 4 x output.numel()" in errors[1] \
            and "expected 4 x input.numel()" in errors[2], (rank, errors)
        # units padded to 64 and 52 on 4 ranks: shards of 16 and 13 fp32 numbers
        assert boxes["off"] == {"AG0": 16 * 4, "AG1": 13 * 4, "RS1": 52 * 4, "RS0": 64 * 4}, rank
        # int8 + a 4-byte scale per 5 numbers; backward's gather in the node: my 1/2 of the unit, fp32
        assert boxes["all"] == {"AG0 (int8)": 16 + 4 * 4, "AG1 (int8)": 13 + 4 * 3, "AG1 (node)": 26 * 4,
                                "AG0 (node)": 32 * 4, "RS1 (int4)": 52 * 4, "RS0 (int4)": 64 * 4}, rank
        x = torch.randn(3, 6, generator=torch.Generator().manual_seed(rank))
        assert torch.allclose(again, ref(x), rtol=1e-6, atol=1e-6), f"rank {rank}: stale weights after a step"
        # hpZ holds, between forward and backward, half of each unit padded to 64 and 52: (32 + 26) fp32
        assert held == [0, (32 + 26) * 4], (rank, held)
    for name in ("off", "all"):          # every collective went over traced sends: each byte counted once
        timeline = Timeline([e for _, _, sent, _, _ in results for e in sent[name]], world_size=4)
        assert sent_per_rank(timeline) == max(timeline.bytes_sent(r) for r in range(4)) > 0


def test_dequantize_refuses_a_block_of_zero():
    with pytest.raises(ValueError, match="block must be"):
        dequantize(torch.zeros(4, dtype=torch.int8), torch.ones(1), block=0)
