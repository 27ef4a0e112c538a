"""pplab.zero (ZeRO stages 1, 2, 3 and offload) against single-process AdamW on the whole global batch.

Everything is float64 except the CS336-shaped test; "equal" means max |difference| <= TOL = 1e-10
(measured: ~1e-16, the order of the additions). The model has Ψ = 118 parameters, which
divides by neither 3 nor 4, so every run on 3 or 4 ranks pads. Memory and traffic are checked
against closed forms computed here from Ψ, N and the bucket sizes, not from pplab.zero's own
formula functions.
"""
import math

import pytest
import torch
from torch import nn

import pplab
from pplab.data_parallel import DDP, shard
from pplab.zero import FlatBucket, FullyShardedModule, ZeroOptimizer, held_bytes, sent_bytes

TOL = 1e-10
GLOBAL = 12                                  # divides by 1, 2, 3, 4
SIZES = [(5, 7), (7, 6), (6, 4)]             # Ψ = 42 + 48 + 28 = 118
PSI = sum(i * o + o for i, o in SIZES)
HPARAMS = dict(lr=0.01, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
ONE_PER_PARAM, ONE_BUCKET = 1e-5, 100.0     # MiB


def make_model(seed=0, frozen=False):
    torch.manual_seed(seed)
    mods = []
    for i, o in SIZES:
        mods += [nn.Linear(i, o), nn.Tanh()]
    model = nn.Sequential(*mods[:-1]).double()
    if frozen:
        model[2].weight.requires_grad_(False)
    return model


class Tied(nn.Module):
    """mid and out share one weight: a tied parameter used by two different layers."""

    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.inp, self.mid, self.out = nn.Linear(5, 6), nn.Linear(6, 6), nn.Linear(6, 6)
        self.out.weight = self.mid.weight
        self.double()

    def forward(self, x):
        return self.out(torch.tanh(self.mid(torch.tanh(self.inp(x)))))[:, :4]


def data(seed=1):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(GLOBAL, 5, generator=g, dtype=torch.float64),
            torch.randn(GLOBAL, 4, generator=g, dtype=torch.float64))


def max_diff(a, b):
    assert len(a) == len(b)
    return max((u - v).abs().max().item() for u, v in zip(a, b))


def reference(steps, build=make_model):
    """One process, the whole global batch, torch's AdamW: parameters after `steps` steps."""
    model, (x, y) = build(), data()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], **HPARAMS)
    for _ in range(steps):
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()], opt


def wrap(model, stage, cap=ONE_BUCKET, offload=None, prefetch=True, group=None):
    """(what to call forward on, its optimizer) for one ZeRO stage."""
    if stage == 3:
        fsdp = FullyShardedModule(model, prefetch=prefetch, group=group)
        return fsdp, ZeroOptimizer(fsdp.parameters(), torch.optim.AdamW, stage=3, group=group, **HPARAMS)
    return model, ZeroOptimizer(model.parameters(), torch.optim.AdamW, stage=stage, bucket_cap_mb=cap,
                                offload=offload, group=group, **HPARAMS)


def train(fwd, opt, steps, group=None):
    x, y = shard(data(), pplab.comm.rank(group), pplab.comm.world_size(group))
    for _ in range(steps):
        nn.functional.mse_loss(fwd(x), y).backward()
        opt.step()
        opt.zero_grad()


def full_params(model, fwd):
    """The model's full parameters on rank 0 (stage 3 gathers them through state_dict)."""
    if isinstance(fwd, FullyShardedModule):
        sd = fwd.state_dict()
        names = [n for n, _ in model.named_parameters()]
        return [sd[n] for n in names] if sd else None
    return [p.detach().clone() for p in model.parameters()]


# ----------------------------------------------------------------------------------
# Step for step like one process


CONFIGS = [(1, ONE_BUCKET, True), (1, ONE_PER_PARAM, True), (2, ONE_BUCKET, True), (2, ONE_PER_PARAM, True),
           (3, None, True), (3, None, False)]          # (stage, bucket cap, prefetch)


def every_stage(steps, build_name):
    build = {"plain": make_model, "frozen": lambda seed=0: make_model(seed, frozen=True), "tied": Tied}[build_name]
    rank = pplab.comm.rank()
    out = {}
    for stage, cap, prefetch in CONFIGS:
        model = build(seed=rank)                   # differently initialised: the wrap must broadcast
        fwd, opt = wrap(model, stage, cap=cap, prefetch=prefetch)
        train(fwd, opt, steps)
        out[stage, cap, prefetch] = full_params(model, fwd)
    return out


