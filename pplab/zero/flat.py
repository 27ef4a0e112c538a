"""One flat buffer for a group of parameters, cut into N equal shards: the unit of all ZeRO stages.

    bucket = FlatBucket(params, world_size=3, rank=1)
    full = bucket.flatten([p.detach() for p in params])   # the parameters end to end, zero-padded
    mine = bucket.shard(full)                              # rank 1's third (a view)

The flat length is rounded up to a multiple of N (`padded`), so that every rank owns
exactly `shard_size` elements and reduce-scatter / all-gather move N equal pieces. The
padding is at most N-1 elements per bucket; it stays 0 through training (its gradient is
0, and AdamW maps a zero parameter with a zero gradient to 0).
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ..runtime import comm


class FlatBucket:
    """Parameters laid end to end, zero-padded to a multiple of `world_size`, owned shard by shard."""

    def __init__(self, params, world_size: int, rank: int, names=None):
        self.params = list(params)
        self.names = list(names) if names is not None else [str(i) for i in range(len(self.params))]
        self.world_size, self.rank = world_size, rank
        self.numel = sum(p.numel() for p in self.params)
        self.shard_size = math.ceil(self.numel / world_size)
        self.padded = self.shard_size * world_size
        self.dtype, self.device = self.params[0].dtype, self.params[0].device
        self.shapes = [p.shape for p in self.params]  # kept: ZeRO-3 empties the parameters between uses
        self.offsets = [0]
        for p in self.params:
            self.offsets.append(self.offsets[-1] + p.numel())

    def flatten(self, tensors, dtype=None) -> torch.Tensor:
        """A new padded flat buffer holding `tensors` (one per parameter, same shapes) end to end."""
        flat = torch.zeros(self.padded, dtype=dtype or self.dtype, device=self.device)
        for t, a, b in zip(tensors, self.offsets, self.offsets[1:]):
            flat[a:b].copy_(t.reshape(-1))
        return flat

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Each parameter's piece of a full flat buffer, shaped like the parameter (views, no copy)."""
        return [flat[a:b].view(shape) for shape, a, b in zip(self.shapes, self.offsets, self.offsets[1:])]

    def shard(self, flat: torch.Tensor, rank: int | None = None) -> torch.Tensor:
        """Rank `rank`'s (default: this rank's) equal piece of a full flat buffer (a view)."""
        r = self.rank if rank is None else rank
        return flat[r * self.shard_size:(r + 1) * self.shard_size]

    def shard_views(self, shard: torch.Tensor) -> list[torch.Tensor]:
        """Each parameter's part of my shard (1-D views, in order): the elements of the parameter that
        fall in my piece of the flat buffer; empty for a parameter that lies wholly in other ranks' pieces."""
        start = self.rank * self.shard_size
        clip = lambda i: min(max(i - start, 0), self.shard_size)        # a flat offset -> into my shard
        return [shard[clip(a):clip(b)] for a, b in zip(self.offsets, self.offsets[1:])]

    def point_params_into(self, flat: torch.Tensor) -> None:
        """Make every parameter a view into `flat`: updating or gathering `flat` updates the model."""
        for p, v in zip(self.params, self.views(flat)):
            p.data = v


class _SumOnWait:
    """The handle of a reduce-scatter built from an all-to-all: wait() also adds the pieces up."""

    def __init__(self, handle, pieces, out, world_size):
        self.work, self.event, self._h = handle.work, handle.event, handle
        self._pieces, self._out, self._n = pieces, out, world_size

    def wait(self) -> None:
        self._h.wait()
        torch.sum(self._pieces.view(self._n, -1), dim=0, out=self._out)


def reduce_scatter(out: torch.Tensor, full: torch.Tensor, group=None):
    """Start out = my piece of the sum over ranks of `full` (async); returns a handle with wait().

    NCCL has a real reduce-scatter. gloo's reduce_scatter_tensor is an all-reduce of everything
    followed by keeping one piece (pytorch#118911): twice the bytes, and about 5x the time of an
    all-reduce on this machine. So on gloo we build it from one all-to-all: rank r sends piece j to
    rank j, receives everyone's piece r and adds them up. That sends (N-1)/N of the data per
    rank, exactly like a ring reduce-scatter; the trace shows it as a "reduce_scatter".
    """
    if dist.get_backend(group) != "gloo":
        return comm.reduce_scatter_tensor(out, full, group=group, async_op=True)
    pieces = torch.empty_like(full)
    h = comm.all_to_all_single(pieces, full, group=group, async_op=True)
    h.event.kind = "reduce_scatter"
    h.event.meta.setdefault("via", "all_to_all")        # "p2p" under pplab.cluster.two_tier: its sends are traced
    return _SumOnWait(h, pieces, out, comm.world_size(group))
