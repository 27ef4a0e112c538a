"""A device mesh: the world's ranks laid out as a grid, one axis per kind of parallelism.

    mesh = Mesh(dp=2, tp=2)                  # inside a launched rank, on a world of 4
    mesh.coords                              # {'pp': 0, 'dp': 1, 'ep': 0, 'cp': 0, 'tp': 0} on rank 2
    mesh.tp_group, mesh.dp_group             # process groups to hand to the chapters' layers (group=)
    print(mesh)                              # which global rank sits where

The grid is `arange(world_size)` reshaped to (pp, dp, ep, cp, tp), outermost first. So tp
varies fastest: the ranks of a tp group are neighbours (on a GPU cluster, the GPUs of one
machine, joined by the fastest links, as tensor parallelism's per-layer all-reduces need),
and pp varies slowest (pipeline stages exchange one activation per micro-batch, the least
traffic, so they can sit on different machines). Megatron-LM orders its groups the same way.

A group of a dimension is the set of ranks whose coordinates agree everywhere except along
that dimension: with dp=2, tp=2 the tp groups are [0, 1] and [2, 3], the dp groups [0, 2]
and [1, 3]. `group("dp", "ep")` spans several dimensions at once (chapter 8 syncs dense
parameters over data × expert ranks).

Another order can be asked for: `Mesh(dp=2, tp=2, order=("tp", "dp"))` numbers the ranks with
dp fastest, so its tp groups are [0, 2] and [1, 3]. Chapter 10 (pplab.cluster.Placement) lays
a mesh onto nodes and compares orders by the bytes each one sends between nodes.

torch has the same idea in `torch.distributed.device_mesh.DeviceMesh`; `init_device_mesh`
with the same sizes and names, in the mesh's order, lays ranks out exactly as this mesh does
(row-major), and `device_mesh()` builds it, so torch's DTensor layers can run on our layout.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

DIMS = ("pp", "dp", "ep", "cp", "tp")        # outermost first: tp ranks are neighbours


def full_sizes(sizes: dict) -> dict:
    """{dim: size} for every one of DIMS, 1 where `sizes` leaves it out; a name or size that is not one says so."""
    unknown = set(sizes) - set(DIMS)
    if unknown:
        raise ValueError(f"unknown mesh dimension(s) {sorted(unknown)}: a mesh has {', '.join(DIMS)}")
    for dim, n in sizes.items():
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"{dim} must be a whole number ≥ 1, got {n!r}")
    return {dim: sizes.get(dim, 1) for dim in DIMS}


def full_order(order, sizes: dict) -> tuple:
    """`order` (outermost first) completed to all of DIMS: the dimensions it leaves out have size 1
    and go where DIMS puts them. None: DIMS itself (tp fastest)."""
    if order is None:
        return DIMS
    order = (order,) if isinstance(order, str) else tuple(order)
    unknown = [d for d in order if d not in DIMS]
    if unknown:
        raise ValueError(f"order names unknown dimension(s) {unknown}: a mesh has {', '.join(DIMS)}")
    if len(set(order)) != len(order):
        raise ValueError(f"order names each of {', '.join(DIMS)} at most once (outermost first), got {order!r}")
    left_out = [d for d in DIMS if d not in order and sizes[d] > 1]
    if left_out:
        raise ValueError(f"order {order!r} leaves out {', '.join(left_out)}, whose size is more than 1: "
                         f"name every dimension larger than 1")
    return order + tuple(d for d in DIMS if d not in order)


def grid(order=None, **sizes) -> torch.Tensor:
    """The global rank at every coordinate: a tensor of shape (pp, dp, ep, cp, tp).
    Ranks are numbered row-major along `order` (outermost first; default DIMS: tp fastest)."""
    s = full_sizes(sizes)
    order = full_order(order, s)
    numbered = torch.arange(math.prod(s.values())).view([s[d] for d in order])
    return numbered.permute(*[order.index(d) for d in DIMS])


def groups(*dims: str, order=None, **sizes) -> list[list[int]]:
    """Every group along `dims` (global ranks), with no torch.distributed needed:
    groups("tp", dp=2, tp=2) == [[0, 1], [2, 3]]; groups("tp", dp=2, tp=2, order=("tp", "dp"))
    == [[0, 2], [1, 3]]."""
    if not dims or any(d not in DIMS for d in dims):
        raise ValueError(f"name one or more of {', '.join(DIMS)}, got {dims!r}")
    g = grid(order, **sizes)
    axes = [DIMS.index(d) for d in dims]
    rest = [a for a in range(len(DIMS)) if a not in axes]
    size = math.prod(g.shape[a] for a in axes)
    return g.permute(*rest, *axes).reshape(-1, size).tolist()


def describe(order=None, **sizes) -> str:
    """A printed map: each rank's coordinates, then the groups of each dimension used."""
    s = full_sizes(sizes)
    used = [d for d in full_order(order, s) if s[d] > 1] or ["dp"]
    g = grid(order, **sizes)
    lines = [" × ".join(f"{d}={s[d]}" for d in used) + f"  ({g.numel()} ranks, {used[-1]} innermost)",
             "rank  " + "  ".join(f"{d:>2}" for d in used)]
    at = {g[tuple(c)].item(): c for c in torch.cartesian_prod(*[torch.arange(n) for n in g.shape])
          .view(-1, len(DIMS)).tolist()}
    for rank in range(g.numel()):
        lines.append(f"{rank:4d}  " + "  ".join(f"{at[rank][DIMS.index(d)]:>2}" for d in used))
    for d in used:
        lines.append(f"{d} groups: " + "  ".join(str(r) for r in groups(d, order=order, **sizes)))
    return "\n".join(lines)


