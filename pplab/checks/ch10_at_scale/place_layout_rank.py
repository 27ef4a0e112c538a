"""The jobs and probes that place_layout.py runs in its sealed ranks.

Kept apart from the checker, which holds the references: a graded check's ranks may import
this module and nothing of the checker (fresh_zygote.py), and there the library modules the
exercise asks the student to write are not available at all (denied.py)."""
from __future__ import annotations

from ..sealed.forbidden import refuse_library


def _refuse_cluster(fn) -> None:
    """In the sealed rank: Forbidden if the answer asks pplab.cluster or pplab.mesh for the placement."""
    from ... import cluster, mesh
    refuse_library(fn, "place_layout", "the placement", {"place": cluster.place, "Placement": cluster.Placement,
                   "placement_rule": cluster.placement_rule, "groups": mesh.groups, "grid": mesh.grid},
                   "pplab.cluster or pplab.mesh")
