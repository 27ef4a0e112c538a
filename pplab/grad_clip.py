"""Gradient clipping when the gradients are cut over ranks: one global norm, counted once.

    total = clip_grad_norm_(model, max_norm=1.0, tp_group=mesh.tp_group, pp_group=mesh.pp_group,
                            optimizer=opt)       # after backward (and DP's all-reduce), before opt.step()

On one process, torch.nn.utils.clip_grad_norm_ computes the norm of all gradients as one
vector, ||g|| = (sum_i |g_i|^p)^(1/p) (or max_i |g_i| for p = inf), and if it exceeds
max_norm multiplies every gradient by max_norm / (||g|| + 1e-6). Parallel training must get
the same number although no rank holds the whole vector. Each rank adds up |g_i|^p over the
elements it *owns*, and one all-reduce of that scalar per group adds the ranks' parts:

* data parallelism (DDP): every replica holds the same averaged gradient, so the dp group is
  not summed over (that would count each element dp times);
* tensor parallelism: a split weight (column/row-parallel, vocabulary-parallel) holds a
  different slice on each rank, summed over the tp group; a *replicated* one (LayerNorm,
  positions, a row-parallel bias) holds the same gradient on every tp rank, so only tp rank 0
  counts it (Megatron-LM does the same);
* pipeline parallelism: each stage holds different layers, summed over the pp group;
* ZeRO (pplab.zero): after the reduce-scatter each dp rank holds the mean gradient of its
  shard of each flat bucket only, summed over the dp group; the bucket's zero padding (at
  most N-1 elements) belongs to no parameter and is left out. The parameters a
  FullyShardedModule keeps whole (replicate=) hold the same all-reduced gradient on every dp
  rank: only dp rank 0 counts them.

For p = inf the sum becomes a max and the all-reduce takes the max. Every rank then has the
same total, and scales what it holds by the same factor: its gradients, or (ZeRO 1-2) the
optimizer's shard gradients, which are what its step uses. The cost is one all-reduce of one
number per group of more than one rank, traced by pplab.comm like every collective.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from .runtime import comm
from .tensor_parallel import ColumnParallelLinear, RowParallelLinear
from .tensor_parallel.transformer import VocabParallelEmbedding
from .zero import FullyShardedModule, ZeroOptimizer

__all__ = ["clip_grad_norm_", "global_grad_norm", "tensor_parallel_split", "owned_gradients"]


def tensor_parallel_split(model) -> set:
    """ids of the parameters that tensor parallelism splits (a different slice on every tp rank):
    column-parallel weight and bias, row-parallel weight, vocabulary-parallel table. Every other
    parameter of a tensor-parallel model is replicated (the same on every tp rank)."""
    split = set()
    for m in _modules(model):
        if isinstance(m, ColumnParallelLinear):
            split |= {id(m.weight)} | ({id(m.bias)} if m.bias is not None else set())
        elif isinstance(m, (RowParallelLinear, VocabParallelEmbedding)):
            split.add(id(m.weight))                  # a row-parallel bias is added once, after the sum
    return split


def _modules(model):
    """Every submodule, inside ZeRO-3 wrappers too (their wrapped module is not a registered child)."""
    for m in model.modules():
        yield m
        if isinstance(m, FullyShardedModule):
            yield from _modules(m.module)


def _pieces_of_bucket(bucket, shard_grad):
    """(parameter, my slice of its gradient) for each parameter that overlaps my shard of a flat
    ZeRO bucket: shard r covers flat elements [r·S, (r+1)·S); the padding past bucket.numel is no
    parameter's, so it is in no piece."""
    lo = bucket.rank * bucket.shard_size
    hi = lo + bucket.shard_size
    out = []
    for p, a, b in zip(bucket.params, bucket.offsets, bucket.offsets[1:]):
        start, end = max(a, lo), min(b, hi)
        if start < end:
            out.append((p, shard_grad[start - lo:end - lo]))
    return out


