"""Megatron sequence parallelism (Korthikanti et al. 2022): on top of tensor parallelism, built
from chapter 3's layers, the parts of a transformer layer that TP replicates (LayerNorm,
dropout, residual adds) run on a sequence shard, and TP's all-reduce splits into its two
halves: an all-gather of the sequence before the column-parallel layer, a reduce-scatter after
the row-parallel one.

Its memory is Korthikanti et al.'s s·b·h·(34 + 5·a·s/h)/t bytes per layer (pplab.memory's
`activation_bytes_formula`; its `saved_activations` measures what autograd really keeps). Its
forward sends what TP's two all-reduces send (all-gather + reduce-scatter = all-reduce);
backward adds one all-gather per column layer, which re-gathers the input it did not keep.
"""
from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..runtime import comm
from .. import trace
from ..tensor_parallel.layers import all_gather_along, copy_to_parallel, reduce_scatter_along
from ..tensor_parallel.transformer import ParallelMLP, ParallelSelfAttention, TransformerBlock

__all__ = ["MegatronBlock", "sequence_parallel_layer_norm", "ring_collectives"]


# ----------------------------------------------------------------------------------
# Megatron sequence parallelism: chapter 3's tensor-parallel block, the sequence cut in between.


class _ColumnKeepingShard(torch.autograd.Function):
    """A column-parallel linear on the all-gathered sequence that keeps only this rank's
    shard of its input for backward and all-gathers it again there (Korthikanti et al.):
    s/t·b·h saved instead of s·b·h, for one more all-gather in backward."""

    @staticmethod
    def forward(ctx, x, weight, bias, group):
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.has_bias = group, bias is not None
        return F.linear(all_gather_along(x, 0, group), weight, bias)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        x_full = all_gather_along(x, 0, ctx.group)              # again: forward did not keep it
        dw = dy.flatten(0, -2).T @ x_full.flatten(0, -2)
        db = dy.flatten(0, -2).sum(0) if ctx.has_bias else None
        dx = reduce_scatter_along(dy @ weight, 0, ctx.group)    # every rank's part of dL/dx, summed; my tokens
        return dx, dw, db, None


def _dropout(x, p, training):
    # native_dropout keeps a 1-byte mask for backward (as on GPUs); F.dropout on CPU keeps a full-size one
    return torch.native_dropout(x, p, True)[0] if training and p > 0 else x


def _attention_core(qkv, heads, dropout, training):
    """Causal attention of [s, b, 3·heads·d] -> [s, b, heads·d], laid out as chapter 3's, but
    unfused: the s x s scores are materialised and kept, as Korthikanti et al. count them."""
    s, b, _ = qkv.shape
    q, k, v = qkv.view(s, b, 3, heads, -1).permute(2, 1, 3, 0, 4)            # each [b, heads, s, d]
    causal = torch.full((s, s), -math.inf, dtype=qkv.dtype, device=qkv.device).triu(1)   # added: saves nothing
    probs = torch.softmax(q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5 + causal, -1)
    return (_dropout(probs, dropout, training) @ v).permute(2, 0, 1, 3).reshape(s, b, -1)


def sequence_parallel_layer_norm(ln: nn.LayerNorm, x, group=None):
    """LayerNorm `ln` on this rank's sequence shard x: its weights see only this rank's tokens,
    so their gradients are summed over the group (chapter 3's f operator on the weights)."""
    w, b = (copy_to_parallel(t, group) for t in (ln.weight, ln.bias))
    return F.layer_norm(x, ln.normalized_shape, w, b, ln.eps)


