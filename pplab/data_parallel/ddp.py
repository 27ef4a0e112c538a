"""Data parallelism from scratch: a DDP whose gradient all-reduces run while backward runs.

    model = DDP(MyModel(), bucket_cap_mb=25)       # inside pplab.launch: one replica per rank
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = shard((X, Y))                           # this rank's equal share of the global batch
    loss = loss_fn(model(x), y)                    # the mean over this rank's samples
    loss.backward()                                # on return, .grad = the mean over all ranks
    opt.step()                                     # the same step on every rank

Every rank holds a whole copy of the model and sees its own slice of the global batch.
Two things keep the copies identical, so that p ranks train exactly like one process
on the whole global batch:

1. **The same start.** At construction every parameter (and buffer) is broadcast from
   rank 0, so replicas initialised differently start equal.
2. **The same gradient.** After backward each rank's gradient is replaced by the mean
   over ranks. If every rank's loss is the mean over n local samples, the mean of the
   p local gradients is the gradient of the mean over all p*n samples: the
   single-process gradient. With unequal shares (n = 4, 3, 3) the mean of means
   weights samples unequally and the answer is silently different, so DDP checks the
   local batch sizes (the first dimension of forward's first tensor argument) and
   raises if they differ; `shard` refuses a global batch that does not divide by p.

How the gradients are averaged, in the order it happens:

* **Buckets.** One all-reduce per parameter pays the per-message latency hundreds of
  times; one all-reduce of everything can start only once backward is over. So the
  parameters are grouped into buckets of at most `bucket_cap_mb` MiB (a parameter
  bigger than that gets a bucket of its own), in *reverse* registration order, because
  backward produces the last layers' gradients first.
* **Hooks.** `register_post_accumulate_grad_hook` calls us when a parameter's .grad is
  final for this backward. When every gradient of a bucket is there, the bucket is
  flattened into one buffer and `comm.all_reduce(buffer, async_op=True)` is started:
  it runs on the backend's threads while backward goes on computing the earlier layers.
  Buckets are launched strictly in order 0, 1, 2, ...: collectives are matched by the
  order in which ranks issue them, so every rank must issue them in the same order.
* **End of backward.** A callback queued with the autograd engine runs when backward
  is done: it waits for every bucket, divides by p and copies the means back into
  .grad. So `loss.backward(); opt.step()` just works, as with torch's DDP.
* `overlap=False` launches every bucket only at that point (for comparison: the
  swimlane then shows all the communication after backward instead of under it).
* `no_sync()`: backward passes inside it only accumulate .grad locally, with no
  communication; the next backward outside it all-reduces the accumulated sums
  (gradient accumulation: divide each micro-step's loss by the number of micro-steps).

The trace shows forward as "F" and backward as "B" compute boxes, and each bucket's
all-reduce as "AR<i>" in the comm lane, from launch until the backend finished it;
"n" is the tiny gather of the local batch sizes at the end of each synchronised backward.

**Buffers** (BatchNorm's running mean and variance, say) are not learned: each rank's
forward updates its own from its own samples, so the replicas drift apart. As torch's
DDP does (broadcast_buffers=True), rank 0's buffers are broadcast to every rank at the
start of each forward ("buf" in the comm lane), except right after a forward that ran
under no_sync() or without grad (torch's rule). So rank 0's running stats are the
model's, and every rank evaluates alike.

Whether overlap pays depends on where backward runs: on a CPU the backend's threads
take cores from backward. `pplab.data_parallel.overlap` measures it from the trace, and its
`stand_in_compute` makes each layer a timed wait standing in for an accelerator.
"""
from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist
from torch import nn

from ..runtime import comm
from .. import trace
from ..trace import Event, now


def shard(batch, rank: int | None = None, world_size: int | None = None):
    """This rank's equal share of a global batch: a tensor, or a tuple/list of tensors cut alike."""
    rank = comm.rank() if rank is None else rank
    p = comm.world_size() if world_size is None else world_size
    tensors = list(batch) if isinstance(batch, (tuple, list)) else [batch]
    n = len(tensors[0])
    if any(len(t) != n for t in tensors):
        raise ValueError(f"shard: the tensors have different numbers of samples {[len(t) for t in tensors]}")
    if n % p:
        raise ValueError(
            f"a global batch of {n} samples does not split evenly over {p} ranks, and the mean of "
            f"unequal per-rank means is not the mean over the global batch. Use a global batch that "
            f"is a multiple of {p} (e.g. {p * (n // p) or p} or {p * (n // p + 1)}), or drop the last {n % p}.")
    k = n // p
    parts = [t[rank * k:(rank + 1) * k] for t in tensors]
    return type(batch)(parts) if isinstance(batch, (tuple, list)) else parts[0]


