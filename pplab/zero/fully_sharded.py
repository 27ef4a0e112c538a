"""ZeRO stage 3: the parameters themselves are sharded, and gathered one unit at a time.

    fsdp = FullyShardedModule(model)              # units: model's children that have parameters
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)    # or fsdp.parameters(): the same steps
    loss_fn(fsdp(x), y).backward()                # x: this rank's share of the global batch
    opt.step()                                    # each rank steps its shards; nothing to gather
    opt.zero_grad()

This is the shape of torch's FSDP2 (`torch.distributed.fsdp.fully_shard`): after wrapping, each of
the model's own parameters *is* this rank's shard of it. Between uses `model[2].weight` holds my
piece of it, and after backward `model[2].weight.grad` holds my piece of the gradient, the mean over
the ranks, in the parameter's own dtype (the fp32 master). An optimizer built on `model.parameters()`
steps exactly the shards. Inside a unit's forward and backward the same parameters hold the full,
gathered values. Around each unit:

* **before its forward**: all-gather the unit's full parameters from everyone's shards ("AG"),
  and start the *next* unit's all-gather at once (prefetch), so that it travels while this
  unit computes;
* **after its forward**: free the full parameters (the buffer's storage shrinks to 0 bytes);
* **before its backward** (a hook on the unit's output gradient): gather them again, and
  prefetch the unit before it, which backward reaches next;
* **after its backward** (all its parameters' gradients are final): flatten the gradients,
  free them and the full parameters, and reduce-scatter ("RS"): each rank receives the sum of
  its shard's gradient, divided by N at the end of backward.

**How a unit is cut.** Each unit (by default each child of `model` with trainable parameters: a layer,
a block) is one FlatBucket: its parameters laid end to end in one flat buffer, cut into N equal
pieces. My piece is `fsdp.parameters()` (one flat fp32 tensor per unit), and each model parameter is,
between uses, a 1-D view of its own elements in that piece (empty if they all lie in other ranks'
pieces): torch's FSDP1 with use_orig_params does the same. FSDP2 instead cuts every parameter on dim 0
(rank r keeps rows r*k..(r+1)*k, padded to N*k rows), so that a shard keeps the parameter's row
shape; to still send one message per unit it copies the shards into a flat buffer before each
all-gather and out of it after (copy-in, copy-out). We keep the flat cut because it is one idea
(the FlatBucket of stages 1 and 2) with no copies: the all-gather fills the full buffer whose views
*are* the parameters, and the padding is at most N-1 elements per unit, so the traffic is exactly
3(N-1)/N of the model's bytes per step and the memory Ψ/N per rank (row padding would add up to N-1
rows per parameter). What it loses is the row shape of a shard, which only the layout of a
sharded checkpoint needs; the values, gradients and optimizer steps are the same.

Traffic per rank: two all-gathers and one reduce-scatter of every parameter, 3Ψ where DDP and
stages 1-2 move 2Ψ. Memory: Ψ/N of each of parameters, gradients and optimizer state, plus the
full parameters of the one or two units gathered at a time. The trace holds "F<k>"/"B<k>"
compute boxes per unit, "AG<k>"/"RS<k>" in the comm lane, and a memory event at every gather
and free (`trace.hold`/`release`), so the swimlane's memory curve rises and falls unit by unit.

A parameter used by two units (tied weights) or by no unit goes to a *root* unit, gathered at
the start of forward and kept until its gradient is final. Frozen parameters
(requires_grad=False) are not sharded: every rank keeps them whole, like buffers. `replicate`
names submodules whose parameters are not sharded either but trained whole on every rank, their
gradients all-reduced at the end of backward ("AR", 2(N-1)/N of their bytes, as DDP): small
parameters such as norm weights, where a gather's latency costs more than the memory saved
(DeepSpeed's stage3_param_persistence_threshold keeps small parameters whole for the same reason).
Units are prefetched in the order they are listed, which should be the order forward runs them.
`full_state_dict()` gives the full model state on every rank, the parameters in their own
dtype (the fp32 masters); `state_dict()` the same on rank 0 only; `load_state_dict` takes it on every rank.

**Mixed precision** (`compute_dtype=torch.bfloat16` or `torch.float16`): the shards stay in the
model's own dtype (fp32): they are the *master weights* the optimizer steps. Each gather casts my
shard to the compute dtype first, so the all-gathers carry 2 bytes per parameter and forward and
backward run in 2 bytes; floating-point inputs, buffers and frozen parameters are cast to it too
(replicated parameters are not: they compute in their own dtype, as mixed-precision recipes keep norms).
`reduce_dtype` is what the gradients are summed in: the compute dtype (the default, 2 bytes on the
wire) or torch.float32 (4 bytes, but no rounding between the ranks' additions, and no fp16
overflow of a sum whose mean would fit). My shard of the mean lands in `.grad` in fp32.

**Shards kept elsewhere** (`shard_store`, None by default: the shards stay in RAM). pplab.zero.offload sets
it to keep the shards on disk between uses (ZeRO-Infinity's parameter offload): `fetch(u, ahead)`
before a unit's all-gather brings my shard of unit u into RAM and may start bringing `ahead`, the
unit gathered after it (the next in forward, the one before in backward); `evict(u)` once the
all-gather has read the shard; `in_memory()`, a context in which every shard is in RAM, around
the methods that read or write the shards themselves (load_state_dict, full_state_dict). The model's
parameters show the shard as it was when the unit was last freed: read a stepped shard through
fsdp.parameters() or full_state_dict().
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn

from ..runtime import comm
from .. import trace
from ..data_parallel.ddp import end_trace_when_done, tensors_in
from ..trace import Event, now
from .flat import FlatBucket, reduce_scatter
from .optimizer import root_rank


class _Unit:
    """One unit's flat buffer (released between uses), my shard of it, and where it stands."""

    def __init__(self, index, name, named_params, world_size, rank, compute_dtype=None):
        self.index, self.name = index, name
        self.bucket = FlatBucket([p for _, p in named_params], world_size, rank, [n for n, _ in named_params])
        self.full = self.bucket.flatten([p.detach() for _, p in named_params])
        self.shard = nn.Parameter(self.bucket.shard(self.full).clone())     # in the model's dtype: the master
        self.shard._pplab_bucket, self.shard._pplab_zero = self.bucket, 3
        if compute_dtype is not None:                  # what forward sees (and the all-gather carries)
            self.full = self.full.to(compute_dtype)
        self.nbytes = self.full.numel() * self.full.element_size()
        for _, p in named_params:                      # ZeroOptimizer(model.parameters(), stage=3) steps this
            p._pplab_shard, p._pplab_full_shape = self.shard, p.shape      # (p.shape: my shard's, between uses)
        self.state, self.handle = "free", None         # "free" | "gathering" | "full"
        self.compute_start = None                      # when its forward / backward compute began
        self.shown_grad, self.grad_views = None, []    # the shard's gradient as the parameters show it

    def allocate(self) -> None:
        """Give the full buffer its memory back (for an all-gather to fill) and make the parameters
        views into it again."""
        self.take_back_grads()
        self.full.untyped_storage().resize_(self.nbytes)
        for p, view in zip(self.bucket.params, self.bucket.views(self.full)):
            p.grad = None                              # backward writes the full gradient here
            p.data = view

    def release(self) -> None:
        """Free the full buffer; the parameters become views of my shard again."""
        self.full.untyped_storage().resize_(0)        # what autograd saved of them shrinks too: 0 bytes
        self.show_shard()

    def show_shard(self) -> None:
        """Each parameter = its elements in my shard, its .grad = the same elements of my shard's gradient."""
        grad = self.shard.grad
        self.grad_views = self.bucket.shard_views(grad) if grad is not None else [None] * len(self.bucket.params)
        for p, view, g in zip(self.bucket.params, self.bucket.shard_views(self.shard.detach()), self.grad_views):
            p.data = view
            p.grad = g
        self.shown_grad = grad

    def take_back_grads(self) -> None:
        """What an optimizer on the model's parameters did to their .grad since show_shard, into my
        shard's gradient: zero_grad(set_to_none=True) left None (a zero gradient), or a new tensor."""
        grad = self.shard.grad
        if grad is None or grad is not self.shown_grad:    # none, or set through fsdp.parameters(): it wins
            return
        for p, shown, mine in zip(self.bucket.params, self.grad_views, self.bucket.shard_views(grad)):
            if p.grad is None:
                mine.zero_()
            elif p.grad is not shown:
                mine.copy_(p.grad.reshape(-1))


