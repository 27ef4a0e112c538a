"""Mixed precision across ranks: 2-byte compute, fp32 master weights, and one loss scale for all.

Micikevicius et al. (*Mixed Precision Training*, ICLR 2018) run forward and backward in 16 bits
and keep three things in fp32: a *master copy* of the weights (an update of 1e-4 relative to a
weight is lost when rounded into fp16's or bf16's 10 or 7 bits of mantissa), the optimizer's
sums, and the reductions. fp16's narrow range (6e-8 to 65504) adds a fourth: small gradients
underflow to 0, so the loss is multiplied by a *scale* S before backward (every gradient is then
S times larger) and the gradients are divided by S again before the step. bf16 has fp32's range
and needs no scale.

Where each piece lives in pplab, by strategy:

    DDP(model_bf16, reduce_dtype=...)  +  MasterWeights(model.parameters(), torch.optim.AdamW)
    ZeroOptimizer(model_bf16.parameters(), AdamW, stage=1|2, master_dtype=torch.float32, reduce_dtype=...)
    FullyShardedModule(model_fp32, compute_dtype=torch.bfloat16, reduce_dtype=...)  + ZeroOptimizer(stage=3)

In every case the parameters travel (broadcast, all-gather) in the compute dtype, and the
gradients are summed over the ranks in `reduce_dtype`: the compute dtype (2 bytes a parameter on
the wire) or fp32 (4 bytes, no rounding between the ranks' additions, no fp16 overflow of a sum
whose mean fits). `traffic_bytes` gives what each rank sends for either choice.

Dynamic loss scaling (`LossScaler`): start with a large S; after a step whose gradients hold an
inf or a NaN, skip the update and halve S; after `growth_interval` good steps in a row, double
it. Under data parallelism the decision must be the *same on every rank*: with ZeRO or FSDP each
rank sees only its shard of the gradient, so an overflow lands on one rank, and if that rank alone
skipped, the replicas would drift apart. So each rank's "I saw an inf" is all-reduced (max) over
the ranks before anyone decides: one rank's inf skips every rank's step.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from .runtime import comm

__all__ = ["MasterWeights", "LossScaler", "poison_gradient", "traffic_bytes"]


class MasterWeights:
    """`optimizer_class` stepping fp32 copies of a 2-byte model's parameters (every rank, all of them).

        model = DDP(make_model().to(torch.bfloat16), reduce_dtype=torch.float32)
        opt = MasterWeights(model.parameters(), torch.optim.AdamW, lr=1e-3)   # after DDP: rank 0's start
        loss_fn(model(x.bfloat16()), y).backward()                            # bf16 gradients, averaged
        opt.step()                   # fp32 copy of each gradient -> the master steps -> rounded into the model
        opt.zero_grad()

    Per parameter: the model's 2 bytes, its gradient's 2, and here 4 (master) + the inner
    optimizer's state (AdamW: 4 + 4): the (2 + 2 + 12) bytes of Rajbhandari et al.'s ZeRO table.
    `masters` and `inner` are named as ZeroOptimizer's, so pplab.zero.held_bytes counts them.
    """

    def __init__(self, params, optimizer_class, master_dtype=torch.float32, **defaults):
        if not (isinstance(master_dtype, torch.dtype) and master_dtype.is_floating_point):
            raise ValueError(f"master_dtype must be a floating-point torch.dtype, got {master_dtype!r}")
        self.params = [p for p in {id(p): p for p in params}.values() if p.requires_grad]   # a tied weight once
        if not self.params:
            raise ValueError("no parameter with requires_grad=True was given: nothing to optimize")
        self.masters = [p.detach().to(master_dtype, copy=True) for p in self.params]
        self.inner = optimizer_class(self.masters, **defaults)

    @property
    def param_groups(self):
        return self.inner.param_groups

    @torch.no_grad()
    def step(self) -> None:
        for p, m in zip(self.params, self.masters):
            m.grad = None if p.grad is None else p.grad.to(m.dtype)    # a widened copy: exact
        self.inner.step()
        for p, m in zip(self.params, self.masters):
            p.copy_(m)                                                 # rounded into the model's dtype
            m.grad = None                                              # temporary: the model's is kept

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()


class LossScaler:
    """Dynamic loss scaling with one decision for every rank of `group` (None: all ranks).

        scaler = LossScaler(init_scale=2.0**16, growth_interval=2000)
        scaler.scale_loss(loss).backward()       # gradients are `scaler.scale` times too large
        stepped = scaler.step(optimizer)         # unscale, agree on overflow, step or skip, update S
        optimizer.zero_grad()

    `optimizer`: a torch optimizer, MasterWeights or ZeroOptimizer (stages 1-3). The gradients to
    check are those its (inner) optimizer is about to step with, the fp32 ones: they exist only
    once the optimizer has reduced and widened them, so step() runs the checks at the moment its
    inner optimizer's step() is called, and lets that step happen only if no rank saw an overflow.
    Outside torch.distributed (one process) the agreement is a no-op: the same class is the
    single-process reference. `history` lists (scale used, stepped) for every step.
    """

    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, group=None):
        if not (math.isfinite(init_scale) and init_scale > 0):
            raise ValueError(f"init_scale must be a finite number > 0, got {init_scale!r}")
        if not growth_factor > 1:
            raise ValueError(f"growth_factor must be > 1 (2.0 doubles the scale), got {growth_factor!r}")
        if not 0 < backoff_factor < 1:
            raise ValueError(f"backoff_factor must be between 0 and 1 (0.5 halves the scale), got {backoff_factor!r}")
        if isinstance(growth_interval, bool) or not isinstance(growth_interval, int) or growth_interval < 1:
            raise ValueError(f"growth_interval is a number of good steps >= 1, got {growth_interval!r}")
        self.scale, self.growth_factor, self.backoff_factor = float(init_scale), growth_factor, backoff_factor
        self.growth_interval, self.group = growth_interval, group
        self.good_steps = 0                      # steps without overflow since the scale last changed
        self.history: list[tuple[float, bool]] = []

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale

    def unscale_(self, grads) -> None:
        """Divide the gradients by the scale, in place (exact: the scale is a power of two)."""
        for g in grads:
            g.mul_(1.0 / self.scale)

    def overflow_anywhere(self, grads) -> bool:
        """Whether any rank's gradients hold an inf or a NaN: each rank's flag, all-reduced with max."""
        mine = any(not bool(torch.isfinite(g).all()) for g in grads)
        flag = torch.tensor([1.0 if mine else 0.0])
        if dist.is_initialized() and comm.world_size(self.group) > 1:    # 4 bytes: one rank's inf is everyone's
            handle = comm.all_reduce(flag, op="max", group=self.group, async_op=True)
            handle.event.label = "inf?"
            handle.wait()
        return bool(flag.item())

    def update(self, overflow: bool) -> None:
        """Halve the scale after an overflow; grow it after growth_interval good steps in a row."""
        if overflow:
            self.scale *= self.backoff_factor
            self.good_steps = 0
        else:
            self.good_steps += 1
            if self.good_steps == self.growth_interval:
                self.scale *= self.growth_factor
                self.good_steps = 0

    def step(self, optimizer) -> bool:
        """Unscale, agree on overflow, step (or skip) and update the scale. True if the step ran."""
        inner = getattr(optimizer, "inner", optimizer)      # MasterWeights, ZeroOptimizer: the fp32 optimizer
        real_step, seen = inner.step, {}

        def checked_step(*args, **kwargs):
            grads = [p.grad for g in inner.param_groups for p in g["params"] if p.grad is not None]
            self.unscale_(grads)
            seen["overflow"] = self.overflow_anywhere(grads)
            if not seen["overflow"]:
                real_step(*args, **kwargs)

        inner.step = checked_step                           # for the length of this one call
        try:
            optimizer.step()
        finally:
            del inner.step
        if "overflow" not in seen:
            raise RuntimeError(f"{type(optimizer).__name__}.step() never called its inner optimizer's step(): "
                               f"LossScaler.step takes a torch optimizer, MasterWeights or ZeroOptimizer")
        self.history.append((self.scale, not seen["overflow"]))
        self.update(seen["overflow"])
        return not seen["overflow"]


def poison_gradient(param: torch.Tensor, index: int = 0, value: float = math.inf):
    """Make the *next* gradient computed for `param` hold `value` at flat `index`, once: a stand-in
    for an fp16 overflow in one rank's backward (call it on that rank only). Returns the hook handle.
    A FullyShardedModule's parameter holds only this rank's shard between uses, but its gradient
    arrives whole: `index` counts in the whole parameter."""
    numel = math.prod(getattr(param, "_pplab_full_shape", param.shape))
    if not 0 <= index < numel:
        raise ValueError(f"index {index} is outside the parameter's {numel} elements")

    def hook(grad):
        handle.remove()
        grad = grad.clone()
        grad.view(-1)[index] = value
        return grad
    handle = param.register_hook(hook)
    return handle


def traffic_bytes(strategy: str, psi: int, n: int, compute_bytes: int, reduce_bytes: int) -> float:
    """Bytes each rank sends per step by the ring formulas, for Ψ parameters on n ranks.

    ddp:  the gradients' all-reduce, 2(n-1)/n·Ψ·reduce_bytes (the parameters never travel).
    zero (stages 1, 2): a reduce-scatter in reduce_bytes, an all-gather in compute_bytes, (n-1)/n·Ψ each.
    fsdp (stage 3): two all-gathers in compute_bytes and a reduce-scatter in reduce_bytes.
    Ψ here is the number of elements reduced: padded to a multiple of n for zero and fsdp.
    """
    per_pass = (n - 1) / n * psi
    if strategy == "ddp":
        return 2 * per_pass * reduce_bytes
    if strategy == "zero":
        return per_pass * (reduce_bytes + compute_bytes)
    if strategy == "fsdp":
        return per_pass * (reduce_bytes + 2 * compute_bytes)
    raise ValueError(f"strategy must be 'ddp', 'zero' or 'fsdp', got {strategy!r}")
