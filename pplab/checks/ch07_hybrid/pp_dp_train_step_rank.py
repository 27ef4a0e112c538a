"""What exercise pp_dp_train_step's checker (pp_dp_train_step.py) runs in its sealed ranks."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from .. import sealed
from ..sealed.forbidden import refuse_library
from ..stage_rank import WatchedStage


def _refuse_library_trainer(fn) -> None:
    """In the sealed rank: Forbidden if the answer uses the library's pipeline executor or hybrid trainer."""
    from ... import hybrid
    from ...pipeline import PipelineExecutor, run_pipeline
    refuse_library(fn, "pp_dp_train_step", "the 1F1B loop and the data-parallel gradient average",
                   {"PipelineExecutor": PipelineExecutor, "run_pipeline": run_pipeline,
                    "pplab.hybrid.train": hybrid.train},          # by object only: .train() is a module's too
                   "pplab.pipeline's executor or pplab.hybrid's trainer")


def _trainer_rank(fn, trials):
    t = trials[0]
    sealed.begin(0)
    rank, mesh = dist.get_rank(), layout(t["pp"], t["dp"])
    handles = {kind: [(ranks, dist.new_group(ranks)) for ranks in mesh[kind]] for kind in ("pp", "dp")}
    pp_group, dp_group = (next(g for ranks, g in handles[kind] if rank in ranks) for kind in ("pp", "dp"))
    events = []
    layers = nn.Sequential(*[m for _ in range(t["layers"]) for m in (nn.Linear(t["d"], t["d"], dtype=torch.float64),
                                                                      nn.Tanh())])
    with torch.no_grad():
        for q, value in zip(layers.parameters(), t["parameters"]):
            q.copy_(value)
    stage = WatchedStage(layers, lambda k, x: events.append("F"),      # for the 1F1B memory count
                         lambda k, grad: events.append("B"))
    sealed.phase("step")
    loss = fn(stage, t["inputs"].clone(), t["targets"].clone(), nn.MSELoss(), t["m"], pp_group, dp_group)
    sealed.phase("")
    if isinstance(loss, torch.Tensor) and loss.numel() == 1:
        loss = loss.item()
    elif isinstance(loss, (int, float)) and not isinstance(loss, bool):
        loss = float(loss)
    elif loss is not None:
        loss = f"a {type(loss).__name__}"
    sealed.observe(0, {"events": events, "loss": loss,
                       "grads": {n: None if q.grad is None else q.grad.clone() for n, q in stage.named_parameters()}})


def layout(pp: int, dp: int) -> dict:
    """{"pp": pipelines (ranks of one replica, stage order), "dp": copies of each stage}, with
    pplab.mesh's layout: rank = stage·dp + replica."""
    return {"pp": [[s * dp + k for s in range(pp)] for k in range(dp)],
            "dp": [[s * dp + k for k in range(dp)] for s in range(pp)]}
