"""A transformer split Megatron's way, from the two layers of `pplab.tensor_parallel`.

    block = ParallelTransformerBlock.from_dense(dense_block)   # rank r: its heads, its ffn slice
    y = block(x)                                               # x, y: [s, b, h] on every rank

Each dense module here (`MLP`, `SelfAttention`, `TransformerBlock`) has a parallel twin built
from it with `from_dense`, so a test or a notebook runs the very same model on one process and on
p ranks and compares outputs and gradients. The course's tiny GPT is built from these layers
in `pplab.models`.

* MLP: h -> ffn (column) -> GeLU -> ffn -> h (row). GeLU is applied to each rank's own slice of
  the ffn features, which is why W1 is split by columns: no communication in between.
* Attention: heads are independent, so each rank owns heads/p of them: q, k and v come from one
  fused column layer (one all-reduce backward, not three), the output projection is a row layer.
* A block (pre-LayerNorm, two residuals) thus costs 2 all-reduces of [s, b, h] forward and 2
  backward, and nothing else: LayerNorm and the residuals run replicated on every rank.
* Vocabulary: the embedding table is split by rows (token ids), and so is the output layer, whose
  logits are never gathered: `vocab_parallel_cross_entropy` needs only a max, a sum of exps and the
  target's logit from every rank, in two all-reduces (the max, one number per token; then the two
  sums stacked, two numbers per token) instead of an all-gather of [tokens, vocab]. Vocabularies that do not divide (1000 over 3) work.
"""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from ..runtime import comm
from .layers import (ColumnParallelLinear, RowParallelLinear, my_range, reduce_from_parallel)


class MLP(nn.Module):
    def __init__(self, hidden, ffn):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(hidden, ffn), nn.Linear(ffn, hidden)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class ParallelMLP(nn.Module):
    """Column -> GeLU -> row: one all-reduce forward (g) and one backward (f). x, y: [..., h]."""

    def __init__(self, hidden, ffn, sequence_parallel=False, group=None):
        super().__init__()
        self.fc1 = ColumnParallelLinear(hidden, ffn, sequence_parallel=sequence_parallel, group=group)
        self.fc2 = RowParallelLinear(ffn, hidden, sequence_parallel=sequence_parallel, group=group)

    @classmethod
    def from_dense(cls, mlp: MLP, sequence_parallel=False, group=None):
        m = cls(mlp.fc1.in_features, mlp.fc1.out_features, sequence_parallel, group)
        m.fc1 = ColumnParallelLinear.from_dense(mlp.fc1, sequence_parallel=sequence_parallel, group=group)
        m.fc2 = RowParallelLinear.from_dense(mlp.fc2, sequence_parallel=sequence_parallel, group=group)
        return m

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


def _attend(qkv, heads):
    """Causal attention of [s, b, 3*heads*d] -> [s, b, heads*d], q, k, v side by side."""
    s, b, _ = qkv.shape
    q, k, v = qkv.view(s, b, 3, heads, -1).permute(2, 1, 3, 0, 4)        # each [b, heads, s, d]
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return o.permute(2, 0, 1, 3).reshape(s, b, -1)


class SelfAttention(nn.Module):
    """Causal multi-head self-attention on [s, b, h]; qkv's outputs are [q | k | v], head-major."""

    def __init__(self, hidden, heads):
        super().__init__()
        if hidden % heads:
            raise ValueError(f"hidden size {hidden} is not a multiple of {heads} heads")
        self.heads = heads
        self.qkv, self.proj = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)

    def forward(self, x):
        return self.proj(_attend(self.qkv(x), self.heads))


