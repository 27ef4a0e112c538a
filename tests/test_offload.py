"""pplab.zero.offload: ZeRO's optimizer state on disk trains exactly as in RAM, moves K·Ψ/N bytes each way per step.

The references: pplab.zero.ZeroOptimizer without offload (the same arithmetic, so results must be
*equal*, bit for bit, in float64 and in bf16 with fp32 masters), torch's AdamW on one process for the
float64 runs, and byte counts worked out here by hand from the layer sizes (Ψ = 118, which 2 and 3
do not divide evenly per bucket: every run pads).
"""
import math
import os
import tempfile
import time

import pytest
import torch
from torch import nn

import pplab
from pplab.data_parallel import shard
from pplab.memory import PeakMemory, storage_bytes
from pplab.zero.offload import (DiskFit, DiskOffloadedZero, TensorFile, _line, disk_bytes_per_step, fit_disk,
                           param_offload_bytes_per_step)
from pplab.zero import FullyShardedModule, ZeroOptimizer, held_bytes

SIZES = [(5, 7), (7, 6), (6, 4)]                  # Ψ = 42 + 48 + 28 = 118
PSI = sum(i * o + o for i, o in SIZES)
HPARAMS = dict(lr=0.01, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
ONE_PER_PARAM, ONE_BUCKET = 1e-5, 100.0          # MiB
STEPS = 3
#          stage, bucket cap,     model dtype,    master dtype,  prefetch, drop_cache
CONFIGS = [(1, ONE_BUCKET, torch.float64, None, True, True),
           (2, ONE_PER_PARAM, torch.float64, None, False, True),
           (3, None, torch.float64, None, True, False),
           (1, ONE_PER_PARAM, torch.bfloat16, torch.float32, True, True),
           (2, ONE_BUCKET, torch.bfloat16, torch.float32, True, False)]


def make_model(seed, dtype):
    torch.manual_seed(seed)
    mods = []
    for i, o in SIZES:
        mods += [nn.Linear(i, o), nn.Tanh()]
    return nn.Sequential(*mods[:-1]).to(dtype)


def data(dtype):
    g = torch.Generator().manual_seed(1)
    return torch.randn(12, 5, generator=g).to(dtype), torch.randn(12, 4, generator=g).to(dtype)


def shard_elements(stage, cap, n):
    """Elements of this rank's shard, by hand: each flat buffer (one per parameter tensor, one for
    the whole model, or one per layer at stage 3) padded to a multiple of n, then cut in n."""
    if stage == 3:
        buffers = [i * o + o for i, o in SIZES]
    elif cap == ONE_BUCKET:
        buffers = [PSI]
    else:
        buffers = [k for i, o in SIZES for k in (i * o, o)]
    return sum(math.ceil(k / n) for k in buffers)


def build(config, disk, folder, rank):
    stage, cap, dtype, master, prefetch, drop_cache = config
    model = make_model(seed=rank, dtype=dtype)            # differently initialised: ZeRO broadcasts rank 0's
    kw = dict(HPARAMS)
    if stage == 3:
        fwd = FullyShardedModule(model)
        params = fwd.parameters()
    else:
        fwd, params = model, model.parameters()
        kw.update(bucket_cap_mb=cap, master_dtype=master)
    if disk:
        opt = DiskOffloadedZero(params, torch.optim.AdamW, stage, folder=folder, prefetch=prefetch,
                                drop_cache=drop_cache, **kw)
    else:
        opt = ZeroOptimizer(params, torch.optim.AdamW, stage, **kw)
    return model, fwd, opt


def full_params(model, fwd):
    if isinstance(fwd, FullyShardedModule):
        sd = fwd.state_dict()
        return [sd[n] for n, _ in model.named_parameters()] if sd else None
    return [p.detach().clone() for p in model.parameters()]


def train_and_watch(config, disk, folder):
    """Train STEPS steps; what was moved per step, what the optimizer holds between steps, the files."""
    rank, p = pplab.comm.rank(), pplab.comm.world_size()
    model, fwd, opt = build(config, disk, folder, rank)
    x, y = shard(data(config[2]), rank, p)
    moved, held = [], []
    pplab.trace.reset(rank)
    for _ in range(STEPS):
        nn.functional.mse_loss(fwd(x).double(), y.double()).backward()
        opt.step()
        opt.zero_grad()
        moved.append((opt.bytes_read, opt.bytes_written) if disk else None)
        inner = opt.inner
        state = [t for st in inner.state.values() for t in st.values() if torch.is_tensor(t) and t.dim() > 0]
        masters = list(opt.masters) if opt.masters is not opt.shards else []   # (else: the model's own shards)
        held.append((held_bytes(fwd, opt)["optimizer"], storage_bytes(state + masters)))
    traced = {k: sum(e.meta["payload"] for e in pplab.trace.events() if e.kind == k)
              for k in ("disk_read", "disk_write")}
    links = []
    if disk:
        for f in opt.inner.files.values():
            fd = f.file.fileno()
            links.append((os.readlink(f"/proc/self/fd/{fd}"), os.fstat(fd).st_nlink))
    checkpoint = opt.state_dict()
    if disk:
        opt.close()
    return full_params(model, fwd), moved, held, traced, links, checkpoint


def every_config(folder):
    return {config: {disk: train_and_watch(config, disk, folder) for disk in (False, True)}
            for config in CONFIGS}


def torch_reference():
    model, (x, y) = make_model(0, torch.float64), data(torch.float64)
    opt = torch.optim.AdamW(model.parameters(), **HPARAMS)
    for _ in range(STEPS):
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return [p.detach() for p in model.parameters()]


def same_checkpoint(a, b):
    if a is None or b is None:
        return a is b
    if a["param_groups"] != b["param_groups"] or a["state"].keys() != b["state"].keys():
        return False
    return all(a["state"][k].keys() == b["state"][k].keys() and
               all(torch.equal(torch.as_tensor(a["state"][k][j]), torch.as_tensor(b["state"][k][j]))
                   for j in a["state"][k]) for k in a["state"])


@pytest.mark.parametrize("p", [2, 3])
def test_disk_offload_trains_exactly_as_in_ram_and_moves_k_psi_over_n(p, tmp_path):
    results = pplab.launch(every_config, str(tmp_path), world_size=p, timeout=90)
    expected_torch = torch_reference()
    for rank, by_config in enumerate(results):
        for config, runs in by_config.items():
            stage, cap, dtype, master = config[:4]
            where = (rank, stage, cap, dtype)
            (params, _, held_ram, _, _, ckpt_ram), (params_disk, moved, held_disk, traced, links, ckpt_disk) = \
                runs[False], runs[True]
            if params is not None:
                assert all(torch.equal(a, b) for a, b in zip(params, params_disk)), where
                if dtype == torch.float64:
                    assert max((a - b).abs().max().item() for a, b in zip(params_disk, expected_torch)) < 1e-10
            assert same_checkpoint(ckpt_ram, ckpt_disk), where
            # bytes per step, by hand: K bytes of state per element of my shard, read and written
            s = shard_elements(stage, cap, p)
            if master is None:                # two moments in the model's dtype (float64: 16 bytes)
                k = 2 * 8
                per_step = [(0, k * s)] + [(k * s, k * s)] * (STEPS - 1)   # no state to read before step 1
            else:                             # fp32 master + two fp32 moments: 12 bytes; step 1 reads the master only
                k = 12
                per_step = [(4 * s, k * s)] + [(k * s, k * s)] * (STEPS - 1)
            assert moved == per_step, where
            assert traced == {"disk_read": sum(r for r, _ in per_step),
                              "disk_write": sum(w for _, w in per_step)}, where   # (trace reset after creation)
            # RAM held by the optimizer state between steps: K bytes per element of my shard, or none
            assert held_ram == [(k * s, k * s)] * STEPS, where
            assert held_disk == [(0, 0)] * STEPS, where
            # the files: in the folder asked for, without a name (so nothing can be left behind)
            assert links and all(link.startswith(str(tmp_path) + "/") and link.endswith("(deleted)")
                                 and nlink == 0 for link, nlink in links), (where, links)
    assert os.listdir(tmp_path) == []


def _in_shm():
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def _left_in_shm(before):
    """What appeared in /dev/shm since `before` and stays there, other than launch folders (each
    launch removes its own). What another test process makes for a moment (a DataLoader's
    segment, a semaphore) is gone a second later; what a killed rank left would stay."""
    new = {n for n in _in_shm() - before if not n.startswith("pplab-launch-")}
    deadline = time.monotonic() + 1.0
    while new and time.monotonic() < deadline:
        time.sleep(0.1)
        new &= _in_shm()
    return new

def fail_after_a_step(folder):
    rank = pplab.comm.rank()
    model = make_model(rank, torch.float64)
    opt = DiskOffloadedZero(model.parameters(), torch.optim.AdamW, 2, folder=folder, **HPARAMS)
    x, y = shard(data(torch.float64), rank, pplab.comm.world_size())
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    if rank == 1:
        links = [os.readlink(f"/proc/{os.getpid()}/fd/{f.file.fileno()}") for f in opt.inner.files.values()]
        raise RuntimeError(f"planned failure with files open: {links}")
    nn.functional.mse_loss(model(x), y).backward()       # rank 0 waits for rank 1 here, and is killed
    opt.step()


def test_a_failed_run_leaves_no_file_behind(tmp_path):
    shm_before = _in_shm()
    with pytest.raises(pplab.LaunchError) as info:
        pplab.launch(fail_after_a_step, str(tmp_path), world_size=3, timeout=30)
    message = str(info.value)
    assert "planned failure with files open" in message
    assert message.count(f"'{tmp_path}/#") >= 2 and "(deleted)" in message    # they were there, nameless
    assert os.listdir(tmp_path) == []
    assert not _left_in_shm(shm_before)


def test_tensor_file_round_trip_by_dtype_and_cache_setting(tmp_path):
    for dtype in (torch.float32, torch.bfloat16, torch.float64, torch.int64):
        for drop in (True, False):
            t = (torch.arange(1000) * 7 - 300).to(dtype)
            f = TensorFile(t.numel(), dtype, str(tmp_path), drop_cache=drop)
            try:
                assert os.fstat(f.file.fileno()).st_size == 1000 * t.element_size() == f.nbytes
                f.write(t.view(10, 100))
                out = torch.zeros(10, 100, dtype=dtype)
                f.read(out)
                assert torch.equal(out.view(-1), t), (dtype, drop)
            finally:
                f.close()
    assert os.listdir(tmp_path) == []


def test_formula_and_fit_against_hand_values():
    assert disk_bytes_per_step(118, 2) == 472.0                     # 8 · 118 / 2
    assert disk_bytes_per_step(1_000_000, 4, state_bytes=12) == 3_000_000
    a, b = _line([1e6, 2e6, 4e6], [0.002 + 1e6 / 5e8, 0.002 + 2e6 / 5e8, 0.002 + 4e6 / 5e8])
    assert math.isclose(a, 0.002) and math.isclose(b, 5e8)
    fit = DiskFit(read_latency=1e-4, read_bandwidth=1e9, write_latency=2e-4, write_bandwidth=5e8)
    assert math.isclose(fit.predict(1e6, 1e6, files=3), 3e-4 + 1e-3 + 6e-4 + 2e-3)
    with pytest.raises(ValueError, match="number of ranks"):
        disk_bytes_per_step(118, 0)
    with pytest.raises(RuntimeError, match="too busy"):
        _line([1e6, 2e6], [0.003, 0.002])                           # a larger file done sooner


def test_fit_disk_measures_with_nameless_files(tmp_path):
    fds_before = len(os.listdir("/proc/self/fd"))
    fit = fit_disk(str(tmp_path), sizes=(2 ** 16, 2 ** 22), repeats=3, drop_cache=False)
    assert isinstance(fit, DiskFit) and fit.drop_cache is False
    assert all(math.isfinite(v) for v in (fit.read_latency, fit.read_bandwidth, fit.write_latency, fit.write_bandwidth))
    assert os.listdir(tmp_path) == [] and len(os.listdir("/proc/self/fd")) == fds_before
    with pytest.raises(ValueError, match="at least 2 sizes"):
        fit_disk(str(tmp_path), sizes=(2 ** 20,))


def bad_inputs(folder):
    model = make_model(0, torch.float64)
    errors = []
    for call in (lambda: DiskOffloadedZero(model.parameters(), torch.optim.AdamW, 2, folder=folder + "/nope"),
                 lambda: DiskOffloadedZero(model.parameters(), "AdamW", 2, folder=folder)):
        try:
            call()
        except (ValueError, TypeError) as e:
            errors.append(f"{type(e).__name__}: {e}")
    return errors


def test_bad_input_says_what_to_change(tmp_path):
    errors = pplab.launch(bad_inputs, str(tmp_path), world_size=1)[0]
    assert len(errors) == 2
    assert errors[0].startswith("ValueError") and "not an existing folder" in errors[0]
    assert errors[1].startswith("TypeError") and "torch.optim.Optimizer class" in errors[1]


def resume(config):
    """Save after 2 steps, load into a new offloaded optimizer (files in the default folder), 1 more step."""
    rank, p = pplab.comm.rank(), pplab.comm.world_size()
    x, y = shard(data(config[2]), rank, p)

    def steps(fwd, opt, k):
        for _ in range(k):
            nn.functional.mse_loss(fwd(x).double(), y.double()).backward()
            opt.step()
            opt.zero_grad()

    model, fwd, opt = build(config, True, None, rank)
    steps(fwd, opt, 2)
    model_sd, opt_sd = fwd.state_dict(), opt.state_dict()
    everyone = [None] * p
    torch.distributed.all_gather_object(everyone, (model_sd, opt_sd))     # rank 0's, as torch.load on each
    model2, fwd2, opt2 = build(config, True, None, 100 + rank)            # other weights, no state
    fwd2.load_state_dict(everyone[0][0])
    opt2.load_state_dict(everyone[0][1])
    links = [os.readlink(f"/proc/self/fd/{f.file.fileno()}") for f in opt2.inner.files.values()]
    held = held_bytes(fwd2, opt2)["optimizer"]
    steps(fwd2, opt2, 1)
    opt.close()
    opt2.close()
    straight_model, straight_fwd, straight = build(config, False, None, rank)
    steps(straight_fwd, straight, 3)
    return (full_params(model2, fwd2), full_params(straight_model, straight_fwd)), links, held


@pytest.mark.parametrize("config", [CONFIGS[3]], ids=["stage1-bf16-masters"])
def test_checkpoint_of_the_offloaded_state_resumes_exactly(config):
    for rank, ((resumed, straight), links, held) in enumerate(pplab.launch(resume, config, world_size=3)):
        if straight is not None:
            assert all(torch.equal(a, b) for a, b in zip(resumed, straight)), rank   # saved, loaded, on: = 3 straight
        assert held == 0, "after load_state_dict the state is back on disk, none of it in RAM"
        assert links and all(link.startswith(tempfile.gettempdir() + "/") and link.endswith("(deleted)")
                             for link in links), links


def peak_during_step(disk, layers=8):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(32, 32, bias=False) for _ in range(layers)]).double()
    kind = DiskOffloadedZero if disk else ZeroOptimizer
    opt = kind(model.parameters(), torch.optim.AdamW, 2, bucket_cap_mb=ONE_PER_PARAM, **HPARAMS)
    x = torch.randn(4, 32, dtype=torch.float64)
    peaks = []
    for _ in range(3):
        model(x).pow(2).sum().backward()
        with PeakMemory(count=lambda t: t.numel() == 32 * 32 // 2) as mem:    # tensors of one shard's size
            opt.step()
        opt.zero_grad()
        peaks.append(mem.peak)
    if disk:
        opt.close()
    return peaks


def test_during_a_step_ram_holds_at_most_three_shards_of_state():
    shard_state = 2 * 8 * 32 * 32 // 2                  # two float64 moments of a 512-element shard
    in_ram = pplab.launch(peak_during_step, False, world_size=2)
    on_disk = pplab.launch(peak_during_step, True, world_size=2)
    for rank in range(2):
        adam_own = max(in_ram[rank][1:])                # AdamW's temporaries, once its state exists
        for peak in on_disk[rank][1:]:
            # the shard stepping, the next being read, the last being written; not all 8 at once
            assert shard_state < peak <= 3 * shard_state + adam_own < 8 * shard_state, (rank, peak, adam_own)


# ----------------------------------------------------------------------------------
# Stage 3's parameter shards on disk too (offload_params): the references are the same training with
# the shards in RAM (FullyShardedModule + ZeroOptimizer, bit for bit, shard by shard on every rank),
# torch's AdamW on one process (float64), and byte counts from the layer sizes by hand.

DIMS = [6, 5, 4, 5]                 # units of (6+1)·5 = 35, (5+1)·4 = 24, (4+1)·5 = 25 elements:
UNIT_SIZES = [(i + 1) * o for i, o in zip(DIMS, DIMS[1:])]   # 35 and 25 padded at N = 2 and N = 3
#            dtype,          units (None: each Linear),  compute dtype,  prefetch, drop_cache
P_CONFIGS = {2: [(torch.float32, None, None, True, True),
                 (torch.float32, None, torch.bfloat16, True, True)],
             3: [(torch.float64, ("0", "2"), None, False, False)]}      # the last Linear in the root unit


def p_model(seed, dtype):
    torch.manual_seed(seed)
    mods = [m for i, o in zip(DIMS, DIMS[1:]) for m in (nn.Linear(i, o), nn.Tanh())][:-1]
    return nn.Sequential(*mods).to(dtype)


def p_data(dtype):
    g = torch.Generator().manual_seed(2)
    return torch.randn(12, DIMS[0], generator=g).to(dtype), torch.randn(12, DIMS[-1], generator=g).to(dtype)


def train_stage3(config, disk, folder):
    """STEPS steps at stage 3; per step the bytes moved and the bytes held between steps; the trace's
    disk boxes, the files, and at the end my shards (read back into RAM by close) and the full model."""
    dtype, units, compute, prefetch, drop_cache = config
    rank, n = pplab.comm.rank(), pplab.comm.world_size()
    fsdp = FullyShardedModule(p_model(rank, dtype), units=units and list(units), compute_dtype=compute)
    if disk:
        opt = DiskOffloadedZero(fsdp.parameters(), torch.optim.AdamW, 3, folder=folder, prefetch=prefetch,
                                drop_cache=drop_cache, offload_params=fsdp, **HPARAMS)
    else:
        opt = ZeroOptimizer(fsdp.parameters(), torch.optim.AdamW, 3, **HPARAMS)
    x, y = shard(p_data(dtype), rank, n)
    pplab.trace.reset(rank)
    moved, held = [], []
    for _ in range(STEPS):
        nn.functional.mse_loss(fsdp(x).double(), y.double()).backward()
        opt.step()
        opt.zero_grad()
        moved.append((opt.bytes_read, opt.bytes_written) if disk else None)
        held.append(held_bytes(fsdp, opt))
    boxes = [(e.kind, e.label, e.meta.get("ahead"), e.meta["payload"]) for e in pplab.trace.events()
             if e.kind.startswith("disk")]
    links = [os.readlink(f"/proc/self/fd/{f.file.fileno()}") for f in opt.inner.files.values()] if disk else []
    full = fsdp.state_dict()                   # through the hook (and, with a compute dtype, in_memory)
    if disk:
        opt.close()                            # the shards come back into RAM
    shards = [u.shard.detach().clone() for u in fsdp.units]
    order = [u.name for u in fsdp.units]
    return shards, full, moved, held, boxes, links, order


def stage3_both(folder):
    n = pplab.comm.world_size()
    return {c: (train_stage3(c, False, folder), train_stage3(c, True, folder)) for c in P_CONFIGS[n]}


@pytest.mark.parametrize("p", [2, 3])
def test_stage3_params_on_disk_train_exactly_and_move_3p_plus_k_read_p_plus_k_written(p, tmp_path):
    results = pplab.launch(stage3_both, str(tmp_path), world_size=p, timeout=90)
    torch_ref = None
    for rank, by_config in enumerate(results):
        for config, (ram, disk) in by_config.items():
            dtype, units, compute, prefetch, _ = config
            where = (rank, p, config)
            shards, full, moved, held, boxes, links, order = disk
            assert all(torch.equal(a, b) for a, b in zip(ram[0], shards)), where       # my shards, bit for bit
            assert ram[1].keys() == full.keys() and all(torch.equal(ram[1][k], full[k]) for k in full), where
            if dtype == torch.float64 and rank == 0:
                torch_ref = torch_ref or p_torch_reference()
                assert max((full[k] - torch_ref[k]).abs().max().item() for k in full) < 1e-10
            # by hand: my shard of each unit, ceil(size / p) elements of P bytes (the model's dtype)
            names = [str(2 * k) for k in range(len(UNIT_SIZES))]
            root = [k for k, name in enumerate(names) if units is not None and name not in units]
            s = {name: math.ceil(size / p) for name, size in zip(names, UNIT_SIZES)}
            P = torch.empty((), dtype=dtype).element_size()
            K = 2 * P                                           # AdamW's two moments
            S = sum(s.values())
            gathers = sum(s.values()) * 2 - sum(s[names[k]] for k in root)     # the root: forward only
            first = (P * gathers + P * S, (P + K) * S)          # the step reads the shards, no state yet
            later = (P * gathers + (P + K) * S, (P + K) * S)
            assert moved == [first] + [later] * (STEPS - 1), (where, moved)
            if not root:                                        # the formula, within the padding
                read, written = param_offload_bytes_per_step(sum(UNIT_SIZES), p, state_bytes=K, param_bytes=P)
                assert 0 <= later[0] - read <= (3 * P + K) * len(UNIT_SIZES) and \
                    0 <= later[1] - written <= (P + K) * len(UNIT_SIZES), where
            # between steps: no parameter and no optimizer state in RAM (in RAM: P + K bytes per element)
            assert [(h["params"], h["optimizer"]) for h in held] == [(0, 0)] * STEPS, where
            assert [(h["params"], h["optimizer"]) for h in ram[3]] == [(P * S, K * S)] * STEPS, where
            # the reads before all-gathers: forward order, then backward's; queued ahead but the first of each
            layers = [u for u in order if u != "root"]
            per_step = (["root"] if root else []) + layers + layers[::-1]
            params = [(label, ahead) for kind, label, ahead, _ in boxes if label.startswith("param")]
            assert [order[int(label[5:])] for label, _ in params] == per_step * STEPS, where
            ahead = [False] + [True] * (len(per_step) - 1)
            ahead[len(per_step) - len(layers)] = False           # backward's first read: nothing before it
            assert [a for _, a in params] == (ahead if prefetch else [False] * len(per_step)) * STEPS, where
            assert sum(b for kind, *_, b in boxes if kind == "disk_read") == sum(r for r, _ in moved), where
            assert links and all(link.startswith(str(tmp_path) + "/") and link.endswith("(deleted)")
                                 for link in links), (where, links)
    assert os.listdir(tmp_path) == []


def p_torch_reference():
    model, (x, y) = p_model(0, torch.float64), p_data(torch.float64)
    opt = torch.optim.AdamW(model.parameters(), **HPARAMS)
    for _ in range(STEPS):
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach() for k, v in model.state_dict().items()}


