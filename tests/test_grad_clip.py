"""pplab.grad_clip: the global gradient norm and clipping across DP, TP, PP and ZeRO shards.

The reference is torch.nn.utils.clip_grad_norm_ on one process, inside hybrid.train_single:
every layout trains the tiny GPT for two steps, clipping with norm_type 2 at step 0 and inf at
step 1, both below the gradient's norm (so both clip). Equal means: the norm every rank
computes, the losses and every parameter shard after training, each within TOL (float64).
Several layouts share one launch (the mesh is rebuilt for each), to keep the launches few.
"""
import math

import pytest
import torch
from torch import nn

import pplab
from pplab import data
from pplab.grad_clip import clip_grad_norm_, global_grad_norm, owned_gradients, tensor_parallel_split
from pplab.hybrid import GPTConfig, train, train_single
from pplab.mesh import Mesh
from pplab.models import gpt_layers, parallel_layers

pytestmark = pytest.mark.usefixtures("no_leftover_processes")

TOL = 1e-10
CFG = GPTConfig(vocab=len(data.VOCAB), seq=6, hidden=12, heads=6, ffn=20, layers=2)   # tp 2, 3, 6 all divide
BATCH = 12                                                                           # dp 2, 3, 4, 6 all divide
# (max_norm, norm_type) at steps 0 and 1, both far below the norm: the clipped gradients' elements come out
# near AdamW's eps (1e-8), where its update g / (sqrt(v) + eps) depends on their scale; at larger scales Adam,
# which divides by the gradient's own size, would hide a wrong clip factor.
CLIPS = [(1e-6, 2.0), (1e-8, math.inf)]


def clip_hook(norms, sizes=None):
    """before_step for train (sizes given: the mesh's groups) or train_single (torch's own)."""
    def on_rank(model, opt, mesh):
        max_norm, p = CLIPS[len(norms)]
        tp = mesh.tp_group if mesh.size("tp") > 1 else None
        pp = mesh.pp_group if mesh.size("pp") > 1 else None
        norms.append(clip_grad_norm_(model, max_norm, p, tp_group=tp, pp_group=pp, optimizer=opt).item())

    def single(model, opt):
        max_norm, p = CLIPS[len(norms)]
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, p).item())
    return on_rank if sizes is not None else single


def clipped_layouts_job(layouts):
    ref_norms = []
    ref_losses, ref_layers = train_single(CFG, steps=2, batch_size=BATCH, before_step=clip_hook(ref_norms))
    out = []
    for sizes, kw in layouts:
        norms = []
        mesh = Mesh(**sizes)
        res = train(CFG, mesh, steps=2, batch_size=BATCH, before_step=clip_hook(norms, sizes), **kw)
        tp = mesh.tp_group if mesh.size("tp") > 1 else None
        expect = parallel_layers(ref_layers, tp, kw.get("sequence_parallel", False)) if tp is not None else ref_layers
        expect = dict(nn.Sequential(*expect).named_parameters())
        out.append({"norms": norms, "ref_norms": ref_norms, "losses": res["losses"], "ref_losses": ref_losses,
                    "param_diff": max((p - expect[n]).abs().max().item() for n, p in res["params"].items())})
    return out


LAYOUTS = {
    2: [({"tp": 2}, {"sequence_parallel": True}), ({"pp": 2}, {"schedule": "interleaved-1f1b"}),
        ({"dp": 2}, {"zero": 3})],
    3: [({"tp": 3}, {}), ({"dp": 3}, {"zero": 2}), ({"dp": 3}, {})],              # DDP: replicas not summed
    6: [({"dp": 2, "tp": 3}, {"zero": 3}), ({"pp": 2, "tp": 3}, {}), ({"pp": 3, "dp": 2}, {"zero": 3})],
    8: [({"pp": 2, "dp": 2, "tp": 2}, {"zero": 1, "sequence_parallel": True})],
}


