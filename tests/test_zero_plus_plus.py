"""ZeRO++ (pplab/zero/plusplus.py) on real ranks of an emulated two-tier cluster.

References: hand values and torch's own quantisation (torch.quantize_per_channel) for the
quantiser; one-process training for the exact paths (all off, hpZ alone); for the quantised
paths, one process with the same weights the ranks computed with, and the error bound that
block-wise rounding implies; the byte formulas worked out in predict_cross_node_bytes's doc.
"""
import math
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

import pplab
from pplab import collectives, trace
from pplab.cluster import Cluster, cross_node_bytes, two_tier
from pplab.flops import sent_per_rank
from pplab.trace import Timeline
from pplab.zero import FullyShardedModule
from pplab.zero.plusplus import (ZeroPlusPlus, dequantize, pack_int4, predict_cross_node_bytes, quantize,
                                 quantised_all_gather, quantised_reduce_scatter, unpack_int4)

pytestmark = pytest.mark.usefixtures("no_leftover_processes")

ROWS, LR, STEPS, BLOCK = 12, 0.1, 3, 5
SETTINGS = {"off": dict(qwz=False, hpz=False, qgz=False), "hpz": dict(qwz=False, hpz=True, qgz=False),
            "qwz": dict(qwz=True, hpz=False, qgz=False), "qgz": dict(qwz=False, hpz=False, qgz=True),
            "all": dict(qwz=True, hpz=True, qgz=True), "all_int8": dict(grad_bits=8)}


# -- the quantiser ------------------------------------------------------------------------


def test_quantize_by_hand():
    x = torch.tensor([127.0, -3.6, 50.2, 0.0, -2.54, 1.0])
    q, scales = quantize(x, bits=8, block=4)                      # blocks [127, -3.6, 50.2, 0], [-2.54, 1]
    assert q.tolist() == [127, -4, 50, 0, -127, 50] and q.dtype == torch.int8
    assert torch.allclose(scales, torch.tensor([1.0, 0.02]))      # max|x| / 127 per block
    assert torch.allclose(dequantize(q, scales, block=4), torch.tensor([127.0, -4.0, 50.0, 0.0, -2.54, 1.0]))
    q4, s4 = quantize(torch.tensor([7.0, -3.2, 2.6, 0.0, 0.0]), bits=4, block=4)
    assert q4.tolist() == [7, -3, 3, 0, 0] and s4.tolist() == [1.0, 0.0]      # an all-zero block: scale 0
    packed = pack_int4(torch.tensor([-7, 7, 0, 3, -1], dtype=torch.int8))     # +8: 1, 15, 8, 11, 7 (+ pad 8)
    assert packed.tolist() == [1 | 15 << 4, 8 | 11 << 4, 7 | 8 << 4]
    assert unpack_int4(packed, 5).tolist() == [-7, 7, 0, 3, -1]


@pytest.mark.parametrize("bits", [8, 4])
def test_quantize_equals_torch_quantize_per_channel_and_keeps_its_bound(bits):
    g = torch.Generator().manual_seed(bits)
    x = torch.randn(1003, generator=g) * torch.logspace(-3, 2, 1003)         # blocks of very different sizes
    block, qmax = 64, 2 ** (bits - 1) - 1
    q, scales = quantize(x, bits, block)
    rows = torch.zeros(len(scales) * block)
    rows[:x.numel()] = x
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")                                      # torch's quantized dtypes: deprecated
        ref = torch.quantize_per_channel(rows.view(-1, block), rows.view(-1, block).abs().amax(1).double() / qmax,
                                         torch.zeros(len(scales), dtype=torch.long), 0, torch.qint8)
    differ = q != ref.int_repr().reshape(-1)[:x.numel()]
    steps = (x / scales.repeat_interleave(block)[:x.numel()])[differ]     # torch multiplies by 1/scale: a tie
    assert int(differ.sum()) <= 1 and bool(((steps.abs().frac() - 0.5).abs() < 1e-4).all())   # may round apart
    assert torch.allclose(dequantize(q, scales, block), ref.dequantize().reshape(-1)[:x.numel()], rtol=1e-6, atol=0)
    assert q.abs().max() == qmax
    error = (dequantize(q, scales, block) - x).abs()
    assert bool((error <= scales.repeat_interleave(block)[:x.numel()] / 2 * (1 + 1e-6)).all())


