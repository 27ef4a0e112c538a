"""Activation recomputation (pplab.recompute) against the run that keeps everything, and its
saved bytes against Korthikanti et al. 2022, Table 2.

Exactness: the same block, inputs and random seed with and without recomputation give bit-equal
outputs, input gradients and parameter gradients (torch.equal), with dropout on: recomputation
must draw the forward's masks again. On one process, on tensor-parallel ranks (t = 2, 3), with and
without sequence parallelism, and through a 1F1B pipeline of two stages.

Bytes: what autograd keeps (pplab.memory.saved_activations) equals Table 2's row for each policy,
in bf16 (2-byte activations, 1-byte dropout masks, as the paper counts), plus LayerNorm's mean and
1/std, which the paper leaves out (pplab.recompute.expected_saved_bytes states the term); and
float32's variant (activation_bytes_formula's element_bytes=4), for two shapes.

Compute: FLOPs of forward + backward counted by torch's FlopCounterMode (from shapes, so exact):
full recomputation adds exactly one forward; selective adds attention's q kᵀ (one s x s product).
"""
import math

import pytest
import torch
from torch import nn

import pplab
from pplab.memory import activation_bytes_formula, saved_activations
from pplab.recompute import POLICIES, Recomputed, best_every, expected_saved_bytes, flops, recompute_layers
from pplab.sequence_parallel import MegatronBlock
from pplab.tensor_parallel.transformer import TransformerBlock

SHAPES = [dict(s=12, b=2, h=24, a=6), dict(s=24, b=1, h=12, a=6)]     # heads divide by 1, 2, 3; s too


def block(shape, dtype, sp, policy, seed=0):
    torch.manual_seed(seed)
    dense = TransformerBlock(shape["h"], shape["a"], 4 * shape["h"]).to(dtype)
    b = MegatronBlock.from_dense(dense, dropout=0.1, sequence_parallel=sp)
    return b if policy == "none" else Recomputed(b, policy)


def one_step(shape, dtype, sp, policy):
    """This rank's saved bytes, output, input gradient and parameter gradients for one step."""
    t, r = pplab.comm.world_size(), pplab.comm.rank()
    m = block(shape, dtype, sp, policy)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(shape["s"], shape["b"], shape["h"], generator=g).to(dtype)
    if sp:
        x = x.chunk(t)[r].clone()                       # its own storage: a view would count all of x
    x.requires_grad_()
    torch.manual_seed(100 + r)                           # each rank's own dropout masks
    with saved_activations(m.parameters()) as saved:
        y = m(x)
    (y.float() * torch.arange(y.numel()).view(y.shape).sin()).sum().backward()
    return saved.bytes, [y.detach(), x.grad] + [p.grad for p in m.parameters()]


def all_cases():
    """On every rank: for each shape, dtype, sp and policy, (bytes, wanted bytes, grads equal?)."""
    t = pplab.comm.world_size()
    out = []
    for shape in SHAPES:
        for dtype, e in ((torch.bfloat16, 2), (torch.float32, 4)):
            for sp in ((False, True) if t > 1 else (False,)):
                _, plain = one_step(shape, dtype, sp, "none")
                for policy in POLICIES:
                    nbytes, got = one_step(shape, dtype, sp, policy)
                    want = expected_saved_bytes(**shape, t=t, sequence_parallel=sp, policy=policy, element_bytes=e)
                    same = len(got) == len(plain) and all(torch.equal(u, v) for u, v in zip(got, plain))
                    out.append(((shape["s"], shape["h"], str(dtype), sp, policy), nbytes, want, same))
    return out


@pytest.mark.parametrize("t", [1, 2, 3])
def test_saved_bytes_are_table_2_and_grads_are_exact(t):
    results = all_cases() if t == 1 else pplab.launch(all_cases, world_size=t)
    for rank, cases in enumerate([results] if t == 1 else results):
        assert len(cases) == len(SHAPES) * 2 * (2 if t > 1 else 1) * 3
        for case, nbytes, want, same in cases:
            assert nbytes == want, (f"rank {rank}, t={t}", case, nbytes, want)
            assert same, (f"rank {rank}, t={t}: recomputed output or gradients differ from the plain run", case)