def fail_in_forward_with_shards_on_disk(folder):
    rank = pplab.comm.rank()
    fsdp = FullyShardedModule(p_model(rank, torch.float32))
    opt = DiskOffloadedZero(fsdp.parameters(), torch.optim.AdamW, 3, folder=folder, offload_params=fsdp, **HPARAMS)
    x, y = shard(p_data(torch.float32), rank, pplab.comm.world_size())
    nn.functional.mse_loss(fsdp(x), y).backward()
    opt.step()
    if rank == 1:                               # in the next forward, with the reads of units 1 and 2 queued
        links = [os.readlink(f"/proc/{os.getpid()}/fd/{f.file.fileno()}") for f in opt.inner.files.values()]

        def fail(*_):
            raise RuntimeError(f"planned failure in forward, files open: {links}")
        fsdp.module[2].register_forward_pre_hook(fail)
    nn.functional.mse_loss(fsdp(x), y).backward()      # ranks 0 and 2 wait in an all-gather: killed


def test_a_run_failing_with_shards_on_disk_leaves_nothing_behind(tmp_path):
    shm_before = _in_shm()
    with pytest.raises(pplab.LaunchError) as info:
        pplab.launch(fail_in_forward_with_shards_on_disk, str(tmp_path), world_size=3, timeout=30)
    message = str(info.value)
    assert "planned failure in forward" in message
    assert message.count(f"'{tmp_path}/#") >= 2 and "(deleted)" in message     # they were there, nameless
    assert os.listdir(tmp_path) == []
    assert not _left_in_shm(shm_before)


