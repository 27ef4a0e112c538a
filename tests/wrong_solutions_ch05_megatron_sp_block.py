"""Plausible wrong answers to the capstone `megatron_sp_block` (a Megatron transformer block with
sequence parallelism), each one mistake a student could make, one of them wrong on rank 1 only.

WRONG[exercise_id] lists (function, regular expressions the check's message must match, timeout
for the check or None for the default), as in wrong_solutions_ch00_broadcast.py. Every answer here is one
implementation, `_block`, with one switch turned.
"""
import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from pplab import comm
from pplab.sequence_parallel import MegatronBlock


def _gather(x, group):
    out = x.new_empty(comm.world_size(group) * x.shape[0], *x.shape[1:])
    comm.all_gather_into_tensor(out, x.contiguous(), group=group)
    return out


def _scatter(x, group):
    out = x.new_empty(x.shape[0] // comm.world_size(group), *x.shape[1:])
    comm.reduce_scatter_tensor(out, x.contiguous(), group=group)
    return out


def _all_reduce(x, group):
    x = x.clone()
    comm.all_reduce(x, group=group)
    return x


def _mine(x, group):
    return x.chunk(comm.world_size(group))[comm.rank(group)].contiguous()


def _op(forward, backward):
    """An autograd Function from two functions of (tensor, group)."""
    class Op(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, group):
            ctx.group = group
            return forward(x, group)

        @staticmethod
        def backward(ctx, grad):
            return backward(grad, ctx.group), None
    return Op.apply


g = _op(_gather, _scatter)                                    # right
g_bar = _op(_scatter, _gather)                                # right
f = _op(lambda w, group: w.view_as(w), _all_reduce)           # right, on a replicated weight
g_without_reduce_scatter = _op(_gather, _mine)                # backward keeps its slice of its own partial gradient
g_bar_by_all_reduce = _op(lambda x, group: _mine(_all_reduce(x, group), group), _gather)
gather_keep_slice = _op(_gather, _mine)                       # chapter 3's gather: slice backward
slice_gather_back = _op(_mine, _gather)                       # chapter 3's split: all-gather backward
all_reduce_forward = _op(_all_reduce, lambda x, group: x)     # chapter 3's g
all_reduce_backward = _op(lambda x, group: x.view_as(x), _all_reduce)   # chapter 3's f


def _linear(dense, rows=None, cols=None):
    w, b = dense.weight.detach(), dense.bias.detach()
    w, b = (w, b) if rows is None else (w[rows], b[rows])
    w = w if cols is None else w[:, cols]
    layer = nn.Linear(w.shape[1], w.shape[0])
    with torch.no_grad():
        layer.weight.copy_(w)
        layer.bias.copy_(b)
    return layer


def _attend(qkv, heads):
    s, b, _ = qkv.shape
    q, k, v = qkv.view(s, b, 3, heads, -1).permute(2, 1, 3, 0, 4)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True).permute(2, 0, 1, 3).reshape(s, b, -1)


