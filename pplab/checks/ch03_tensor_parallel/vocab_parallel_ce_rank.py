"""What exercise vocab_parallel_ce's checker (vocab_parallel_ce.py) runs in its sealed ranks."""
from __future__ import annotations

import torch

from .. import sealed
from ..sealed.forbidden import refuse_library


def _ce_rank(fn, trials):
    """In every sealed rank: the loss of this rank's slice of the logits, then backward."""
    t = trials[0]
    sealed.begin(0)
    shard = t["shard"].requires_grad_()
    sealed.phase("forward")
    loss = fn(shard, t["targets"], t["start"], None)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        sealed.observe(0, {"error": f"vocab_parallel_ce must return the mean loss as a 1-element tensor, got "
                                    f"{type(loss).__name__} {getattr(loss, 'shape', '')}"})
        return
    sealed.phase("backward")
    if loss.requires_grad:
        loss.backward()
    sealed.phase("")
    sealed.observe(0, {"loss": loss.detach().reshape(()), "grad": shard.grad, "shard": shard.shape[1]})


def _refuse_vocab_parallel_ce(fn) -> None:
    """In the sealed rank: Forbidden if the answer uses the library's vocabulary-parallel loss."""
    from ...tensor_parallel import transformer as tpt
    refuse_library(fn, "vocab_parallel_ce", "the vocabulary-parallel loss",
                   {"vocab_parallel_cross_entropy": tpt.vocab_parallel_cross_entropy},
                   "pplab.tensor_parallel.transformer.vocab_parallel_cross_entropy")