def param_offload_bad_inputs(folder):
    errors = []
    fsdp = FullyShardedModule(p_model(0, torch.float32))
    other, third = FullyShardedModule(p_model(0, torch.float32)), FullyShardedModule(p_model(0, torch.float32))
    plain = p_model(0, torch.float32)

    def offload(params, stage, module):
        return DiskOffloadedZero(params, torch.optim.AdamW, stage, folder=folder, offload_params=module)
    opt = offload(fsdp.parameters(), 3, fsdp)
    for args in ((plain.parameters(), 2, plain),            # not a FullyShardedModule, not stage 3
                 (other.parameters(), 3, third),            # another module's shards
                 (fsdp.parameters(), 3, fsdp)):             # offloaded twice
        try:
            offload(*args)
        except ValueError as e:
            errors.append(str(e))
    opt.close()
    return errors


def test_param_offload_formula_and_bad_input(tmp_path):
    assert param_offload_bytes_per_step(84, 2) == (20 * 42, 12 * 42)        # fp32 Adam: (3·4 + 8), (4 + 8)
    assert param_offload_bytes_per_step(90, 3, state_bytes=16, param_bytes=8) == (40 * 30, 24 * 30)
    with pytest.raises(ValueError, match="number of ranks"):
        param_offload_bytes_per_step(84, 0)
    errors = pplab.launch(param_offload_bad_inputs, str(tmp_path), world_size=1)[0]
    assert len(errors) == 3, errors
    assert "at stage=3" in errors[0] and "Sequential" in errors[0]
    assert "whose parameters() were given" in errors[1]
    assert "offloaded already" in errors[2]


