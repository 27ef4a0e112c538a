"""What exercise megatron_sp_block's checker (megatron_sp_block.py) runs in its sealed ranks."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from .. import sealed
from ..sealed.forbidden import refuse_library


def _block_rank(fn, trials):
    """Build the student's block from the dense one, then forward and backward on this rank's tokens."""
    from ...tensor_parallel.transformer import TransformerBlock
    t = trials[0]
    sealed.begin(0)
    groups = [dist.new_group(m) for m in t["members"]] if t["members"] else [None]
    group = next((g for g, m in zip(groups, t["members"] or [None]) if m is None or dist.get_rank() in m))
    shape = t["shape"]
    dense = TransformerBlock(shape["h"], shape["heads"], shape["ffn"])
    dense.load_state_dict(t["state"])
    sealed.phase("setup")
    module = fn(dense, group)
    out = {"is_module": isinstance(module, nn.Module)}
    params = dict(module.named_parameters()) if out["is_module"] else {}
    out["params"] = {n: p.detach().clone() for n, p in params.items()}
    x = t["x"].clone().requires_grad_()
    sealed.phase("checker")                  # every rank goes on only if all can (else: a hang)
    go = torch.tensor([int(out["is_module"])])
    dist.all_reduce(go, op=dist.ReduceOp.MIN)
    if go.item():
        sealed.phase("forward")
        y = module(x)
        fits = isinstance(y, torch.Tensor) and y.shape == x.shape
        out["y"] = y.detach().clone() if fits else None
        out["y_shape"] = list(y.shape) if isinstance(y, torch.Tensor) else type(y).__name__
        sealed.phase("checker")
        go = torch.tensor([int(fits)])
        dist.all_reduce(go, op=dist.ReduceOp.MIN)
        if go.item():
            sealed.phase("backward")
            (y * t["dy"]).sum().backward()
            out["x_grad"] = x.grad
            out["grads"] = {n: p.grad for n, p in params.items()}
    sealed.phase("")
    sealed.observe(0, out)


def _refuse_library_block(fn) -> None:
    """In the sealed rank: Forbidden if the answer uses the library's own layers or operators."""
    from ...sequence_parallel import megatron
    from ...tensor_parallel import layers, transformer
    library = {name: getattr(module, name) for module, names in (
        (megatron, ("MegatronBlock", "sequence_parallel_layer_norm", "_ColumnKeepingShard")),
        (transformer, ("ParallelSelfAttention", "ParallelMLP", "ParallelTransformerBlock")),
        (layers, ("ColumnParallelLinear", "RowParallelLinear", "GatherFromSequenceParallel",
                  "ReduceScatterToSequenceParallel", "gather_from_sequence_parallel",
                  "reduce_scatter_to_sequence_parallel", "CopyToParallel", "copy_to_parallel",
                  "ReduceFromParallel", "reduce_from_parallel"))) for name in names}
    library["pplab.tensor_parallel.layers.all_gather_along"] = layers.all_gather_along        # by object only:
    library["pplab.tensor_parallel.layers.reduce_scatter_along"] = layers.reduce_scatter_along  # any method may be so named
    refuse_library(fn, "megatron_sp_block", "the block's sharding and its g, ḡ and f operators", library,
                   "pplab's own tensor- or sequence-parallel layers (pplab.tensor_parallel, "
                   "pplab.sequence_parallel)")
