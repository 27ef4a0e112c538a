"""A tiny GPT as a list of layers: one definition for one process, tensor/sequence parallel, and pipeline stages.

    cfg = GPTConfig(vocab=len(pplab.data.VOCAB), seq=16)
    layers = gpt_layers(cfg, seed=0)            # [Embed, block, ..., block, Head]: dense, on every rank
    model = nn.Sequential(*layers)              # one process: ids [b, s] -> logits [b, s, V]
    loss = gpt_loss(model(x), y)

    mine = parallel_layers(layers, group=tp_group, sequence_parallel=True)   # this rank's shards
    loss = gpt_loss(nn.Sequential(*mine)(x), y, group=tp_group)             # logits never gathered

Why a list: chapter 4's pipeline executor cuts a list of layers into stages, so the same list
runs whole (nn.Sequential), split over tensor-parallel ranks, or cut into stages, or all three.
Inputs and outputs are batch-first ([b, s]) because the executor cuts micro-batches along
dim 0; between the layers the activations are [s, b, h], the layout of chapters 3 and 5.

Nothing here is a new layer: the blocks are chapter 3's TransformerBlock (dense) and chapter 5's
MegatronBlock (its tensor-parallel split, with or without sequence parallelism), the vocabulary
is chapter 3's VocabParallelEmbedding, column-parallel head and vocab-parallel cross-entropy.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..runtime import comm
from ..sequence_parallel import MegatronBlock, sequence_parallel_layer_norm
from ..tensor_parallel import ColumnParallelLinear, split_to_parallel
from ..tensor_parallel.transformer import TransformerBlock, VocabParallelEmbedding, vocab_parallel_cross_entropy


@dataclass(frozen=True)
class GPTConfig:
    vocab: int
    seq: int = 16                  # longest sequence (learned positions)
    hidden: int = 32
    heads: int = 4
    ffn: int = 64
    layers: int = 2                # transformer blocks (the model has layers + 2 pipeline layers)

    def parameters(self) -> int:
        """Number of parameters, by formula (tests check it against the model)."""
        h, f, v = self.hidden, self.ffn, self.vocab
        block = 4 * h + (3 * h * h + 3 * h) + (h * h + h) + (h * f + f) + (f * h + h)
        return v * h + self.seq * h + self.layers * block + 2 * h + h * v


class Embed(nn.Module):
    """ids [b, s] -> token + position embeddings, [s, b, h]."""

    def __init__(self, vocab, seq, hidden):
        super().__init__()
        self.tokens, self.positions = nn.Embedding(vocab, hidden), nn.Embedding(seq, hidden)

    def _add_positions(self, x):
        s = x.shape[1]
        if s > self.positions.num_embeddings:
            raise ValueError(f"sequences of {s} tokens, but the model has positions for "
                             f"{self.positions.num_embeddings}: use GPTConfig(seq={s}) or shorter inputs")
        return (x + self.positions.weight[:s]).transpose(0, 1)

    def forward(self, ids):
        return self._add_positions(self.tokens(ids))


class ParallelEmbed(Embed):
    """Token table split by vocabulary (one all-reduce), positions replicated; with sequence
    parallelism each rank keeps its slice of the sequence, [s/t, b, h]."""

    def __init__(self, dense: Embed, group=None, sequence_parallel=False):
        nn.Module.__init__(self)
        self.tokens = VocabParallelEmbedding.from_dense(dense.tokens, group)
        self.positions = copy.deepcopy(dense.positions)
        self.group, self.sp = group, sequence_parallel

    def forward(self, ids):
        x = self._add_positions(self.tokens(ids))
        return split_to_parallel(x, 0, self.group) if self.sp else x


class Head(nn.Module):
    """Final LayerNorm and output layer: [s, b, h] -> logits [b, s, V]."""

    def __init__(self, hidden, vocab):
        super().__init__()
        self.ln, self.out = nn.LayerNorm(hidden), nn.Linear(hidden, vocab, bias=False)

    def forward(self, x):
        return self.out(self.ln(x)).transpose(0, 1)


class ParallelHead(Head):
    """LayerNorm replicated (on the sequence shard with SP), output split by vocabulary: this
    rank's logits [b, s, V_r], never gathered (gpt_loss takes them as they are)."""

    def __init__(self, dense: Head, group=None, sequence_parallel=False):
        nn.Module.__init__(self)
        self.ln = copy.deepcopy(dense.ln)
        self.out = ColumnParallelLinear.from_dense(dense.out, sequence_parallel=sequence_parallel, group=group)
        self.group, self.sp = group, sequence_parallel

    def forward(self, x):
        x = sequence_parallel_layer_norm(self.ln, x, self.group) if self.sp else self.ln(x)
        return self.out(x).transpose(0, 1)


def gpt_layers(cfg: GPTConfig, seed: int = 0, dtype=torch.float64) -> list[nn.Module]:
    """The dense model as a list of layers, the same on every rank that uses the same seed."""
    torch.manual_seed(seed)
    layers = [Embed(cfg.vocab, cfg.seq, cfg.hidden)]
    layers += [TransformerBlock(cfg.hidden, cfg.heads, cfg.ffn) for _ in range(cfg.layers)]
    layers.append(Head(cfg.hidden, cfg.vocab))
    return [layer.to(dtype) for layer in layers]


def parallel_layers(layers, group=None, sequence_parallel: bool = False) -> list[nn.Module]:
    """This rank's tensor-parallel share of `gpt_layers(...)` (group: the tp group; a group of
    one gives the same computation through the same code)."""
    t = comm.world_size(group)
    block = next((b for b in layers if isinstance(b, TransformerBlock)), None)
    if block is not None and block.attn.heads % t:
        raise ValueError(f"{block.attn.heads} attention heads cannot be split over tp={t} ranks: "
                         f"use a tp that divides {block.attn.heads}")
    out = []
    for layer in layers:
        if isinstance(layer, Embed):
            out.append(ParallelEmbed(layer, group, sequence_parallel))
        elif isinstance(layer, Head):
            out.append(ParallelHead(layer, group, sequence_parallel))
        else:
            out.append(MegatronBlock.from_dense(layer, sequence_parallel=sequence_parallel, group=group))
    return out


def gpt_loss(logits, targets, group=None, vocab: int | None = None):
    """Mean next-token cross-entropy. With a tp group, logits are this rank's vocabulary slice and
    the loss is chapter 3's vocab-parallel cross-entropy (two small all-reduces, no gather)."""
    if group is None:
        return F.cross_entropy(logits.flatten(0, -2), targets.flatten())
    return vocab_parallel_cross_entropy(logits, targets, group, vocab_size=vocab)