def resume_stage3_on_disk(folder):
    """2 steps with the shards on disk, save; load into a fresh model and optimizer (other weights,
    shards on disk), 1 more step; against 3 steps in RAM. bf16 compute: state_dict reads the masters."""
    rank, n = pplab.comm.rank(), pplab.comm.world_size()
    x, y = shard(p_data(torch.float32), rank, n)

    def build_and_train(seed, disk, steps, model_sd=None, opt_sd=None):
        fsdp = FullyShardedModule(p_model(seed, torch.float32), compute_dtype=torch.bfloat16)
        opt = (DiskOffloadedZero(fsdp.parameters(), torch.optim.AdamW, 3, folder=folder, offload_params=fsdp, **HPARAMS)
               if disk else ZeroOptimizer(fsdp.parameters(), torch.optim.AdamW, 3, **HPARAMS))
        if model_sd is not None:
            fsdp.load_state_dict(model_sd)
            opt.load_state_dict(opt_sd)
        held = held_bytes(fsdp, opt)
        for _ in range(steps):
            nn.functional.mse_loss(fsdp(x).float(), y.float()).backward()
            opt.step()
            opt.zero_grad()
        return fsdp, opt, held

    fsdp, opt, _ = build_and_train(rank, True, 2)
    everyone = [None] * n
    torch.distributed.all_gather_object(everyone, (fsdp.state_dict(), opt.state_dict()))   # rank 0's, to all
    opt.close()
    resumed, opt2, held = build_and_train(100 + rank, True, 1, *everyone[0])
    opt2.close()
    straight, _, _ = build_and_train(rank, False, 3)
    return [u.shard.detach() for u in resumed.units], [u.shard.detach() for u in straight.units], held