def owned_gradients(model, optimizer=None) -> tuple[list, object]:
    """What this rank holds of the gradient, as (parameter, gradient tensor or slice) pairs, and the
    dp group ZeRO cut the gradients over (None without ZeRO). Whole gradients for plain
    parameters; for ZeRO, my shard's slices (stage 1 is reduce-scattered here first)."""
    pieces, zero_group = [], None
    if isinstance(optimizer, ZeroOptimizer) and optimizer.stage in (1, 2):
        optimizer.reduce_gradients()                 # stage 1 reduce-scatters in step(): do it now
        for bucket, g in zip(optimizer.buckets, optimizer.shard_grads):
            if g is None:
                raise RuntimeError("the ZeroOptimizer holds no gradient: call loss.backward() before clipping")
            pieces += _pieces_of_bucket(bucket, g)
        zero_group = _world_if_none(optimizer.group)
    for p in model.parameters():
        stage = getattr(p, "_pplab_zero", None)
        if stage in (1, 2):
            if not (isinstance(optimizer, ZeroOptimizer) and optimizer.stage == stage):
                raise ValueError(f"this model's parameters belong to a ZeRO-{stage} ZeroOptimizer, which holds "
                                 f"their averaged gradients: pass it as optimizer=")
            continue                                 # counted above, from the optimizer's shards
        if hasattr(p, "_pplab_shard"):
            raise ValueError("these are the parameters of the model inside a FullyShardedModule: each holds only "
                             "this rank's shard, and the norm needs the wrapper's group: pass the FullyShardedModule "
                             "itself (clip_grad_norm_(fsdp, ...))")
        if p.grad is None:
            continue
        if hasattr(p, "_pplab_bucket"):              # ZeRO-3: a FullyShardedModule's shard
            pieces += _pieces_of_bucket(p._pplab_bucket, p.grad)
        else:
            pieces.append((p, p.grad))
    for m in _modules(model):
        if isinstance(m, FullyShardedModule):
            zero_group = _world_if_none(m.group)
    return pieces, zero_group


def _world_if_none(group):
    """ZeRO's group=None means every rank (pplab's convention); here None means 'no such group'."""
    return dist.group.WORLD if group is None else group


def global_grad_norm(model, norm_type: float = 2.0, tp_group=None, pp_group=None, optimizer=None) -> torch.Tensor:
    """The norm of the whole model's gradient, as one process would compute it, on every rank.

    model: this rank's part of the model (its tensor-parallel shards, its pipeline stages; DDP,
      FullyShardedModule or a ModuleList of stages are fine). tp_group, pp_group: the groups
      that split the model (None: that dimension is not used). optimizer: a ZeroOptimizer of
      stage 1 or 2 (it holds the gradients); for stage 3 the model's shards hold them.
    Returns a 0-dim float64 tensor, equal on every rank.
    """
    norm_type = _check_norm_type(norm_type)
    pieces, zero_group = owned_gradients(model, optimizer)
    split = tensor_parallel_split(model)
    _check_groups(model, tp_group)
    first_tp_rank = tp_group is None or comm.rank(tp_group) == 0
    first_dp_rank = zero_group is None or comm.rank(zero_group) == 0
    pieces = [(p, g) for p, g in pieces                   # what ZeRO-3 keeps whole (replicate=): dp rank 0 only
              if first_dp_rank or not getattr(p, "_pplab_replicated", False)]
    counted = [g.detach().double() for p, g in pieces
               if g.numel() and (id(p) in split or first_tp_rank)]          # replicated: tp rank 0 only
    zero = torch.zeros((), dtype=torch.float64, device=pieces[0][1].device if pieces else "cpu")
    if norm_type == math.inf:
        local = max((g.abs().max() for g in counted), default=zero)
    else:
        local = sum((g.abs().pow(norm_type).sum() for g in counted), zero)
    total = local.reshape(1).clone()
    for group in (tp_group, pp_group, zero_group):    # one all-reduce of one number per group
        if group is not None and comm.world_size(group) > 1:
            comm.all_reduce(total, op="max" if norm_type == math.inf else "sum", group=group)
    total = total[0]
    return total if norm_type == math.inf else total.pow(1.0 / norm_type)


def clip_grad_norm_(model, max_norm: float, norm_type: float = 2.0, tp_group=None, pp_group=None,
                    optimizer=None) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_ for a model cut over ranks: compute the global norm
    (global_grad_norm, same arguments), and if it exceeds max_norm scale every gradient this rank
    holds by max_norm / (norm + 1e-6), as torch does. Returns the norm before clipping."""
    if not (isinstance(max_norm, (int, float)) and max_norm > 0):
        raise ValueError(f"max_norm must be a number > 0, got {max_norm!r}")
    total = global_grad_norm(model, norm_type, tp_group, pp_group, optimizer)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    with torch.no_grad():
        for _, g in owned_gradients(model, optimizer)[0]:    # replicated ones too: every copy is scaled
            g.mul_(coef.to(g.dtype))
    return total


def _check_norm_type(norm_type) -> float:
    p = float(norm_type)
    if not (p == math.inf or p > 0):
        raise ValueError(f"norm_type must be a number > 0 or math.inf, got {norm_type!r}")
    return p


def _check_groups(model, tp_group) -> None:
    """A tensor-parallel model with no tp_group would count each replicated parameter once per tp rank."""
    if tp_group is not None:
        return
    for m in _modules(model):
        if isinstance(m, (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding)) and \
                comm.world_size(m.group) > 1:
            raise ValueError(f"this model has tensor-parallel layers ({type(m).__name__} over "
                             f"{comm.world_size(m.group)} ranks): pass their group as tp_group=, so that "
                             f"split parameters are summed over it and replicated ones counted once")
