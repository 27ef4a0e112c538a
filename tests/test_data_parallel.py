"""pplab.data_parallel.DDP against single-process training on the whole global batch.

Everything is float64; "equal" means max |difference| <= TOL = 1e-10 (the measured
differences are ~1e-16: the only change is the order of the additions).
"""
import math

import pytest
import torch
import torch.distributed as dist
from torch import nn

import pplab
from pplab.data_parallel import DDP, reverse_buckets, shard

pytestmark = pytest.mark.usefixtures("no_leftover_processes")

TOL = 1e-10
GLOBAL = 12                     # divides by 1, 2, 3 and 4
TINY, MEDIUM, HUGE = 1e-6, 5e-4, 100.0      # MiB: one parameter per bucket / some / all in one


def make_model(seed=0, layers=3, width=6):
    torch.manual_seed(seed)
    mods, d = [], 5
    for _ in range(layers - 1):
        mods += [nn.Linear(d, width), nn.Tanh()]
        d = width
    mods.append(nn.Linear(d, 3))
    return nn.Sequential(*mods).double()


def data(n=GLOBAL, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 5, generator=g, dtype=torch.float64), torch.randn(n, 3, generator=g, dtype=torch.float64)


def make_opt(name, params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.5) if name == "sgd" else torch.optim.Adam(params, lr=0.01)


def loss_fn(model, x, y):
    return nn.functional.mse_loss(model(x), y)      # the mean over the samples it is given


def single_process(opt_name, steps):
    """The reference: one process, the whole global batch, the same initial model."""
    model, (x, y) = make_model(), data()
    opt = make_opt(opt_name, model.parameters())
    for _ in range(steps):
        loss_fn(model, x, y).backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def max_diff(a, b):
    return max((u - v).abs().max().item() for u, v in zip(a, b))


# ----------------------------------------------------------------------------------
# Same result as one process


def train_configs(steps):
    """Each rank: every (optimizer, bucket size, overlap) combination, from a differently seeded model."""
    rank = pplab.comm.rank()
    out = {}
    for opt_name in ("sgd", "adam"):
        for cap in (TINY, MEDIUM, HUGE):
            for overlap in (True, False):
                model = DDP(make_model(seed=rank), bucket_cap_mb=cap, overlap=overlap)
                opt = make_opt(opt_name, model.parameters())
                x, y = shard(data())
                for _ in range(steps):
                    loss_fn(model, x, y).backward()
                    opt.step()
                    opt.zero_grad()
                out[opt_name, cap, overlap] = ([p.detach().clone() for p in model.parameters()],
                                               len(model.buckets))
    return out


@pytest.mark.parametrize("p", [1, 2, 3, 4])
def test_parameters_equal_single_process_training(p):
    steps = 3
    results = pplab.launch(train_configs, steps, world_size=p, timeout=60)
    reference = {name: single_process(name, steps) for name in ("sgd", "adam")}
    n_params = len(reference["sgd"])
    for rank, out in enumerate(results):
        for (opt_name, cap, overlap), (params, n_buckets) in out.items():
            assert max_diff(params, reference[opt_name]) <= TOL, (rank, opt_name, cap, overlap)
            expected = {TINY: n_params, HUGE: 1}.get(cap)
            if expected is not None:
                assert n_buckets == expected
            else:
                assert 1 < n_buckets < n_params
    # the reference really moved: a DDP that did nothing would not match it
    assert max_diff(reference["sgd"], [q.detach() for q in make_model().parameters()]) > 1e-3


