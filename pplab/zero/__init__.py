"""ZeRO from scratch: data parallelism without N copies of the model state.

Plain data parallelism (chapter 2) keeps, on every one of N ranks, all Ψ parameters, all Ψ
gradients and the whole optimizer state: with b bytes per parameter, b per gradient and K
per parameter of optimizer state, (b + b + K)Ψ bytes per rank, N times over. ZeRO cuts the
redundant copies, one kind of tensor per stage, while each rank still trains on its own
share of the batch:

    what each rank holds            parameters   gradients   optimizer state   traffic/rank
    DDP                              bΨ           bΨ          KΨ                2Ψ all-reduce
    stage 1  ZeroOptimizer(stage=1)  bΨ           bΨ          KΨ/N              2Ψ RS + AG
    stage 2  ZeroOptimizer(stage=2)  bΨ           bΨ/N        KΨ/N              2Ψ RS + AG
    stage 3  FullyShardedModule      bΨ/N         bΨ/N        KΨ/N              3Ψ AG + AG + RS

Mixed-precision Adam is b = 2 (bf16) and K = 12 (fp32 master copy, momentum, variance:
ZeroOptimizer(..., master_dtype=torch.float32) on a bf16 model); plain fp32 AdamW is b = 4, K = 8. "Traffic" is bytes sent per rank in
units of the model's bytes, as the ring algorithms send them ((N-1)/N of it per pass, taken
as 1 in the formula's round numbers).

    ZeroOptimizer       optimizer.py       stages 1 and 2, master_dtype, reduce_dtype, offload="cpu"; stage 3's optimizer
    FullyShardedModule  fully_sharded.py   stage 3: per-unit gather, compute, free, prefetch; compute_dtype, reduce_dtype
    FlatBucket          flat.py            parameters end to end, padded, cut in N shards

And the table itself, by formula and measured from the run (accounting.py):

    model_state_bytes(stage, ...)       the table's formula, per rank
    traffic_bytes(stage, ...)           the traffic column's formula, per rank
    held_bytes(model, optimizer)        bytes of parameters, gradients, optimizer state this rank holds
    sent_bytes(timeline, rank)          bytes this rank sent in the traced collectives (ring algorithms)

Beyond the table, in their own modules: ZeRO-Infinity's disk tier (offload.py,
chapter 9), and ZeRO++ (plusplus.py, chapter 10c).
"""
from .accounting import held_bytes, model_state_bytes, sent_bytes, traffic_bytes
from .flat import FlatBucket
from .fully_sharded import FullyShardedModule
from .optimizer import ZeroOptimizer

__all__ = ["ZeroOptimizer", "FullyShardedModule", "FlatBucket", "held_bytes", "sent_bytes",
           "model_state_bytes", "traffic_bytes"]