def test_bad_input():
    with pytest.raises(ValueError, match="bits must be 4 or 8"):
        quantize(torch.ones(3), bits=2)
    with pytest.raises(ValueError, match="block must be"):
        quantize(torch.ones(3), block=0)
    with pytest.raises(ValueError, match="need 1 scales"):
        dequantize(torch.ones(3, dtype=torch.int8), torch.ones(2), block=4)


# -- training on ranks ---------------------------------------------------------------------


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 9), nn.Tanh(), nn.Linear(9, 5))         # 63 and 50 parameters


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(ROWS, 6, generator=g), torch.randn(ROWS, 5, generator=g)


@torch.no_grad()
def _sgd_step(params):
    """Plain SGD by hand (torch.optim's first use imports torch._dynamo: seconds per rank)."""
    for t in params:
        t -= LR * t.grad
        t.grad = None


def _mine(x, p):
    k = len(x) // p
    return x[dist.get_rank() * k:(dist.get_rank() + 1) * k]


def _rank_data(rank, numel, spread=True):
    """Rank-specific numbers; with spread, each block of 3 on its own scale, 0.01 to 100."""
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(numel, generator=g)
    if spread:
        x *= (10.0 ** torch.randint(-2, 3, (math.ceil(numel / 3),), generator=g)).repeat_interleave(3)[:numel]
    return x


def _collectives(cluster):
    """The two quantised collectives alone, on this rank's own numbers: 7 per rank and piece."""
    p = cluster.world_size
    gathered = torch.empty(p * 7)
    quantised_all_gather(gathered, _rank_data(dist.get_rank(), 7), block=3)
    reduced = {}
    for bits in (4, 8):
        reduced[bits] = torch.empty(7)
        quantised_reduce_scatter(reduced[bits], _rank_data(dist.get_rank(), 7 * p, spread=False), cluster,
                                 bits=bits, block=3)
    return {"gathered": gathered, "reduced": reduced}


def _train(cluster, names, block):
    """Each setting trains STEPS SGD steps; per step: the master state before it, and the bytes
    that crossed nodes (this rank's sends). ZeRO-3 (FullyShardedModule) trains alongside."""
    x, y = _data()
    out = {"collectives": _collectives(cluster)}
    for name in names:
        wrapped = (FullyShardedModule(_model()) if name == "zero3" else
                   ZeroPlusPlus(_model(), cluster, block=block, **SETTINGS[name]))
        states, crossed = [], []
        for _ in range(STEPS):
            states.append(wrapped.state_dict())
            trace.reset(dist.get_rank())
            with collectives.unchecked(), two_tier(cluster, bandwidth=math.inf):   # known-good calls: no call check
                nn.functional.mse_loss(wrapped(_mine(x, cluster.world_size)), _mine(y, cluster.world_size)).backward()
                _sgd_step(wrapped.parameters())
            crossed.append(cross_node_bytes(Timeline(trace.events()), cluster, rank=dist.get_rank()))
        states.append(wrapped.state_dict())
        out[name] = {"states": states, "crossed": crossed, "padded": [u.bucket.padded for u in wrapped.layers]}
    return out


def _one_process(steps):
    model = _model()
    x, y = _data()
    for _ in range(steps):
        nn.functional.mse_loss(model(x), y).backward()
        _sgd_step(model.parameters())
    return model.state_dict()


@pytest.fixture(scope="module", params=[(2, 2), (2, 3)], ids=["2x2", "2x3"])
def trained(request):
    """One launch per cluster trains every setting (a launch costs more than the training)."""
    cluster = Cluster(*request.param)
    return cluster, pplab.launch(_train, cluster, ["zero3", *SETTINGS], BLOCK, world_size=cluster.world_size)