class Mesh:
    """This rank's place in the mesh and its process groups. Call it on every rank (it creates
    every group of every dimension, which torch.distributed needs all ranks to do, in order).
    order: the dimensions, outermost first, that number the ranks (default DIMS: tp fastest)."""

    def __init__(self, order=None, **sizes):
        self.sizes = full_sizes(sizes)
        self.order = full_order(order, self.sizes)
        if not dist.is_initialized():
            raise RuntimeError("Mesh(...) runs inside a rank: call it in a function started by pplab.launch")
        world = dist.get_world_size()
        product = math.prod(self.sizes.values())
        if product != world:
            named = [d for d in DIMS if self.sizes[d] > 1] or ["dp"]
            raise ValueError(f"{'·'.join(named)} = {'·'.join(str(self.sizes[d]) for d in named)} = {product} "
                             f"but the world has {world} ranks: choose sizes whose product is {world}")
        self.rank = dist.get_rank()
        where = (grid(self.order, **self.sizes) == self.rank).nonzero()[0].tolist()
        self.coords = dict(zip(DIMS, where))
        self._groups = {}
        for dim in DIMS:                                   # same order on every rank
            self.group(dim)

    def group(self, *dims: str):
        """The process group of this rank along `dims` (several dims: one group spanning them).
        A combination not asked for before is created now: every rank must ask, in the same order."""
        if not dims or any(d not in DIMS for d in dims):
            raise ValueError(f"name one or more of {', '.join(DIMS)}, got {dims!r}")
        key = tuple(d for d in DIMS if d in dims)
        if key not in self._groups:
            mine = None
            for ranks in groups(*key, order=self.order, **self.sizes):
                created = dist.new_group(ranks)            # every rank creates every group
                if self.rank in ranks:
                    mine = (created, ranks)
            self._groups[key] = mine
        return self._groups[key][0]

    def ranks(self, *dims: str) -> list[int]:
        """The global ranks of this rank's group along `dims`."""
        self.group(*dims)
        return self._groups[tuple(d for d in DIMS if d in dims)][1]

    def size(self, dim: str) -> int:
        return self.sizes[dim]

    def rank_in(self, dim: str) -> int:
        """This rank's index along `dim` (its rank within that group)."""
        return self.coords[dim]

    dp_group = property(lambda self: self.group("dp"))
    tp_group = property(lambda self: self.group("tp"))
    pp_group = property(lambda self: self.group("pp"))
    ep_group = property(lambda self: self.group("ep"))
    cp_group = property(lambda self: self.group("cp"))

    @property
    def pp_prev(self) -> int | None:
        """Global rank of the previous pipeline stage (None on the first)."""
        i = self.coords["pp"]
        return self.ranks("pp")[i - 1] if i > 0 else None

    @property
    def pp_next(self) -> int | None:
        """Global rank of the next pipeline stage (None on the last)."""
        i, stages = self.coords["pp"], self.ranks("pp")
        return stages[i + 1] if i + 1 < len(stages) else None

    def device_mesh(self, device_type: str = "cpu"):
        """torch's DeviceMesh with the same layout (only the dimensions larger than one): init_device_mesh
        numbers ranks row-major in the order its dimensions are named, so they are named along self.order."""
        from torch.distributed.device_mesh import init_device_mesh
        used = [d for d in self.order if self.sizes[d] > 1] or ["dp"]
        return init_device_mesh(device_type, tuple(self.sizes[d] for d in used), mesh_dim_names=tuple(used))

    @classmethod
    def from_device_mesh(cls, device_mesh) -> "Mesh":
        """Our mesh for a DeviceMesh whose dimension names are among pp, dp, ep, cp, tp (in any order:
        it becomes the mesh's order)."""
        names = tuple(device_mesh.mesh_dim_names or ())
        if not names or any(n not in DIMS for n in names) or len(set(names)) != len(names):
            raise ValueError(f"the DeviceMesh's dimensions must be named from {DIMS}, each once, got {names}")
        sizes = dict(zip(names, device_mesh.mesh.shape))
        if not torch.equal(device_mesh.mesh.flatten().cpu(), torch.arange(device_mesh.mesh.numel())):
            raise ValueError("this DeviceMesh does not lay ranks out in order (row-major): pplab's mesh cannot match it")
        return cls(order=names, **sizes)

    def __repr__(self) -> str:
        used = {d: n for d, n in self.sizes.items() if n > 1}
        order = "" if self.order == DIMS else f", order={tuple(d for d in self.order if d in used)}"
        return f"Mesh({', '.join(f'{d}={n}' for d, n in used.items())}{order}) rank {self.rank} at {self.coords}"

    def __str__(self) -> str:
        return describe(self.order, **self.sizes)