class ParallelSelfAttention(nn.Module):
    """Rank r computes heads [r*heads/p, (r+1)*heads/p): its rows of qkv, its columns of proj."""

    def __init__(self, hidden, heads, sequence_parallel=False, group=None):
        super().__init__()
        p = comm.world_size(group)
        if hidden % heads:
            raise ValueError(f"hidden size {hidden} is not a multiple of {heads} heads")
        if heads % p:
            raise ValueError(f"{heads} heads cannot be split over {p} ranks: use a number of ranks "
                             f"that divides {heads}")
        self.heads, self.local_heads = heads, heads // p
        self.qkv = ColumnParallelLinear(hidden, 3 * hidden, sequence_parallel=sequence_parallel, group=group)
        self.proj = RowParallelLinear(hidden, hidden, sequence_parallel=sequence_parallel, group=group)

    @classmethod
    def from_dense(cls, attn: SelfAttention, sequence_parallel=False, group=None):
        h = attn.proj.in_features
        m = cls(h, attn.heads, sequence_parallel, group).to(attn.qkv.weight.dtype)
        r, n = comm.rank(group), m.local_heads
        mine = slice(r * n, (r + 1) * n)
        with torch.no_grad():         # rows of W_qkv are (q|k|v, head, d): keep this rank's heads of each
            m.qkv.weight.copy_(attn.qkv.weight.view(3, attn.heads, -1, h)[:, mine].reshape(-1, h))
            m.qkv.bias.copy_(attn.qkv.bias.view(3, attn.heads, -1)[:, mine].reshape(-1))
            m.proj.weight.copy_(attn.proj.weight[:, r * n * (h // attn.heads):(r + 1) * n * (h // attn.heads)])
            m.proj.bias.copy_(attn.proj.bias)
        return m

    def forward(self, x):
        return self.proj(_attend(self.qkv(x), self.local_heads))


class TransformerBlock(nn.Module):
    """Pre-LayerNorm block: x + attn(ln1(x)), then + mlp(ln2(.)). x: [s, b, h]."""

    def __init__(self, hidden, heads, ffn):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.attn, self.mlp = SelfAttention(hidden, heads), MLP(hidden, ffn)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class ParallelTransformerBlock(TransformerBlock):
    """The same block with split attention and MLP; the LayerNorms are replicated on every rank."""

    def __init__(self, hidden, heads, ffn, group=None):
        nn.Module.__init__(self)
        self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.attn = ParallelSelfAttention(hidden, heads, group=group)
        self.mlp = ParallelMLP(hidden, ffn, group=group)

    @classmethod
    def from_dense(cls, block: TransformerBlock, group=None):
        m = cls(block.attn.proj.in_features, block.attn.heads, block.mlp.fc1.out_features, group)
        m.ln1, m.ln2 = copy.deepcopy(block.ln1), copy.deepcopy(block.ln2)
        m.attn = ParallelSelfAttention.from_dense(block.attn, group=group)
        m.mlp = ParallelMLP.from_dense(block.mlp, group=group)
        return m


# ----------------------------------------------------------------------------------
# The vocabulary: embedding and loss, split by token id


class VocabParallelEmbedding(nn.Module):
    """Rank r holds the embeddings of tokens [start, end); others' tokens give 0 here, and g's
    all-reduce adds the one rank that knows each token. ids: any shape -> [*ids.shape, h]."""

    def __init__(self, vocab, hidden, group=None):
        super().__init__()
        p = comm.world_size(group)
        if vocab < p:
            raise ValueError(f"a vocabulary of {vocab} tokens cannot be split over {p} ranks")
        self.vocab, self.group = vocab, group
        self.start, self.end = my_range(vocab, group)
        self.weight = nn.Parameter(torch.randn(self.end - self.start, hidden))   # nn.Embedding's N(0, 1)

    @classmethod
    def from_dense(cls, emb: nn.Embedding, group=None):
        m = cls(emb.num_embeddings, emb.embedding_dim, group).to(emb.weight.dtype)
        with torch.no_grad():
            m.weight.copy_(emb.weight[m.start:m.end])
        return m

    def forward(self, ids):
        if ids.numel() and (ids.min() < 0 or ids.max() >= self.vocab):
            raise ValueError(f"token ids must be in [0, {self.vocab}), got {ids.min().item()}..{ids.max().item()}")
        mine = (ids >= self.start) & (ids < self.end)
        local = F.embedding((ids - self.start) * mine, self.weight) * mine.unsqueeze(-1)
        return reduce_from_parallel(local, self.group)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, start, group):
        logits = logits.float() if logits.dtype == torch.float16 else logits
        m = logits.max(dim=-1).values                       # 1. the max over the whole vocabulary
        if comm.world_size(group) > 1:
            comm.all_reduce(m, op="max", group=group)
        e = (logits - m.unsqueeze(-1)).exp()
        sum_exp = e.sum(dim=-1)                             # 2. the sum of exps over the whole vocabulary
        mine = (targets >= start) & (targets < start + logits.shape[-1])
        idx = ((targets - start) * mine).unsqueeze(-1)
        target = (logits - m.unsqueeze(-1)).gather(-1, idx).squeeze(-1) * mine   # 3. from its owner only
        if comm.world_size(group) > 1:
            both = torch.stack([sum_exp, target])           # one all-reduce for the two sums
            comm.all_reduce(both, group=group)
            sum_exp, target = both[0], both[1]
        ctx.save_for_backward(e / sum_exp.unsqueeze(-1), mine, idx)
        return sum_exp.log() - target                       # -log softmax(target), per token

    @staticmethod
    def backward(ctx, grad):
        softmax, mine, idx = ctx.saved_tensors              # d loss/d logits = softmax - onehot: local
        g = softmax.clone()
        g.scatter_add_(-1, idx, -mine.unsqueeze(-1).to(g.dtype))
        return g * grad.unsqueeze(-1), None, None, None


def vocab_parallel_cross_entropy(logits_shard, targets, group=None, vocab_size=None, reduction="mean"):
    """Cross-entropy of logits split by vocabulary: logits_shard [..., V_r] holds this rank's
    columns [start, end) of the [..., V] logits (V_r as torch.tensor_split gives them), targets
    [...] are ids in [0, V). The logits are never gathered: one max all-reduce and one sum
    all-reduce of two numbers per token. Without `vocab_size`, one all-gather of each rank's
    V_r (one integer each) finds `start`. Returns the mean loss, or per-token losses."""
    p, r = comm.world_size(group), comm.rank(group)
    if vocab_size is None and p > 1:
        sizes = torch.zeros(p, dtype=torch.long, device=logits_shard.device)
        mine = torch.tensor([logits_shard.shape[-1]], device=logits_shard.device)
        comm.all_gather_into_tensor(sizes, mine, group=group)
        start = int(sizes[:r].sum())
    else:
        start = my_range(vocab_size, group)[0] if vocab_size is not None else 0
    loss = _VocabParallelCrossEntropy.apply(logits_shard, targets, start, group)
    return loss.mean() if reduction == "mean" else loss