def _local_batch_size(args, kwargs) -> int:
    """The first dimension of the first tensor passed to forward (0 if there is none)."""
    for a in list(args) + list(kwargs.values()):
        if isinstance(a, torch.Tensor) and a.dim() > 0:
            return a.shape[0]
    return 0


def _finished(event: Event) -> None:
    """Runs on the backend's thread when an all-reduce is done: close its trace box."""
    if event.end is None:
        event.end = now()


def end_trace_when_done(handle: comm.Handle) -> None:
    """An async collective's trace box ends when the backend has finished, not when we get round to wait()."""
    try:
        future = handle.work.get_future()
    except (AttributeError, RuntimeError):   # some backends' ops have no future: the box ends at wait()
        return
    future.add_done_callback(lambda _, event=handle.event: _finished(event))


def reverse_buckets(named_params, cap_bytes: int) -> list[list]:
    """(name, parameter) pairs grouped into buckets of at most `cap_bytes`, last parameter first.

    Backward produces the last layers' gradients first, so that is the order their
    communication can start in. A parameter bigger than the cap gets a bucket of its own;
    one bucket holds one dtype on one device (it becomes one flat buffer).
    """
    buckets, size = [], 0
    for name, p in reversed(list(named_params)):
        nbytes = p.numel() * p.element_size()
        current = buckets[-1] if buckets else None
        if current is None or size + nbytes > cap_bytes or p.dtype != current[0][1].dtype \
                or p.device != current[0][1].device:
            buckets.append([])
            size = 0
        buckets[-1].append((name, p))
        size += nbytes
    return buckets


def _all_reduce_bucket(flat, i: int, group):
    """Start the all-reduce of bucket i's flat gradients ("AR<i>" in the comm lane)."""
    handle = comm.all_reduce(flat, group=group, async_op=True)
    handle.event.label, handle.event.meta["bucket"] = f"AR{i}", i
    end_trace_when_done(handle)
    return handle


def _mean_into_grads(flat, bucket, world_size: int) -> None:
    """The summed bucket -> the mean over ranks, copied back into each parameter's .grad."""
    flat.div_(world_size)
    offset = 0
    for _, p in bucket:
        p.grad.copy_(flat[offset:offset + p.numel()].view_as(p.grad))
        offset += p.numel()


def all_reduce_gradients(params, group=None, bucket_cap_mb: float = 25) -> None:
    """DDP's bucketed all-reduce, once, now: every .grad becomes its mean over `group`.

    For gradients accumulated over several backward passes when the hooks cannot tell which is
    the last: a pipeline runs one backward per micro-batch, so pplab.hybrid (zero=0, pp > 1)
    calls this once after the schedule's flush, as DDP would after no_sync() micro-steps.
    Parameters without a gradient are left out (every replica has the same ones)."""
    params = [(i, p) for i, p in enumerate(params) if p.grad is not None]
    flats = []
    for i, bucket in enumerate(reverse_buckets(params, int(bucket_cap_mb * 2**20))):
        flat = torch.cat([p.grad.reshape(-1) for _, p in bucket])
        flats.append((flat, bucket, _all_reduce_bucket(flat, i, group)))
    for _, _, handle in flats:              # every one launched before any is waited on
        handle.wait()
    for flat, bucket, _ in flats:
        _mean_into_grads(flat, bucket, comm.world_size(group))


def tensors_in(x):
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for v in x:
            yield from tensors_in(v)
    elif isinstance(x, dict):
        for v in x.values():
            yield from tensors_in(v)


