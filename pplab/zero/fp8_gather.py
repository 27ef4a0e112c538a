"""Chapter 11b: FSDP (ZeRO-3) whose parameter all-gathers carry FP8, as in torchao's float8 FSDP2.

FullyShardedModule with compute_dtype=torch.bfloat16 casts my fp32 master shard to bf16 before each
all-gather: 2 bytes a number on the wire. A model whose matmuls run in FP8 anyway (pplab.fp8) would
cast the gathered weights to FP8 right after; casting *before* the gather sends 1 byte a number:

    fsdp = Fp8GatherFSDP(model, compute_dtype=torch.bfloat16)      # fp8=False: plain bf16 gathers
    loss_fn(fsdp(x), y).backward()

Each rank quantises its own flat shard in 1 × `block` tiles (e4m3, one fp32 scale per tile,
DeepSeek-V3's activation tiling applied to the flat shard), all-gathers the fp8 bytes and the
scales (two traced all-gathers, started together, prefetched like FSDP's), and every rank, the
owner too, dequantises into the compute dtype: all ranks compute with the same weights. torchao
instead uses one scale per parameter, agreed by one all-reduce of the amaxes after each optimizer
step; tiles need no extra collective, for 4 bytes per `block` numbers. The masters stay fp32 and exact, and
the gradients are reduce-scattered as in FullyShardedModule (bf16 here: FP8 gradients would
need loss-scale-like care this chapter does not take).

Bytes per gather and rank, shards of s numbers: bf16 2s; fp8 s + 4⌈s/block⌉ (`gather_bytes`).
"""
from __future__ import annotations

import math

import torch

from ..data_parallel.ddp import end_trace_when_done
from ..fp8 import dequantise_tiles, fp8_format, quantise_tiles
from ..runtime import comm
from .fully_sharded import FullyShardedModule

SCALE_BYTES = 4                 # one fp32 scale per tile


def gather_bytes(shard_numel: int, fp8: bool = True, element_size: int = 2, block: int = 128) -> int:
    """Bytes one rank hands one all-gather of its shard: fp8 numbers plus fp32 scales, or
    `element_size` bytes a number (2: bf16) without fp8. Each rank of a ring sends (p-1)× this."""
    if fp8:
        return shard_numel + SCALE_BYTES * math.ceil(shard_numel / block)
    return shard_numel * element_size


class Fp8GatherFSDP(FullyShardedModule):
    """ZeRO-3 whose all-gathers send fp8 (e4m3) in 1×block tiles; fp8=False: FullyShardedModule's own.
    compute_dtype: what forward and backward compute in after dequantising (bf16 by default)."""

    def __init__(self, module, fp8: bool = True, block: int = 128, fmt="e4m3", units=None,
                 compute_dtype=torch.bfloat16):
        if isinstance(block, bool) or not isinstance(block, int) or block < 1:
            raise ValueError(f"block must be a whole number of elements >= 1, got {block!r}")
        self.fp8_format = fp8_format(fmt)
        super().__init__(module, units=units, compute_dtype=compute_dtype)
        self.fp8, self.block = bool(fp8), block

    def _gather(self, u) -> None:
        if not self.fp8 or u.state != "free":
            return super()._gather(u)
        if self.shard_store is not None:
            raise RuntimeError("Fp8GatherFSDP keeps its shards in RAM: shard_store is not supported")
        self._allocate(u)
        q, scales = quantise_tiles(u.shard.detach().view(1, -1), (1, self.block), self.fp8_format)
        u.fp8_q = torch.empty(self.world_size * q.numel(), dtype=torch.uint8)     # gloo sends bytes
        u.fp8_scales = torch.empty(self.world_size * scales.numel())
        handles = [comm.all_gather_into_tensor(u.fp8_q, q.view(torch.uint8).reshape(-1), group=self.group,
                                               async_op=True),
                   comm.all_gather_into_tensor(u.fp8_scales, scales.reshape(-1), group=self.group, async_op=True)]
        for h, what in zip(handles, ("fp8", "scales")):
            h.event.label, h.event.meta["unit"] = f"AG{u.index} ({what})", u.name
            end_trace_when_done(h)
        u.handle, u.fp8_handles = handles[0], handles
        u.state = "gathering"

    def _wait(self, u) -> None:
        if self.fp8 and u.state == "gathering" and getattr(u, "fp8_handles", None):
            for h in u.fp8_handles:
                h.wait()
            qs, scales = u.fp8_q.view(self.world_size, -1), u.fp8_scales.view(self.world_size, -1)
            pieces = [dequantise_tiles(q.view(self.fp8_format.dtype).view(1, -1), sc.view(1, -1), (1, self.block))
                      for q, sc in zip(qs, scales)]
            u.full.copy_(torch.cat(pieces, dim=1).view(-1).to(u.full.dtype))
            u.fp8_handles = u.fp8_q = u.fp8_scales = None
            u.state = "full"
            return
        super()._wait(u)
