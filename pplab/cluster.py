"""Chapter 10: a network with two tiers, emulated for real on one machine.

A GPU cluster is nodes of a few GPUs each. Inside a node the GPUs talk over fast links (NVLink);
between nodes, over a network several times slower (InfiniBand, Ethernet). Here the ranks of a
launch are grouped into nodes, and every point-to-point message from one node to another is held
back to a bandwidth and latency of your choice:

    c = Cluster(n_nodes=2, ranks_per_node=2)            # ranks 0,1 on node 0; ranks 2,3 on node 1
    with two_tier(c, bandwidth=20e6, latency=1e-3):     # inside fn, on every rank
        hierarchical_all_reduce(x, c)                   # vs collectives.all_reduce(x): flat ring
    cross_node_bytes(results.timeline, c)               # bytes that crossed between nodes, from the trace

`two_tier` wraps `pplab.comm.send` / `isend` while it is open: a message of n bytes to a rank on
another node is held back latency + n / bandwidth seconds before the real (much faster) transfer
starts, so it arrives no sooner than that network would deliver it; one rank's messages to other
nodes queue on its one network link. Messages
inside a node are untouched. The collectives of chapter 1 are built from those sends, so they
run on the emulated network as they are. The collectives that pplab.comm hands to the backend
(what FullyShardedModule uses) are run, inside the block, as pplab.collectives' own algorithms,
so that their bytes cross the emulated network too and are in the trace.

    hierarchical_all_reduce(t, c)     reduce-scatter in the node, all-reduce across, all-gather in the node
    hsdp_average_gradients(fsdp, c)   HSDP's extra step: the shards' gradients averaged across nodes
    predict_all_reduce(...)           the α-β time of flat and hierarchical all-reduce, two (α, β) pairs

A layout laid onto the nodes (which ranks form each group of a dp × tp × pp mesh, how many nodes
each spans, how many bytes each dimension sends between nodes per step), and the rule that
places the chattiest dimension inside a node:

    p = place(Cluster(2, 2), dp=2, tp=2, order=("dp", "tp"))   # tp innermost: each tp pair in one node
    p.groups("tp"), p.nodes_spanned("tp")                       # [[0, 1], [2, 3]], [1, 1]
    p.cross_node_bytes({"tp": 9e6, "dp": 2e5})                  # bytes each dimension sends between nodes
    placement_rule({"tp": 9e6, "dp": 2e5})                      # ("dp", "tp"): most traffic innermost
"""
from __future__ import annotations

import contextlib
import itertools
import math
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import collectives, mesh, trace
from .runtime import comm
from .trace import Event, now