def grads_with_no_sync():
    rank = pplab.comm.rank()
    model = DDP(make_model(seed=rank), bucket_cap_mb=TINY)
    local = make_model()                          # a plain copy of rank 0's start, for local grads
    x, y = data(2 * GLOBAL)
    micro = [shard((x[:GLOBAL], y[:GLOBAL])), shard((x[GLOBAL:], y[GLOBAL:]))]
    with model.no_sync():
        (loss_fn(model, *micro[0]) / 2).backward()
    after_first = [p.grad.clone() for p in model.parameters()]
    (loss_fn(local, *micro[0]) / 2).backward()
    local_grads = [p.grad.clone() for p in local.parameters()]
    n_ar_during_no_sync = len([e for e in pplab.trace.events() if e.kind in ("all_reduce", "all_gather")])
    (loss_fn(model, *micro[1]) / 2).backward()
    return after_first, local_grads, n_ar_during_no_sync, [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("p", [2, 3])
def test_no_sync_accumulation_equals_the_combined_batch(p):
    results = pplab.launch(grads_with_no_sync, world_size=p, timeout=60)
    ref = make_model()
    loss_fn(ref, *data(2 * GLOBAL)).backward()        # both micro-batches of every rank at once
    expected = [q.grad for q in ref.parameters()]
    for after_first, local_grads, n_comm, final in results:
        assert n_comm == 0                              # no communication inside no_sync
        assert max_diff(after_first, local_grads) <= TOL    # just this rank's own gradient
        assert max_diff(final, expected) <= TOL
    assert max_diff(results[0][0], results[1][0]) > 1e-6    # ranks really differed before the sync


# ----------------------------------------------------------------------------------
# Start, buckets, overlap


def params_after_wrapping():
    rank = pplab.comm.rank()
    before = [p.detach().clone() for p in make_model(seed=rank).parameters()]
    model = DDP(make_model(seed=rank))
    return before, [p.detach().clone() for p in model.parameters()]


def test_broadcast_makes_differently_initialised_replicas_equal():
    results = pplab.launch(params_after_wrapping, world_size=3, timeout=60)
    rank0_init = results[0][0]
    assert max_diff(results[1][0], rank0_init) > 1e-3          # they did start different
    for _, after in results:
        assert max_diff(after, rank0_init) == 0.0


def bucket_layouts():
    model = make_model(layers=4, width=8)
    model[2].weight.requires_grad_(False)                      # frozen: no bucket, no all-reduce
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    layouts = {}
    for cap in (TINY, 8 * 8 * 8 / 2**20, HUGE):                 # 8x8 float64 weight = 512 bytes
        ddp = DDP(model, bucket_cap_mb=cap)
        layouts[cap] = ddp.buckets
        ddp.remove_hooks()
    return names, layouts


def test_buckets_hold_parameters_in_reverse_order_within_the_cap():
    names, layouts = pplab.launch(bucket_layouts, world_size=2, timeout=60)[0]
    for cap, buckets in layouts.items():
        assert [n for b in buckets for n, _ in b] == names[::-1]
        for b in buckets:               # over the cap only as a single oversized parameter
            assert sum(nb for _, nb in b) <= cap * 2**20 or len(b) == 1
        # greedy: the next bucket's first parameter would not have fitted in this one
        for b, nxt in zip(buckets, buckets[1:]):
            assert sum(nb for _, nb in b) + nxt[0][1] > cap * 2**20
    assert [len(b) for b in layouts[TINY]] == [1] * len(names)
    assert len(layouts[HUGE]) == 1
    assert [[n for n, _ in b] for b in layouts[8 * 8 * 8 / 2**20]] == \
        [["6.bias", "6.weight", "4.bias"], ["4.weight"], ["2.bias", "0.bias", "0.weight"]]   # 280, 512, 448 B


def traced_steps(overlap, steps=2):
    model = DDP(make_model(layers=4, width=16), bucket_cap_mb=TINY, overlap=overlap)
    opt = make_opt("sgd", model.parameters())
    x, y = shard(data())
    for _ in range(steps):
        loss_fn(model, x, y).backward()
        opt.step()
        opt.zero_grad()
    return len(model.buckets)


@pytest.mark.parametrize("overlap", [True, False])
def test_trace_shows_all_reduces_overlapping_backward(overlap):
    results = pplab.launch(traced_steps, overlap, world_size=2, timeout=60)
    n_buckets, tl = results[0], results.timeline
    payload = sum(p.numel() * 8 for p in make_model(layers=4, width=16).parameters())
    for rank in range(2):
        backs = tl.select(rank, kind="B")
        ars = tl.select(rank, kind="all_reduce")
        assert len(backs) == 2 and len(ars) == 2 * n_buckets
        for step, b in enumerate(backs):
            mine = ars[step * n_buckets:(step + 1) * n_buckets]
            assert [e.label for e in mine] == [f"AR{i}" for i in range(n_buckets)]   # launched in order
            assert sum(e.meta["payload"] for e in mine) == payload
            assert all(e.start >= b.start for e in mine)
            if overlap:     # bucket 0 holds the last layer: launched while the earlier layers' backward runs
                assert all(e.start < b.end for e in mine)
            else:           # nothing sent until backward is over
                assert all(e.start >= b.end for e in mine)


# ----------------------------------------------------------------------------------
# Bad input: clear errors, no hangs


@pytest.mark.parametrize("cap", [0, -1, math.nan, math.inf, True, "25"])
def test_bucket_cap_must_be_positive(cap):
    with pytest.raises(ValueError, match="bucket_cap_mb must be a number of MiB > 0"):
        DDP(make_model(), bucket_cap_mb=cap)


def test_ddp_outside_a_process_group_says_how_to_start_one():
    with pytest.raises(RuntimeError, match="pplab.launch"):
        DDP(make_model())


def test_shard_refuses_a_global_batch_that_does_not_divide():
    with pytest.raises(ValueError, match="multiple of 4 .e.g. 8 or 12"):
        shard(torch.zeros(10, 2), rank=0, world_size=4)
    assert shard((torch.arange(12), torch.arange(12)), rank=2, world_size=3)[1].tolist() == [8, 9, 10, 11]


def misuses():
    rank = pplab.comm.rank()
    x, y = shard(data())
    errors = {}

    def expect(name, fn):
        try:
            fn()
            errors[name] = None
        except Exception as exc:  # noqa: BLE001
            errors[name] = f"{type(exc).__name__}: {exc}"

    model = DDP(make_model())

    def nested():
        with model.no_sync(), model.no_sync():
            pass
    expect("nested", nested)

    def forward_in_backward_out():
        with model.no_sync():
            loss = loss_fn(model, x, y)
        loss.backward()
    expect("straddle", forward_in_backward_out)
    model.zero_grad()
    expect("works_after", lambda: loss_fn(model, x, y).backward())

    expect("wrapped_twice", lambda: DDP(model.module))

    class WithUnused(nn.Module):
        def __init__(self):
            super().__init__()
            self.used, self.spare = nn.Linear(5, 3).double(), nn.Linear(5, 3).double()

        def forward(self, x):
            return self.used(x)
    unused = DDP(WithUnused(), bucket_cap_mb=TINY)
    expect("unused", lambda: loss_fn(unused, x, y).backward())

    uneven = DDP(make_model())
    expect("uneven", lambda: loss_fn(uneven, x[:3 + rank], y[:3 + rank]).backward())

    expect("different_models", lambda: DDP(make_model(width=6 + rank)))

    aborting = DDP(make_model(layers=4), bucket_cap_mb=TINY)

    def fail(grad):                 # the first layer's gradient: after later buckets were launched
        raise ValueError("user hook failed")
    aborting.module[0].weight.register_hook(fail)
    expect("aborted", lambda: loss_fn(aborting, x, y).backward())
    expect("after_abort", lambda: aborting(x))
    return errors


def test_misuse_gives_clear_errors_on_every_rank():
    results = pplab.launch(misuses, world_size=2, timeout=60)
    for errors in results:
        assert "no_sync() is already active: do not nest it" in errors["nested"]
        assert "forward ran inside no_sync() but backward outside it" in errors["straddle"]
        assert errors["works_after"] is None
        assert "already carry the hooks of another DDP" in errors["wrapped_twice"]
        assert "got no gradient in this backward: ['spare.bias', 'spare.weight']" in errors["unused"]
        assert "local batch sizes differ [3, 4]" in errors["uneven"]
        assert "rank 1's model differs from rank 0's" in errors["different_models"]
        assert "user hook failed" in errors["aborted"]
        assert "the previous backward did not finish" in errors["after_abort"]


# ----------------------------------------------------------------------------------
# Buffers: BatchNorm's running stats differ by rank (each normalises its own samples)


def make_bn_model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 6), nn.BatchNorm1d(6), nn.Tanh(), nn.Linear(6, 3)).double()


