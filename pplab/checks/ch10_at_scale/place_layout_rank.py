"""What exercise place_layout's checker (place_layout.py) runs in its sealed ranks."""
from __future__ import annotations

from ..sealed.forbidden import refuse_library


def _refuse_cluster(fn) -> None:
    """In the sealed rank: Forbidden if the answer asks pplab.cluster or pplab.mesh for the placement."""
    from ... import cluster, mesh
    refuse_library(fn, "place_layout", "the placement", {"place": cluster.place, "Placement": cluster.Placement,
                   "placement_rule": cluster.placement_rule, "groups": mesh.groups, "grid": mesh.grid},
                   "pplab.cluster or pplab.mesh")
