"""What exercise moe_bytes's checker (moe_bytes.py) runs in its sealed ranks.

In a graded check pplab.expert_parallel is not available at all (denied.py), so the probe has
nothing to refuse."""
from __future__ import annotations

import torch

from .. import sealed
from ..sealed.forbidden import refuse_library


PHASES = ("counts", "dispatch", "combine")           # the moe_bytes job's phases, in order


_DTYPES = {2: torch.bfloat16, 4: torch.float32, 8: torch.float64}


def _measure_rank(fn, trials):
    """In every sealed rank: the library's MoE layer (not the answer) on this rank's tokens, steered to the
    trial's routing, one forward; each of its three all-to-alls in a phase of its own, so that the
    router's record of what was really sent splits into counts, dispatch and combine."""
    from ... import collectives
    from ...expert_parallel import MoE, steer
    original = collectives.all_to_all_single
    for i, t in enumerate(trials):
        sealed.begin(i)
        layer = MoE(t["hidden"], 4, t["E"], t["k"], t["capacity_factor"]).to(_DTYPES[t["element_size"]])
        x = steer(layer, t["choices"])
        names = iter(PHASES)

        def in_its_phase(*args, **kwargs):
            sealed.phase(next(names))
            return original(*args, **kwargs)
        collectives.all_to_all_single = in_its_phase
        try:
            with torch.no_grad(), collectives.unchecked():
                layer(x)
        finally:
            collectives.all_to_all_single = original
            sealed.phase("")
        sealed.observe(i, {"dropped": layer.dropped})


def _refuse_all_to_all_bytes(fn) -> None:
    """In the sealed rank: Forbidden if the answer asks pplab.expert_parallel for the bytes."""
    from ...expert_parallel import all_to_all_bytes            # loaded only when this check runs
    refuse_library(fn, "moe_bytes", "the bytes per rank", {"all_to_all_bytes": all_to_all_bytes},
                   "pplab.expert_parallel.all_to_all_bytes")