def test_checkpoint_with_shards_on_disk_resumes_exactly(tmp_path):
    for rank, (resumed, straight, held) in enumerate(pplab.launch(resume_stage3_on_disk, str(tmp_path), world_size=2)):
        assert all(torch.equal(a, b) for a, b in zip(resumed, straight)), rank   # saved, loaded, on: = 3 straight
        assert (held["params"], held["optimizer"]) == (0, 0), "after loading, shards and state are back on disk"
    assert os.listdir(tmp_path) == []


def _looked_at_between_steps(folder):
    """A learner reads the shards between steps (printing them, say): the values must be right and the
    reading must not bring the shards back into RAM for good, nor crash the rank."""
    torch.manual_seed(0)
    fsdp = FullyShardedModule(nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 4)))
    opt = DiskOffloadedZero(fsdp.parameters(), torch.optim.AdamW, 3, folder=folder, offload_params=fsdp, **HPARAMS)
    x = torch.randn(4, 6)
    for _ in range(2):
        fsdp(x).sum().backward()
        opt.step()
        opt.zero_grad()
    seen = [p.detach().clone() for p in fsdp.parameters()]       # read through the files' memory maps
    held = held_bytes(fsdp, opt)
    with opt.all_in_memory():                                    # read back into RAM the usual way
        truth = [p.detach().clone() for p in fsdp.parameters()]
    with fsdp.full_parameters() as module:
        plus_one = [p.detach() + 1 for p in module.parameters()]
    with opt.all_in_memory(), torch.no_grad():                   # change the shards in RAM, run forward there:
        for p in fsdp.parameters():                              # it must gather them as changed, not re-read
            p += 1                                               # the files' older values
        edited = fsdp(x)
    reference = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 4))
    with torch.no_grad():
        for p, value in zip(reference.parameters(), plus_one):
            p.copy_(value)
        forward_ok = torch.allclose(edited, reference(x), rtol=1e-6, atol=1e-6)
    return all(torch.equal(a, b) for a, b in zip(seen, truth)), held, forward_ok