def test_quantised_collectives_against_torch_and_the_bound(trained):
    cluster, runs = trained
    p = cluster.world_size
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pieces = []
        for r in range(p):                           # each rank's 7 numbers by torch's quantiser, blocks of 3
            rows = torch.cat([_rank_data(r, 7), torch.zeros(2)]).view(3, 3)
            q = torch.quantize_per_channel(rows, rows.abs().amax(1).double() / 127, torch.zeros(3, dtype=torch.long),
                                           0, torch.qint8)
            pieces.append(q.dequantize().reshape(-1)[:7])
    for rank, run in enumerate(runs):
        assert torch.allclose(run["collectives"]["gathered"], torch.cat(pieces), rtol=1e-6, atol=0), f"rank {rank}"
    inputs = [_rank_data(r, 7 * p, spread=False) for r in range(p)]     # the bound uses each rank's largest
    exact = sum(inputs)
    for bits in (4, 8):
        q = 2 ** (bits - 1) - 1
        m = [x.abs().max().item() for x in inputs]   # the bound of _qgz_bound, for a sum (not a mean)
        bound = sum(mk / (2 * q) for mk in m) + sum(sum(m[k] for k in cluster.node_ranks(a)) * (1 + 1 / (2 * q)) / (2 * q)
                                                  for a in range(cluster.n_nodes))
        for rank, run in enumerate(runs):
            got, want = run["collectives"]["reduced"][bits], exact[7 * rank:7 * (rank + 1)]
            assert (got - want).abs().max() <= bound, f"int{bits}, rank {rank}: my piece of the sum"
            assert (got - want).abs().max() > 0, "the gradients were rounded on the way"


def test_exact_paths_train_like_one_process(trained):
    cluster, runs = trained
    want = _one_process(STEPS)
    for name in ("zero3", "off", "hpz"):                        # no quantisation: equal up to rounding
        for rank, run in enumerate(runs):
            if rank == 0:                                       # state_dict: the full state on rank 0 only
                final = run[name]["states"][-1]
                for key, value in want.items():
                    assert torch.allclose(final[key], value, rtol=1e-5, atol=1e-6), f"{name}: {key}"
            else:
                assert run[name]["states"][-1] == {}


def test_every_path_crosses_nodes_as_the_formula_says(trained):
    cluster, runs = trained
    p = cluster.world_size
    for name in SETTINGS:
        padded = runs[0][name]["padded"]
        assert padded == [math.ceil(63 / p) * p, math.ceil(50 / p) * p]       # shards the model does not fill
        predicted = predict_cross_node_bytes(padded, cluster, 4, block=BLOCK, **SETTINGS[name])["total"]
        for step in range(STEPS):
            assert sum(r[name]["crossed"][step] for r in runs) == predicted, f"{name}, step {step}"


def test_cross_node_formula_by_hand():
    # 2 × 2, units of 64 and 52 fp32 numbers (shards of 16, 13): 3 ring passes × 2 links × 3 shards
    cluster = Cluster(2, 2)
    assert predict_cross_node_bytes([64, 52], cluster, 4, False, False, False)["total"] == 3 * 2 * 3 * (16 + 13) * 4
    # ZeRO++: int8 shards + one scale per 5 numbers (4 and 3 scales); int4 gradients: 8 and 7 bytes,
    # each of 4 ranks sending 1 piece to the other node
    assert predict_cross_node_bytes([64, 52], cluster, 4, block=BLOCK)["total"] == \
        2 * 3 * (16 + 4 * 4 + 13 + 4 * 3) + 4 * 1 * (8 + 4 * 4 + 7 + 4 * 3)
    # 3 × 2 (units of 66 and 54: shards of 11 and 9), blocks of 4, hpZ off: the backward gather crosses
    # too, in int8 (ring: 3 links × 5 shards); int8 gradients: each of 6 ranks sends 2 pieces across
    assert predict_cross_node_bytes([66, 54], Cluster(3, 2), 2, hpz=False, grad_bits=8, block=4)["total"] == \
        2 * 3 * 5 * (11 + 4 * 3 + 9 + 4 * 3) + 6 * 2 * (11 + 4 * 3 + 9 + 4 * 3)
    assert predict_cross_node_bytes([66, 54], Cluster(3, 2), 2, False, False, False)["gradients"] == \
        3 * 5 * (11 + 9) * 2


def _flat_shards(state, p):
    """Each unit's parameters end to end, padded, as p shards (FlatBucket's layout)."""
    units = [["0.weight", "0.bias"], ["2.weight", "2.bias"]]
    out = []
    for names in units:
        flat = torch.cat([state[n].reshape(-1) for n in names])
        padded = torch.zeros(math.ceil(flat.numel() / p) * p)
        padded[:flat.numel()] = flat
        out.append(padded.view(p, -1))
    return out


