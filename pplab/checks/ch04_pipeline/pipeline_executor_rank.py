"""What exercise pipeline_executor's checker (pipeline_executor.py) runs in its sealed ranks."""
from __future__ import annotations


import torch
import torch.distributed as dist
from torch import nn

from .. import sealed
from ..sealed.forbidden import refuse_module
from ..stage_rank import WatchedStage


def _executor_rank(fn, trials):
    """In every sealed rank: the answer runs this rank's actions on its stage; the stage's
    notes go to the checker after every event (so a hang still tells how far each rank got)."""
    from ...pipeline import make_schedule
    rank, p = dist.get_rank(), dist.get_world_size()
    for t, trial in enumerate(trials):
        sealed.begin(t)

        def note(event, t=t):
            note.events.append(event)
            sealed.observe(t, {"done": False, "events": note.events})
        note.events = []
        sealed.observe(t, {"done": False, "events": []})
        layers = nn.Sequential(nn.Linear(trial["d"], trial["d"], dtype=torch.float64), nn.Tanh())
        with torch.no_grad():
            for q, value in zip(layers.parameters(), trial["parameters"]):
                q.copy_(value)
        stage = WatchedStage(layers, lambda k, x: note(("F", x.detach().clone())),   # each input, each gradient
                             lambda k, grad: note(("B", k, grad.detach().clone())))
        actions = list(make_schedule(trial["schedule"], p, trial["m"]).actions[rank])
        fn(actions, stage, trial["microbatches"], nn.MSELoss(),
           rank - 1 if rank > 0 else None, rank + 1 if rank < p - 1 else None)
        grads = {n: None if q.grad is None else q.grad.clone() for n, q in stage.named_parameters()}
        sealed.observe(t, {"done": True, "events": note.events, "grads": grads})
        dist.barrier()                                   # the next trial's messages after this one's


def _refuse_executor(fn) -> None:
    """In the sealed rank: Forbidden if the answer uses pplab.pipeline's executor."""
    refuse_module(fn, "pipeline_executor", "the executor loop", "pplab.pipeline.executor",
                  ("PipelineExecutor", "run_pipeline"), shown="pplab.pipeline's executor")