class DDP(nn.Module):
    """Wrap `module` for data-parallel training on every rank of the default process group.

    bucket_cap_mb: largest bucket, in MiB (a larger parameter gets a bucket to itself).
    overlap: all-reduce each bucket as soon as it is ready (True) or after backward (False).
    broadcast_buffers: copy rank 0's buffers to every rank before each forward (as torch).
    group: the data-parallel ranks (None: every rank), e.g. a mesh's dp group; "rank 0" is then
    the group's first rank.
    reduce_dtype: the dtype the buckets are all-reduced in (None: the parameters'). torch.float32 on a
    bf16/fp16 model sums without rounding between the ranks' additions, at twice the bytes; the mean
    is rounded once into .grad (pplab.mixed_precision.MasterWeights then steps fp32 copies).
    `ddp.buckets` lists each bucket's (parameter name, bytes), in launch order.
    """

    def __init__(self, module: nn.Module, bucket_cap_mb: float = 25, overlap: bool = True,
                 broadcast_buffers: bool = True, group=None, reduce_dtype=None):
        super().__init__()
        if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float)) \
                or not math.isfinite(bucket_cap_mb) or bucket_cap_mb <= 0:
            raise ValueError(f"bucket_cap_mb must be a number of MiB > 0, got {bucket_cap_mb!r}; e.g. 25 "
                             f"(torch's default), or 0.001 for about one parameter per bucket")
        if not dist.is_initialized():
            raise RuntimeError("DDP needs torch.distributed: create it inside a function run by "
                               "pplab.launch(fn, world_size=...) or in a script started by torchrun")
        self.module, self.overlap, self.group = module, bool(overlap), group
        self.world_size = comm.world_size(group)
        self._root = dist.get_global_rank(group, 0) if group is not None else 0
        self.broadcast_buffers = bool(broadcast_buffers)
        params = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        wrapped = [n for n, p in params if getattr(p, "_pplab_ddp_hook", None) is not None]
        if wrapped:
            raise RuntimeError(f"parameters {wrapped[:3]} already carry the hooks of another DDP: call "
                               f"old_ddp.remove_hooks() first, or wrap a fresh model (copy.deepcopy)")
        zeroed = [n for n, p in params if getattr(p, "_pplab_zero", None)]
        if zeroed:
            raise RuntimeError(f"parameters {zeroed[:3]} belong to a pplab.zero optimizer or FullyShardedModule, "
                               f"which averages the gradients itself (reduce-scatter): DDP's all-reduce on top "
                               f"would average them twice and keep a full gradient copy. Drop the DDP wrapper")
        self._check_same_model_everywhere()

        # 1. The same start: rank 0's parameters and buffers everywhere.
        with torch.no_grad():
            for t in list(module.parameters()) + list(module.buffers()):
                comm.broadcast(t.detach(), src=self._root, group=group)

        # 2. Buckets: parameters in reverse order, a new bucket when the next would not fit.
        self._buckets = reverse_buckets(params, int(bucket_cap_mb * 2**20))
        if reduce_dtype is not None and not (isinstance(reduce_dtype, torch.dtype) and reduce_dtype.is_floating_point):
            raise ValueError(f"reduce_dtype must be a floating-point torch.dtype or None, got {reduce_dtype!r}")
        self._flat = [torch.empty(sum(p.numel() for _, p in b), dtype=reduce_dtype or b[0][1].dtype,
                                  device=b[0][1].device) for b in self._buckets]

        # 3. Hooks: tell us when each parameter's gradient is final.
        for i, bucket in enumerate(self._buckets):
            for name, p in bucket:
                p._pplab_ddp_hook = p.register_post_accumulate_grad_hook(
                    lambda param, i=i, name=name: self._grad_ready(i, name))

        self._sync = True               # False inside no_sync()
        self._sync_buffers = True       # broadcast buffers before the next forward (as torch's DDP)
        self._forward_synced = None     # whether the last forward ran outside no_sync()
        self._samples = 0               # local samples seen by forward since the last all-reduce
        self._backward_start = None     # set from the first hook of a backward until its end
        self._waiting: list[set] = []   # per bucket: parameters whose gradient is not final yet
        self._next = 0                  # the next bucket to launch (always in order)
        self._handles: list = []        # (bucket index, comm.Handle) in flight

    @property
    def buckets(self) -> list[list[tuple[str, int]]]:
        """Each bucket's (parameter name, bytes), in the order they are all-reduced."""
        return [[(n, p.numel() * p.element_size()) for n, p in b] for b in self._buckets]

    def remove_hooks(self) -> None:
        """Detach this DDP from the module's parameters (to wrap the same model again)."""
        for bucket in self._buckets:
            for _, p in bucket:
                p._pplab_ddp_hook.remove()
                p._pplab_ddp_hook = None

    def _check_same_model_everywhere(self) -> None:
        mine = [(n, tuple(p.shape), str(p.dtype)) for n, p in self.module.named_parameters()]
        everyone = [None] * self.world_size
        dist.all_gather_object(everyone, mine, group=self.group)
        for r, theirs in enumerate(everyone):
            if theirs != everyone[0]:
                diff = next((a, b) for a, b in zip(everyone[0] + [None], theirs + [None]) if a != b)
                raise RuntimeError(f"rank {r}'s model differs from rank 0's (rank 0: {diff[0]}, rank {r}: "
                                   f"{diff[1]}): every rank must wrap the same architecture in DDP")

    # ------------------------------------------------------------------------------
    # Forward and the start of backward

    def forward(self, *args, **kwargs):
        if self._backward_start is not None:
            raise RuntimeError("the previous backward did not finish (it raised an error), so some ranks may "
                               "still be waiting for its all-reduces; DDP cannot resume: restart the run")
        if torch.is_grad_enabled():     # an evaluation under no_grad has no backward to sync
            self._forward_synced = self._sync
            self._samples += _local_batch_size(args, kwargs)
        if self.broadcast_buffers and self._sync_buffers:
            handles = [comm.broadcast(b, src=self._root, group=self.group, async_op=True)
                       for b in self.module.buffers()]
            for h in handles:
                h.event.label = "buf"
                h.wait()
        with trace.span("F"):
            out = self.module(*args, **kwargs)
        # as torch: the next forward broadcasts again only after a forward that will sync gradients
        self._sync_buffers = torch.is_grad_enabled() and self._sync
        for t in tensors_in(out):         # backward reaching the output = backward starting
            if t.requires_grad:
                t.register_hook(lambda grad: self._start_backward())
        return out

    def _start_backward(self) -> None:
        """Called by every hook; acts only on the first one of each backward pass."""
        if self._backward_start is not None:
            return
        if self._forward_synced is not None and self._forward_synced != self._sync:
            where = ("inside no_sync() but backward outside it" if self._sync else
                     "outside no_sync() but backward inside it")
            raise RuntimeError(f"forward ran {where}: put the forward and the backward of a "
                               f"micro-step both inside the `with ddp.no_sync():` block, or both outside")
        self._backward_start = now()
        self._waiting = [{n for n, _ in b} for b in self._buckets]
        self._next, self._handles = 0, []
        torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    def _grad_ready(self, i: int, name: str) -> None:
        self._start_backward()
        if not self._sync:              # no_sync(): .grad just accumulates locally
            return
        self._waiting[i].discard(name)
        if self.overlap:
            self._launch_ready_buckets()

    # ------------------------------------------------------------------------------
    # All-reducing buckets

    def _launch_ready_buckets(self) -> None:
        """Launch buckets in order for as long as the next one has all its gradients."""
        while self._next < len(self._buckets) and not self._waiting[self._next]:
            i = self._next
            torch.cat([p.grad.reshape(-1) for _, p in self._buckets[i]], out=self._flat[i])
            self._handles.append((i, _all_reduce_bucket(self._flat[i], i, self.group)))
            self._next += 1

    def _end_backward(self) -> None:
        """Runs once backward is done: wait for every bucket, average, copy back into .grad."""
        trace.record(Event(dist.get_rank(), "B", "compute", self._backward_start, now(), "B",
                           meta={"sync": self._sync}))
        try:
            if not self._sync:
                return
            self._launch_ready_buckets()            # overlap=False: all of them, now
            for i, h in self._handles:              # wait for *everything* before any error,
                h.wait()                            # so no rank leaves a collective behind
            for i, h in self._handles:
                _mean_into_grads(self._flat[i], self._buckets[i], self.world_size)
            missing = [n for waiting in self._waiting for n in sorted(waiting)]
            if missing:
                raise RuntimeError(
                    f"parameters got no gradient in this backward: {missing}. DDP all-reduces every "
                    f"parameter's gradient each step, so their buckets were never launched. Use them in "
                    f"forward, or set requires_grad=False on them before wrapping the model in DDP")
            # Every rank's local batch size: a tiny collective, cheap here where the ranks are in step.
            sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world_size)]
            h = comm.all_gather(sizes, torch.tensor([self._samples]), group=self.group, async_op=True)
            h.event.label = "n"
            h.wait()
            sizes = [int(s) for s in sizes]
            if len(set(sizes)) > 1:
                raise RuntimeError(
                    f"the ranks' local batch sizes differ {sizes} (rank r at index r): the mean of their "
                    f"mean-loss gradients is then not the global batch's gradient. Give every rank the "
                    f"same number of samples (pplab.data_parallel.shard splits a global batch evenly)")
        finally:
            self._samples = 0 if self._sync else self._samples
            self._backward_start, self._handles = None, []

    # ------------------------------------------------------------------------------
    # Gradient accumulation

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes in this block accumulate .grad locally, with no communication."""
        if not self._sync:
            raise RuntimeError("no_sync() is already active: do not nest it. One `with ddp.no_sync():` "
                               "around all the micro-steps but the last is enough")
        self._sync = False
        try:
            yield
        finally:
            self._sync = True