def test_a_learner_may_read_offloaded_shards_between_steps(tmp_path):
    for same, held, forward_ok in pplab.launch(_looked_at_between_steps, str(tmp_path), world_size=2):
        assert same, "a shard read between steps differs from its value read back into RAM"
        assert held["params"] == 0 and held["optimizer"] == 0, held
        assert forward_ok, "a forward inside all_in_memory() must use the shards as changed there"


def test_fit_disk_times_the_sizes_in_turn_and_fits_by_hand_values(monkeypatch, tmp_path):
    """A made-up disk and clock: a write of n bytes takes 1 ms + n / 500 MB/s, a read 2 ms +
    n / 1 GB/s, except that the first size's tries are slowed by a load that comes and goes in the
    first round only. The sizes take turns, every file is closed, and the medians give the line."""
    from pplab.zero import offload
    clock, order, closed = [0.0], [], []

    class FakeFile:
        def __init__(self, numel, dtype, folder, drop_cache):
            self.n = 4 * numel

        def write(self, t):
            order.append(("w", self.n))
            clock[0] += 1e-3 + self.n / 5e8 + (0.05 if len(order) <= 4 else 0.0)   # a burst: the first round

        def read(self, t):
            order.append(("r", self.n))
            clock[0] += 2e-3 + self.n / 1e9

        def close(self):
            closed.append(self.n)
    monkeypatch.setattr(offload, "TensorFile", FakeFile)
    monkeypatch.setattr(offload.time, "perf_counter", lambda: clock[0])
    fit = fit_disk(str(tmp_path), sizes=(2 ** 16, 2 ** 20), repeats=3)
    assert order == [("w", 2 ** 16), ("w", 2 ** 20)] + [("w", 2 ** 16), ("r", 2 ** 16), ("w", 2 ** 20), ("r", 2 ** 20)] * 3
    assert sorted(closed) == [2 ** 16, 2 ** 20]
    assert fit.write_latency == pytest.approx(1e-3) and fit.write_bandwidth == pytest.approx(5e8)
    assert fit.read_latency == pytest.approx(2e-3) and fit.read_bandwidth == pytest.approx(1e9)