@pytest.mark.parametrize("world", sorted(LAYOUTS))
def test_clipped_training_equals_torch_clip_grad_norm_on_one_process(world):
    results = pplab.launch(clipped_layouts_job, LAYOUTS[world], world_size=world)
    for r, per_layout in enumerate(results):
        for (sizes, kw), res in zip(LAYOUTS[world], per_layout):
            where = f"rank {r}, {sizes} {kw}"
            ref = res["ref_norms"]
            assert ref[0] > CLIPS[0][0] and ref[1] > CLIPS[1][0], f"the clips must bind: norms {ref}"
            assert all(abs(a - b) <= TOL * b for a, b in zip(res["norms"], ref)), (where, res["norms"], ref)
            assert all(abs(a - b) <= TOL for a, b in zip(res["losses"], res["ref_losses"])), where
            assert res["param_diff"] <= TOL, (where, res["param_diff"])


def unclipped_differs_job():
    """Without clipping the second loss differs from the clipped reference: the test above can fail."""
    ref_norms = []
    clipped, _ = train_single(CFG, steps=2, batch_size=BATCH, before_step=clip_hook(ref_norms))
    plain, _ = train_single(CFG, steps=2, batch_size=BATCH)
    return clipped[1] - plain[1]


def test_the_clip_changes_training():
    assert abs(unclipped_differs_job()) > 1e-3


# ---------------------------------------------------------------------------------------------
# The pieces: what counts, what is summed where, what it costs


def test_split_parameters_are_the_column_row_and_vocabulary_ones():
    """By hand: in the tensor-parallel GPT, every weight of a linear layer or the token table is split;
    LayerNorms, positions and the row-parallel biases (attn.proj, mlp.fc2) are replicated."""
    model = nn.Sequential(*parallel_layers(gpt_layers(CFG), group=None))
    split = tensor_parallel_split(model)
    names = {n for n, p in model.named_parameters() if id(p) in split}
    blocks = {f"{b}.{n}" for b in (1, 2) for n in ("attn.qkv.weight", "attn.qkv.bias", "attn.proj.weight",
                                                   "mlp.fc1.weight", "mlp.fc1.bias", "mlp.fc2.weight")}
    assert names == {"0.tokens.weight", "3.out.weight"} | blocks


def zero_padding_job():
    """ZeRO-2 over 3 ranks, a model of 10 parameters: 12 flat elements, the last 2 padding on rank 2.
    Garbage written into the padding must not change the norm; the norm equals torch's on the
    averaged gradient; each all-reduce carries one float64 (8 bytes)."""
    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 2, dtype=torch.float64), nn.Linear(2, 1, bias=False, dtype=torch.float64))
    opt = pplab.zero.ZeroOptimizer(model.parameters(), torch.optim.SGD, stage=2, lr=0.1)
    x = torch.arange(6 * (rank + 1), dtype=torch.float64).view(-1, 3)[-2:] / 7 - rank   # a different batch per rank
    model(x).pow(2).sum().backward()
    before = global_grad_norm(model, 2.0, optimizer=opt).item()
    for b, g in zip(opt.buckets, opt.shard_grads):
        pad_start = b.numel - b.rank * b.shard_size
        if pad_start < b.shard_size:
            g[max(pad_start, 0):] = 1e6                   # padding: no parameter's gradient
    after = global_grad_norm(model, 2.0, optimizer=opt).item()
    inf_norm = global_grad_norm(model, math.inf, optimizer=opt).item()
    pieces = sum(g.numel() for _, g in owned_gradients(model, opt)[0])
    return {"before": before, "after": after, "inf": inf_norm, "pieces": pieces, "x": x,
            "padded": [b.padded for b in opt.buckets]}