def test_formula_rows_by_hand():
    """Table 2's rows written out for s=12, b=2, h=24, a=6, t=3 (sbh = 576, as/h = 3)."""
    sbh = 12 * 2 * 24
    f = activation_bytes_formula
    assert f(12, 2, 24, 6) == sbh * (34 + 5 * 3)
    assert f(12, 2, 24, 6, t=3, sequence_parallel=False) == sbh * (10 + 8 + 5)
    assert f(12, 2, 24, 6, t=3) == sbh * (34 + 15) / 3
    assert f(12, 2, 24, 6, t=3, sequence_parallel=False, recompute="selective") == sbh * 18
    assert f(12, 2, 24, 6, t=3, recompute="selective") == 34 * sbh / 3
    assert f(12, 2, 24, 6, recompute="full") == 2 * sbh == f(12, 2, 24, 6, t=3, sequence_parallel=False,
                                                                recompute="full")
    assert f(12, 2, 24, 6, t=3, recompute="full") == 2 * sbh / 3           # each rank keeps its s/t tokens
    assert f(12, 2, 24, 6, element_bytes=4) == sbh * (66 + 9 * 3)         # float32: masks stay 1 byte
    with pytest.raises(ValueError, match="recompute must be"):
        f(12, 2, 24, 6, recompute="half")
    with pytest.raises(ValueError, match="element_bytes"):
        f(12, 2, 24, 6, element_bytes=3)


def step_flops(policy, shape=SHAPES[0]):
    m = block(shape, torch.float32, False, policy)
    x = torch.randn(shape["s"], shape["b"], shape["h"], requires_grad=True)
    return flops(lambda: m(x).sum().backward()), flops(lambda: m(x))


def test_full_recomputation_costs_one_forward_selective_the_scores():
    s, b, h = SHAPES[0]["s"], SHAPES[0]["b"], SHAPES[0]["h"]
    plain, forward = step_flops("none")
    assert forward == 2 * s * b * (3 * h * h + h * h + 8 * h * h) + 4 * b * s * s * h      # matmuls by hand
    assert plain == 3 * forward                                                          # backward = 2 forwards
    assert step_flops("full")[0] == plain + forward
    # selective runs q kᵀ again, not p·v: torch's checkpoint stops recomputing as soon as it has every
    # tensor backward needs, and p·v's backward needs only its inputs, p and v
    assert step_flops("selective")[0] == plain + 2 * b * s * s * h


def test_every_k_blocks_keeps_one_input_per_group():
    """A stack of 5 blocks: every=2 keeps 3 inputs (2, 2, 1 blocks), every=5 one; grads exact."""
    s, b, h, a = 8, 2, 12, 3

    def run(policy, every):
        torch.manual_seed(0)
        layers = [MegatronBlock.from_dense(TransformerBlock(h, a, 2 * h), dropout=0.2, sequence_parallel=False)
                  for _ in range(5)]
        model = nn.Sequential(*recompute_layers([nn.Identity()] + layers, policy, every))
        x = torch.randn(s, b, h, generator=torch.Generator().manual_seed(1), requires_grad=True)
        torch.manual_seed(7)
        with saved_activations(model.parameters()) as saved:
            y = model(x)
        y.pow(2).sum().backward()
        return saved.bytes, len(model), [x.grad] + [p.grad for p in model.parameters()]

    _, _, plain = run("none", 1)
    for every, groups in ((1, 5), (2, 3), (5, 1)):
        nbytes, n_layers, grads = run("full", every)
        assert (nbytes, n_layers) == (groups * s * b * h * 4, 1 + groups), every
        assert all(torch.equal(u, v) for u, v in zip(grads, plain)), every


def test_best_every_by_hand():
    assert best_every(16) == 4                   # 4 kept + 4 recomputed
    assert best_every(10) == 2                   # 5 + 2 = 4 + 3 = 3 + 4 = 7: the smallest group wins the tie
    assert best_every(1) == 1
    assert best_every(16, kept=1, held=17) == 1  # a block holds 17 times its input: recompute one at a time
    with pytest.raises(ValueError):
        best_every(0)


def test_bad_input_says_what_to_change():
    with pytest.raises(ValueError, match="one of"):
        Recomputed(nn.Linear(2, 2), "some")
    with pytest.raises(ValueError, match="MegatronBlock"):
        Recomputed(TransformerBlock(8, 2, 8), "selective")
    with pytest.raises(ValueError, match="policy='full'"):
        recompute_layers([TransformerBlock(8, 2, 8)], "selective", every=2)
    with pytest.raises(ValueError, match="every"):
        recompute_layers([TransformerBlock(8, 2, 8)], "full", every=0)


