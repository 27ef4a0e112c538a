"""Plausible wrong answers to `checkpointed_block` (a transformer block that recomputes attention's
scores only), each one mistake a student could make, one of them wrong on rank 1 only.

WRONG[exercise_id] lists (function, regular expressions the check's message must match, timeout
for the check or None for the default), as in wrong_solutions_ch00_broadcast.py.
"""
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from pplab.recompute import Recomputed


class _Recompute(torch.autograd.Function):
    """core(qkv), keeping qkv only; replay=False runs core again on whatever random state is current."""

    @staticmethod
    def forward(ctx, qkv, core, replay):
        ctx.core, ctx.rng, ctx.replay = core, torch.get_rng_state(), replay
        ctx.save_for_backward(qkv)
        return core(qkv)

    @staticmethod
    def backward(ctx, grad):
        (qkv,) = ctx.saved_tensors
        later = torch.get_rng_state()
        if ctx.replay:
            torch.set_rng_state(ctx.rng)
        with torch.enable_grad():
            qkv = qkv.detach().requires_grad_()
            out = ctx.core(qkv)
        torch.set_rng_state(later)
        return torch.autograd.grad(out, qkv, grad)[0], None, None


class _RecomputeKeepingStats(_Recompute):
    """_Recompute that also keeps each query row's softmax statistic (float32, one per head and
    token), as flash attention keeps its log-sum-exp: b·(a/t)·s·4 bytes the selective row has no room for."""

    @staticmethod
    def forward(ctx, qkv, core, heads):
        ctx.core, ctx.rng, ctx.replay = core, torch.get_rng_state(), True
        s, b, _ = qkv.shape
        ctx.save_for_backward(qkv, qkv.new_zeros(b, heads, s, dtype=torch.float32))
        return core(qkv)

    @staticmethod
    def backward(ctx, grad):
        qkv, _ = ctx.saved_tensors
        later = torch.get_rng_state()
        torch.set_rng_state(ctx.rng)
        with torch.enable_grad():
            qkv = qkv.detach().requires_grad_()
            out = ctx.core(qkv)
        torch.set_rng_state(later)
        return torch.autograd.grad(out, qkv, grad)[0], None, None


def _selective(block, replay=True):
    core = block.attention
    block.attention = lambda qkv: _Recompute.apply(qkv, core, replay)
    return block


def recomputes_nothing_on_rank_1(block):
    """Rank 0 recomputes; rank 1 (and 2) return the block as it is, keeping everything."""
    return _selective(block) if dist.get_rank() == 0 else block


def ckpt_recomputes_on_two_ranks_only(block):
    """`if dist.get_rank() < 2`, two ranks in mind: right with t = 2; with t = 3 rank 2 keeps everything."""
    return _selective(block) if dist.get_rank() < 2 else block


def ckpt_keeps_row_statistics(block):
    """Selective, and keeps a float32 statistic per query row and head besides qkv: over the budget
    by 4·b·(a/t)·s bytes, under 5% of it."""
    core, heads = block.attention, block.attn.local_heads
    block.attention = lambda qkv: _RecomputeKeepingStats.apply(qkv, core, heads)
    return block


def ckpt_wrapped_twice(block):
    """The checkpointing cell run twice in the notebook: block.attention wrapped, and the wrapper
    wrapped again. Exact and within budget, but attention's core runs three times (twice in
    backward): twice the recomputation selective needs."""
    return _selective(_selective(block))


def forgets_the_dropout_mask(block):
    """Recomputes attention in backward, but dropout draws new masks there."""
    return _selective(block, replay=False)


def keeps_the_dropout_output(block):
    """Recomputes the scores and softmax only: dropout's mask and output ([b, a/t, s, s]) stay kept."""
    heads, p = block.attn.local_heads, block.dropout

    def softmax_of_scores(q, k):
        s = q.shape[-2]
        causal = torch.full((s, s), -float("inf"), dtype=q.dtype).triu(1)
        return torch.softmax(q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5 + causal, -1)

    def attention(qkv):
        s, b, _ = qkv.shape
        q, k, v = qkv.view(s, b, 3, heads, -1).permute(2, 1, 3, 0, 4)
        probs = checkpoint(softmax_of_scores, q, k, use_reentrant=False)
        dropped = torch.native_dropout(probs, p, True)[0] if block.training and p > 0 else probs
        return (dropped @ v).permute(2, 0, 1, 3).reshape(s, b, -1)
    block.attention = attention
    return block


class _WholeBlock(nn.Module):
    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, x):
        return checkpoint(self.block, x, use_reentrant=False)


def recomputes_the_whole_block(block):
    """Full recomputation: fits the budget, at one more forward of the whole block."""
    return _WholeBlock(block)


def uses_the_library(block):
    return Recomputed(block, "selective")


WHERE = r"^t=2, s=\d+, b=\d, h=\d+, \d heads, dropout 0\.\d, "
WRONG = {
    "checkpointed_block": [
        (recomputes_nothing_on_rank_1,
         [WHERE + r"rank 1: autograd kept [\d,]+ bytes for backward; the budget is",
          r"exactly what the block keeps without recomputation: nothing was dropped",
          r"Parts: exact ✔ · within budget ✘ · recompute cost ✔ \(2 of 3\)"], None),
        (ckpt_recomputes_on_two_ranks_only,
         [r"^t=3, s=\d+, b=\d, h=\d+, \d heads, dropout 0\.\d, rank 2: autograd kept [\d,]+ bytes for backward",
          r"nothing was dropped", r"Parts: exact ✔ · within budget ✘ · recompute cost ✔ \(2 of 3\)"], None),
        (ckpt_keeps_row_statistics,
         [WHERE + r"rank 0: autograd kept [\d,]+ bytes for backward; the budget is [\d,]+ .*: over by [\d,]+\.",
          r"exact ✔ · within budget ✘ · recompute cost ✔"], None),
        (ckpt_wrapped_twice,
         [WHERE + r"rank 0: backward recomputed [\d,]+ FLOPs", r"more than attention's core ran again",
          r"exact ✔ · within budget ✔ · recompute cost ✘ \(2 of 3\)"], None),
        (forgets_the_dropout_mask,
         [WHERE + r"rank 0: the output is exact but x\.grad differs", r"Dropout drew a new mask",
          r"preserve_rng_state=True", r"\(2 of 3\)"], None),
        (keeps_the_dropout_output,
         [WHERE + r"rank 0: autograd kept", r"over by [\d,]+\. Attention's s x s tensors",
          r"exact ✔ · within budget ✘ · recompute cost ✔"], None),
        (recomputes_the_whole_block,
         [WHERE + r"rank 0: backward recomputed [\d,]+ FLOPs", r"the whole block's forward ran again",
          r"exact ✔ · within budget ✔ · recompute cost ✘ \(2 of 3\)"], None),
        (uses_the_library,
         [r"^exercise 'checkpointed_block' asks you to work out the recomputation policy yourself; you use "
          r"pplab\.recompute"], None),
    ],
}