def test_zero_norm_leaves_the_padding_out_and_equals_torch():
    results = pplab.launch(zero_padding_job, world_size=3)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 2, dtype=torch.float64), nn.Linear(2, 1, bias=False, dtype=torch.float64))
    for r in range(3):
        model(results[r]["x"]).pow(2).sum().div(3).backward()      # the mean of the three ranks' gradients
    grads = [p.grad for p in model.parameters()]
    expect2 = torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads])).item()
    expect_inf = max(g.abs().max().item() for g in grads)
    assert results[0]["padded"] == [12]                                # 10 elements padded to 3 × 4
    for r, res in enumerate(results):
        assert abs(res["before"] - expect2) <= TOL * expect2, (r, res, expect2)
        assert res["after"] == res["before"], f"rank {r}: the padding was counted"
        assert abs(res["inf"] - expect_inf) <= TOL * expect_inf, (r, res["inf"], expect_inf)
    assert [res["pieces"] for res in results] == [4, 4, 2]               # rank 2 owns 2 elements and 2 of padding
    comm = [e for e in results.timeline.events if e.kind == "all_reduce"]
    assert len(comm) == 3 * 3 and all(e.meta["payload"] == 8 for e in comm)   # 3 norms × 3 ranks, one float64 each


def traffic_job():
    """Only the traffic is looked at: the model is split over tp (not cut over pp), and pp_group is given."""
    mesh = Mesh(pp=2, dp=2, tp=2)
    model = nn.Sequential(*parallel_layers(gpt_layers(CFG), mesh.tp_group))
    x, y = data.batch(2, CFG.seq)
    model(x).sum().backward()
    with pplab.trace.span("clip", "clip"):
        clip_grad_norm_(model, 1.0, tp_group=mesh.tp_group, pp_group=mesh.pp_group)
    return None


def test_the_traffic_is_one_scalar_all_reduce_per_group():
    """tp and pp used (DDP's replicas hold equal gradients: no dp all-reduce): two 8-byte all-reduces per rank,
    over its tp group and over its pp group."""
    results = pplab.launch(traffic_job, world_size=8)
    tl = results.timeline
    for r in range(8):
        clip = [e for e in tl.select(r, "compute") if e.label == "clip"][0]
        inside = [e for e in tl.select(r, "comm") if clip.start <= e.start <= clip.end]
        mesh_tp = [g for g in pplab.mesh.groups("tp", pp=2, dp=2, tp=2) if r in g][0]
        mesh_pp = [g for g in pplab.mesh.groups("pp", pp=2, dp=2, tp=2) if r in g][0]
        assert [(e.kind, list(e.group), e.meta["payload"]) for e in inside] == \
            [("all_reduce", mesh_tp, 8), ("all_reduce", mesh_pp, 8)], (r, inside)


def error_job(case):
    mesh = Mesh(tp=2)
    model = nn.Sequential(*parallel_layers(gpt_layers(CFG), mesh.tp_group))
    x, y = data.batch(2, CFG.seq)
    if case == "zero":
        model = nn.Sequential(*gpt_layers(CFG))
        pplab.zero.ZeroOptimizer(model.parameters(), torch.optim.SGD, stage=1, lr=0.1)
    if case == "fsdp module":                # the wrapped model given in place of the wrapper
        model = nn.Sequential(*gpt_layers(CFG))
        pplab.zero.FullyShardedModule(model)
    model(x).sum().backward()
    try:
        clip_grad_norm_(model, 1.0, **({"norm_type": 0} if case == "norm" else {}))
    except ValueError as e:
        return str(e)


@pytest.mark.parametrize("case,message", [
    ("tp", "pass their group as tp_group="),
    ("zero", "belong to a ZeRO-1 ZeroOptimizer.*pass it as optimizer="),
    ("norm", "norm_type must be a number > 0 or math.inf"),
    ("fsdp module", "pass the FullyShardedModule itself"),
])
def test_bad_calls_say_what_to_change(case, message):
    for msg in pplab.launch(error_job, case, world_size=2):
        assert msg is not None and __import__("re").search(message, msg), msg


def test_max_norm_must_be_positive():
    with pytest.raises(ValueError, match="max_norm must be a number > 0"):
        clip_grad_norm_(nn.Linear(2, 2), -1.0)


