"""Published training runs, as the papers give them, and the planner's prediction for each.

    for row in NARAYANAN_TABLE_1: narayanan_prediction(row)     # Megatron-LM on up to 3,072 A100s
    llama_prediction(LLAMA3_TABLE_4[0])                          # Llama 3 405B on 8,192 H100s

Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM", Table 1: GPT models with a vocabulary of 51,200 and sequences of 2,048 tokens, mixed
precision on DGX A100 nodes (8 GPUs, NVLink; 8 × 200 Gb/s InfiniBand), full activation
recomputation, TFLOP/s per GPU counted by their equation 3 (`pplab.flops.megatron_flops`, which
counts the recomputed forward). The table does not give the micro-batch size nor the interleaving:
the planner picks the fastest that fits. The runs of 2021 had neither sequence parallelism
(Korthikanti et al., 2022) nor a sharded optimizer, nor fused attention.

Llama Team, Meta 2024, "The Llama 3 Herd of Models", Tables 3 and 4 and section 3.3: 405B parameters,
126 layers, hidden 16,384, FFN 53,248 (SwiGLU), 128 heads, 8 key/value heads, a vocabulary of 128K
(Table 3 rounds it to 128,000; the released tokenizer has 128,256, used here), 16M tokens a step, on H100s of 80 GB (8 a server, 400 Gb/s a GPU between servers). FSDP shards the
optimizer state and the gradients but keeps the weights between forward and backward: ZeRO-2. No
activation recomputation at 8K tokens (the paper's words), made possible by its balanced pipeline:
the first and last stages hold one layer fewer, the embedding and the output layer in their place
(126 + 2 = 128 slots, 8 a rank). V (interleaving) is not given: the planner picks it (the paper's
"the first model chunk on the first stage has only the embedding" implies chunks of one slot, V = 8).
The long-context row of Table 4 printed DP 4 in the paper's first versions (July and August 2024),
which contradicts the row's own 16,384 GPUs (8 × 16 × 16 × 4 = 8,192) and 16M tokens
(4 × 16 × 131,072 = 8.4M); the revised version (v3, November 2024) prints DP 8, which satisfies both.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..flops import megatron_flops
from ..hardware import A100_80GB, H100_SXM
from .at_scale import GPUCluster, Transformer, search


@dataclass(frozen=True)
class MegatronRow:
    billions: float
    heads: int
    hidden: int
    layers: int
    tp: int
    pp: int
    gpus: int
    batch: int
    tflops: float          # achieved TFLOP/s per GPU, published


NARAYANAN_TABLE_1 = [MegatronRow(*r) for r in [
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 137), (3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
    (7.5, 32, 4096, 36, 4, 1, 128, 512, 142), (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138), (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148), (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
    (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163), (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163)]]


def megatron_gpt(row: MegatronRow) -> Transformer:
    """Their GPT: vocabulary 51,200, 2,048 tokens, FFN 4h, output layer tied to the embedding;
    attention as in 2021: scores written to memory (no FlashAttention), dropout masks kept."""
    return Transformer(f"GPT {row.billions}B", row.layers, row.hidden, row.heads, 51200, 2048,
                       flash=False, dropout=True)


def narayanan_prediction(row: MegatronRow):
    """The fastest layout with the published tp, pp and dp that fits, as run in 2021 (full recomputation,
    no ZeRO, no SP, an even split of the layers); returns (estimate, predicted TFLOP/s per GPU by their equation 3)."""
    model, dp = megatron_gpt(row), row.gpus // (row.tp * row.pp)
    plan = search(model, GPUCluster(A100_80GB, row.gpus // 8, 8), row.batch, sp=False)
    est = plan.best(dp=dp, tp=row.tp, pp=row.pp, cp=1, zero=0, recompute="full", balanced=False)
    flops = megatron_flops(row.batch, model.seq, model.layers, model.hidden, model.vocab)
    return est, flops / est.time["step"] / row.gpus / 1e12


LLAMA3_405B = Transformer("Llama 3 405B", layers=126, hidden=16384, heads=128, vocab=128256, seq=8192,
                          ffn=53248, kv_heads=8, gated=True, tied=False)


@dataclass(frozen=True)
class LlamaRow:
    gpus: int
    tp: int
    cp: int
    pp: int
    dp: int
    seq: int
    batch_per_dp: int
    tflops: float
    mfu: float

    @property
    def batch(self) -> int:
        return self.dp * self.batch_per_dp


LLAMA3_TABLE_4 = [LlamaRow(8192, 8, 1, 16, 64, 8192, 32, 430, 0.43), LlamaRow(16384, 8, 1, 16, 128, 8192, 16, 400, 0.41),
                  LlamaRow(16384, 8, 16, 16, 8, 131072, 16, 380, 0.38)]
LLAMA3_MFU_BAND = (0.38, 0.43)


def llama_plan(row: LlamaRow):
    model = dataclasses.replace(LLAMA3_405B, seq=row.seq)
    return search(model, GPUCluster(H100_SXM, row.gpus // 8, 8), row.batch)


def llama_prediction(row: LlamaRow, plan=None):
    """(the fastest fitting variant of the published layout as the paper ran it: ZeRO-2, no
    recomputation, the balanced stage split; its rank among all the planner's layouts, its rank among
    those with the same cp (each dp × tp × pp × cp counted once), the plan)."""
    plan = plan or llama_plan(row)
    shape = dict(dp=row.dp, tp=row.tp, pp=row.pp, cp=row.cp)
    return (plan.best(**shape, zero=2, recompute="none", balanced=True), plan.rank(**shape),
            plan.rank(among={"cp": row.cp}, **shape), plan)
