"""What exercise ddp_from_scratch's checker (ddp_from_scratch.py) runs in its sealed ranks."""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .. import sealed
from ..sealed.failures import Fail
from ..sealed.forbidden import refuse_library


_STEPS = 2                                           # training steps per trial


def _ddp_rank(fn, configs):
    """In every sealed rank: two SGD steps per model with the answer's hooks, on this rank's
    slice of its group's batch. The router records every all-reduce (size, group, async,
    in backward or finish, waited for when); the job adds which gradients were in when each
    started (its own hooks run before the answer's)."""
    rank = dist.get_rank()
    made = {tuple(ranks): dist.new_group(ranks) for c in configs for ranks in c["groups"]}   # every rank, in order
    ready, started = [], []

    def note(kind, into):
        if kind == "all_reduce":
            started.append(list(ready))
    for c, config in enumerate(configs):
        members = next(ranks for ranks in config["groups"] if rank in ranks)
        group = made[tuple(members)]
        sealed.begin(c * _STEPS)
        model = _mlp(config)
        with torch.no_grad():
            for q, value in zip(model.parameters(), config["parameters"]):
                q.copy_(value)
        for name, q in model.named_parameters():        # before the answer's hooks: ours run first
            q.register_post_accumulate_grad_hook(lambda q, name=name: ready.append(name))
        finish = fn(model, group, config["cap"])
        if not callable(finish):
            raise Fail(f"{fn.__name__} must return finish, a function the training loop calls after every "
                       f"loss.backward(); it returned {type(finish).__name__}.", seed_matters=False)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for step, (x, y) in enumerate(config["batches"]):
            sealed.begin(c * _STEPS + step)
            model.zero_grad()
            loss = F.mse_loss(model(x), y)
            del ready[:], started[:]
            with sealed.watch_collectives(note):
                sealed.phase("backward")
                loss.backward()
                sealed.phase("finish")
                finish()
                sealed.phase("")
            sealed.observe(c * _STEPS + step,
                           {"ready": list(started),
                            "grads": {n: None if q.grad is None else q.grad.clone() for n, q in model.named_parameters()}})
            optimizer.step()
        dist.barrier()


def _ddp_rank_of_trials(fn, trials):
    """run_sealed gives a rank one input per trial; this job's configs all come with trial 0."""
    _ddp_rank(fn, trials[0])


def _mlp(config) -> nn.Module:
    torch.manual_seed(config["seed"])                    # the same model on every rank
    layers = []
    for a, b in zip(config["widths"], config["widths"][1:]):
        layers += [nn.Linear(a, b, dtype=torch.float64), nn.Tanh()]
    return nn.Sequential(*layers[:-1])


def _refuse_library_ddp(fn) -> None:
    """In the sealed rank: Forbidden if the answer uses a library DDP."""
    from ...data_parallel import ddp                  # graded: a stand-in, whose names refuse_library skips
    refuse_library(fn, "ddp_from_scratch", "the buckets and their all-reduces",
                   {"DDP": ddp.DDP, "reverse_buckets": ddp.reverse_buckets,
                    "DistributedDataParallel": nn.parallel.DistributedDataParallel}, "a library DDP")
