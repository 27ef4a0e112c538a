"""What exercise checkpointed_block's checker (checkpointed_block.py) runs in its sealed ranks."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from .. import sealed
from ..sealed.forbidden import refuse_library


def _rank_job(fn, trials):
    from ...sequence_parallel import MegatronBlock
    from ...tensor_parallel.transformer import TransformerBlock
    t = trials[0]
    sealed.begin(0)
    shape, rank = t["shape"], dist.get_rank()

    def fresh():
        dense = TransformerBlock(shape["h"], shape["a"], 4 * shape["h"])
        dense.load_state_dict(t["state"])
        return MegatronBlock.from_dense(dense.to(torch.bfloat16), dropout=shape["dropout"], sequence_parallel=False)

    plain_block = fresh()
    plain = _step(plain_block, t["x"], t["dy"], t["seed"] + rank)
    plain["grads"] = {n: p.grad for n, p in plain_block.named_parameters()}
    block = fresh()
    module = fn(block)
    out = {"plain": plain, "is_module": isinstance(module, nn.Module)}
    go = torch.tensor([int(out["is_module"])])
    dist.all_reduce(go, op=dist.ReduceOp.MIN)                 # every rank goes on, or none
    if go.item():
        out["mine"] = _step(module, t["x"], t["dy"], t["seed"] + rank)
        out["mine"]["grads"] = {n: p.grad for n, p in block.named_parameters()}
    sealed.observe(0, out)


def _refuse_library_recompute(fn) -> None:
    """In the sealed rank: Forbidden if the answer uses pplab.recompute's own wrappers."""
    from ... import recompute
    refuse_library(fn, "checkpointed_block", "the recomputation policy",
                   {"Recomputed": recompute.Recomputed, "recompute_layers": recompute.recompute_layers},
                   "pplab.recompute (Recomputed, recompute_layers)")


def _step(module, x, dy, seed):
    """One forward and backward of module on x: what it computed, kept and multiplied."""
    from torch.utils.flop_counter import FlopCounterMode
    from ...memory import saved_activations
    x = x.clone().requires_grad_()
    torch.manual_seed(seed)
    with FlopCounterMode(display=False) as counter:
        with saved_activations(module.parameters()) as saved:
            y = module(x)
        fits = isinstance(y, torch.Tensor) and y.shape == x.shape
        if fits:
            (y.float() * dy).sum().backward()
    return {"y": y.detach().clone() if fits else None,
            "y_shape": list(y.shape) if isinstance(y, torch.Tensor) else type(y).__name__,
            "x_grad": x.grad, "bytes": saved.bytes, "flops": counter.get_total_flops()}
