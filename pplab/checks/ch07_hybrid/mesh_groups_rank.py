"""What exercise mesh_groups's checker (mesh_groups.py) runs in its sealed ranks."""
from __future__ import annotations

from ..sealed.library_view import unavailable
import torch.distributed as dist

from .. import sealed
from ..sealed.forbidden import refuse_library


_LIBRARY = "<used pplab.mesh>"                      # what a rank reports when the answer called pplab.mesh


class _UsedLibrary(Exception):
    """Raised by the stand-ins for pplab.mesh's functions while the answer runs."""


def _mesh_rank(fn, trials):
    """In each sealed rank: what the answer says about this rank (pplab.mesh refused meanwhile)."""
    from ... import mesh as library
    pp, dp, tp = trials[0]
    sealed.begin(0)
    rank = dist.get_rank()
    saved = {} if unavailable(library) else {n: getattr(library, n) for n in ("groups", "grid", "describe", "Mesh")}

    def refused(*args, **kwargs):
        raise _UsedLibrary()
    for n in saved:                              # an import inside the answer gets these
        setattr(library, n, refused)
    try:
        got = fn(rank, pp, dp, tp)
    except _UsedLibrary:
        sealed.observe(0, {"answer": _LIBRARY})
        return
    finally:
        for n, f in saved.items():
            setattr(library, n, f)
    if isinstance(got, dict):
        got = {k: list(v) if isinstance(v, (list, tuple, range)) else v for k, v in got.items()}
        got = {k: [int(r) if hasattr(r, "__int__") else r for r in v] if isinstance(v, list) else repr(v)
               for k, v in got.items() if isinstance(k, str)}
    else:
        got = repr(got)
    sealed.observe(0, {"answer": got})


def _refuse_mesh(fn) -> None:
    """In the sealed rank: Forbidden if the answer names pplab.mesh's functions or torch's DeviceMesh."""
    from torch.distributed.device_mesh import init_device_mesh

    from ... import mesh
    refuse_library(fn, "mesh_groups", "the groups of a mesh",
                   {"groups": mesh.groups, "grid": mesh.grid, "Mesh": mesh.Mesh, "describe": mesh.describe,
                    "init_device_mesh": init_device_mesh}, "pplab.mesh (or torch's DeviceMesh)")
