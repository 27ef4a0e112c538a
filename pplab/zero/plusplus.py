"""Chapter 10c: ZeRO++, ZeRO-3 that sends less between nodes (Wang et al. 2023).

ZeRO-3 (fully_sharded.py) moves every parameter three times per step: an all-gather before a
unit's forward, another before its backward, and a reduce-scatter of its gradient. On a cluster
most of those bytes cross the slow network between nodes. ZeRO++ adds three ideas, each one a
switch here so that its effect can be seen alone:

    zpp = ZeroPlusPlus(model, cluster, qwz=True, hpz=True, qgz=True)
    loss_fn(zpp(x), y).backward()
    opt.step()                       # opt over zpp.parameters(): the fp32 master shards, as in ZeRO-3

* **qwZ**, quantised weights: the forward's all-gather sends my shard as int8, one fp32 scale per
  block of `block` numbers (block-wise symmetric quantisation), and every rank dequantises what
  it receives. 1 byte a parameter (+4/block) instead of 2 (bf16) or 4 (fp32). The master shard
  stays exact; only what forward and backward compute with is rounded.
* **hpZ**, a hierarchical secondary partition: after a unit's forward each rank keeps 1/r of the
  gathered unit (r = ranks per node), so that the node as a whole holds all of it. The backward's
  all-gather then runs among the ranks of my node only: nothing crosses nodes. It costs memory:
  Ψ/r per rank more than ZeRO-3's Ψ/p, until the unit's backward.
* **qgZ**, quantised gradients: the reduce-scatter becomes a hierarchical all-to-all of int4
  (or int8) gradients. Hop 1, inside the node: each rank sends every local rank the gradient
  pieces that rank will own on every node, quantised; each rank dequantises and sums its node's
  part. Hop 2, across nodes on my rail: the node's partial sums, quantised again, go to the rank
  that owns them. One quantisation per hop (a ring would quantise p-1 times), and only the
  node's sum, not every rank's gradient, crosses the network.

Gradients go as int4 by default (grad_bits=4), as in the paper: half a byte, 4× less than bf16,
and the quarter of the model's bytes in its 3M → 0.75M count. Its step is 127/7 ≈ 18× int8's, but
each number is rounded only twice (once per hop) and summed in fp32 in between, which keeps the
error within a bound the tests check step by step; grad_bits=8 buys 18× finer steps for 2× the bytes.

All messages go through pplab.collectives (rings and pairwise all-to-all built from traced
p2p sends), so under cluster.two_tier they are throttled, and cluster.cross_node_bytes reads
them from the trace. `predict_cross_node_bytes` gives what the formulas say they must be.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from .. import collectives, trace
from ..cluster import Cluster
from ..runtime import comm
from ..trace import Event, now
from .fully_sharded import FullyShardedModule

BLOCK = 128                 # numbers per quantisation block: one fp32 scale each
SCALE_BYTES = 4


# ----------------------------------------------------------------------------------
# Block-wise symmetric quantisation


def _check_bits_block(bits, block):
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, got {bits!r}")
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise ValueError(f"block must be a whole number of elements >= 1, got {block!r}")


def quantize(x: torch.Tensor, bits: int = 8, block: int = BLOCK):
    """x (any shape) -> (q, scales): q int8, x's numel, in [-(2^(bits-1) - 1), 2^(bits-1) - 1];
    scales fp32, one per block of `block` numbers (the last may be short), scale = max|x| / qmax.

    Symmetric (no zero point): 0 stays exactly 0 and a block's largest number is exact.
    Dequantised, every number is within scale / 2 of x: |x - q·scale| <= max|x of its block| / (2 qmax).
    """
    _check_bits_block(bits, block)
    qmax = 2 ** (bits - 1) - 1
    flat = x.detach().reshape(-1).float()
    n = flat.numel()
    blocks = torch.zeros(math.ceil(n / block) * block)
    blocks[:n] = flat
    blocks = blocks.view(-1, block)
    scales = blocks.abs().amax(dim=1) / qmax
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))      # an all-zero block: q = 0
    q = torch.round(blocks / safe[:, None]).clamp_(-qmax, qmax).to(torch.int8)
    return q.reshape(-1)[:n], scales


def dequantize(q: torch.Tensor, scales: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """q (int8, n numbers), scales (one per block) -> fp32 q·scale, n numbers."""
    _check_bits_block(8, block)
    n = q.numel()
    if scales.numel() != math.ceil(n / block):
        raise ValueError(f"{n} numbers in blocks of {block} need {math.ceil(n / block)} scales, got {scales.numel()}")
    per_number = scales.float().repeat_interleave(block)[:n]
    return q.reshape(-1).float() * per_number


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """int8 numbers in [-7, 7] -> uint8, two per byte (first in the low 4 bits); odd n: a 0 appended."""
    u = (q.reshape(-1).to(torch.int16) + 8).to(torch.uint8)          # [-7, 7] -> [1, 15]
    if u.numel() % 2:
        u = torch.cat([u, torch.full((1,), 8, dtype=torch.uint8)])
    return u[0::2] | (u[1::2] << 4)


def unpack_int4(packed: torch.Tensor, n: int) -> torch.Tensor:
    """The inverse of pack_int4: the first n int8 numbers."""
    both = torch.stack([packed & 0x0F, packed >> 4], dim=1).reshape(-1)[:n]
    return both.to(torch.int8) - 8


# ----------------------------------------------------------------------------------
# The two quantised collectives


@torch.no_grad()
def quantised_all_gather(output: torch.Tensor, input: torch.Tensor, block: int = BLOCK, group=None) -> None:
    """qwZ: output = every rank's `input`, concatenated in rank order, each dequantised from int8.

    What travels: two ring all-gathers, of the int8 numbers (1 byte each) and of the fp32 scales.
    Every rank, the owner too, uses the dequantised values, so that all compute with the same weights.
    """
    p = comm.world_size(group)
    if output.numel() != p * input.numel():
        raise ValueError(f"output has {output.numel()} elements, expected {p} x input.numel() = {p * input.numel()}")
    q, scales = quantize(input, 8, block)
    all_q = torch.empty(p * q.numel(), dtype=torch.int8)
    all_scales = torch.empty(p * scales.numel())
    collectives.all_gather_into_tensor(all_q, q, group=group)
    collectives.all_gather_into_tensor(all_scales, scales, group=group)
    pieces = [dequantize(qj, sj, block) for qj, sj in zip(all_q.split(q.numel()), all_scales.split(scales.numel()))]
    output.view(-1).copy_(torch.cat(pieces))


def _quantised_all_to_all(rows: torch.Tensor, bits: int, block: int, group) -> torch.Tensor:
    """Row j of `rows` goes to the j-th rank of `group`, quantised; returns the rows received, dequantised (fp32)."""
    g, m = rows.shape
    quantised = [quantize(row, bits, block) for row in rows]
    q = torch.stack([pack_int4(qj) if bits == 4 else qj for qj, _ in quantised])
    scales = torch.stack([s for _, s in quantised])
    q_in, scales_in = torch.empty_like(q), torch.empty_like(scales)
    collectives.all_to_all_single(q_in, q, group=group)
    collectives.all_to_all_single(scales_in, scales, group=group)
    return torch.stack([dequantize(unpack_int4(qj, m) if bits == 4 else qj, sj, block)
                        for qj, sj in zip(q_in, scales_in)])


@torch.no_grad()
def quantised_reduce_scatter(output: torch.Tensor, input: torch.Tensor, cluster: Cluster,
                             bits: int = 4, block: int = BLOCK) -> None:
    """qgZ: output = my piece (of p equal ones, in rank order) of the sum of every rank's `input`,
    by a hierarchical all-to-all of quantised pieces. Rank k = node a, local rank i (k = a·r + i).

    Reordering: piece k goes first to local rank i of my node (hop 1), then to node a (hop 2).
    So the input, seen as [node a, local i, piece], is sent by local index: local rank i gets
    the n pieces [a, i] for every a, sums the r contributions of its node, and sends piece [a, i]
    of that sum to rank a·r + i on its rail, which adds up the n nodes' sums.
    """
    _check_bits_block(bits, block)
    node, rail = cluster.groups()
    n, r, s = cluster.n_nodes, cluster.ranks_per_node, output.numel()
    if input.numel() != n * r * s:
        raise ValueError(f"input has {input.numel()} elements, expected {n * r} x output.numel() = {n * r * s}")
    by_local = input.reshape(n, r, s).transpose(0, 1).reshape(r, n * s)      # row i: what local rank i sums
    node_sum = _quantised_all_to_all(by_local, bits, block, node).sum(dim=0)  # hop 1, inside the node
    total = _quantised_all_to_all(node_sum.view(n, s), bits, block, rail).sum(dim=0)   # hop 2, across
    output.view(-1).copy_(total)


# ----------------------------------------------------------------------------------
# ZeRO-3 with the three switches


class ZeroPlusPlus(FullyShardedModule):
    """ZeRO-3 over all ranks of `cluster` (the launch's world) with qwZ, hpZ and qgZ switchable.

    All three off: ZeRO-3 with ring all-gathers and a ring reduce-scatter (NCCL's, the paper's
    baseline). grad_bits: 4 (the paper's) or 8. block: numbers per quantisation scale.
    compute_dtype: as FullyShardedModule's (bf16: the paper's fp16 weights and gradients on the wire).
    """

    def __init__(self, module, cluster: Cluster, qwz: bool = True, hpz: bool = True, qgz: bool = True,
                 grad_bits: int = 4, block: int = BLOCK, units=None, compute_dtype=None):
        if not isinstance(cluster, Cluster):
            raise TypeError(f"cluster must be a pplab.cluster.Cluster, got {type(cluster).__name__}")
        _check_bits_block(grad_bits, block)
        node, rail = cluster.groups()                 # checks the launch has cluster.world_size ranks
        super().__init__(module, units=units, compute_dtype=compute_dtype)
        self.cluster, self.node, self.rail = cluster, node, rail
        self.qwz, self.hpz, self.qgz = bool(qwz), bool(hpz), bool(qgz)
        self.grad_bits, self.block = grad_bits, block
        self.local = dist.get_rank() % cluster.ranks_per_node
        self._masters = False                          # True: gather the exact masters (state_dict)
        for u in self.units:
            u.secondary = None                         # hpZ: my 1/r of the unit, between forward and backward

    def _record(self, kind, label, group, start, payload):
        """The swimlane's box for a collective run here; its bytes are in the p2p sends it made."""
        event = trace.record(Event(comm.rank(), kind, "comm", start, now(), label, group=comm.group_ranks(group),
                                   meta={"payload": payload, "via": "p2p"}))
        return comm.Handle(None, event)

    def _gather(self, u) -> None:
        if u.state != "free":
            return
        self._allocate(u)
        start = now()
        # payload: the bytes this rank hands the gather (its piece), as pplab.comm traces a collective
        if self._in_backward and u.secondary is not None:          # hpZ: inside my node only
            payload = u.secondary.numel() * u.secondary.element_size()
            collectives.all_gather_into_tensor(u.full, u.secondary, group=self.node)
            self._drop_secondary(u)
            group, label = self.node, f"AG{u.index} (node)"
        elif self.qwz and not self._masters:                       # qwZ: int8 + scales from everyone
            payload = u.shard.numel() + SCALE_BYTES * math.ceil(u.shard.numel() / self.block)
            quantised_all_gather(u.full, u.shard.detach(), self.block)
            group, label = None, f"AG{u.index} (int8)"
        else:
            payload = u.shard.numel() * u.full.element_size()
            collectives.all_gather_into_tensor(u.full, u.shard.detach().to(u.full.dtype))
            group, label = None, f"AG{u.index}"
        u.handle = self._record("all_gather", label, group, start, payload)
        u.state = "gathering"

    def _after_forward(self, u, out) -> None:
        if self.hpz and torch.is_grad_enabled():                   # keep my node's 1/r until backward
            self._wait(u)
            self._drop_secondary(u)                                # a second forward before backward
            u.secondary = u.full.view(self.cluster.ranks_per_node, -1)[self.local].clone()
            trace.hold(u.secondary.numel() * u.secondary.element_size(), f"secondary {u.name}")
        super()._after_forward(u, out)

    def _reduce_scatter(self, u, out, grads):
        start = now()
        if self.qgz:
            quantised_reduce_scatter(out, grads, self.cluster, self.grad_bits, self.block)
        else:
            collectives.reduce_scatter_tensor(out, grads)
        label = f"RS{u.index}" + (f" (int{self.grad_bits})" if self.qgz else "")
        return self._record("reduce_scatter", label, None, start, grads.numel() * grads.element_size())

    def _end_backward(self) -> None:
        try:
            super()._end_backward()
        finally:
            for u in self.units:                       # a unit whose backward never came
                self._drop_secondary(u)

    def _drop_secondary(self, u) -> None:
        if u.secondary is not None:
            trace.release(u.secondary.numel() * u.secondary.element_size(), f"secondary {u.name}")
            u.secondary = None

    def state_dict(self, *args, **kwargs):
        """The full state from the exact master shards (never the quantised weights), on rank 0."""
        self._masters = True
        try:
            return super().state_dict(*args, **kwargs)
        finally:
            self._masters = False


# ----------------------------------------------------------------------------------
# What the formulas say crosses nodes


def predict_cross_node_bytes(padded_sizes, cluster: Cluster, element_size: int, qwz: bool = True,
                             hpz: bool = True, qgz: bool = True, grad_bits: int = 4, block: int = BLOCK) -> dict:
    """Bytes crossing nodes in one training step of ZeroPlusPlus, summed over all ranks.

    padded_sizes: each unit's padded numel P (p shards of s = P/p), for units gathered per use.
    element_size: bytes per number of the gathers and gradients without quantisation (2: bf16).
    With n nodes of r ranks (p = n·r), per unit:

      ring all-gather over p ranks (numbered node by node): n of its links cross nodes, and each
      carries p-1 shards:                                              n (p-1) × shard bytes
        shard bytes: s·element_size, or with qwZ s + 4·ceil(s/block)  (int8 + fp32 scales)
      forward gather: as above; backward gather: 0 with hpZ (inside the node), else as above
      gradients, ring reduce-scatter: n (p-1) × s·element_size
        qgZ: hop 1 stays in the node; in hop 2 each of p ranks sends n-1 pieces of s numbers
        to the other nodes:  p (n-1) × (ceil(s/2) or s, + 4·ceil(s/block))
    """
    n, r = cluster.n_nodes, cluster.ranks_per_node
    p = n * r
    ring = n * (p - 1) if n > 1 else 0
    out = {"forward_gather": 0, "backward_gather": 0, "gradients": 0}
    for padded in padded_sizes:
        s = padded // p
        scales = SCALE_BYTES * math.ceil(s / block)
        gather = ring * ((s + scales) if qwz else s * element_size)
        out["forward_gather"] += gather
        out["backward_gather"] += 0 if hpz else gather            # hpZ: inside the node
        payload = (math.ceil(s / 2) if grad_bits == 4 else s) + scales
        out["gradients"] += p * (n - 1) * payload if qgz else ring * s * element_size
    out["total"] = sum(out.values())
    return out