@pytest.mark.parametrize("p", [1, 2, 3, 4])
def test_every_stage_trains_like_single_process_adamw(p):
    steps = 3
    results = pplab.launch(every_stage, steps, "plain", world_size=p, timeout=90)
    expected, _ = reference(steps)
    for config, params in results[0].items():
        assert max_diff(params, expected) <= TOL, config
    for rank in range(1, p):                       # stages 1, 2: every rank holds the same full model
        for config, params in results[rank].items():
            if config[0] != 3:
                assert max_diff(params, expected) <= TOL, (rank, config)
    assert max_diff(expected, list(make_model().parameters())) > 1e-3     # training really moved


@pytest.mark.parametrize("build", ["frozen", "tied"])
def test_frozen_and_tied_parameters(build):
    steps = 3
    results = pplab.launch(every_stage, steps, build, world_size=3, timeout=90)
    expected, _ = reference(steps, {"frozen": lambda: make_model(frozen=True), "tied": Tied}[build])
    for config, params in results[0].items():
        assert max_diff(params, expected) <= TOL, config
    if build == "frozen":                          # the frozen weight did not move (AdamW's decay skipped it)
        assert max_diff([results[0][CONFIGS[0]][2]], [make_model()[2].weight]) == 0.0


def stage_one_under_ddp(stage):
    model = make_model()
    if stage == 3:
        return repr(pytest.raises(RuntimeError, FullyShardedModule, DDP(model)).value)
    with pytest.raises(RuntimeError) as zero_on_ddp:
        ZeroOptimizer(DDP(model).parameters(), torch.optim.AdamW, stage=stage)
    other = make_model()
    ZeroOptimizer(other.parameters(), torch.optim.AdamW, stage=stage)
    with pytest.raises(RuntimeError) as ddp_on_zero:
        DDP(other)
    return str(zero_on_ddp.value), str(ddp_on_zero.value)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_refuses_to_average_twice_under_ddp(stage):
    out = pplab.launch(stage_one_under_ddp, stage, world_size=2, timeout=60)[0]
    if stage == 3:
        assert "DDP" in out
    else:
        assert "average" in out[0] and "bare model" in out[0]
        assert "twice" in out[1] and "Drop the DDP" in out[1]


# ----------------------------------------------------------------------------------
# Checkpoints


def resume(stage, save_at, steps):
    rank = pplab.comm.rank()
    model = make_model(seed=rank)
    fwd, opt = wrap(model, stage)
    train(fwd, opt, save_at)
    model_sd = fwd.state_dict() if stage == 3 else {k: v.clone() for k, v in model.state_dict().items()}
    opt_sd = opt.state_dict()
    everyone = [None] * pplab.comm.world_size()      # "torch.load on every rank": rank 0's files to all
    torch.distributed.all_gather_object(everyone, (model_sd, opt_sd))
    model_sd, opt_sd = everyone[0]
    fresh = make_model(seed=100 + rank)              # a new run: other weights, no optimizer state
    fwd2, opt2 = wrap(fresh, stage)
    fwd2.load_state_dict(model_sd)
    opt2.load_state_dict(opt_sd)
    train(fwd2, opt2, steps - save_at)
    return opt_sd if rank == 0 else None, full_params(fresh, fwd2)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_state_dict_is_torchs_and_resumes_identically(stage):
    results = pplab.launch(resume, stage, 2, 4, world_size=3, timeout=60)
    saved, params = results[0]
    after_two, torch_opt = reference(2)
    expected, _ = reference(4)
    assert max_diff(params, expected) <= TOL      # saved at 2, resumed, 2 more = 4 straight
    # the saved state is what torch's AdamW holds after 2 steps, parameter by parameter
    torch_sd = torch_opt.state_dict()
    names = [n for n, _ in make_model().named_parameters()]
    for i in range(len(names)):
        key = names[i] if stage == 3 else i
        for k in ("exp_avg", "exp_avg_sq"):
            assert (saved["state"][key][k] - torch_sd["state"][i][k]).abs().max() <= TOL, (key, k)
        assert float(saved["state"][key]["step"]) == 2.0
    assert saved["param_groups"][0]["lr"] == HPARAMS["lr"]


# ----------------------------------------------------------------------------------
# Memory held per rank and bytes sent per step