class FullyShardedModule(nn.Module):
    """Wrap `module` for ZeRO stage 3 on the ranks of `group` (None: every rank); see the module doc.

    units: names of submodules to gather one at a time (default: the children with parameters).
    prefetch: start the next unit's all-gather while this one computes (True) or only when needed.
    compute_dtype: the dtype of forward, backward and the all-gathers (None: the model's own);
      the shards stay in the model's dtype (the fp32 master weights).
    reduce_dtype: the dtype the gradients are reduce-scattered in (None: the compute dtype).
    replicate: names of submodules whose trainable parameters every rank keeps whole, their gradients
      all-reduced (e.g. the norms); they compute in their own dtype.
    Put the model on its device and in its dtype before wrapping it: the wrapper shards what it finds.
    """

    def __init__(self, module: nn.Module, units=None, prefetch: bool = True, group=None,
                 compute_dtype=None, reduce_dtype=None, replicate=()):
        super().__init__()
        if not dist.is_initialized():
            raise RuntimeError("FullyShardedModule needs torch.distributed: create it inside a function run "
                               "by pplab.launch(fn, world_size=...) or in a script started by torchrun")
        if any(getattr(p, "_pplab_ddp_hook", None) is not None for p in module.parameters()):
            raise RuntimeError("this model is wrapped in pplab DDP, which keeps full parameters and "
                               "all-reduces full gradients: wrap the bare model in FullyShardedModule instead")
        if any(getattr(p, "_pplab_zero", None) for p in module.parameters()):
            raise RuntimeError("this model's parameters already belong to a ZeroOptimizer or "
                               "FullyShardedModule: wrap a fresh model (copy.deepcopy)")
        for name, dtype in (("compute_dtype", compute_dtype), ("reduce_dtype", reduce_dtype)):
            if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
                raise ValueError(f"{name} must be a floating-point torch.dtype (torch.bfloat16, torch.float16, "
                                 f"torch.float32) or None, got {dtype!r}")
        object.__setattr__(self, "module", module)     # not a registered child: parameters() = shards
        self.compute_dtype = compute_dtype
        self.group, self.prefetch = group, bool(prefetch)
        self.world_size, self.rank = comm.world_size(group), comm.rank(group)
        with torch.no_grad():                          # the same start: rank 0's values everywhere
            for t in list(module.parameters()) + list(module.buffers()):
                comm.broadcast(t.detach(), src=root_rank(group), group=group)

        # Which unit owns each trainable parameter: the one unit that uses it, else the root.
        submodules = dict(module.named_modules())
        if isinstance(replicate, str):
            raise ValueError(f"replicate takes a list of submodule names, e.g. [{replicate!r}], not one string")
        for n in replicate:
            if n not in submodules:
                raise ValueError(f"no submodule named {n!r} to replicate: use names from "
                                 f"model.named_modules(), e.g. {list(submodules)[1:5]}")
        whole = {id(p): p for n in replicate for p in submodules[n].parameters() if p.requires_grad}
        sharded = lambda c: any(p.requires_grad and id(p) not in whole for p in c.parameters())
        if units is None:
            units = [n for n, c in module.named_children() if sharded(c)]
        for n in units:
            if n not in submodules or n == "":
                raise ValueError(f"no submodule named {n!r} to make a unit of: use names from "
                                 f"model.named_modules(), e.g. {list(submodules)[1:5]}")
            nested = [m for m in units if m != n and m.startswith(n + ".")]
            if nested:
                raise ValueError(f"unit {n!r} contains unit(s) {nested}: units must not overlap")
        users = {}
        for k, n in enumerate(units):
            for p in submodules[n].parameters():
                users.setdefault(id(p), set()).add(k)
        own = [[] for _ in units]
        root = []
        for name, p in module.named_parameters():      # a tied parameter once, under its first name
            if p.requires_grad and id(p) not in whole:
                k = users.get(id(p), set())
                (own[next(iter(k))] if len(k) == 1 else root).append((name, p))
        self.units = []
        if root:
            self.units.append(_Unit(0, "root", root, self.world_size, self.rank, compute_dtype))
        for n, named in zip(units, own):
            if named:
                self.units.append(_Unit(len(self.units), n, named, self.world_size, self.rank, compute_dtype))
        if not self.units:
            raise ValueError("the model has no parameter with requires_grad=True: nothing to shard")
        self.reduce_dtype = reduce_dtype or self.units[0].full.dtype
        if compute_dtype is not None:                  # what is not sharded computes in it too
            with torch.no_grad():
                for t in [p for p in module.parameters() if not p.requires_grad] + list(module.buffers()):
                    if t.is_floating_point():
                        t.data = t.data.to(compute_dtype)
        self.root = self.units[0] if root else None
        self.layers = [u for u in self.units if u is not self.root]     # gathered and freed per use
        self.shards = nn.ParameterList([u.shard for u in self.units])
        self.replicated = nn.ParameterList(list(whole.values()))   # parameters() = shards + these
        for p in self.replicated:
            p._pplab_replicated = True                 # ZeroOptimizer(stage=3) steps shards only

        for u in self.units:
            for p in u.bucket.params:
                p._pplab_zero = 3                      # pplab's DDP refuses these parameters
                p.register_post_accumulate_grad_hook(lambda param, u=u: self._grad_ready(u, param))
            u.release()                                # between uses: my shard only (its views)
        for u in self.layers:
            submodules[u.name].register_forward_pre_hook(lambda mod, args, u=u: self._before_forward(u))
            submodules[u.name].register_forward_hook(lambda mod, args, out, u=u: self._after_forward(u, out))
        trace.hold(sum(u.shard.numel() * u.shard.element_size() for u in self.units), "shards")
        self._in_backward, self._handles, self._waiting = False, [], {}
        self.shard_store = None                        # where the shards live between uses: None = RAM

    # ------------------------------------------------------------------------------
    # Gather, wait, free

    def _gather(self, u: _Unit) -> None:
        """Start the all-gather of unit u's full parameters (nothing if they are there or coming)."""
        if u.state != "free":
            return
        if self.shard_store is not None:               # my shard back in RAM, the next one on its way
            self.shard_store.fetch(u, self._gathered_after(u))
        self._allocate(u)
        mine = u.shard.detach().to(u.full.dtype)       # the compute dtype's copy of my master shard
        u.handle = comm.all_gather_into_tensor(u.full, mine, group=self.group, async_op=True)
        u.handle.event.label, u.handle.event.meta["unit"] = f"AG{u.index}", u.name
        end_trace_when_done(u.handle)
        u.state = "gathering"

    def _allocate(self, u: _Unit) -> None:
        u.allocate()
        trace.hold(u.nbytes, f"gather {u.name}")

    def _wait(self, u: _Unit) -> None:
        if u.state == "gathering":
            u.handle.wait()
            if self.shard_store is not None:           # the all-gather has read my shard
                self.shard_store.evict(u)
        u.state = "full"

    def _free(self, u: _Unit) -> None:
        if u.state == "free":
            return
        self._wait(u)                                  # never free memory a collective writes into
        u.release()
        trace.release(u.nbytes, f"free {u.name}")
        u.state = "free"

    def _neighbour(self, u: _Unit, step: int):
        i = self.layers.index(u) + step
        return self.layers[i] if 0 <= i < len(self.layers) else None

    def _gathered_after(self, u: _Unit):
        """The unit gathered after u: the first layer after the root, then the next one in forward
        and the one before in backward (None after the last)."""
        if u is self.root:
            return self.layers[0] if self.layers else None
        return self._neighbour(u, -1 if self._in_backward else +1)

    def _shards_in_memory(self):
        return self.shard_store.in_memory() if self.shard_store is not None else contextlib.nullcontext()

    # ------------------------------------------------------------------------------
    # Forward

    def forward(self, *args, **kwargs):
        if self.compute_dtype is not None:
            args = [a.to(self.compute_dtype) if torch.is_tensor(a) and a.is_floating_point() else a for a in args]
        if self.root is not None:
            self._gather(self.root)
            self._wait(self.root)
        out = self.module(*args, **kwargs)
        if not torch.is_grad_enabled():                # no backward coming: nothing stays gathered
            for u in self.units:
                self._free(u)
        return out

    def _before_forward(self, u: _Unit) -> None:
        self._gather(u)
        self._wait(u)
        nxt = self._neighbour(u, +1)
        if self.prefetch and nxt is not None:
            self._gather(nxt)                          # travels while u computes
        u.compute_start = now()

    def _after_forward(self, u: _Unit, out) -> None:
        trace.record(Event(comm.rank(), "F", "compute", u.compute_start, now(), f"F{u.index}",
                           meta={"unit": u.name}))
        self._free(u)
        if torch.is_grad_enabled():
            for t in tensors_in(out):                    # its output's gradient = its backward starting
                if t.requires_grad:
                    t.register_hook(lambda grad, u=u: self._before_backward(u))

    # ------------------------------------------------------------------------------
    # Backward

    def _start_backward(self) -> None:
        if not self._in_backward:
            self._in_backward, self._handles = True, []
            self._waiting = {u.index: set(map(id, u.bucket.params)) for u in self.units}
            self._started = set()
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    def _before_backward(self, u: _Unit) -> None:
        self._start_backward()
        if u.index in self._started:                   # once per backward, whichever output comes first
            return
        self._started.add(u.index)
        self._gather(u)
        self._wait(u)
        prev = self._neighbour(u, -1)
        if self.prefetch and prev is not None:
            self._gather(prev)                         # backward reaches it next
        u.compute_start = now()

    def _grad_ready(self, u: _Unit, param) -> None:
        self._start_backward()
        self._waiting[u.index].discard(id(param))
        if self._waiting[u.index]:
            return
        if u is not self.root:
            trace.record(Event(comm.rank(), "B", "compute", u.compute_start or now(), now(), f"B{u.index}",
                               meta={"unit": u.name}))
        grads = u.bucket.flatten([p.grad for p in u.bucket.params], dtype=self.reduce_dtype)
        for p in u.bucket.params:
            p.grad = None                              # my shard of the sum is all I keep
        self._free(u)
        out = torch.empty(u.bucket.shard_size, dtype=self.reduce_dtype, device=u.shard.device)
        self._handles.append((u, self._reduce_scatter(u, out, grads), out))

    def _reduce_scatter(self, u: _Unit, out, grads):
        """Start out = my shard of the sum over ranks of unit u's flat gradients; returns its handle."""
        h = reduce_scatter(out, grads, group=self.group)
        h.event.label, h.event.meta["unit"] = f"RS{u.index}", u.name
        end_trace_when_done(h)
        return h

    def _end_backward(self) -> None:
        try:
            self._all_reduce_replicated()
            for _, h, _ in self._handles:
                h.wait()
            for u, _, out in self._handles:
                out.div_(self.world_size)              # the sum over ranks -> the mean
                out = out.to(u.shard.dtype)            # into the master's dtype (no copy if the same)
                u.shard.grad = out if u.shard.grad is None else u.shard.grad.add_(out)
                u.show_shard()                         # the model's parameters: my piece of it as .grad
            missing = [u.name for u in self.units if self._waiting[u.index]]
            if missing:
                raise RuntimeError(f"unit(s) {missing} got no gradient for some of their parameters in this "
                                   f"backward, so their reduce-scatter never ran. Use every trainable "
                                   f"parameter in forward, or set requires_grad=False before wrapping")
        finally:
            for u in self.units:
                self._free(u)                          # e.g. a prefetch that backward never used
            self._in_backward, self._handles = False, []

    def _all_reduce_replicated(self) -> None:
        """The replicated parameters' gradients -> their mean over the ranks (one all-reduce, as DDP).
        A parameter that got no gradient on this rank counts as a zero gradient, so every rank sends."""
        params = list(self.replicated)
        if not params:
            return
        bucket = FlatBucket(params, 1, 0)
        flat = bucket.flatten([p.grad if p.grad is not None else torch.zeros_like(p) for p in params])
        h = comm.all_reduce(flat, group=self.group, async_op=True)
        h.event.label = "AR"
        h.wait()
        flat.div_(self.world_size)
        for p, g in zip(params, bucket.views(flat)):
            p.grad = g

    # ------------------------------------------------------------------------------
    # Full state in, full state out

    def train(self, mode: bool = True):
        self.module.train(mode)
        return super().train(mode)

    @contextlib.contextmanager
    def full_parameters(self):
        """Inside the block every unit is gathered: the wrapped module's parameters are whole on
        every rank (torch's FSDP calls it summon_full_params); freed again after. All ranks call it."""
        for u in self.units:
            self._gather(u)
        try:
            for u in self.units:
                self._wait(u)
            yield self.module
        finally:
            for u in self.units:
                self._free(u)

    def full_state_dict(self) -> dict:
        """The full, unsharded state of the wrapped module on every rank; all ranks call it. The sharded
        parameters are all-gathered from the master shards, in their dtype (fp32 with a compute_dtype:
        not rounded to it); replicated and frozen parameters and buffers as the module holds them."""
        masters = {}
        with self._shards_in_memory():
            for u in self.units:                       # all-gather the master shards themselves
                full = torch.empty(u.bucket.padded, dtype=u.shard.dtype, device=u.shard.device)
                h = comm.all_gather_into_tensor(full, u.shard.detach(), group=self.group, async_op=True)
                h.event.label = f"master{u.index}"
                h.wait()
                masters.update(zip(map(id, u.bucket.params), u.bucket.views(full)))
        state = self.module.state_dict(keep_vars=True)          # a tied parameter under each of its names
        return {k: masters.get(id(v), v).detach().clone() for k, v in state.items()}

    def state_dict(self, *args, **kwargs):
        """full_state_dict() on rank 0, {} elsewhere (what rank 0 saves); all ranks call it."""
        state = self.full_state_dict()
        return state if self.rank == 0 else {}

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Load a full state (the same dict on every rank): each rank keeps its shard of it."""
        expected = set(self.module.state_dict(keep_vars=True))      # names only: no values read
        missing, unexpected = expected - set(state_dict), set(state_dict) - expected
        if strict and (missing or unexpected):
            raise KeyError(f"state_dict does not fit the model: missing {sorted(missing)[:5]}, "
                           f"unexpected {sorted(unexpected)[:5]}")
        sharded = {id(p) for u in self.units for p in u.bucket.params}
        with torch.no_grad(), self._shards_in_memory():
            for u in self.units:
                full = u.bucket.flatten([state_dict[n] for n in u.bucket.names])
                u.shard.copy_(u.bucket.shard(full))
            for name, t in list(self.module.named_parameters()) + list(self.module.named_buffers()):
                if id(t) not in sharded and name in state_dict:
                    t.copy_(state_dict[name])
        for u in self.units:
            u.show_shard()                             # where the store left the shard (in RAM, or on disk)