class _Block(nn.Module):
    """A Megatron-SP block; each keyword turns on one mistake."""

    def __init__(self, block, group, heads_contiguous=False, ln_grads_summed=True, gather=g, scatter=g_bar,
                 bias="after", residual_whole=False, use_group=True, ffn_split="tensor_split", attention_dtype=None):
        super().__init__()
        group = group if use_group else None
        t, r = comm.world_size(group), comm.rank(group)
        H, h = block.attn.heads, block.attn.proj.in_features
        n, d = H // t, h // H
        mine = torch.arange(r * n * d, (r + 1) * n * d)
        rows = torch.arange(r * 3 * n * d, (r + 1) * 3 * n * d) if heads_contiguous else \
            torch.cat([mine, mine + h, mine + 2 * h])
        ffn = torch.arange(block.mlp.fc1.out_features)
        ffn = ffn.tensor_split(t)[r] if ffn_split == "tensor_split" else ffn.chunk(t)[r]     # chunk: ceil(n/t) each
        self.ln1, self.ln2 = copy.deepcopy(block.ln1), copy.deepcopy(block.ln2)
        self.attn, self.mlp = nn.Module(), nn.Module()
        self.attn.qkv, self.attn.proj = _linear(block.attn.qkv, rows=rows), _linear(block.attn.proj, cols=mine)
        self.mlp.fc1, self.mlp.fc2 = _linear(block.mlp.fc1, rows=ffn), _linear(block.mlp.fc2, cols=ffn)
        self.group, self.heads, self.rank = group, n, r
        self.ln_grads_summed, self.gather, self.scatter, self.bias = ln_grads_summed, gather, scatter, bias
        self.residual_whole, self.attention_dtype = residual_whole, attention_dtype

    def _norm(self, ln, x):
        w, b = (f(p, self.group) for p in (ln.weight, ln.bias)) if self.ln_grads_summed else (ln.weight, ln.bias)
        return F.layer_norm(x, ln.normalized_shape, w, b, ln.eps)

    def _row(self, layer, a):
        if self.bias == "before, every rank":
            return self.scatter(F.linear(a, layer.weight, layer.bias), self.group)
        if self.bias == "before, rank 0 only":
            return self.scatter(F.linear(a, layer.weight, layer.bias if self.rank == 0 else None), self.group)
        return self.scatter(F.linear(a, layer.weight), self.group) + f(layer.bias, self.group)

    def forward(self, x):
        if self.residual_whole:                     # chapter 3's block on the gathered sequence
            return self._whole(x)
        qkv = self.attn.qkv(self.gather(self._norm(self.ln1, x), self.group))
        a = _attend(qkv, self.heads) if self.attention_dtype is None else \
            _attend(qkv.to(self.attention_dtype), self.heads).to(qkv.dtype)
        x = x + self._row(self.attn.proj, a)
        m = F.gelu(self.mlp.fc1(self.gather(self._norm(self.ln2, x), self.group)))
        return x + self._row(self.mlp.fc2, m)

    def _whole(self, x):
        x = gather_keep_slice(x, self.group)        # [s, b, h] on every rank, from here on
        a = _attend(self.attn.qkv(all_reduce_backward(self.ln1(x), self.group)), self.heads)
        x = x + all_reduce_forward(F.linear(a, self.attn.proj.weight), self.group) + self.attn.proj.bias
        m = F.gelu(self.mlp.fc1(all_reduce_backward(self.ln2(x), self.group)))
        x = x + all_reduce_forward(F.linear(m, self.mlp.fc2.weight), self.group) + self.mlp.fc2.bias
        return slice_gather_back(x, self.group)     # this rank's tokens


def sp_all_reduce_instead_of_reduce_scatter(block, group=None):
    """ḡ all-reduces the partial sums and keeps this rank's tokens: right values, more traffic."""
    return _Block(block, group, scatter=g_bar_by_all_reduce)


def sp_layernorm_grads_not_summed(block, group=None):
    """LayerNorm's weights are whole on every rank and used as they are: their gradients stay partial."""
    return _Block(block, group, ln_grads_summed=False)


def sp_g_backward_keeps_its_slice(block, group=None):
    """g's backward takes this rank's tokens of its own partial gradient, without the reduce-scatter."""
    return _Block(block, group, gather=g_without_reduce_scatter)


def sp_heads_split_contiguously(block, group=None):
    """Rank r takes rows r·3h/t.. of W_qkv, as if q, k and v were interleaved per head."""
    return _Block(block, group, heads_contiguous=True)


def sp_row_bias_on_rank_zero_only(block, group=None):
    """Right on rank 0 only: "add the bias once" read as rank 0 adding it before the reduce-scatter.
    The output is right; the other ranks' bias gradients are None."""
    return _Block(block, group, bias="before, rank 0 only")


def sp_row_bias_before_the_reduce_scatter(block, group=None):
    return _Block(block, group, bias="before, every rank")


def sp_residual_on_the_whole_sequence(block, group=None):
    """Gathers the sequence once and runs chapter 3's block on all of it: right values, the residual
    path whole on every rank, all-reduces after the row layers."""
    return _Block(block, group, residual_whole=True)


def sp_ignores_the_group(block, group=None):
    """Splits and communicates over the whole world whatever group it is given."""
    return _Block(block, group, use_group=False)