def test_fit_disk_measures_again_when_a_burst_bends_a_line_and_says_so_when_it_never_grows(monkeypatch, tmp_path):
    """A made-up disk whose larger file writes faster than the smaller one in the first
    measurement (a burst of load on the small one): fit_disk measures again and fits the second.
    One that never grows fails after offload.MEASUREMENTS measurements, saying why."""
    from pplab.zero import offload
    clock, rounds = [0.0], []

    def fake(bent_rounds):
        class FakeFile:
            def __init__(self, numel, dtype, folder, drop_cache):
                self.n = 4 * numel

            def write(self, t):
                rounds.append(self.n)
                first = len(rounds) <= 2 + 2 * bent_rounds       # setup writes, then bent measurements
                clock[0] += 1e-3 + self.n / 5e8 + (0.05 if first and self.n == 2 ** 16 else 0.0)

            def read(self, t):
                clock[0] += 2e-3 + self.n / 1e9

            def close(self):
                pass
        return FakeFile
    monkeypatch.setattr(offload.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(offload, "TensorFile", fake(bent_rounds=3))      # the whole first measurement (3 repeats)
    fit = fit_disk(str(tmp_path), sizes=(2 ** 16, 2 ** 20), repeats=3)
    assert len(rounds) == 2 + 2 * 3 * 2                                    # set up, then measured twice
    assert fit.write_latency == pytest.approx(1e-3) and fit.write_bandwidth == pytest.approx(5e8)
    rounds.clear()
    monkeypatch.setattr(offload, "TensorFile", fake(bent_rounds=10 ** 6))   # always bent
    with pytest.raises(RuntimeError, match="did not grow with the sizes"):
        fit_disk(str(tmp_path), sizes=(2 ** 16, 2 ** 20), repeats=3)
    assert len(rounds) == 2 + 2 * 3 * offload.MEASUREMENTS

