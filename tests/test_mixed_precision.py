"""pplab.mixed_precision (and the compute/reduce dtypes of DDP, ZeroOptimizer, FullyShardedModule)
against one process that casts the same way.

The reference runs the same 2-byte model on each rank's share of the batch in turn (local gradients
in the compute dtype), sums the N local gradients in the reduce dtype in rank order and divides by
N, as N ranks do; then AdamW steps fp32 master weights and the model gets them rounded. The model
has Ψ = 118 parameters in 3 layers: 118 divides by neither 3 nor 4, so ZeRO and FSDP pad.

AdamW's eps is 1e-3, not 1e-8: with gradients of about 0.1, Adam is then not blind to a gradient's
scale, so a missing division by N (or a loss scale never divided out) changes the masters visibly.

Tolerances. ZeroOptimizer and FullyShardedModule reduce-scatter on gloo as one all-to-all and a
torch.sum over the N pieces in rank order (pplab.zero.flat), the reference's own operation: equal to
EXACT = 1e-6 on the fp32 masters (measured: 0, every bit). DDP's all-reduce is gloo's: in fp32 the
sum of 2 or 3 bf16/fp16 numbers is exact in any order, so EXACT again. In 2 bytes gloo rounds after
each addition, in its own order, where torch's sum rounds once: each rounding is at most half a unit
in the last place of a partial sum, so the mean gradient differs by at most u·Σ|g_r|/N + one ulp of
the mean (u = 2^-8 in bf16, 2^-11 in fp16), checked element by element at the first step. Over 3
AdamW steps such a difference is not small in relative terms where the ranks' gradients cancel
(Adam divides each element by its own size), so the masters get GLOO_2_BYTES = 3 steps × lr × 0.1
= 3e-3 (measured at 3 ranks: 3e-4 in bf16, 1e-5 in fp16; 0 at 2 ranks).
"""
import math

import pytest
import torch
from torch import nn

import pplab
from pplab.data_parallel import DDP, shard
from pplab.memory import state_bytes
from pplab.mixed_precision import LossScaler, MasterWeights, poison_gradient, traffic_bytes
from pplab.trace import Timeline
from pplab.zero import FullyShardedModule, ZeroOptimizer, held_bytes, sent_bytes

EXACT, GLOO_2_BYTES = 1e-6, 3e-3
GLOBAL, STEPS = 12, 3
SIZES = [(5, 7), (7, 6), (6, 4)]                 # Ψ = 42 + 48 + 28 = 118
PSI = sum(i * o + o for i, o in SIZES)
HPARAMS = dict(lr=0.01, betas=(0.9, 0.99), eps=1e-3, weight_decay=0.1)
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
CONFIGS = [(BF16, BF16), (BF16, FP32), (FP16, FP16), (FP16, FP32)]     # (compute, reduce)


def make_model(seed=0):
    torch.manual_seed(seed)
    mods = []
    for i, o in SIZES:
        mods += [nn.Linear(i, o), nn.Tanh()]
    return nn.Sequential(*mods[:-1])