def norm_types_job():
    """tp=3 (odd, ffn 20 and vocab 31 split unevenly): every norm_type against torch on the dense model's
    gradients, and a max_norm above the norm leaves the gradients as they were."""
    mesh = Mesh(tp=3)
    dense = nn.Sequential(*gpt_layers(CFG))
    model = nn.Sequential(*parallel_layers(gpt_layers(CFG), mesh.tp_group))
    x, y = data.batch(4, CFG.seq, step=1)
    pplab.models.gpt_loss(dense(x), y).backward()
    pplab.models.gpt_loss(model(x), y, mesh.tp_group, CFG.vocab).backward()
    out = {}
    for p in (1.0, 3.0, math.inf):
        expect = torch.nn.utils.get_total_norm([q.grad for q in dense.parameters()], p).item()
        out[p] = (global_grad_norm(model, p, tp_group=mesh.tp_group).item(), expect)
    before = [q.grad.clone() for q in model.parameters()]
    clip_grad_norm_(model, 1e6, 2.0, tp_group=mesh.tp_group)
    out["unchanged"] = all(torch.equal(a, q.grad) for a, q in zip(before, model.parameters()))
    return out


def test_every_norm_type_on_three_tp_ranks_equals_torch():
    for r, out in enumerate(pplab.launch(norm_types_job, world_size=3)):
        for p in (1.0, 3.0, math.inf):
            got, expect = out[p]
            assert abs(got - expect) <= 1e-10 * expect, (r, p, got, expect)
        assert out["unchanged"], f"rank {r}: a norm below max_norm must leave the gradients as they are"


def _zero3_model():
    torch.manual_seed(0)      # 3·5+5 + 5·4+4 + 4+4 + 4+1 = 57 elements: padded on 2 ranks and on 3
    return nn.Sequential(nn.Linear(3, 5, dtype=torch.float64), nn.Tanh(), nn.Linear(5, 4, dtype=torch.float64),
                         nn.LayerNorm(4, dtype=torch.float64), nn.Linear(4, 1, dtype=torch.float64))


def _zero3_batch(rank):
    return torch.randn(4, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(10 + rank))


def zero3_default_group_job():
    """ZeRO-3 with group=None (every rank, pplab's default), plain and with the LayerNorm kept whole
    (replicate=): each rank holds a different part of the gradient, so the parts' norms must be summed
    over the ranks, and a whole parameter's gradient (the same on every rank) counted once."""
    rank, out = torch.distributed.get_rank(), []
    for replicate in ((), ("3",)):
        for p in (2.0, math.inf):
            fsdp = pplab.zero.FullyShardedModule(_zero3_model(), replicate=replicate)
            fsdp(_zero3_batch(rank)).pow(2).sum().backward()
            before = clip_grad_norm_(fsdp, 1e-3, p).item()
            out.append((replicate, p, before, global_grad_norm(fsdp, p).item()))
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_zero3_over_every_rank_equals_torch_clip_grad_norm(world):
    results = pplab.launch(zero3_default_group_job, world_size=world)
    model = _zero3_model()
    for r in range(world):           # ZeRO-3's gradient: the mean of the ranks' gradients
        model(_zero3_batch(r)).pow(2).sum().div(world).backward()
    grads = [q.grad.clone() for q in model.parameters()]
    for k, (replicate, p, before, after) in enumerate(results[0]):
        for q, g in zip(model.parameters(), grads):
            q.grad = g.clone()
        want = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3, p).item()
        want_after = torch.linalg.vector_norm(torch.cat([q.grad.flatten() for q in model.parameters()]), p).item()
        for r in range(world):
            got = results[r][k]
            assert abs(got[2] - want) <= TOL * want, (world, replicate, p, r, got, want)
            assert abs(got[3] - want_after) <= TOL * want_after, (world, replicate, p, r, got, want_after)