def memory_after_a_step(stage, cap):
    model = make_model()
    if stage == 0:                                  # plain replicated AdamW: what DDP keeps
        fwd, opt = model, torch.optim.AdamW(model.parameters(), **HPARAMS)
    else:
        fwd, opt = wrap(model, stage, cap=cap)
    x, y = shard(data())
    nn.functional.mse_loss(fwd(x), y).backward()
    opt.step()
    held = held_bytes(fwd, opt)                     # measured after the step, before zero_grad
    return held, len(opt.buckets) if stage else 0


def per_unit_sizes():
    return [i * o + o for i, o in SIZES]


@pytest.mark.parametrize("p", [1, 2, 3, 4])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_memory_held_per_rank_matches_the_formula_within_padding(p, stage):
    cap = ONE_PER_PARAM
    results = pplab.launch(memory_after_a_step, stage, cap, world_size=p, timeout=60)
    b = 8                                           # float64: (8 + 8 + 16)Ψ, AdamW's two moments
    # the padded length of each flat buffer: one per parameter tensor (stages 1, 2), one per layer (3)
    sizes = [n for i, o in SIZES for n in (i * o, o)] if stage in (1, 2) else per_unit_sizes()
    padded = sum(math.ceil(n / p) * p for n in sizes)
    expected = {0: (b * PSI, b * PSI, 2 * b * PSI),
                1: (b * padded, b * PSI, 2 * b * padded // p),
                2: (b * padded, b * padded // p, 2 * b * padded // p),
                3: (b * padded // p, b * padded // p, 2 * b * padded // p)}[stage]
    formula = {0: 32 * PSI, 1: 8 * PSI + 8 * PSI + 16 * PSI / p, 2: 8 * PSI + 24 * PSI / p, 3: 32 * PSI / p}[stage]
    for held, n_buckets in results:
        assert (held["params"], held["grads"], held["optimizer"]) == expected
        # within padding: at most N-1 elements per flat buffer, in each kind of tensor
        assert 0 <= held["total"] - formula <= (b + b + 2 * b) * (p - 1) * len(sizes)
        if stage in (1, 2):
            assert n_buckets == 6


def test_held_bytes_and_memory_state_bytes_count_alike_on_a_case_by_hand():
    """held_bytes counts with pplab.memory's counter: on an fp32 Linear(4, 3) (Ψ = 15) after one
    Adam step both give 60 B of parameters and 60 of gradients; Adam's two moments are 120 B, and
    state_bytes adds the two float32 step counters (8 B) that ZeRO's table (and held_bytes) leaves out.
    With a bf16 model and fp32 master copies stepped by SGD with momentum (as MasterWeights and
    ZeroOptimizer keep them): 30 B of parameters, 30 + 60 of gradients (the masters' own), and
    60 of momentum + 60 of masters as optimizer state."""
    from pplab.memory import state_bytes
    torch.manual_seed(0)
    lin = nn.Linear(4, 3)
    adam = torch.optim.Adam(lin.parameters())
    lin(torch.randn(2, 4)).sum().backward()
    adam.step()
    held, counted = held_bytes(lin, adam), state_bytes(lin, adam)
    assert held == {"params": 60, "grads": 60, "optimizer": 120, "total": 240}
    assert (counted.parameters, counted.gradients, counted.optimizer) == (60, 60, 120 + 2 * 4)

    model = nn.Linear(4, 3).to(torch.bfloat16)
    model(torch.randn(2, 4, dtype=torch.bfloat16)).sum().backward()
    masters = [p.detach().float().requires_grad_() for p in model.parameters()]
    for m, p in zip(masters, model.parameters()):
        m.grad = p.grad.float()
    inner = torch.optim.SGD(masters, lr=0.1, momentum=0.9)
    inner.step()

    class Masters:                                  # the two attributes held_bytes reads
        pass
    opt = Masters()
    opt.masters, opt.inner = masters, inner
    assert held_bytes(model, opt) == {"params": 30, "grads": 30 + 60, "optimizer": 60 + 60, "total": 240}
    outer, kept = state_bytes(model), state_bytes(masters, inner)
    assert (outer.parameters, outer.gradients) == (30, 30)
    assert (kept.gradients, kept.parameters + kept.optimizer) == (60, 60 + 60)


def traffic(stage, steps):
    model = make_model()
    fwd, opt = wrap(model, stage, cap=ONE_BUCKET)
    train(fwd, opt, steps)
    return pplab.trace.events()


@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_bytes_per_step_from_the_trace_are_2psi_then_3psi(p, stage):
    steps = 2
    result = pplab.launch(traffic, stage, steps, world_size=p, timeout=60)
    timeline = result.timeline
    kinds = {e.kind for e in timeline.select(category="comm")}
    assert "all_reduce" not in kinds                # no rank ever all-reduces a gradient
    # every flat buffer padded to a multiple of p: one bucket (stages 1, 2), one per layer (3)
    sizes = [PSI] if stage in (1, 2) else per_unit_sizes()
    model_bytes = 8 * sum(math.ceil(n / p) * p for n in sizes)
    passes = 3 if stage == 3 else 2                 # RS + AG, or AG (forward) + AG (backward) + RS
    for rank in range(p):
        assert sent_bytes(timeline, rank) == steps * passes * (p - 1) * model_bytes // p
        ags = timeline.select(rank, "comm", "all_gather")
        rss = timeline.select(rank, "comm", "reduce_scatter")
        assert len(ags) == steps * (passes - 1) * len(sizes) and len(rss) == steps * len(sizes)


# ----------------------------------------------------------------------------------
# Stage 3's schedule: gather, compute, free, with prefetch


def stage3_step(prefetch):
    fwd, opt = wrap(make_model(), 3, prefetch=prefetch)
    train(fwd, opt, 1)
    return [u.nbytes for u in fwd.units], [u.state for u in fwd.units]


@pytest.mark.parametrize("prefetch", [True, False])
def test_stage3_gathers_one_unit_at_a_time_and_frees_it(prefetch):
    result = pplab.launch(stage3_step, prefetch, world_size=2, timeout=60)
    tl = result.timeline
    unit_bytes, states = result[0]
    assert states == ["free"] * 3                   # nothing stays gathered after the step
    for rank in range(2):
        ev = tl.select(rank)
        fwd = [e for e in ev if e.kind == "F"]
        ags = [e for e in ev if e.kind == "all_gather"]
        assert [e.label for e in fwd] == ["F0", "F1", "F2"]
        assert [e.label for e in ags] == ["AG0", "AG1", "AG2", "AG2", "AG1", "AG0"]
        bwd = [e for e in ev if e.kind == "B"]
        assert [e.label for e in bwd] == ["B2", "B1", "B0"]
        if prefetch:    # unit k+1's gather is launched before unit k's forward compute starts; in backward,
            assert all(ags[k + 1].start <= fwd[k].start for k in range(2))          # unit k-1's before unit k's
            assert all(ags[4 + k].start <= bwd[k].start for k in range(2)), "backward prefetch: AG1, AG0"
        else:           # ... or only once unit k is done
            assert all(ags[k + 1].start >= fwd[k].end for k in range(2))
            assert all(ags[4 + k].start >= bwd[k].end for k in range(2))
        # the memory curve: the shards, plus one gathered unit (two with prefetch), back to the shards
        _, held = tl.memory_curve(rank)
        shards = sum(unit_bytes) // 2
        assert held[1] == shards and held[-1] == shards
        assert max(held) <= shards + sum(sorted(unit_bytes)[-(2 if prefetch else 1):])
        assert held.count(shards) >= 3              # down to the shards again between units


def between_uses():
    """What a learner reads from a wrapped model's own parameters between uses (FSDP2's shape), and the
    same step taken by optimizers built on model.parameters() and on fsdp.parameters()."""
    model = make_model(seed=pplab.comm.rank())       # the wrap broadcasts rank 0's, make_model(0)
    fsdp = FullyShardedModule(model)
    x, y = shard(data(), pplab.comm.rank(), pplab.comm.world_size())
    on_model = torch.optim.SGD(model.parameters(), lr=0.1)
    on_shards = torch.optim.SGD(fsdp.parameters(), lr=0.1)
    unit = fsdp.units[2]                             # unit "4": 4.weight, 4.bias

    def backward():
        nn.functional.mse_loss(fsdp(x), y).backward()
        return [p.grad.clone() for p in model.parameters()]

    out = {"g1": backward(), "w": [p.detach().clone() for p in model.parameters()],
           "same_storage": model[4].weight.untyped_storage().data_ptr() == unit.shard.untyped_storage().data_ptr(),
           "shard_grad": unit.shard.grad.clone(), "sum": model[2].weight.sum().item()}
    out["g2"] = backward()                           # no zero_grad: accumulated
    on_model.zero_grad(set_to_none=True)             # cleared through the model's parameters ...
    out["after_model_zero"] = backward()             # ... so the shard's gradient starts again
    model[0].bias.grad = None                        # one cleared by hand: only it starts again
    out["one_cleared"] = backward()
    on_shards.zero_grad(set_to_none=True)            # cleared through the shards
    out["after_shard_zero"] = backward()
    before = [p.detach().clone() for p in fsdp.parameters()]
    on_model.step()                                  # steps the shards: the parameters are views of them
    out["stepped"] = [(b - p.detach()).abs().max().item() for b, p in zip(before, fsdp.parameters())]
    with fsdp.full_parameters():                     # whole again inside, in their own shapes
        out["full"] = [p.detach().clone() for p in model.parameters()]
    out["full_state"] = fsdp.full_state_dict()       # on every rank
    return out


def test_between_uses_the_model_parameters_are_this_ranks_shard():
    """FSDP2's shape: each model parameter is this rank's piece of the unit's flat shard (1-D), with its
    piece of the mean gradient as .grad, whatever optimizer clears it; stepping model.parameters()
    steps the shards. Reference: one process's gradient on the whole batch, cut by hand."""
    p = 3
    diff_flat = lambda a, b: max_diff([torch.cat([t.reshape(-1) for t in a])], [torch.cat([t.reshape(-1) for t in b])])
    results = pplab.launch(between_uses, world_size=p, timeout=60)
    ref = make_model()
    x, y = data()
    nn.functional.mse_loss(ref(x), y).backward()
    params = list(ref.parameters())
    for rank, out in enumerate(results):
        assert out["same_storage"]
        mine = []
        for unit in range(3):                        # each unit: weight and bias end to end, cut in 3
            w, b = params[2 * unit], params[2 * unit + 1]
            n = w.numel() + b.numel()
            k = -(-n // p)
            lo, hi = rank * k, min((rank + 1) * k, n)
            ends = [(0, w.numel()), (w.numel(), n)]
            for t, (a, e) in zip((w, b), ends):
                mine.append((t.detach().reshape(-1)[max(a, lo) - a:max(min(e, hi), a) - a],
                             t.grad.reshape(-1)[max(a, lo) - a:max(min(e, hi), a) - a]))
        assert [tuple(g.shape) for g in out["g1"]] == [tuple(v.shape) for v, _ in mine], rank
        assert diff_flat(out["w"], [v for v, _ in mine]) == 0, rank
        g = [gr for _, gr in mine]
        assert diff_flat(out["g1"], g) <= TOL, rank
        assert diff_flat(out["g2"], [2 * t for t in g]) <= TOL, rank
        assert diff_flat(out["after_model_zero"], g) <= TOL, rank
        assert diff_flat(out["one_cleared"], [t * (1 if i == 1 else 2) for i, t in enumerate(g)]) <= TOL, rank
        assert diff_flat(out["after_shard_zero"], g) <= TOL, rank
        assert abs(out["sum"] - mine[2][0].sum().item()) <= TOL, rank
        assert all(d > 0 for d in out["stepped"]), rank
        assert diff_flat(out["full"], [t.detach() - 0.1 * t.grad for t in params]) <= TOL, rank   # one SGD step
        assert list(out["full_state"]) == list(ref.state_dict()), rank
        assert diff_flat(list(out["full_state"].values()), out["full"]) == 0, rank
        assert diff_flat(list(out["full_state"].values()), list(results[0]["full_state"].values())) == 0
    assert sum(t.numel() for t in results[2]["g1"][:2]) == 42 - 28      # rank 2: the last 14 of unit 0's 42


# ----------------------------------------------------------------------------------
# Offload, sub-groups, bad input


def offloaded(stage):
    model = make_model(seed=pplab.comm.rank())
    fwd, opt = wrap(model, stage, cap=ONE_BUCKET, offload="cpu")
    train(fwd, opt, 3)
    moves = [(e.kind, e.meta["payload"]) for e in pplab.trace.events() if e.kind in ("d2h", "h2d")]
    return [p.detach().clone() for p in model.parameters()], moves, opt.masters[0].device.type


@pytest.mark.parametrize("stage", [1, 2])
def test_offload_steps_on_cpu_copies_and_matches(stage):
    results = pplab.launch(offloaded, stage, world_size=3, timeout=60)
    expected, _ = reference(3)
    shard_bytes = 8 * math.ceil(PSI / 3)
    for params, moves, device in results:
        assert max_diff(params, expected) <= TOL
        assert moves == [("d2h", shard_bytes), ("h2d", shard_bytes)] * 3     # per step: grad out, param back
        assert device == "cpu"


def on_subgroups(stage):
    import torch.distributed as dist
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mine = groups[dist.get_rank() // 2]
    model = make_model(seed=7 * (dist.get_rank() % 2))     # each pair's root (0, 2) starts from seed 0
    fwd, opt = wrap(model, stage, cap=ONE_PER_PARAM, group=mine)
    train(fwd, opt, 3, group=mine)
    comm_groups = {e.group for e in pplab.trace.events() if e.category == "comm" and e.group}
    return full_params(model, fwd), comm_groups


@pytest.mark.parametrize("stage", [2, 3])
def test_sharding_over_a_subgroup(stage):
    results = pplab.launch(on_subgroups, stage, world_size=4, timeout=60)
    expected, _ = reference(3)
    for rank in (0, 2):                             # each pair trains like one process, on its own
        params, groups = results[rank]
        assert max_diff(params, expected) <= TOL
        assert groups == {(rank, rank + 1)}


def bad_inputs():
    errors = {}
    for name, call in {
        "stage": lambda: ZeroOptimizer(make_model().parameters(), torch.optim.AdamW, stage=4),
        "offload": lambda: ZeroOptimizer(make_model().parameters(), torch.optim.AdamW, offload="gpu"),
        "stage3 plain": lambda: ZeroOptimizer(make_model().parameters(), torch.optim.AdamW, stage=3),
        "unit": lambda: FullyShardedModule(make_model(), units=["7"]),
        "replicate name": lambda: FullyShardedModule(make_model(), replicate=["9"]),
        "replicate str": lambda: FullyShardedModule(make_model(), replicate="0"),
        "replicated to stage 3": lambda: ZeroOptimizer(FullyShardedModule(make_model(), replicate=["0"]).parameters(),
                                                       torch.optim.AdamW, stage=3),
    }.items():
        try:
            call()
        except (ValueError, RuntimeError) as e:
            errors[name] = str(e)
    fsdp = FullyShardedModule(make_model())       # the model's parameters: ZeroOptimizer steps their units' shards
    errors["stage3 on the model"] = ([id(p) for p in ZeroOptimizer(fsdp.module.parameters(), torch.optim.AdamW,
                                                                   stage=3).params] == [id(p) for p in fsdp.parameters()])
    model = make_model()
    opt = ZeroOptimizer(model.parameters(), torch.optim.AdamW, stage=1)
    try:
        opt.step()
    except RuntimeError as e:
        errors["no backward"] = str(e)
    try:
        ZeroOptimizer(model.parameters(), torch.optim.AdamW, stage=2)
    except RuntimeError as e:
        errors["twice"] = str(e)
    return errors


def test_bad_input_says_what_to_change():
    errors = pplab.launch(bad_inputs, world_size=2, timeout=60)[0]
    assert "1, 2 or 3" in errors["stage"]
    assert "None or 'cpu'" in errors["offload"]
    assert "FullyShardedModule(model)" in errors["stage3 plain"]
    assert "no submodule named '7'" in errors["unit"]
    assert "no submodule named '9' to replicate" in errors["replicate name"]
    assert "not one string" in errors["replicate str"]
    assert "torch.optim.AdamW(model.parameters())" in errors["replicated to stage 3"]
    assert errors["stage3 on the model"] is True
    assert "backward" in errors["no backward"]
    assert "already belong to another ZeroOptimizer" in errors["twice"]


def unused_parameter():
    model = make_model()
    model.append(nn.Linear(4, 4).double())          # never reached by forward below
    opt = ZeroOptimizer(model.parameters(), torch.optim.AdamW, stage=2, bucket_cap_mb=ONE_PER_PARAM)
    x, y = shard(data())
    nn.functional.mse_loss(model[:5](x), y).backward()


def test_stage2_names_a_parameter_without_gradient():
    with pytest.raises(pplab.LaunchError, match="got no gradient"):
        pplab.launch(unused_parameter, world_size=2, timeout=60)


# ----------------------------------------------------------------------------------
# In the shape of Stanford CS336 assignment 2's test_sharded_optimizer.py (our own code): the same
# model trained with a plain optimizer and with the sharded one, the same batch on every rank,
# parameters compared after every step. float32, torch.testing.assert_close's default tolerances.


class ToyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(10, 10, bias=False), nn.Linear(10, 50), nn.Linear(50, 5)

    def forward(self, x):
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


class ToyModelWithTiedWeights(ToyModel):
    def __init__(self):
        super().__init__()
        self.fc0 = nn.Linear(10, 10, bias=False)
        self.fc0.weight = self.fc1.weight               # the same tensor, used twice

    def forward(self, x):
        return super().forward(torch.relu(self.fc0(x)))


def sharded_vs_plain(model_class, steps):
    import copy
    torch.manual_seed(42)
    plain = model_class()
    sharded = copy.deepcopy(plain)
    hp = dict(lr=0.1, weight_decay=0.1, betas=(0.9, 0.999), eps=1e-8)
    plain_opt = torch.optim.AdamW(plain.parameters(), **hp)
    sharded_opt = ZeroOptimizer(sharded.parameters(), torch.optim.AdamW, stage=1, **hp)
    history = []
    for step in range(steps):
        torch.manual_seed(step)                         # the same batch on every rank
        x, y = torch.rand(32, 10), torch.rand(32, 5)
        for model, opt in ((plain, plain_opt), (sharded, sharded_opt)):
            opt.zero_grad()
            ((model(x) - y) ** 2).mean().backward()
            opt.step()
        history.append(([p.detach().clone() for p in plain.parameters()],
                        [p.detach().clone() for p in sharded.parameters()]))
    return history


@pytest.mark.parametrize("model_class,p", [(ToyModel, 2), (ToyModelWithTiedWeights, 3)])
def test_sharded_optimizer_like_cs336(model_class, p):
    steps = 5
    results = pplab.launch(sharded_vs_plain, model_class, steps, world_size=p, timeout=60)
    for history in results:
        for plain, sharded in history:
            assert len(plain) == len(sharded)
            for a, b in zip(plain, sharded):
                torch.testing.assert_close(a, b)
    first, last = results[0][0][0], results[0][-1][0]
    assert max_diff(first, last) > 1e-2                 # the models really trained


# ----------------------------------------------------------------------------------
# Mixed precision: bf16 parameters, gradients and collectives; fp32 master shards.
# Reference: one process, the same bf16 model, an fp32 master copy stepped by AdamW and rounded back
# into the bf16 parameters; the gradient is accumulated over the N ranks' local batches in bf16 and
# divided by N, which is what N ranks with bf16 reduce-scatters compute. Tolerance MP_TOL = 1e-6 on
# the bf16 parameters and the fp32 masters (measured: 0, every bit). Against the reference that
# takes the whole global batch's bf16 gradient at once, only bf16 rounding differs: within 2e-3.

MP_TOL = 1e-6


def mp_reference(steps, n):
    model, (x, y) = make_model().to(torch.bfloat16), data()
    masters = [p.detach().float().clone() for p in model.parameters()]
    opt = torch.optim.AdamW(masters, **HPARAMS)
    for _ in range(steps):
        local = []
        for r in range(n):
            xr, yr = shard((x, y), r, n)
            nn.functional.mse_loss(model(xr.to(torch.bfloat16)), yr.to(torch.bfloat16)).backward()
            local.append([p.grad for p in model.parameters()])
            model.zero_grad(set_to_none=True)
        for i, m in enumerate(masters):
            m.grad = (torch.stack([g[i] for g in local]).sum(0) / n).float()
        opt.step()
        with torch.no_grad():
            for m, p in zip(masters, model.parameters()):
                p.copy_(m)
    return [p.detach().clone() for p in model.parameters()], masters


def mixed_precision(stage, steps):
    model = make_model(seed=pplab.comm.rank()).to(torch.bfloat16)
    opt = ZeroOptimizer(model.parameters(), torch.optim.AdamW, stage=stage, master_dtype=torch.float32,
                        bucket_cap_mb=ONE_BUCKET, **HPARAMS)
    x, y = shard(data())
    for _ in range(steps):
        nn.functional.mse_loss(model(x.to(torch.bfloat16)), y.to(torch.bfloat16)).backward()
        opt.step()
        held = held_bytes(model, opt)
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()], held, opt.state_dict()


def as_double(tensors):
    return [t.double() for t in tensors]


@pytest.mark.parametrize("p", [1, 2, 3])
@pytest.mark.parametrize("stage", [1, 2])
def test_mixed_precision_bf16_with_fp32_master_shards(stage, p):
    steps = 3
    results = pplab.launch(mixed_precision, stage, steps, world_size=p, timeout=60)
    params, masters = mp_reference(steps, p)
    global_batch, _ = mp_reference(steps, 1)
    padded = math.ceil(PSI / p) * p
    for got, held, _ in results:
        assert all(t.dtype == torch.bfloat16 for t in got)
        assert max_diff(as_double(got), as_double(params)) <= MP_TOL
        assert max_diff(as_double(got), as_double(global_batch)) <= 2e-3
        # (2 + 2 + 12)Ψ: bf16 parameters and gradients; fp32 master and two fp32 moments, split
        grads = 2 * PSI if stage == 1 else 2 * padded // p
        assert (held["params"], held["grads"], held["optimizer"]) == (2 * padded, grads, 12 * padded // p)
    saved = results[0][2]["state"]                      # the fp32 masters are in the checkpoint
    assert max_diff(as_double(saved[i]["master"] for i in range(len(masters))), as_double(masters)) <= MP_TOL
    assert all(saved[i]["master"].dtype == torch.float32 for i in range(len(masters)))


# ----------------------------------------------------------------------------------
# Gradient accumulation: two backward passes, then one step


def accumulate_reference(steps, micro=2):
    """One process, torch's AdamW: `micro` whole-batch backward passes (gradients add up in .grad),
    then one step."""
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), **HPARAMS)
    for s in range(steps):
        for j in range(micro):
            x, y = data(seed=10 * s + j)
            nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def accumulate_job(steps, micro=2):
    rank, p = pplab.comm.rank(), pplab.comm.world_size()
    out = {}
    for stage, cap in [(1, ONE_BUCKET), (2, ONE_BUCKET), (2, ONE_PER_PARAM), (3, None)]:
        model = make_model(seed=rank)
        fwd, opt = wrap(model, stage, cap=cap)
        for s in range(steps):
            for j in range(micro):           # this rank's share of each of the micro batches
                x, y = shard(data(seed=10 * s + j), rank, p)
                nn.functional.mse_loss(fwd(x), y).backward()
            opt.step()
            opt.zero_grad()
        out[stage, cap] = full_params(model, fwd)
    return out


@pytest.mark.parametrize("p", [2, 3])
def test_two_backwards_before_a_step_equal_single_process_accumulation(p):
    """ZeRO-2 reduce-scatters in each backward's hooks and must add the second backward's mean
    gradient to the first's, not replace it (stage 1 accumulates in .grad, stage 3 in its shards).
    p = 3: Ψ = 118 does not divide, the buffers pad."""
    results = pplab.launch(accumulate_job, 2, world_size=p, timeout=90)
    expected = accumulate_reference(2)
    for rank, res in enumerate(results):
        for (stage, cap), params in res.items():
            if params is not None:            # stage 3: the full model on rank 0 only
                assert max_diff(params, expected) <= TOL, (rank, stage, cap)
    assert max_diff(accumulate_reference(2, micro=1), expected) > 1e-4   # the second backward matters


# ----------------------------------------------------------------------------------
# FlatBucket: the slices by hand


@pytest.mark.parametrize("world_size, own_rank, shards", [
    (3, 1, [[1, 2, 3], [4, 5, 6], [7, 0, 0]]),           # 7 elements: shard_size 3, padded to 9
    (4, 2, [[1, 2], [3, 4], [5, 6], [7, 0]]),            # shard_size 2, padded to 8
])
def test_flat_bucket_shard_of_an_explicit_rank_by_hand(world_size, own_rank, shards):
    params = [torch.zeros(3), torch.zeros(2, 2)]          # 3 + 4 = 7 elements: no world size divides it
    bucket = FlatBucket(params, world_size=world_size, rank=own_rank)
    flat = bucket.flatten([torch.tensor([1.0, 2, 3]), torch.tensor([[4.0, 5], [6, 7]])])
    assert flat.tolist() == list(range(1, 8)) + [0] * (bucket.padded - 7)
    for r, want in enumerate(shards):
        assert bucket.shard(flat, rank=r).tolist() == want, r      # rank=0 too: not "rank or self.rank"
    assert bucket.shard(flat).tolist() == shards[own_rank]         # default: the bucket's own rank
    bucket.shard(flat, rank=0)[0] = 9.0                            # a view: writing it writes the buffer
    assert flat[0] == 9.0
