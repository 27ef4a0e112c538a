"""Sequence parallelism: cut the sequence over ranks, because activations grow with it.

Three ways, all taking `group=` (None = every rank) so they can sit inside a larger mesh:

* **Ring attention** (ring_attention.py): K/V blocks go round a
  ring of point-to-point sends, partial results merged by the online-softmax rule.
* **DeepSpeed-Ulysses** (ulysses.py, `ulysses_attention`): q, k, v arrive sharded by sequence. One
  all-to-all re-cuts them by heads: every rank then holds the *whole* sequence for H/p
  of the heads, runs ordinary attention on them, and a second all-to-all cuts the output
  back by sequence. Heads are independent, so nothing else needs to talk.
* **Megatron sequence parallelism** (megatron.py, `MegatronBlock`): on top of tensor parallelism, built
  from chapter 3's layers, the parts of a transformer layer that TP replicates (LayerNorm,
  dropout, residual adds) run on a sequence shard, and TP's all-reduce splits into its two
  halves: an all-gather of the sequence before the column-parallel layer, a reduce-scatter
  after the row-parallel one.

Beyond these, in their own modules (chapter 11c): packed documents (packed.py: the document mask,
each rank's work, a split that balances it; ring attention takes `documents=` and explicit runs as
its layout) and Llama 3's all-gather context parallelism (allgather_cp.py, `allgather_attention`).

Each file's docstring has its algorithm's traffic and memory.
"""

from ..memory import activation_bytes_formula, saved_activations     # their home is pplab.memory
from .megatron import MegatronBlock, ring_collectives, sequence_parallel_layer_norm
from .ring_attention import gathered_kv_attention, merge, pieces, ring_attention, shard_sequence, unshard_sequence
from .ulysses import heads_to_seq, seq_to_heads, ulysses_attention

__all__ = ["ulysses_attention", "ring_attention", "gathered_kv_attention", "merge", "pieces",
           "shard_sequence", "unshard_sequence", "seq_to_heads", "heads_to_seq", "MegatronBlock",
           "sequence_parallel_layer_norm", "activation_bytes_formula", "saved_activations", "ring_collectives"]