def buffers(model):
    return [b.detach().clone() for b in model.buffers()]


def bn_reference(p, steps):
    """torch DDP's rule, by hand in one process: before each forward every replica takes rank
    0's buffers; rank r's forward then updates them from its own samples; the gradient is the
    mean of the p local gradients. Returns the parameters, each rank's final buffers and the
    eval output (which uses rank 0's buffers, broadcast before it)."""
    model, (x, y) = make_bn_model(), data()
    opt = make_opt("sgd", model.parameters())
    xs, ys = x.chunk(p), y.chunk(p)
    names = [n for n, _ in model.named_buffers()]
    rank0 = buffers(model)
    for _ in range(steps):
        losses, after = [], []
        for r in range(p):                      # replica r: the shared parameters, its own buffers
            mine = dict(zip(names, [b.clone() for b in rank0]))
            out = torch.func.functional_call(model, (dict(model.named_parameters()), mine), (xs[r],))
            losses.append(nn.functional.mse_loss(out, ys[r]))
            after.append(list(mine.values()))   # updated in place by this forward
        (sum(losses) / p).backward()
        opt.step()
        opt.zero_grad()
        rank0 = after[0]
    for b, b0 in zip(model.buffers(), rank0):
        b.copy_(b0)
    with torch.no_grad():
        out = model.eval()(x)
    return [q.detach().clone() for q in model.parameters()], after, out