def sp_returns_the_whole_sequence(block, group=None):
    class Whole(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = _Block(block, group)
            self.ln1, self.ln2, self.attn, self.mlp = self.inner.ln1, self.inner.ln2, self.inner.attn, self.inner.mlp

        def forward(self, x):
            return _gather(self.inner(x), self.inner.group)
    return Whole()


def sp_ffn_in_chunks(block, group=None):
    """The ffn split with torch.chunk (ceil(ffn/t) rows each): tensor_split's on 2 ranks, and on 3
    ranks with ffn = 3k + 1, k+1, k+1, k-1 rows where tensor_split gives k+1, k, k. Still a partition
    of the ffn, so the values are right: the layout gives it away."""
    return _Block(block, group, ffn_split="chunk")


def sp_attention_in_bfloat16(block, group=None):
    """Attention's core run in bfloat16 "for speed" (q, k, v cast down, the output cast back): off by
    about 1e-3, ten times the float32 tolerance 1e-4, far inside 1e-2."""
    return _Block(block, group, attention_dtype=torch.bfloat16)


def sp_from_library(block, group=None):
    return MegatronBlock.from_dense(block, keep_input_shard=False, group=group)


def sp_broadcasts_the_weights(block, group=None):
    """Rank 0 broadcasts the dense weights, though every rank already has them."""
    for p in block.parameters():
        with torch.no_grad():
            dist.broadcast(p.data, comm.group_ranks(group)[0], group=group)
    return _Block(block, group)


WHERE = r"^t=[23]( \(sub-groups \[\[0, 2\], \[1, 3\]\] of 4 ranks\))?, s=\d+, b=\d, h=\d+, \d heads, ffn=\d+, rank \d"
RIGHT_VALUES = r"Parts: forward ✔ · input grad ✔ · parameter grads ✔ · traffic ✘ \(3 of 4\)\. .*\[3 of 4 points\]$"

WRONG = {
    "megatron_sp_block": [
        (sp_all_reduce_instead_of_reduce_scatter,
         [WHERE, r"in forward this rank sent [\d,]+ bytes with ring collectives \(all_gather of \d+ elements, "
                 r"all_reduce of \d+ elements", r"the formula says [\d,]+: an all-reduce of the whole sequence",
          r"where ḡ makes a reduce-scatter. The values are right", RIGHT_VALUES], None),
        (sp_layernorm_grads_not_summed,
         [WHERE + r": ln1\.weight\.grad differs from its share of the single-process gradient",
          r"It is the sum over this rank's tokens only", r"all-reduce its gradient over the group",
          r"Parts: forward ✔ · input grad ✔ · parameter grads ✘ · traffic ✘ \(2 of 4\)\. .*\[2 of 4 points\]$"], None),
        (sp_g_backward_keeps_its_slice,
         [WHERE + r": x\.grad differs from the single-process gradient", r"Your backward made no reduce-scatter",
          r"g's backward must sum them over the ranks", r"Parts: forward ✔ · input grad ✘"], None),
        (sp_heads_split_contiguously,
         [WHERE + r": the output differs", r"attn\.qkv\.weight is not this rank's share of the dense attn\.qkv\.weight",
          r"it holds rows [\d., ]+ of it; rows of W_qkv are \[q \| k \| v\], each head-major",
          r"Parts: forward ✘ · input grad ✘ · parameter grads ✘ · traffic ✔ \(1 of 4\)"], None),
        (sp_row_bias_on_rank_zero_only,
         [r"^t=2, s=\d+, b=\d, h=\d+, \d heads, ffn=\d+, rank 1: attn\.proj\.bias\.grad is None",
          r"Every rank holds attn\.proj\.bias whole", r"Parts: forward ✔ · input grad ✔ · parameter grads ✘"], None),
        (sp_row_bias_before_the_reduce_scatter,
         [WHERE + r": the output differs", r"It is the output of a block whose attn\.proj and mlp\.fc2 biases "
                                    r"are t times larger", r"Add it once, after the reduce-scatter"], None),
        (sp_residual_on_the_whole_sequence,
         [WHERE + r": in forward this rank sent", r"the sequence was gathered once and the block ran on the whole",
          r"keeps the residual path on this rank's s/t tokens", RIGHT_VALUES], None),
        (sp_ignores_the_group,
         [r"^t=2 \(sub-groups \[\[0, 2\], \[1, 3\]\] of 4 ranks\), .*, rank \d \(rank \d of group \[\d, \d\]\): "
          r"the output differs", r"Its collectives ran over ranks \[0, 1, 2, 3\], not over its group \[\d, \d\]: pass "
          r"group=group"], None),
        (sp_returns_the_whole_sequence,
         [WHERE + r": the block returned \[\d+, \d, \d+\], not a tensor of this rank's shape",
          r"Parts: forward ✘ · input grad ✘ · parameter grads ✘"], None),
        (sp_ffn_in_chunks,
         [r"^t=3, .*, rank [12]: the parameters are not this rank's share: mlp\.fc1\.weight is not this rank's share",
          r"Parts: forward ✔ · input grad ✔ · parameter grads ✘ · traffic ✔",
          r"the first ffn % t ranks get one more"], None),
        (sp_attention_in_bfloat16, [WHERE + r": the output differs from the single-process block's",
                                    r"Parts: forward ✘ · input grad ✘"], None),
        (sp_from_library,
         [r"^exercise 'megatron_sp_block' asks you to work out the block's sharding and its g, ḡ and f operators "
          r"yourself; you use pplab's own tensor- or sequence-parallel layers"], None),
        (sp_broadcasts_the_weights,
         [WHERE + r": building the block communicated", r"each cuts its own share out of it with no message",
          RIGHT_VALUES], None),
    ],
}