@dataclass(frozen=True)
class Cluster:
    """n_nodes × ranks_per_node ranks; rank r sits on node r // ranks_per_node (node-major, as torchrun numbers them)."""

    n_nodes: int
    ranks_per_node: int

    def __post_init__(self):
        for name in ("n_nodes", "ranks_per_node"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a whole number >= 1, got {v!r}")

    @property
    def world_size(self) -> int:
        return self.n_nodes * self.ranks_per_node

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def node_ranks(self, node: int) -> list[int]:
        """The ranks on `node`: the group that shards (HSDP) or reduce-scatters (hierarchical all-reduce)."""
        return list(range(node * self.ranks_per_node, (node + 1) * self.ranks_per_node))

    def rail_ranks(self, local: int) -> list[int]:
        """The `local`-th rank of every node: one per node, the group that talks across nodes."""
        return [node * self.ranks_per_node + local for node in range(self.n_nodes)]

    def crosses(self, src: int, dst: int) -> bool:
        return self.node_of(src) != self.node_of(dst)

    def groups(self):
        """(my node's group, my rail's group), made once per process; every rank must call it.

        dist.new_group must be called by every rank for every group, in the same order,
        even for the groups it is not in: that is why all of them are made here at once.
        """
        if dist.get_world_size() != self.world_size:
            raise ValueError(f"this cluster has {self.n_nodes} nodes × {self.ranks_per_node} ranks = "
                             f"{self.world_size} ranks, but the launch has {dist.get_world_size()}: "
                             f"launch with world_size={self.world_size}")
        if self not in _groups:
            nodes = [dist.new_group(self.node_ranks(n)) for n in range(self.n_nodes)]
            rails = [dist.new_group(self.rail_ranks(i)) for i in range(self.ranks_per_node)]
            me = dist.get_rank()
            _groups[self] = (nodes[self.node_of(me)], rails[me % self.ranks_per_node])
        return _groups[self]


_groups: dict = {}


# ----------------------------------------------------------------------------------
# The emulated network: slow messages between nodes


class _Link:
    """This rank's one link out of its node: the time it is free again."""
    free_at = 0.0


def _throttled_isend(cluster, bandwidth, latency, isend):
    def send_to(tensor, dst, group=None, tag=0):
        if not cluster.crosses(dist.get_rank(), dst):
            return isend(tensor, dst, group, tag)
        start = now()
        on_wire = max(start, _Link.free_at)        # this rank's earlier messages out are still on the link
        _Link.free_at = on_wire + tensor.numel() * tensor.element_size() / bandwidth
        left = _Link.free_at + latency - now()
        if left > 0:
            time.sleep(left)                       # the data leaves when the modelled link would deliver it
        handle = isend(tensor, dst, group, tag)
        handle.event.start = start                 # the swimlane's box covers the modelled wire time
        handle.event.meta["cross_node"] = True
        return handle
    return send_to


def _done(kind, tensor, group, start, async_op):
    """The trace box and (for async_op) an already finished handle of a collective run over p2p."""
    event = trace.record(Event(dist.get_rank(), kind, "comm", start, now(), kind, group=comm.group_ranks(group),
                               meta={"payload": tensor.numel() * tensor.element_size(), "via": "p2p"}))
    return comm.Handle(None, event) if async_op else None


def _over_p2p(kind, run):
    def call(*args, group=None, async_op=False, **kwargs):
        start = now()
        run(*args, group=group, **kwargs)
        return _done(kind, args[1] if kind != "all_reduce" else args[0], group, start, async_op)
    return call


@contextlib.contextmanager
def two_tier(cluster: Cluster, bandwidth: float, latency: float = 0.0):
    """Inside this block, this rank's messages to other nodes take >= latency + n / bandwidth seconds.

    bandwidth in bytes per second (math.inf: count only), latency in seconds. Every rank of
    the launch should enter it. The backend's collectives (comm.all_reduce, all_gather,
    all_gather_into_tensor, reduce_scatter_tensor, all_to_all_single) run as pplab.collectives' ring and pairwise
    algorithms meanwhile, so that they too send through the emulated network; they finish before
    returning (an async_op=True call gets a handle already done), so a prefetch does not overlap.
    """
    if not (isinstance(bandwidth, (int, float)) and bandwidth > 0):
        raise ValueError(f"bandwidth is bytes per second > 0 (math.inf to count only), got {bandwidth!r}")
    if not (isinstance(latency, (int, float)) and 0 <= latency < math.inf):
        raise ValueError(f"latency is seconds >= 0, got {latency!r}")
    if not dist.is_initialized() or dist.get_world_size() != cluster.world_size:
        raise ValueError(f"two_tier needs a launch of {cluster.world_size} ranks ({cluster.n_nodes} nodes × "
                         f"{cluster.ranks_per_node}): call it inside fn of pplab.launch(fn, "
                         f"world_size={cluster.world_size})")
    isend = _throttled_isend(cluster, bandwidth, latency, comm.isend)
    replaced = {
        "isend": isend,
        "send": lambda tensor, dst, group=None, tag=0: isend(tensor, dst, group, tag).wait(),
        "all_reduce": _over_p2p("all_reduce", lambda t, op="sum", group=None:
                                collectives.all_reduce(t, op=op, group=group)),
        "all_gather_into_tensor": _over_p2p("all_gather", collectives.all_gather_into_tensor),
        "all_gather": _over_p2p("all_gather", collectives.all_gather),     # DDP's count of samples
        "reduce_scatter_tensor": _over_p2p("reduce_scatter", collectives.reduce_scatter_tensor),
        "all_to_all_single": _over_p2p("all_to_all", collectives.all_to_all_single),
    }
    before = {name: getattr(comm, name) for name in replaced}
    _Link.free_at = 0.0
    try:
        for name, fn in replaced.items():
            setattr(comm, name, fn)
        yield cluster
    finally:
        for name, fn in before.items():
            setattr(comm, name, fn)


def cross_node_bytes(timeline, cluster: Cluster, rank: int | None = None) -> int:
    """Bytes sent from one node to another in `timeline` (by `rank`, or by all), read from its send events."""
    return sum(e.bytes_sent for e in timeline.select(rank, "comm", "send")
               if e.peer is not None and cluster.crosses(e.rank, e.peer))


# ----------------------------------------------------------------------------------
# Hierarchical all-reduce and HSDP


@torch.no_grad()
def hierarchical_all_reduce(tensor: torch.Tensor, cluster: Cluster, op: str = "sum") -> None:
    """All-reduce `tensor` in place in three steps (NCCL's tree of rings, Horovod's hierarchical mode):

    1. reduce-scatter inside the node: local rank i holds piece i of the node's sum;
    2. all-reduce piece i across nodes, among the i-th ranks of every node (a ring);
    3. all-gather inside the node: every rank has the whole result.

    Only step 2 crosses nodes, and it moves 1/ranks_per_node of the tensor.
    """
    node, rail = cluster.groups()
    r = cluster.ranks_per_node
    flat = tensor.reshape(-1)
    padded = torch.zeros(math.ceil(flat.numel() / r) * r, dtype=flat.dtype)
    padded[:flat.numel()] = flat                  # every local rank gets an equal piece
    piece = torch.empty(padded.numel() // r, dtype=flat.dtype)
    collectives.reduce_scatter_tensor(piece, padded, op=op, group=node)
    collectives.all_reduce(piece, op=op, group=rail)
    collectives.all_gather_into_tensor(padded, piece, group=node)
    tensor.copy_(padded[:flat.numel()].view_as(tensor))


@torch.no_grad()
def hsdp_average_gradients(fsdp, cluster: Cluster) -> None:
    """HSDP: after backward, average each shard's gradient with the same shard on the other nodes.

    `fsdp` is a FullyShardedModule over my node's group: it reduce-scattered the gradients
    inside the node and divided by ranks_per_node. The i-th rank of every node holds the same
    shard, so an all-reduce among them (my rail) and a division by n_nodes give the mean over all ranks.
    """
    _, rail = cluster.groups()
    for shard in fsdp.parameters():
        collectives.all_reduce(shard.grad, group=rail)
        shard.grad.div_(cluster.n_nodes)


def time_all_reduces(cluster: Cluster, numel: int, bandwidth: float, latency: float, repeats: int = 5) -> dict:
    """On every rank (inside pplab.launch): seconds of each flat and hierarchical all-reduce of
    `numel` float32 on the emulated network, {"flat": [...], "hierarchical": [...]}.

    The two take turns, the first of a pair alternating, so that a change in the machine's load
    hits both alike; a barrier starts each. The call checks are off (collectives.unchecked):
    they are a round trip of their own. A run's time is its slowest rank's: take the max over ranks.
    """
    cluster.groups()
    torch.manual_seed(dist.get_rank())
    x = torch.randn(numel)
    runs = {"flat": lambda t: collectives.all_reduce(t), "hierarchical": lambda t: hierarchical_all_reduce(t, cluster)}
    times = {name: [] for name in runs}
    with collectives.unchecked(), two_tier(cluster, bandwidth, latency):
        for i in range(repeats + 1):                # the first pair warms up and is dropped
            for name in (list(runs) if i % 2 else list(runs)[::-1]):
                t = x.clone()
                dist.barrier()
                start = now()
                runs[name](t)
                if i:
                    times[name].append(now() - start)
    return times


# ----------------------------------------------------------------------------------
# The cost model with two tiers


def predict_all_reduce(nbytes: float, cluster: Cluster, intra: tuple, inter: tuple,
                       algorithm: str = "flat") -> float:
    """Seconds for a ring all-reduce of `nbytes` by the α-β model, with (α, β) = intra inside a node
    and inter between nodes (α in s, β in s per byte).

    flat: one ring over all p ranks. Each of its 2(p-1) steps sends N/p on every link at once,
    so with more than one node every step waits for a link between nodes:
        2(p-1) (α_inter + N/p β_inter)
    hierarchical (r ranks per node, n nodes):
        (r-1)(α_intra + N/r β_intra)           reduce-scatter in the node
      + 2(n-1)(α_inter + N/(r n) β_inter)      ring all-reduce of my 1/r piece across nodes
      + (r-1)(α_intra + N/r β_intra)           all-gather in the node
    """
    if algorithm not in ("flat", "hierarchical"):
        raise ValueError(f"algorithm must be 'flat' or 'hierarchical', got {algorithm!r}")
    (a_in, b_in), (a_x, b_x) = intra, inter
    p, r, n = cluster.world_size, cluster.ranks_per_node, cluster.n_nodes
    if algorithm == "flat":
        a, b = (a_x, b_x) if n > 1 else (a_in, b_in)
        return 2 * (p - 1) * (a + nbytes / p * b)
    in_node = 2 * (r - 1) * (a_in + nbytes / r * b_in)
    across = 2 * (n - 1) * (a_x + nbytes / (r * n) * b_x)
    return in_node + across


# ----------------------------------------------------------------------------------
# A mesh laid onto the nodes: which ranks each group holds, and what crosses between nodes

# How each dimension's ranks talk, and so which messages a group sends (pplab's algorithms):
#   ring        tp's and dp's all-reduces, cp's ring attention: each rank sends to the next in the group
#   all_to_all  ep's dispatch and combine: each rank sends an equal piece to every other
#   chain       pp: each stage sends its activations to the next stage, which sends gradients back
PATTERN = {"tp": "ring", "cp": "ring", "dp": "ring", "ep": "all_to_all", "pp": "chain"}


class PlacementError(ValueError):
    """This layout cannot be laid onto this cluster; the message says what to change."""


@dataclass(frozen=True)
class Placement:
    """A mesh of `sizes` numbered along `order` (outermost first) on `cluster`'s nodes: global
    rank r is the r-th point of the grid and sits on node r // ranks_per_node. Make one with place()."""

    cluster: Cluster
    sizes: tuple                 # ((dim, size), ...) for every dim of mesh.DIMS
    order: tuple                 # every dim of mesh.DIMS, outermost first

    def groups(self, dim: str) -> list[list[int]]:
        """Every group along `dim`, each in order along it (the ring's order, the pipeline's stages)."""
        return mesh.groups(dim, order=self.order, **dict(self.sizes))

    def nodes_spanned(self, dim: str) -> list[int]:
        """How many nodes each group along `dim` touches (1: it stays inside one node)."""
        return [len({self.cluster.node_of(r) for r in g}) for g in self.groups(dim)]

    def links(self, dim: str) -> list[tuple[int, int, float]]:
        """(src, dst, share) of every message `dim`'s groups send: share is the part of what one
        rank sends per step along `dim` that goes from src to dst (see PATTERN)."""
        out = []
        for g in self.groups(dim):
            n = len(g)
            if n == 1:
                continue
            if PATTERN[dim] == "ring":
                out += [(g[i], g[(i + 1) % n], 1.0) for i in range(n)]
            elif PATTERN[dim] == "all_to_all":
                out += [(a, b, 1 / (n - 1)) for a in g for b in g if a != b]
            else:                                   # chain: activations forward, gradients back
                out += [(a, b, 1.0) for a, b in zip(g, g[1:])] + [(b, a, 1.0) for a, b in zip(g, g[1:])]
        return out

    def cross_node_bytes(self, traffic: dict) -> dict:
        """{dim: bytes sent from one node to another per step, all ranks} for `traffic`, {dim: bytes
        one rank sends per step along dim}: for ring dims what it sends to the next rank (an all-reduce
        of N bytes over g ranks: 2(g-1)/g·N), for ep its all-to-all's input less its own piece, for pp
        what a stage sends to the next one (the same comes back as gradients)."""
        unknown = set(traffic) - set(PATTERN)
        if unknown:
            raise PlacementError(f"traffic names {sorted(unknown)}: the dimensions are {', '.join(PATTERN)}")
        return {dim: sum(share * nbytes for src, dst, share in self.links(dim) if self.cluster.crosses(src, dst))
                for dim, nbytes in traffic.items()}

    def dim_between(self, src: int, dst: int) -> str | None:
        """The dimension along which two ranks differ, if it is the only one (else None)."""
        g = mesh.grid(self.order, **dict(self.sizes))
        a, b = ((g == r).nonzero()[0].tolist() for r in (src, dst))
        differ = [d for d, x, y in zip(mesh.DIMS, a, b) if x != y]
        return differ[0] if len(differ) == 1 else None

    def measured_cross_node_bytes(self, timeline) -> dict:
        """{dim: bytes sent between nodes} read from `timeline`'s send events, each put on the
        dimension along which its two ranks differ ('other' if more than one)."""
        out = {}
        for e in timeline.select(None, "comm", "send"):
            if e.peer is not None and self.cluster.crosses(e.rank, e.peer):
                dim = self.dim_between(e.rank, e.peer) or "other"
                out[dim] = out.get(dim, 0) + e.bytes_sent
        return out

    def table(self, traffic: dict) -> str:
        """One line per dimension: its groups, the nodes each spans, the bytes it sends between nodes."""
        crossed = self.cross_node_bytes(traffic)
        used = [d for d in self.order if dict(self.sizes)[d] > 1]
        lines = [f"order {' > '.join(used)} (outermost first) on {self.cluster.n_nodes} nodes × "
                 f"{self.cluster.ranks_per_node} ranks"]
        for d in used:
            lines.append(f"  {d}: groups {self.groups(d)}, nodes spanned {self.nodes_spanned(d)}, "
                         f"{crossed.get(d, 0):,.0f} B between nodes per step")
        return "\n".join(lines)


def place(cluster: Cluster, order=None, **sizes) -> Placement:
    """Lay a mesh of `sizes` (dp=, tp=, pp=, cp=, ep=) onto `cluster`, its ranks numbered along
    `order` (outermost first; default pplab.mesh.DIMS, tp innermost). Refuses sizes that do not
    fill the cluster, and an order that leaves out a dimension larger than one."""
    if not isinstance(cluster, Cluster):
        raise PlacementError(f"place lays a mesh onto a Cluster(n_nodes, ranks_per_node), got {cluster!r}")
    try:
        full = mesh.full_sizes(sizes)
        order = mesh.full_order(order, full)
    except ValueError as err:
        raise PlacementError(str(err)) from None
    product = math.prod(full.values())
    if product != cluster.world_size:
        named = [d for d in mesh.DIMS if full[d] > 1] or ["dp"]
        raise PlacementError(f"{'·'.join(named)} = {'·'.join(str(full[d]) for d in named)} = {product} ranks, but the "
                             f"cluster has {cluster.n_nodes} nodes × {cluster.ranks_per_node} = {cluster.world_size}: "
                             f"choose sizes whose product is {cluster.world_size}")
    return Placement(cluster, tuple(full.items()), order)


def placement_rule(traffic: dict) -> tuple:
    """The order (outermost first) that puts the dimension with the most traffic per step innermost,
    where its groups are most likely to fit in a node, and the one with the least outermost, where
    its groups span nodes. Ties keep mesh.DIMS's order. traffic: {dim: bytes one rank sends per step}."""
    unknown = set(traffic) - set(mesh.DIMS)
    if unknown:
        raise PlacementError(f"traffic names {sorted(unknown)}: the dimensions are {', '.join(mesh.DIMS)}")
    return tuple(sorted(traffic, key=lambda d: (traffic[d], mesh.DIMS.index(d))))


def orders(**sizes) -> list[tuple]:
    """Every order (outermost first) of the dimensions larger than one: the placements to compare."""
    used = [d for d in mesh.DIMS if mesh.full_sizes(sizes)[d] > 1]
    return list(itertools.permutations(used))


def crossing_time(collective: str, p: int, nbytes: float, inter: tuple) -> float:
    """What the slow tier adds to a ring collective of `nbytes` over p ranks whose ring crosses
    between nodes: every one of its steps waits for a message on a link between nodes,
    (α, β) = inter. all_reduce: 2(p-1)(α + N/p β), predict_all_reduce's flat ring; all_gather and
    reduce_scatter (N the whole tensor): (p-1)(α + N/p β); broadcast (one message, a pipeline hop):
    α + Nβ. On this machine the emulated link holds a message back before the real transfer,
    so this time comes on top of what the transfer costs inside a node."""
    a, b = inter
    steps = {"all_reduce": 2 * (p - 1), "all_gather": p - 1, "reduce_scatter": p - 1}
    if collective == "broadcast":
        return a + nbytes * b
    if collective not in steps:
        raise ValueError(f"collective must be one of all_reduce, all_gather, reduce_scatter, broadcast; got {collective!r}")
    return steps[collective] * (a + nbytes / p * b) if p > 1 else 0.0