class MegatronBlock(nn.Module):
    """Chapter 3's tensor-parallel transformer block (pre-LayerNorm), with dropout, and with
    Megatron sequence parallelism unless sequence_parallel=False.

    With sequence parallelism x and y are [s/t, b, h]: this rank's contiguous slice of the
    sequence (s must divide by t). LayerNorm, dropout and the residual adds run on that slice
    only; the column layers all-gather the sequence, the row layers reduce-scatter it.
    LayerNorm's weights then see only this rank's tokens, so their gradients are summed over
    the group (chapter 3's f operator). keep_input_shard=True saves only the shard of the
    column layers' input (all-gathered again in backward); False keeps the gathered input, as
    chapter 3's ColumnParallelLinear does. Without sequence parallelism x and y are [s, b, h]
    on every rank and everything outside attention and MLP is replicated (chapter 3's block).
    """

    def __init__(self, hidden, heads, ffn, dropout=0.0, sequence_parallel=True, keep_input_shard=True,
                 group=None):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.attn = ParallelSelfAttention(hidden, heads, sequence_parallel, group)
        self.mlp = ParallelMLP(hidden, ffn, sequence_parallel, group)
        self.dropout, self.sp, self.keep_shard, self.group = dropout, sequence_parallel, keep_input_shard, group
        self._checked = set()

    @classmethod
    def from_dense(cls, block: TransformerBlock, dropout=0.0, sequence_parallel=True, keep_input_shard=True,
                   group=None):
        """This rank's part of chapter 3's dense TransformerBlock: its heads, its ffn slice."""
        m = cls(block.attn.proj.in_features, block.attn.heads, block.mlp.fc1.out_features, dropout,
                sequence_parallel, keep_input_shard, group).to(block.ln1.weight.dtype)
        m.ln1.load_state_dict(block.ln1.state_dict())
        m.ln2.load_state_dict(block.ln2.state_dict())
        m.attn = ParallelSelfAttention.from_dense(block.attn, sequence_parallel, group)
        m.mlp = ParallelMLP.from_dense(block.mlp, sequence_parallel, group)
        return m

    def _norm(self, ln, x):
        return sequence_parallel_layer_norm(ln, x, self.group) if self.sp else ln(x)

    def _column(self, layer, x):
        if self.sp and self.keep_shard:
            return _ColumnKeepingShard.apply(x, layer.weight, layer.bias, self.group)
        return layer(x)

    def _check(self, x):
        """Once per input shape: every rank of the group holds the same number of tokens (untraced)."""
        if x.dim() != 3:
            raise ValueError(f"MegatronBlock takes [s, b, h], got shape {list(x.shape)}")
        if x.shape in self._checked or comm.world_size(self.group) == 1:
            return
        shapes = [None] * comm.world_size(self.group)
        with trace.paused():
            dist.all_gather_object(shapes, tuple(x.shape), group=self.group)
        if len(set(shapes)) > 1:
            lengths = [sh[0] for sh in shapes]
            raise ValueError(f"MegatronBlock: the ranks hold {lengths} tokens ([s/t, b, h] shapes {shapes}): "
                             f"sequence parallelism needs the same s/t on every rank, so use a sequence "
                             f"length divisible by {len(shapes)} (here {sum(lengths)} is not)")
        self._checked.add(x.shape)

    def attention(self, qkv):
        """Scores, softmax, dropout and the product with v: what selective recomputation
        (pplab.recompute) drops after the forward and runs again in backward."""
        return _attention_core(qkv, self.attn.local_heads, self.dropout, self.training)

    def forward(self, x):
        if self.sp:
            self._check(x)
        a = self._column(self.attn.qkv, self._norm(self.ln1, x))             # SP: all-gather the sequence
        a = self.attn.proj(self.attention(a))                                # SP: reduce-scatter
        x = x + _dropout(a, self.dropout, self.training)
        m = self.mlp.fc2(F.gelu(self._column(self.mlp.fc1, self._norm(self.ln2, x))))
        return x + _dropout(m, self.dropout, self.training)


@contextlib.contextmanager
def ring_collectives():
    """Inside this block, pplab.comm's all-gather, reduce-scatter and all-reduce (which forward to
    the backend, so the trace sees only their payload) run as pplab.collectives' rings built from
    traced sends: the trace then counts every byte each rank puts on the wire."""
    from .. import collectives
    from ..runtime import comm
    saved = {name: getattr(comm, name) for name in ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce")}
    comm.all_gather_into_tensor = lambda out, x, group=None, async_op=False: collectives.all_gather_into_tensor(
        out, x, group=group)
    comm.reduce_scatter_tensor = lambda out, x, op="sum", group=None, async_op=False: \
        collectives.reduce_scatter_tensor(out, x, op=op, group=group)
    comm.all_reduce = lambda t, op="sum", group=None, async_op=False: collectives.all_reduce(t, op, group=group)
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(comm, name, fn)
