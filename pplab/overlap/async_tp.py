"""Tensor parallelism's all-gather cut into chunks that hide under the partial matmuls.

A column-parallel linear layer after a sequence-parallel region (chapter 3's Megatron SP): each
of p ranks holds `rows[r]` rows of the sequence, x_r, and the columns of the weight that give its
slice of the output features. The output slice needs *every* row:

    y = all_gather(x_r) @ W_r.T                              # gather_then_matmul: wait, then compute

The gather's bytes are on the critical path: nothing can be multiplied until the last row came.
The collective matmul (Wang et al., "Overlap communication with dependent computation via
decomposition", 2023; PyTorch's async TP) cuts the gather into its p ring steps: at step k a rank
multiplies the chunk it holds (its own first, then those passed round the ring) while the next
chunk is already on its way:

    chunk = x_r
    for k in range(p):
        post isend(chunk -> r+1), irecv(next chunk <- r-1)     # in flight ...
        y[rows of chunk's owner] = chunk @ W_r.T              # ... while this computes
        wait

Each rank sends p - 1 chunks, every chunk but the one of rank r+1: the same bytes as a ring
all-gather, only hidden. `row_time` pads each partial matmul to a stand-in accelerator's time
(seconds per row of x) so that a 2-core CPU shows what a GPU would: see hidden.py.
"""
from __future__ import annotations

import torch

from ..runtime import comm
from .hidden import stand_in_span


def _check(x_shard, weight, rows):
    p, me = comm.world_size(), comm.rank()
    rows = list(rows)
    if len(rows) != p or any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in rows):
        raise ValueError(f"rows must list how many sequence rows each of the {p} ranks holds (ints >= 0), "
                         f"got {rows!r}")
    if x_shard.dim() != 2 or x_shard.shape[0] != rows[me]:
        raise ValueError(f"rank {me}'s x_shard is {list(x_shard.shape)}: it must be [rows[{me}]={rows[me]}, hidden]")
    if weight.dim() != 2 or weight.shape[1] != x_shard.shape[1]:
        raise ValueError(f"weight is {list(weight.shape)}: it must be [this rank's output features, "
                         f"hidden={x_shard.shape[1]}] (a Linear's weight, split by its rows)")
    return p, me, rows


def gather_then_matmul(x_shard, weight, rows, row_time: float = 0.0, group=None) -> torch.Tensor:
    """All-gather the sequence (padded to equal chunks for the backend), then one matmul."""
    p, me, rows = _check(x_shard, weight, rows)
    most = max(rows)
    padded = torch.zeros(most, x_shard.shape[1], dtype=x_shard.dtype)
    padded[:rows[me]] = x_shard
    everyone = torch.empty(p * most, x_shard.shape[1], dtype=x_shard.dtype)
    comm.all_gather_into_tensor(everyone, padded, group=group)
    full = torch.cat([everyone[r * most:r * most + rows[r]] for r in range(p)])
    with stand_in_span("mm", row_time * full.shape[0], label="x@W"):
        return full @ weight.T


def collective_matmul(x_shard, weight, rows, row_time: float = 0.0) -> torch.Tensor:
    """The same y, the gather cut into ring steps that run while the previous chunk is multiplied."""
    p, me, rows = _check(x_shard, weight, rows)
    starts = [sum(rows[:r]) for r in range(p)]
    y = torch.empty(sum(rows), weight.shape[0], dtype=torch.result_type(x_shard, weight))
    nxt, prev = (me + 1) % p, (me - 1) % p
    chunk = x_shard.contiguous()
    for k in range(p):
        owner = (me - k) % p                              # whose rows this rank holds at step k
        handles = []
        if k < p - 1:                                     # the chunk after this one, already travelling
            incoming = torch.empty(rows[(owner - 1) % p], x_shard.shape[1], dtype=x_shard.dtype)
            if chunk.numel():
                handles.append(comm.isend(chunk, nxt))
            if incoming.numel():
                handles.append(comm.irecv(incoming, prev))
        with stand_in_span("mm", row_time * rows[owner], label=f"x{owner}@W"):
            y[starts[owner]:starts[owner] + rows[owner]] = chunk @ weight.T
        for h in handles:
            h.wait()
        if k < p - 1:
            chunk = incoming
    return y