def train_bn(steps, broadcast_buffers=True):
    """pplab's DDP and torch's DDP side by side, from differently seeded replicas."""
    rank = pplab.comm.rank()
    x, y = data()
    local = shard((x, y))
    out = {}
    for name, wrap in (("pplab", lambda m: DDP(m, bucket_cap_mb=MEDIUM, broadcast_buffers=broadcast_buffers)),
                       ("torch", lambda m: nn.parallel.DistributedDataParallel(m, broadcast_buffers=broadcast_buffers))):
        model = wrap(make_bn_model(seed=rank))
        opt = make_opt("sgd", model.parameters())
        for _ in range(steps):
            loss_fn(model, *local).backward()
            opt.step()
            opt.zero_grad()
        trained = buffers(model.module)
        model.eval()
        with torch.no_grad():
            evaluated = model(x)
        out[name] = [q.detach().clone() for q in model.parameters()], trained, evaluated
    return out


@pytest.mark.parametrize("p", [2, 3])
def test_buffers_are_broadcast_before_each_forward_as_torch_ddp_does(p):
    steps = 3
    results = pplab.launch(train_bn, steps, world_size=p, timeout=60)
    params, rank_buffers, evaluated = bn_reference(p, steps)
    for rank, out in enumerate(results):
        for name in ("pplab", "torch"):
            got_params, got_buffers, got_eval = out[name]
            assert max_diff(got_params, params) <= TOL, (rank, name)
            assert max_diff(got_buffers[:2], rank_buffers[rank][:2]) <= TOL, (rank, name)   # mean, var
            assert got_buffers[2] == rank_buffers[rank][2] == steps                          # batches seen
            assert max_diff([got_eval], [evaluated]) <= TOL, (rank, name)
    # the ranks' running stats really differ after a step (each saw other samples)
    assert max_diff(rank_buffers[0][:2], rank_buffers[1][:2]) > 1e-3
    # 3 buffers before each of the `steps` training forwards and the eval one, from rank 0
    for rank in range(p):
        bufs = [e for e in results.timeline.select(rank, kind="broadcast") if e.label == "buf"]
        assert len(bufs) == 3 * (steps + 1)
        assert sum(e.meta["payload"] for e in bufs) == (steps + 1) * (6 * 8 + 6 * 8 + 8)


def test_without_broadcast_buffers_each_rank_keeps_its_own_statistics():
    results = pplab.launch(train_bn, 2, False, world_size=2, timeout=60)
    for name in ("pplab", "torch"):
        (_, b0, e0), (_, b1, e1) = results[0][name], results[1][name]
        assert max_diff(b0[:2], b1[:2]) > 1e-3 and max_diff([e0], [e1]) > 1e-6
        for r in range(2):      # and pplab's equal torch's, rank by rank
            assert max_diff(results[r]["pplab"][1][:2], results[r]["torch"][1][:2]) <= TOL
    assert not [e for e in results.timeline.events if e.label == "buf"]