def pipeline_step(policy):
    from pplab.models import GPTConfig, gpt_layers, gpt_loss, parallel_layers
    from pplab.pipeline import make_schedule, run_pipeline
    cfg = GPTConfig(vocab=11, seq=8, hidden=12, heads=3, ffn=24, layers=4)
    alone = [torch.distributed.new_group([r]) for r in range(2)][pplab.comm.rank()]   # a tp group of one
    layers = parallel_layers(gpt_layers(cfg, seed=0, dtype=torch.float32), group=alone)   # MegatronBlocks
    for layer in layers:
        if isinstance(layer, MegatronBlock):
            layer.dropout = 0.1
    g = torch.Generator().manual_seed(3)
    x, y = torch.randint(0, 11, (8, 8), generator=g), torch.randint(0, 11, (8, 8), generator=g)
    torch.manual_seed(5 + pplab.comm.rank())
    out = run_pipeline(make_schedule("1f1b", num_stages=2, num_microbatches=4),
                       recompute_layers(layers, policy), x, y, gpt_loss)
    (start, end), = out["layers"].values()
    blocks = end - start - (start == 0) - (end == cfg.layers + 2)          # the stage's layers, less Embed and Head
    return list(out["grads"].values()), out["peak_activation_bytes"], blocks


def test_pipeline_stage_recomputed_grads_are_exact():
    """1F1B over 2 ranks: bit-equal gradients, less held; and on the measured timeline each block's
    recomputation is an "R" span of forward work inside one of the rank's backward spans."""
    plain = pplab.launch(pipeline_step, "none", world_size=2)
    full = pplab.launch(pipeline_step, "full", world_size=2)
    for rank in range(2):
        assert len(full[rank][0]) == len(plain[rank][0]) > 0
        assert all(torch.equal(u, v) for u, v in zip(full[rank][0], plain[rank][0])), rank
        assert full[rank][1] < plain[rank][1] / 2, (rank, full[rank][1], plain[rank][1])
        again = full.timeline.select(rank=rank, kind="R")
        backward = full.timeline.select(rank=rank, kind="B")
        assert len(again) == 4 * full[rank][2] > 0, (rank, len(again))           # m micro-batches x blocks
        assert all(any(b.start <= r.start and r.end <= b.end for b in backward) for r in again), rank
        assert not plain.timeline.select(rank=rank, kind="R")


def test_simulated_recomputation_is_forward_work_before_each_backward():
    """1F1B, p = 2, m = 4: the step is (m + p - 1)·(t_f + t_b + t_r) = 5·4 = 20 forwards long instead
    of 15; each rank runs m R boxes of t_r each (forward work) ahead of its m backwards."""
    from pplab.pipeline import make_schedule, simulate
    from pplab.recompute import simulate_recomputed
    schedule = make_schedule("1f1b", num_stages=2, num_microbatches=4)
    assert simulate(schedule).makespan == 15
    sim, timeline = simulate_recomputed(schedule)
    assert sim.makespan == 20
    for rank in range(2):
        again = timeline.select(rank=rank, kind="R")
        assert sorted(e.label for e in again) == ["R0", "R1", "R2", "R3"]
        assert all(e.duration == 1 for e in again + timeline.select(rank=rank, kind="F"))
        backward = timeline.select(rank=rank, kind="B")
        assert all(e.duration == 2 for e in backward) and len(backward) == 4
        for r in again:                                         # each R ends where its B begins
            assert any(b.start == r.end and b.label[1:] == r.label[1:] for b in backward)
    sim, timeline = simulate_recomputed(schedule, t_f=1, t_b=3, t_r=0.5)      # selective: a part of a forward
    assert sim.makespan == 5 * 4.5
    assert {e.duration for e in timeline.select(kind="R")} == {0.5}
    assert {e.duration for e in timeline.select(kind="F")} == {1}
    assert {e.duration for e in timeline.select(kind="B")} == {3}
    with pytest.raises(ValueError, match="numbers >= 0"):
        simulate_recomputed(schedule, t_r=-1)
    with pytest.raises(ValueError, match="t_w <= t_b"):
        simulate_recomputed(schedule, t_b=2, t_w=3)


def test_simulated_recomputation_with_a_split_backward_recomputes_in_i():
    """ZB-H1, p = 2, m = 1, t_f = 1, t_b = 2 (I 1, W 1), t_r = 1: I recomputes the forward first (R 1
    + I 1) and W reuses what it rebuilt (1). Rank 1: F0 [1, 2], R0 [2, 3], I0 [3, 4], W0 [4, 5]; rank 0's
    I0 waits for rank 1's: R0 [4, 5], I0 [5, 6], W0 [6, 7]."""
    from pplab.pipeline import make_schedule
    from pplab.recompute import simulate_recomputed
    sim, timeline = simulate_recomputed(make_schedule("zb-h1", 2, 1), t_f=1, t_b=2, t_r=1)
    assert sim.makespan == 7
    assert [(e.label, e.start, e.end) for e in sorted(timeline.select(rank=0, category="compute"),
                                                       key=lambda e: e.start)] == [
        ("F0", 0, 1), ("R0", 4, 5), ("I0", 5, 6), ("W0", 6, 7)]
    sim, timeline = simulate_recomputed(make_schedule("zb-h1", 2, 1), t_f=1, t_b=2, t_r=0.5, t_w=0.5)
    assert {(e.kind, e.duration) for e in timeline.select(category="compute")} == {
        ("F", 1), ("R", 0.5), ("I", 1.5), ("W", 0.5)}