def data(seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(GLOBAL, 5, generator=g), torch.randn(GLOBAL, 4, generator=g)


def loss_of(out, y):
    return nn.functional.mse_loss(out, y.to(out.dtype))


def reference(n, compute, reduce, steps=STEPS, scaler=None, poison=None, strategy="zero"):
    """One process: the fp32 masters after `steps`, and the first step's mean gradient (local sums,
    flat). poison=(step, rank, flat index) puts an inf in that rank's local gradient at that step.
    DDP rounds the mean into the compute dtype's .grad before it is widened for the master; ZeRO and
    FSDP hand the reduced mean on as it is. FSDP's masters start from the fp32 model, not rounded."""
    model, (x, y) = make_model(), data()
    masters = [p.detach().clone() if strategy == "fsdp" else p.detach().to(compute).float()
               for p in model.parameters()]
    params = list(model.to(compute).parameters())
    with torch.no_grad():
        for p, m in zip(params, masters):
            p.copy_(m)
    first = None
    opt = torch.optim.AdamW(masters, **HPARAMS)
    for s in range(steps):
        local = []
        for r in range(n):
            if poison is not None and poison[:2] == (s, r):
                poison_at(params, poison[2])
            xr, yr = shard((x, y), r, n)
            loss = loss_of(model(xr.to(compute)), yr)
            (scaler.scale_loss(loss) if scaler else loss).backward()
            local.append(torch.cat([p.grad.reshape(-1) for p in params]))
            model.zero_grad(set_to_none=True)
        mean = torch.stack([g.to(reduce) for g in local]).sum(0) / n
        mean = (mean.to(compute) if strategy == "ddp" else mean).float()
        first = (torch.stack(local).float().abs().sum(0) / n, mean) if first is None else first
        for m, a, b in zip(masters, offsets(params), offsets(params)[1:]):
            m.grad = mean[a:b].view_as(m).clone()
        (scaler.step(opt) if scaler else opt.step())
        with torch.no_grad():
            for p, m in zip(params, masters):
                p.copy_(m)
    return masters, first


def offsets(params):
    out = [0]
    for p in params:            # a FullyShardedModule's parameter holds its shard between uses: its whole size
        out.append(out[-1] + math.prod(getattr(p, "_pplab_full_shape", p.shape)))
    return out


def poison_at(params, index):
    """poison_gradient on the parameter that holds flat element `index` of the model."""
    for p, a, b in zip(params, offsets(params), offsets(params)[1:]):
        if a <= index < b:
            return poison_gradient(p, index - a)


def max_diff(a, b):
    return max((u.double() - v.double()).abs().max().item() for u, v in zip(a, b))


# ----------------------------------------------------------------------------------
# One rank's training, for each strategy; returns the fp32 masters as full tensors per parameter


def masters_of(strategy, model, opt):
    if strategy == "fsdp":
        state = model.state_dict()                  # the master shards, gathered (rank 0)
        return [state[k] for k, _ in make_model().named_parameters()] if pplab.comm.rank() == 0 else None
    if strategy == "ddp":
        return [m.detach().clone() for m in opt.masters]
    full = opt.state_dict()                         # ZeroOptimizer: the masters are in its checkpoint
    return [full["state"][i]["master"] for i in range(len(full["state"]))] if pplab.comm.rank() == 0 else None


def build(strategy, compute, reduce):
    if strategy == "ddp":
        model = DDP(make_model(seed=pplab.comm.rank()).to(compute), reduce_dtype=reduce)
        return model, MasterWeights(model.parameters(), torch.optim.AdamW, **HPARAMS)
    if strategy == "zero":
        model = make_model(seed=pplab.comm.rank()).to(compute)
        return model, ZeroOptimizer(model.parameters(), torch.optim.AdamW, stage=2, master_dtype=FP32,
                                    reduce_dtype=reduce, **HPARAMS)
    model = FullyShardedModule(make_model(seed=pplab.comm.rank()), compute_dtype=compute, reduce_dtype=reduce)
    return model, ZeroOptimizer(model.parameters(), torch.optim.AdamW, stage=3, **HPARAMS)


def train(strategy, configs, steps=STEPS, scaler_args=None, poison=None):
    out = []
    for compute, reduce in configs:
        with pplab.trace.span("config", f"{compute}/{reduce}"):
            model, opt = build(strategy, compute, reduce)
            scaler = LossScaler(**scaler_args) if scaler_args else None
            x, y = shard(data())
            dtypes = set()                          # the first layer's parameters as its forward sees them
            layer0 = (model if strategy == "zero" else model.module)[0]
            layer0.register_forward_pre_hook(lambda m, args: dtypes.update(str(p.dtype) for p in m.parameters()))
            for s in range(steps):
                if poison is not None and poison[:2] == (s, pplab.comm.rank()):
                    poison_at(list((model.module if strategy != "zero" else model).parameters()), poison[2])
                loss = loss_of(model(x.to(compute)), y)
                (scaler.scale_loss(loss) if scaler else loss).backward()
                if s == 0 and strategy == "ddp":
                    first = torch.cat([p.grad.reshape(-1).float() for p in model.parameters()])
                scaler.step(opt) if scaler else opt.step()
                held = held_bytes(model, opt)
                opt.zero_grad()
            out.append({"masters": masters_of(strategy, model, opt), "held": held,
                        "history": scaler.history if scaler else None, "first": first if strategy == "ddp" else None,
                        "dtypes": dtypes})
    return out


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("strategy", ["ddp", "zero", "fsdp"])
def test_mixed_precision_equals_one_process_that_casts_alike(strategy, n):
    results = pplab.launch(train, strategy, CONFIGS, world_size=n, timeout=60)
    for k, (compute, reduce) in enumerate(CONFIGS):
        want, (size, mean) = reference(n, compute, reduce, strategy=strategy)
        tol = GLOO_2_BYTES if strategy == "ddp" and reduce != FP32 else EXACT
        if strategy == "ddp":                                          # the first mean gradient, every rank
            u = torch.finfo(compute).eps / 2                             # unit roundoff
            bound = u * size + (mean.abs() * 2 * u if reduce != FP32 else 0)
            for r in range(n):
                worst = ((results[r][k]["first"] - mean).abs() - bound).max().item()
                assert worst <= 0, f"ddp, n={n}, {compute}/{reduce}: rank {r}'s mean gradient is off the bound"
        ranks = range(n) if strategy == "ddp" else [0]            # ZeRO, FSDP: gathered on rank 0
        for r in ranks:
            got = results[r][k]["masters"]
            assert all(t.dtype == FP32 for t in got), f"rank {r}: the masters must stay fp32"
            assert max_diff(got, want) <= tol, (f"{strategy}, n={n}, compute {compute}, reduce {reduce}: rank {r}'s "
                                                f"masters differ from one process by {max_diff(got, want):.3g}")
        for r in range(n):
            assert results[r][k]["dtypes"] == {str(compute)}, f"rank {r}: the model must compute in {compute}"
        # The choice is visible: summing in 2 bytes gives other masters. (Not for DDP on 2 ranks: a + b rounded
        # once and halved exactly is what the fp32 sum rounded into .grad is, bit for bit.)
        if compute == BF16 and reduce == FP32 and (strategy != "ddp" or n == 3):
            assert max_diff(want, reference(n, BF16, BF16, strategy=strategy)[0]) > 0
    # Bytes held per parameter (the last config's, after a step): (2 + 2 + 12)Ψ split as the stage says
    padded = math.ceil(PSI / n) * n
    expect = {"ddp": (2 * PSI, 2 * PSI, 12 * PSI),
              "zero": (2 * padded, 4 * padded // n, 12 * padded // n),   # fp32 reduce: my shard's mean in fp32
              "fsdp": (4 * padded // n, 4 * padded // n, 8 * padded // n)}[strategy]
    for r in range(n):
        held = results[r][-1]["held"]
        assert (held["params"], held["grads"], held["optimizer"]) == expect, f"rank {r}: {held} != {expect}"


def test_bytes_per_parameter_of_ddp_with_master_weights_match_state_bytes():
    """The (2 + 2 + 12) of one replica, from pplab.memory.state_bytes: bf16 model and gradients, then the
    inner AdamW's state plus the fp32 masters it steps."""
    model = make_model().to(BF16)
    opt = MasterWeights(model.parameters(), torch.optim.AdamW, **HPARAMS)
    loss_of(model(data()[0].to(BF16)), data()[1]).backward()
    opt.step()
    held = state_bytes(model)
    inner = state_bytes(opt.masters, opt.inner)
    assert (held.parameters, held.gradients) == (2 * PSI, 2 * PSI)
    assert inner.parameters + inner.optimizer == 12 * PSI + 4 * len(opt.masters)   # + AdamW's step counters


# ----------------------------------------------------------------------------------
# Traffic: bytes each rank sent, read from the trace, = the formula for each reduce dtype


def comm_bytes(timeline, config, n):
    """Mean over ranks of the bytes sent in the gradient and parameter collectives of one config."""
    total = 0
    for r in range(n):
        box = next(e for e in timeline.select(r, "compute") if e.label == config)
        inside = [e for e in timeline.select(r, "comm") if box.start <= e.start <= box.end
                  and e.label[:2] in ("AR", "RS", "AG") and e.label[2:].isdigit()]   # buckets and units
        total += sent_bytes(Timeline(inside, world_size=n), r)
    return total / n


@pytest.mark.parametrize("strategy", ["ddp", "zero", "fsdp"])
def test_traffic_from_the_trace_is_the_formula_for_each_reduce_dtype(strategy):
    n, configs = 3, [(BF16, BF16), (BF16, FP32)]
    run = pplab.launch(train, strategy, configs, 1, world_size=n, timeout=60)
    padded = math.ceil(PSI / n) * n
    psi = PSI if strategy == "ddp" else padded
    seen = {}
    for compute, reduce in configs:
        seen[reduce] = comm_bytes(run.timeline, f"{compute}/{reduce}", n)
        want = traffic_bytes(strategy, psi, n, 2, reduce.itemsize)
        assert seen[reduce] == pytest.approx(want, rel=1e-12), f"{strategy}, reduce {reduce}: {seen[reduce]} != {want}"
    # by hand: fp32 reduction adds 2 bytes a parameter per reduction pass
    passes = {"ddp": 2, "zero": 1, "fsdp": 1}[strategy]
    assert seen[FP32] - seen[BF16] == pytest.approx(passes * 2 * psi * (n - 1) / n)


def test_traffic_formula_by_hand():
    assert traffic_bytes("ddp", 300, 3, 2, 4) == 2 * 200 * 4
    assert traffic_bytes("zero", 300, 3, 2, 4) == 200 * (2 + 4)
    assert traffic_bytes("fsdp", 300, 3, 2, 2) == 200 * 6
    with pytest.raises(ValueError, match="strategy must be"):
        traffic_bytes("tp", 300, 3, 2, 2)


# ----------------------------------------------------------------------------------
# Dynamic loss scaling, agreed by every rank


SCALER = dict(init_scale=2.0**10, growth_interval=2)


# An element of the model (flat, in forward order) that lies in the last rank's shard (ZeRO at 3 ranks,
# FSDP at 2): ZeRO's one bucket starts with the last layer, so the first weight ends it; FSDP's last
# unit is the last layer, whose shards end with its bias.
IN_LAST_SHARD = {"zero": 0, "fsdp": PSI - 1, "ddp": 0}


@pytest.mark.parametrize("strategy, n", [("zero", 3), ("fsdp", 2), ("ddp", 2)])   # 2 ranks must agree too
def test_an_inf_on_one_rank_skips_every_rank_then_training_recovers(strategy, n):
    # The inf goes into the local gradient of the last rank (not rank 0), at step 1, in an element of the
    # last rank's shard. So rank 0's own shard stays finite: only the all-reduced flag tells it to skip.
    steps, poison = 5, (1, n - 1, IN_LAST_SHARD[strategy])
    results = pplab.launch(train, strategy, [(FP16, FP32)], steps, SCALER, poison, world_size=n, timeout=60)
    # scale 1024 at steps 0, 1; overflow at 1 -> 512; good at 2, 3 -> grows to 1024 after step 3
    history = [(1024.0, True), (1024.0, False), (512.0, True), (512.0, True), (1024.0, True)]
    for r in range(n):
        assert results[r][0]["history"] == history, f"rank {r}'s scale/steps {results[r][0]['history']}"
    want, _ = reference(n, FP16, FP32, steps, LossScaler(**SCALER), poison, strategy)
    for r in (range(n) if strategy == "ddp" else [0]):
        assert max_diff(results[r][0]["masters"], want) <= EXACT, f"rank {r} differs from one process"
    unpoisoned, _ = reference(n, FP16, FP32, steps, LossScaler(**SCALER), strategy=strategy)
    assert max_diff(want, unpoisoned) > 0                                                # the skip mattered


def deciding_alone(n):
    """A scaler whose ranks each decide from their own shard: what the all-reduce of the flag prevents."""
    model = make_model(seed=pplab.comm.rank()).to(FP16)
    opt = ZeroOptimizer(model.parameters(), torch.optim.AdamW, stage=2, master_dtype=FP32, **HPARAMS)
    scaler = LossScaler(**SCALER)
    scaler.overflow_anywhere = lambda grads: any(not bool(torch.isfinite(g).all()) for g in grads)
    x, y = shard(data())
    poison_at(list(model.parameters()), IN_LAST_SHARD["zero"]) if pplab.comm.rank() == n - 1 else None
    scaler.scale_loss(loss_of(model(x.to(FP16)), y)).backward()
    return scaler.step(opt)


def test_without_the_agreement_ranks_would_decide_differently():
    stepped = pplab.launch(deciding_alone, 3, world_size=3, timeout=60)
    assert list(stepped) == [True, True, False]         # only the shard's owner saw the inf


def test_loss_scaler_schedule_by_hand_and_bad_input():
    s = LossScaler(init_scale=8.0, growth_factor=4.0, backoff_factor=0.25, growth_interval=3)
    for overflow in [False, False, True, False, False, False, False]:
        s.update(overflow)
    assert (s.scale, s.good_steps) == (8.0 * 0.25 * 4.0, 1)
    for bad, match in [(dict(init_scale=0), "init_scale"), (dict(growth_factor=1.0), "growth_factor"),
                       (dict(backoff_factor=1.5), "backoff_factor"), (dict(growth_interval=0), "growth_interval")]:
        with pytest.raises(ValueError, match=match):
            LossScaler(**bad)
    p = nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=1.0)
    scaler = LossScaler(init_scale=4.0)
    scaler.scale_loss(p.sum()).backward()              # gradient 4 -> unscaled 1 -> p = 0
    assert scaler.step(opt) and p.detach().tolist() == [0.0, 0.0, 0.0]
    opt.zero_grad()
    poison_gradient(p, 2, math.nan)                    # a NaN (fp16's inf - inf) is an overflow too
    scaler.scale_loss(p.sum()).backward()
    assert not scaler.step(opt) and p.detach().tolist() == [0.0, 0.0, 0.0], "a NaN gradient must skip the step"
    assert scaler.history == [(4.0, True), (4.0, False)] and scaler.scale == 2.0
    for index in (3, -1):                              # p has elements 0, 1, 2
        with pytest.raises(ValueError, match="outside the parameter's 3 elements"):
            poison_gradient(p, index)


def test_bad_dtypes_are_refused():
    def refuse():
        with pytest.raises(ValueError, match="compute_dtype must be a floating-point"):
            FullyShardedModule(make_model(), compute_dtype=torch.int8)
        with pytest.raises(ValueError, match="reduce_dtype must be a floating-point"):
            DDP(make_model(), reduce_dtype="fp32")
        with pytest.raises(ValueError, match="pass reduce_dtype to it instead"):
            fsdp = FullyShardedModule(make_model())
            ZeroOptimizer(fsdp.parameters(), torch.optim.AdamW, stage=3, reduce_dtype=FP32)
        return True
    assert all(pplab.launch(refuse, world_size=2, timeout=60))


def fsdp_checkpoint_round_trip():
    """FSDP with a compute dtype: state_dict gives the fp32 masters unrounded; loading it into a fresh
    wrapper gives the same shards; full_parameters() shows the model in the compute dtype."""
    fsdp = FullyShardedModule(make_model(seed=pplab.comm.rank()), compute_dtype=BF16)
    saved = fsdp.state_dict()
    everyone = [saved] if pplab.comm.rank() == 0 else [None]
    torch.distributed.broadcast_object_list(everyone, src=0)
    fresh = FullyShardedModule(make_model(seed=7), compute_dtype=BF16)
    fresh.load_state_dict(everyone[0])
    with fresh.full_parameters() as module:
        dtypes = {p.dtype for p in module.parameters()}
        gathered = [p.detach().clone() for p in module.parameters()]
    frozen = make_model(seed=7)                          # a frozen weight is not sharded: loaded and cast whole
    frozen[2].weight.requires_grad_(False)
    frozen = FullyShardedModule(frozen, compute_dtype=BF16)
    frozen.load_state_dict(everyone[0])
    out = frozen(data()[0]).detach()                     # an fp32 input: cast too
    return saved, [s.detach().clone() for s in fsdp.parameters()], [s.detach().clone() for s in fresh.parameters()], \
        dtypes, gathered, out


def test_fsdp_checkpoint_keeps_the_fp32_masters():
    results = pplab.launch(fsdp_checkpoint_round_trip, world_size=3, timeout=60)
    saved = results[0][0]
    original = make_model().state_dict()
    assert saved.keys() == original.keys()
    assert all(saved[k].dtype == FP32 and torch.equal(saved[k], original[k]) for k in original), \
        "state_dict must give rank 0's fp32 values, not their bf16 rounding"
    in_bf16 = make_model().to(BF16)(data()[0].to(BF16))    # torch's own bf16 forward of rank 0's model
    for r, (_, shards, loaded, dtypes, gathered, out) in enumerate(results):
        assert all(torch.equal(a, b) for a, b in zip(shards, loaded)), f"rank {r}: loaded shards differ"
        assert dtypes == {BF16}, f"rank {r}: full_parameters() should show the compute dtype"
        assert all(torch.equal(g, original[k].to(BF16)) for g, k in zip(gathered, original)), f"rank {r}"
        assert out.dtype == BF16 and torch.equal(out, in_bf16), \
            f"rank {r}: the frozen weight must be loaded whole and cast: forward = model.to(bf16)'s"


def test_master_weights_and_scaler_refuse_what_they_cannot_use():
    with pytest.raises(ValueError, match="master_dtype must be a floating-point"):
        MasterWeights(make_model().parameters(), torch.optim.SGD, master_dtype=torch.int32, lr=0.1)
    with pytest.raises(ValueError, match="no parameter with requires_grad"):
        MasterWeights([nn.Parameter(torch.ones(2), requires_grad=False)], torch.optim.SGD, lr=0.1)

    class NoInner:
        inner = torch.optim.SGD([nn.Parameter(torch.ones(1))], lr=0.1)

        def step(self):
            pass                                          # never reaches its inner optimizer
    with pytest.raises(RuntimeError, match="never called its inner optimizer's step"):
        LossScaler().step(NoInner())
    assert "step" not in vars(NoInner.inner)             # the inner step is restored