def buffers_in_state_dict():
    return sorted(DDP(make_bn_model()).state_dict())


def test_state_dict_holds_the_module_and_its_buffers():
    names = pplab.launch(buffers_in_state_dict, world_size=2, timeout=60)[0]
    assert names == sorted("module." + n for n in make_bn_model().state_dict())


def accumulate_bn(steps):
    model = DDP(make_bn_model(seed=pplab.comm.rank()))
    x, y = shard(data(2 * GLOBAL))
    for _ in range(steps):
        with model.no_sync():                   # its forward follows a synced one: broadcast
            loss_fn(model, x[:len(x) // 2], y[:len(y) // 2]).backward()
        loss_fn(model, x[len(x) // 2:], y[len(y) // 2:]).backward()   # follows a no_sync one: none
    return buffers(model.module)


def test_no_sync_forwards_and_the_one_after_them_follow_torchs_buffer_rule():
    results = pplab.launch(accumulate_bn, 2, world_size=2, timeout=60)
    for rank in range(2):
        assert len([e for e in results.timeline.select(rank, kind="broadcast") if e.label == "buf"]) == 3 * 2
    assert max_diff(results[0][:2], results[1][:2]) > 1e-3      # the last forward's stats are the rank's own


def uneven_over_micro_steps(sizes):
    """Rank r's micro-batches have sizes[r] samples: the check must add up every micro-step."""
    model, (x, y) = DDP(make_model()), data()
    first, second = sizes[pplab.comm.rank()]
    with model.no_sync():
        loss_fn(model, x[:first], y[:first]).backward()
    try:
        loss_fn(model, x[:second], y[:second]).backward()
    except RuntimeError as e:
        return str(e)
    return None


def test_batch_sizes_are_counted_over_all_micro_steps():
    # 3 + 4 samples on rank 0 against 4 + 4 on rank 1: the last micro-steps alone look even
    errors = pplab.launch(uneven_over_micro_steps, [(3, 4), (4, 4)], world_size=2, timeout=60)
    assert all("local batch sizes differ [7, 8]" in e for e in errors)
    # 3 + 5 against 4 + 4: equal totals, which is what DDP checks (samples since the last sync)
    assert pplab.launch(uneven_over_micro_steps, [(3, 5), (4, 4)], world_size=2, timeout=60) == [None, None]


# -- the bucket boundary worked out by hand, and DDP on a group without rank 0 ------------------------
#
# The buckets above never sum to exactly the cap, so `<=` and `<` read the same there; and the
# DDPs above span every rank, so "rank 0" and "the group's first rank" coincide.


def test_a_bucket_may_fill_the_cap_exactly():
    """float32: a, b 16 bytes each, c 32 bytes; cap 32 bytes. Last parameter first:
    c alone fills the cap; b starts a new bucket, and a (16 + 16 = 32, not over) joins it."""
    a, b, c = torch.zeros(4), torch.zeros(4), torch.zeros(8)
    buckets = reverse_buckets([("a", a), ("b", b), ("c", c)], cap_bytes=32)
    assert [[name for name, _ in bucket] for bucket in buckets] == [["c"], ["b", "a"]]


def _ddp_on_ranks_1_and_2():
    group = dist.new_group([1, 2])                 # every rank creates it; rank 0 is not in it
    torch.manual_seed(dist.get_rank())             # a different start on every rank
    model = nn.Linear(3, 2)
    if dist.get_rank() == 0:
        return [q.detach().clone() for q in model.parameters()]
    DDP(model, group=group)
    return [q.detach().clone() for q in model.parameters()]


def test_ddp_on_a_group_starts_from_the_groups_first_rank():
    """The group's first rank is global rank 1: ranks 1 and 2 end with rank 1's start;
    rank 0, outside the group, keeps its own."""
    out = pplab.launch(_ddp_on_ranks_1_and_2, world_size=3, timeout=60)
    torch.manual_seed(1)
    rank1_start = [q.detach() for q in nn.Linear(3, 2).parameters()]
    for rank in (1, 2):
        assert all(torch.equal(a, b) for a, b in zip(out[rank], rank1_start)), rank
    assert not torch.equal(out[0][0], rank1_start[0])