# ----------------------------------------------------------------------------------
# The planner's recomputation option: its activations against the executor's, and a layout it makes fit

def planner_setup():
    from pplab import costfit, data
    from pplab.models import GPTConfig, gpt_layers, gpt_loss
    from pplab.planner import LayerTimes
    cfg = GPTConfig(vocab=len(data.VOCAB), seq=16, hidden=32, heads=4, ffn=64, layers=4)
    (x, y), saved = data.batch(4, cfg.seq, 0, 0), []
    layers = gpt_layers(cfg, 0, torch.float64)
    for layer in layers:                       # elements each layer keeps per sample, as planner.measure counts
        with saved_activations(layer.parameters()) as s:
            out = layer(x.detach().requires_grad_(x.is_floating_point()))
            if layer is layers[-1]:
                gpt_loss(out, y)
        saved.append(s.bytes / 4 / 8)
        x = out.detach()
    n = len(layers)
    times = LayerTimes([0.0] * n, [1e-3] * n, [0.0] * n, [2e-3] * n, saved, 1e-9, source="synthetic")
    return cfg, times, costfit.Fit(0.0, 1e-10, 0.0, [1, 2], [0.0, 0.0])


def executor_peaks(recompute):
    from pplab import data
    from pplab.models import GPTConfig, gpt_layers, gpt_loss
    from pplab.pipeline import make_schedule, run_pipeline
    cfg = GPTConfig(vocab=len(data.VOCAB), seq=16, hidden=32, heads=4, ffn=64, layers=4)
    x, y = data.batch(8, cfg.seq, 0, 0)
    layers = recompute_layers(gpt_layers(cfg, 0, torch.float64), "full" if recompute else "none")
    return run_pipeline(make_schedule("1f1b", 2, 4), layers, x, y, gpt_loss)["peak_activation_bytes"]


def test_planner_recompute_predicts_the_executors_activations_and_a_forward_more():
    """pp = 2, m = 4, 1F1B: the planner's activations per rank miss the executor's measured peaks by
    the same bytes with and without recomputation (what it misses is in the embedding and the head,
    which recomputation leaves alone), so the blocks' part, one input each, is exact; and the
    predicted compute grows by one forward of the slow rank's blocks per micro-batch."""
    from pplab import planner
    from pplab.planner import Layout
    cfg, times, fit = planner_setup()
    pred = {rc: planner.predict(cfg, Layout(1, 1, 2, m=4, recompute=rc), 8, fit, times, dtype_bytes=8)
            for rc in (False, True)}
    measured = {rc: pplab.launch(executor_peaks, rc, world_size=2) for rc in (False, True)}
    for rank in range(2):
        miss = [pred[rc].stages[rank]["activations"] - measured[rc][rank] for rc in (False, True)]
        assert miss[0] == miss[1] and abs(miss[0]) < 0.01 * measured[False][rank], (rank, miss)
        assert measured[True][rank] < measured[False][rank] / 4
    cuts = planner.stages(cfg, 2)
    slow_blocks = max(sum(1 for i in range(a, e) if 1 <= i <= cfg.layers) for a, e in cuts)
    extra = pred[True].time["compute"] - pred[False].time["compute"]
    assert extra == pytest.approx(4 * slow_blocks * 1e-3 * 2)          # m · blocks · per sample · samples
    assert pred[True].layout.name.endswith(", recompute")


def test_planner_recompute_makes_a_layout_fit():
    """A budget between the smallest layout's memory with and without recomputation: without the
    option nothing fits; with it, the best layout is a recomputed one."""
    from pplab import planner
    from pplab.planner import PlanError
    cfg, times, fit = planner_setup()
    sizes = {rc: min(planner.predict(cfg, L, 8, fit, times, dtype_bytes=8).memory["total"]
                     for L in planner.enumerate_layouts(cfg, 8, 2, recompute=(rc,))[0]) for rc in (False, True)}
    budget = (sizes[False] + sizes[True]) / 2
    assert sizes[True] < budget < sizes[False]
    with pytest.raises(PlanError, match="no layout fits"):
        planner.plan(cfg, 8, 2, budget, fit, times, dtype_bytes=8)
    p = planner.plan(cfg, 8, 2, budget, fit, times, dtype_bytes=8, recompute=(False, True))
    assert p.ranked and all(x.layout.recompute for x in p.ranked)
