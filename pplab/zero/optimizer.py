"""ZeRO stages 1 and 2 (and the optimizer half of stage 3): every rank steps only its own shard.

    model = MyModel()                             # the bare model, on every rank: no DDP around it
    opt = ZeroOptimizer(model.parameters(), torch.optim.AdamW, stage=2, lr=1e-3)
    x, y = shard((X, Y))                          # this rank's equal share of the global batch
    loss_fn(model(x), y).backward()               # stage 2: gradients reduce-scattered during backward
    opt.step()                                    # step my shard, then all-gather the parameters
    opt.zero_grad()

The trainable parameters are grouped into buckets (last layer first, `bucket_cap_mb` each, as
in chapter 2's DDP), and each bucket is one flat buffer cut into N equal shards (FlatBucket).
The model's parameters become views into these buffers, so gathering a buffer updates the
model in place. Rank r owns shard r of every bucket: only it keeps optimizer state for those
elements, and only it updates them.

* **Stage 1** (optimizer state sharded). backward leaves every rank its own local gradient,
  as in plain training. `step()` reduce-scatters each bucket's gradient, so each rank receives
  the sum over ranks of *its* shard only (divided by N: the mean), steps its shard, and
  all-gathers the updated shards into every rank's full parameters. Traffic per rank: one
  reduce-scatter + one all-gather = one ring all-reduce, the 2Ψ of DDP.
* **Stage 2** (gradients too). A hook per parameter (`register_post_accumulate_grad_hook`)
  sees when a bucket's gradients are all final and starts its reduce-scatter at once, while
  backward goes on with earlier layers (launched in bucket order on every rank, as collectives
  must be). The full gradients are dropped as soon as they are flattened: a rank keeps the
  averaged gradient of its shard only. Same 2Ψ of traffic, less memory.
* **Stage 3** (parameters too) needs the forward pass: `FullyShardedModule` gathers the
  parameters layer by layer and reduce-scatters the gradients itself; pass its `parameters()`
  (the shards) here with stage=3, and `step()` just steps them.
* `master_dtype=torch.float32` with bf16/fp16 parameters (stages 1, 2; mixed precision): the
  model, its gradients and the collectives stay in 2 bytes, and each rank keeps an fp32 master
  copy of its shard only, which the optimizer steps; the result is rounded back into the shard
  before the all-gather. Per parameter: 2 + 2 bytes, and K = 4 + 8 of optimizer state, split.
  `reduce_dtype=torch.float32` reduce-scatters the gradients in fp32 (twice the bytes, no rounding
  between the ranks' additions); my shard's mean then stays fp32 all the way into the master.
* `offload="cpu"` (stages 1, 2; ZeRO-Offload): the fp32 master copy of the shard and the
  optimizer state live on the CPU. Each step copies the shard's gradient device -> CPU, steps
  there, and copies the updated shard CPU -> device before the all-gather. The copies appear in
  the trace as "d2h"/"h2d" boxes in the comm lane (on a CPU-only run they are CPU copies).

Used alone, every stage gives single-process training on the global batch: the optimizer
averages the gradients itself. It therefore refuses parameters of a model wrapped in
pplab.data_parallel.DDP (and DDP refuses ours), since DDP's all-reduce would already have
averaged them: with torch's DDP, which it cannot detect, do not combine it either.

`state_dict()` gathers the full state on rank 0 in torch's own format (state by parameter
index, as `torch.optim.AdamW(model.parameters())` would save it); `load_state_dict` on every
rank takes that dict back and keeps this rank's shard. Parameters without requires_grad get
no shard and no state; a parameter passed twice (tied weights) is counted once.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..runtime import comm
from .. import trace
from ..data_parallel import end_trace_when_done, reverse_buckets
from ..trace import Event, now
from .flat import FlatBucket, reduce_scatter


def root_rank(group) -> int:
    """The global rank of the group's rank 0 (torch's broadcast/gather take global ranks)."""
    return 0 if group is None else dist.get_global_rank(group, 0)


def traced_copy(src: torch.Tensor, dst: torch.Tensor, kind: str, label: str) -> None:
    """dst.copy_(src), recorded as a comm-lane box: an offload transfer between device and CPU."""
    start = now()
    dst.copy_(src)
    trace.record(Event(comm.rank(), kind, "comm", start, now(), label,
                       meta={"payload": src.numel() * src.element_size()}))


class ZeroOptimizer:
    """`optimizer_class` (e.g. torch.optim.AdamW) run on this rank's shard only; see the module doc.

    stage: 1 (optimizer state sharded), 2 (and gradients), 3 (parameters of a FullyShardedModule).
    bucket_cap_mb: largest bucket in MiB (stages 1, 2). 4 rather than DDP's 25: a model of a few
      million parameters then gets several buckets, so reduce-scatters overlap backward
      (benchmarks/zero.py: 0.95-1.06x torch's time at 4 MB, 1.27-1.51x at 25 MB on 2 cores).
    offload: None or "cpu" (stages 1, 2).
    master_dtype: the dtype the optimizer steps in (stages 1, 2); None = the parameters' own.
    reduce_dtype: the dtype the gradients are reduce-scattered in (stages 1, 2); None = the parameters'.
    group: the process group to shard over (None: every rank). Other keywords go to optimizer_class.
    """

    def __init__(self, params, optimizer_class, stage: int = 1, *, bucket_cap_mb: float = 4,
                 offload: str | None = None, master_dtype=None, reduce_dtype=None, group=None, **defaults):
        if stage not in (1, 2, 3):
            raise ValueError(f"stage must be 1, 2 or 3, got {stage!r}")
        if offload not in (None, "cpu"):
            raise ValueError(f"offload must be None or 'cpu', got {offload!r}")
        if offload and stage == 3:
            raise ValueError("offload='cpu' is implemented for stages 1 and 2: use stage=2 to offload")
        if master_dtype is not None and stage == 3:
            raise ValueError("master_dtype is implemented for stages 1 and 2: leave it out for stage 3")
        if reduce_dtype is not None and stage == 3:
            raise ValueError("at stage 3 FullyShardedModule reduces the gradients: pass reduce_dtype to it instead")
        if reduce_dtype is not None and not (isinstance(reduce_dtype, torch.dtype) and reduce_dtype.is_floating_point):
            raise ValueError(f"reduce_dtype must be a floating-point torch.dtype or None, got {reduce_dtype!r}")
        if not (isinstance(bucket_cap_mb, (int, float)) and bucket_cap_mb > 0):
            raise ValueError(f"bucket_cap_mb must be a number of MiB > 0, got {bucket_cap_mb!r}")
        if not dist.is_initialized():
            raise RuntimeError("ZeroOptimizer needs torch.distributed: create it inside a function run by "
                               "pplab.launch(fn, world_size=...) or in a script started by torchrun")
        given = list(params)
        if any(isinstance(p, dict) for p in given):
            raise ValueError("ZeroOptimizer takes one list of parameters (one parameter group), not dicts")
        self.all_params = list({id(p): p for p in given}.values())    # a tied weight once
        self.params = [p for p in self.all_params if p.requires_grad]  # frozen: no grad, no state
        if not self.params:
            raise ValueError("no parameter with requires_grad=True was given: nothing to optimize")
        if any(getattr(p, "_pplab_ddp_hook", None) is not None for p in self.params):
            raise RuntimeError("these parameters belong to a model wrapped in pplab DDP, whose all-reduce "
                               "already averages the gradients: ZeroOptimizer averages them itself "
                               "(reduce-scatter, the same 2Ψ of traffic), so it would average twice. Give "
                               "ZeroOptimizer the bare model's parameters (no DDP)")
        self.stage, self.offload, self.group, self.reduce_dtype = stage, offload, group, reduce_dtype
        self.world_size, self.rank = comm.world_size(group), comm.rank(group)
        if stage == 3:                   # the model's parameters of a FullyShardedModule: their unit's shard
            if any(getattr(p, "_pplab_replicated", False) for p in self.params):
                raise ValueError("ZeroOptimizer(stage=3) steps a FullyShardedModule's shards; this model also has "
                                 "replicated parameters (replicate=...): give a torch optimizer the model's "
                                 "parameters instead, e.g. torch.optim.AdamW(model.parameters())")
            self.params = list({id(s): s for s in (getattr(p, "_pplab_shard", p) for p in self.params)}.values())
        sharded = [hasattr(p, "_pplab_bucket") for p in self.params]
        if stage == 3:
            if not all(sharded):
                raise ValueError("stage 3 shards the parameters themselves: wrap the model first, "
                                 "fsdp = FullyShardedModule(model), and pass fsdp.parameters()")
            self.buckets = [p._pplab_bucket for p in self.params]
            self.shards = self.params
        else:
            if any(sharded):
                raise ValueError("these are the shards of a FullyShardedModule (ZeRO stage 3): use stage=3")
            if any(getattr(p, "_pplab_zero", None) for p in self.params):
                raise RuntimeError("these parameters already belong to another ZeroOptimizer or "
                                   "FullyShardedModule: create one optimizer per model (or copy.deepcopy it)")
            self._check_same_model_everywhere()
            index = {id(p): i for i, p in enumerate(self.all_params)}   # names in the state_dict
            groups = reverse_buckets([(index[id(p)], p) for p in self.params], int(bucket_cap_mb * 2**20))
            self.buckets = [FlatBucket([p for _, p in g], self.world_size, self.rank, [i for i, _ in g])
                            for g in groups]
            self.flats = []
            with torch.no_grad():
                for b in self.buckets:
                    flat = b.flatten([p.detach() for p in b.params])
                    comm.broadcast(flat, src=root_rank(group), group=group)     # the same start
                    b.point_params_into(flat)
                    self.flats.append(flat)
                for p in self.all_params:
                    if not p.requires_grad:               # frozen: not sharded, but the same everywhere
                        comm.broadcast(p.detach(), src=root_rank(group), group=group)
            self.shards = [b.shard(f) for b, f in zip(self.buckets, self.flats)]
            for p in self.params:
                p._pplab_zero = stage
        # What the optimizer steps: my shard itself, or a master copy of it (fp32, on the CPU).
        master_dtype = master_dtype or self.shards[0].dtype
        if offload or master_dtype != self.shards[0].dtype:      # a separate master copy of my shard
            self.masters = [s.detach().to("cpu" if offload else s.device, master_dtype, copy=True)
                            for s in self.shards]
        else:                                                    # my shard of the model itself
            self.masters = self.shards
        self.inner = optimizer_class(self.masters, **defaults)
        self._grads = [None] * len(self.buckets)     # per bucket: the mean gradient of my shard
        self._in_backward = False
        if stage == 2:
            for i, b in enumerate(self.buckets):
                for p in b.params:
                    p.register_post_accumulate_grad_hook(lambda param, i=i: self._grad_ready(i, param))

    @property
    def param_groups(self):
        return self.inner.param_groups

    @property
    def shard_grads(self) -> list:
        """Per bucket, the mean gradient of my shard that this rank keeps (None before backward)."""
        return list(self._grads)

    def _check_same_model_everywhere(self) -> None:
        mine = [(tuple(p.shape), str(p.dtype)) for p in self.params]
        everyone = [None] * self.world_size
        dist.all_gather_object(everyone, mine, group=self.group)
        for r, theirs in enumerate(everyone):
            if theirs != everyone[0]:
                raise RuntimeError(f"rank {r}'s parameters {theirs[:4]}... differ from rank 0's "
                                   f"{everyone[0][:4]}...: every rank must give ZeroOptimizer the same model")

    # ------------------------------------------------------------------------------
    # Gradients: reduce-scatter each bucket, keep my shard's mean

    def _reduce_scatter(self, i: int):
        """Start the reduce-scatter of bucket i's gradients; returns (i, handle, my shard's sum)."""
        b = self.buckets[i]
        dtype = self.reduce_dtype or b.dtype
        full = b.flatten([p.grad for p in b.params], dtype=dtype)
        if self.stage == 2:
            for p in b.params:           # stage 2 keeps no full gradient: my shard is all I need
                p.grad = None
        out = torch.empty(b.shard_size, dtype=dtype, device=b.device)
        h = reduce_scatter(out, full, group=self.group)
        h.event.label = f"RS{i}"
        end_trace_when_done(h)
        return i, h, out

    def _finish_reduce_scatters(self, handles) -> None:
        for _, h, _ in handles:          # wait for all before touching any, so no rank leaves one behind
            h.wait()
        for i, _, out in handles:
            out.div_(self.world_size)    # the sum over ranks -> the mean (the global batch's gradient)
            self._grads[i] = out if self._grads[i] is None else self._grads[i].add_(out)

    def _missing(self) -> list[str]:
        return [f"parameter {name} (shape {tuple(p.shape)})" for b in self.buckets
                for name, p in zip(b.names, b.params) if p.grad is None]

    def _grad_ready(self, i: int, param) -> None:
        """Stage 2: called when `param`'s gradient is final; launch every bucket that is complete."""
        if not self._in_backward:        # the first hook of this backward
            self._in_backward = True
            self._waiting = [set(map(id, b.params)) for b in self.buckets]
            self._next, self._handles = 0, []
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
        self._waiting[i].discard(id(param))
        while self._next < len(self.buckets) and not self._waiting[self._next]:
            self._handles.append(self._reduce_scatter(self._next))
            self._next += 1

    def _end_backward(self) -> None:
        try:
            self._finish_reduce_scatters(self._handles)
            missing = [f"bucket {i}: {len(w)} parameter(s)" for i, w in enumerate(self._waiting) if w]
            if missing:
                raise RuntimeError(f"some parameters got no gradient in this backward ({missing}), so their "
                                   f"buckets were never reduce-scattered. Use them in forward, or set "
                                   f"requires_grad=False on them before creating the ZeroOptimizer")
        finally:
            self._in_backward, self._handles = False, []

    # ------------------------------------------------------------------------------
    # The step: my shard only, then everyone's shards to everyone

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("ZeroOptimizer.step does not take a closure")
        if self.stage == 3:              # FullyShardedModule already put the mean gradient in .grad
            with trace.span("step", "step"):
                self.inner.step()
            return
        self.reduce_gradients()
        if any(g is None for g in self._grads):
            raise RuntimeError("step() before any backward: call loss.backward() first")
        separate = self.masters is not self.shards
        for m, g in zip(self.masters, self._grads):
            if self.offload:             # ZeRO-Offload: the gradient shard goes to the CPU
                m.grad = torch.empty_like(m)
                traced_copy(g, m.grad, "d2h", "grad→cpu")
            else:                        # (mixed precision: an fp32 copy of the bf16 gradient)
                m.grad = g.to(m.dtype)
        with trace.span("step", "step on cpu" if self.offload else "step"):
            self.inner.step()
        handles = []
        for i, (b, flat, s, m) in enumerate(zip(self.buckets, self.flats, self.shards, self.masters)):
            if self.offload:             # the updated shard comes back to the device
                traced_copy(m, s, "h2d", "param→dev")
            elif separate:               # rounded into the 2-byte parameters
                s.copy_(m)
            if separate:
                m.grad = None            # a temporary copy: the gradient kept is the shard's own
            h = comm.all_gather_into_tensor(flat, s, group=self.group, async_op=True)
            h.event.label = f"AG{i}"
            handles.append(h)
        for h in handles:
            h.wait()
        if self.stage == 1:              # the shard's gradient was only needed for this step
            self._grads = [None] * len(self.buckets)
            for m in self.masters:
                m.grad = None

    def reduce_gradients(self) -> None:
        """Stage 1: reduce-scatter this step's gradients now, so that shard_grads hold my shard's
        mean gradient before step() (e.g. to clip it); step() does it when it has not been done.
        Stage 2 reduces during backward, stage 3 in FullyShardedModule: nothing to do."""
        if self.stage != 1 or all(g is not None for g in self._grads):
            return
        missing = self._missing()
        if missing:
            raise RuntimeError(f"no gradient for {missing[:3]}: call loss.backward() before step(), and "
                               f"use every trainable parameter in forward (or set requires_grad=False)")
        self._finish_reduce_scatters([self._reduce_scatter(i) for i in range(len(self.buckets))])

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params + list(self.masters):
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()
        self._grads = [None] * len(self.buckets)

    # ------------------------------------------------------------------------------
    # Checkpoints: the full state on rank 0, torch's format

    def state_dict(self):
        """The full optimizer state on rank 0 (None on the others); every rank must call it."""
        root, me = root_rank(self.group), self.rank == 0
        state = {}
        for b, m in zip(self.buckets, self.masters):
            items = sorted(self.inner.state.get(m, {}).items())
            if self.masters is not self.shards:           # the fp32 master weights: more than the model has
                items.append(("master", m.detach()))
            for key, v in items:
                if torch.is_tensor(v) and v.dim() == 1 and v.numel() == b.shard_size:  # one per element
                    v = v.to(b.device)
                    parts = [torch.empty_like(v) for _ in range(self.world_size)] if me else None
                    comm.gather(v, parts, dst=root, group=self.group)
                    per_param = b.views(torch.cat(parts)) if me else []
                else:                                                  # one per tensor, e.g. "step"
                    per_param = [v] * len(b.params)
                for name, t in zip(b.names, per_param):
                    state.setdefault(name, {})[key] = t.clone() if torch.is_tensor(t) else t
        group = {k: v for k, v in self.inner.param_groups[0].items() if k != "params"}
        group["params"] = ([n for b in self.buckets for n in b.names] if self.stage == 3   # module names
                           else list(range(len(self.all_params))))                      # torch's indices
        return {"state": state, "param_groups": [group]} if me else None

    def load_state_dict(self, state_dict) -> None:
        """Load a state_dict() (the same dict on every rank, e.g. torch.load on each): keep my shard."""
        if len(state_dict.get("param_groups", [])) != 1:
            raise ValueError("expected a state_dict with exactly one param group, as state_dict() saves")
        for k, v in state_dict["param_groups"][0].items():
            if k != "params":
                self.inner.param_groups[0][k] = v
        for b, m in zip(self.buckets, self.masters):
            entries = [state_dict["state"].get(name) for name in b.names]
            if all(e is None for e in entries):
                continue                 # saved before the first step: no state yet
            if any(e is None for e in entries):
                raise ValueError(f"the state_dict has state for some parameters of bucket {b.names} but not "
                                 f"all: it was not saved from this model and optimizer")
            new = {}
            for key, v in entries[0].items():
                if key != "step" and all(torch.is_tensor(e[key]) and e[key].shape == shape
                                         for e, shape in zip(entries, b.shapes)):
                    full = b.flatten([e[key].to(b.device) for e in entries], dtype=v.dtype)
                    new[key] = b.shard(full).clone().to(m.device)
                else:
                    new[key] = v.clone() if torch.is_tensor(v) else v
            master = new.pop("master", None)
            if master is not None and self.masters is not self.shards:
                m.copy_(master)
            self.inner.state[m] = new
