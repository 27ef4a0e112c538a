"""Chapter 11a: communication hidden under computation, measured from the trace.

hidden.py:         hidden_time / hidden_fraction (communication under the same rank's compute),
                   stand_in_span (a compute span padded to a stand-in accelerator's time).
async_tp.py:       collective_matmul: TP's all-gather cut into ring steps under the partial matmuls.
stage.py:          Chunk: a pipeline stage's chunk with forward/backward, padded and traced.
dualpipe_pair.py:  dualpipe_step: DualPipe's overlapped pair on two ranks, pair_hidden_fraction.
shared_expert.py:  moe_with_shared_expert: the expert dispatch in flight under the shared expert.
"""
from .hidden import hidden_fraction, hidden_time, stand_in_span
from .async_tp import collective_matmul, gather_then_matmul
from .stage import Chunk
from .dualpipe_pair import dualpipe_step, pair_hidden_fraction
from .shared_expert import moe_with_shared_expert

__all__ = ["hidden_fraction", "hidden_time", "stand_in_span", "collective_matmul", "gather_then_matmul", "Chunk",
           "dualpipe_step", "pair_hidden_fraction", "moe_with_shared_expert"]
