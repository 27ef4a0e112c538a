"""Tensor parallelism (chapter 3): one layer's weights split over the ranks of a group.

layers.py       Megatron's 1D layers: the conjugate operators f and g (and the sequence-parallel
                all-gather / reduce-scatter) as autograd functions, ColumnParallelLinear and
                RowParallelLinear, split_sizes.
transformer.py  a split MLP and attention (heads over ranks), a transformer block, the
                vocabulary-parallel embedding and cross-entropy, a tiny GPT.
summa.py        2D tensor parallelism: SUMMA's Linear2D on a q x q grid; traced_collectives(), under
                which a trace counts the bytes each rank sends (for 1D layers too).
tp25d.py        2.5D: Linear2p5D on d stacked q x q SUMMA grids, the weight's gradient summed over depth.
tp3d.py         3D: Linear3D on a q x q x q cube (all-gathers and reduce-scatters); the bytes per rank
                of 1D, 2D, 2.5D and 3D side by side, and where their curves cross.
cnn.py          convolutions with filters split over ranks; data-parallel convolutions with
                tensor-parallel fully connected layers.

`pplab.tensor_parallel.ColumnParallelLinear` and the other names of layers.py are here too.
"""
from .layers import (ColumnParallelLinear, CopyToParallel, GatherFromParallel, GatherFromSequenceParallel,
                     ReduceFromParallel, ReduceScatterToSequenceParallel, RowParallelLinear, SplitToParallel,
                     copy_to_parallel, gather_from_parallel, gather_from_sequence_parallel, my_range,
                     reduce_from_parallel, reduce_scatter_to_sequence_parallel, split_sizes, split_to_parallel)