def _quantised_weights(state, p, block):
    """What forward computes with under qwZ, by torch's own quantiser: each shard, block by block."""
    units = [["0.weight", "0.bias"], ["2.weight", "2.bias"]]
    out = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for names, shards in zip(units, _flat_shards(state, p)):
            pieces = []
            for shard in shards:
                rows = torch.zeros(math.ceil(shard.numel() / block) * block)
                rows[:shard.numel()] = shard
                rows = rows.view(-1, block)
                scale = rows.abs().amax(1).double() / 127
                scale[scale == 0] = 1
                q = torch.quantize_per_channel(rows, scale, torch.zeros(len(rows), dtype=torch.long), 0, torch.qint8)
                pieces.append(q.dequantize().reshape(-1)[:shard.numel()])
            flat = torch.cat(pieces)
            for n in names:
                out[n], flat = flat[:state[n].numel()].view_as(state[n]), flat[state[n].numel():]
    return out


def _gradients(weights, p):
    """Every rank's gradient (on its rows) and the mean over ranks, at `weights`, on one process."""
    model = _model()
    model.load_state_dict(weights)
    x, y = _data()
    k = ROWS // p
    per_rank = []
    for r in range(p):
        model.zero_grad()
        nn.functional.mse_loss(model(x[r * k:(r + 1) * k]), y[r * k:(r + 1) * k]).backward()
        per_rank.append({n: t.grad.clone() for n, t in model.named_parameters()})
    return per_rank, {n: sum(g[n] for g in per_rank) / p for n in per_rank[0]}


def _qgz_bound(per_rank, cluster, bits):
    """Largest error of qgZ's mean gradient. Rank k's contribution is rounded once (<= M_k/2q, M_k its
    largest |g|); each node's sum, at most Σ M_k (1 + 1/2q), once more; the mean divides by p."""
    q = 2 ** (bits - 1) - 1
    m = [max(g.abs().max().item() for g in grads.values()) for grads in per_rank]
    hop1 = sum(mk / (2 * q) for mk in m)
    hop2 = sum(sum(m[k] for k in cluster.node_ranks(a)) * (1 + 1 / (2 * q)) / (2 * q) for a in range(cluster.n_nodes))
    return (hop1 + hop2) / cluster.world_size


def test_quantised_paths_step_by_step_within_the_rounding_bound(trained):
    """Every step: master' = master - lr · g̃, where g̃ is within the qgZ bound of the exact mean gradient
    at the weights forward used: the masters themselves (no qwZ) or their int8 rounding (qwZ, torch's)."""
    cluster, runs = trained
    p = cluster.world_size
    for name in ("qwz", "qgz", "all", "all_int8"):
        flags = dict(qwz=True, hpz=True, qgz=True, grad_bits=4) | SETTINGS[name]
        states = runs[0][name]["states"]
        for step in range(STEPS):
            before, after = states[step], states[step + 1]
            weights = _quantised_weights(before, p, BLOCK) if flags["qwz"] else before
            per_rank, mean = _gradients(weights, p)
            bound = _qgz_bound(per_rank, cluster, flags["grad_bits"]) if flags["qgz"] else 1e-6
            for key in mean:
                used = (before[key] - after[key]) / LR                  # the gradient the step applied
                worst = (used - mean[key]).abs().max().item()
                assert worst <= bound * 1.001 + 1e-6, f"{name}, step {step}, {key}: off by {worst:.2e} > {bound:.2e}"
        if flags["qgz"]:                                                # the rounding is real, not skipped
            _, mean = _gradients(states[0] if not flags["qwz"] else _quantised_weights(states[0], p, BLOCK), p)
            used = {k: (states[0][k] - states[1][k]) / LR for k in mean}
            assert max((used[k] - mean[k]).abs().max().item() for k in mean) > 1e-5, name


def test_bad_input_on_ranks():
    def wrong_world():
        with pytest.raises(ValueError, match="launch with world_size=6"):
            ZeroPlusPlus(_model(), Cluster(3, 2))
        with pytest.raises(TypeError, match="pplab.cluster.Cluster"):
            ZeroPlusPlus(_model(), (2, 2))
        with pytest.raises(ValueError, match="bits must be 4 or 8"):
            ZeroPlusPlus(_model(), Cluster(2, 2), grad_bits=3)
        return True
    assert all(pplab.launch(wrong_world, world_size=4))


# -- what the swimlane's boxes say, a forward alone, bad input on ranks --------------------------------
# What the swimlane's boxes say each rank handed its collectives (worked out by hand), a forward
# with no backward after it, and bad input on ranks.


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
