"""What exercise sharded_optimizer's checker (sharded_optimizer.py) runs in its sealed ranks. The job records
the parameters after each step, what zero_grad left, and the optimizer state the rank really holds.

In a graded check pplab.zero is not available at all (denied.py), so the probe has nothing to
refuse."""
from __future__ import annotations

import sys
import weakref
import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_post_hook

from .. import sealed
from ..sealed.forbidden import refuse_library
from ..sealed.library_view import unavailable


_OPTIMIZERS = {"AdamW": torch.optim.AdamW, "SGD": torch.optim.SGD}


def _recording(name, made):
    """optimizer_class for the answer: the torch class, noting each instance it creates."""
    class Recorded(_OPTIMIZERS[name]):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)
    Recorded.__name__ = Recorded.__qualname__ = name
    return Recorded


_MADE = weakref.WeakSet()          # every torch optimizer made (or stepped) in this rank, of any class


def _note(optimizer, *args, **kwargs) -> None:
    _MADE.add(optimizer)


def _noting_init(init):
    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        _MADE.add(self)
    return __init__


# Every optimizer class runs torch.optim.Optimizer.__init__, and every step runs torch's global
# step hooks: between them no optimizer that holds state goes unseen. (Walking gc.get_objects()
# found the same ones, at a tenth of a second a walk, several walks a trial.)
torch.optim.Optimizer.__init__ = _noting_init(torch.optim.Optimizer.__init__)


register_optimizer_step_post_hook(_note)


def _optimizers() -> list:
    """Every torch optimizer alive in this rank, of any class."""
    return list(_MADE)


def _resident_bytes(before: list) -> int:
    """Bytes of per-element state (tensors of dimension >= 1, each storage once) held by the
    optimizers alive now that were not alive at `before`: the state the answer really keeps,
    whichever class holds it (an unused optimizer_class instance "for show" beside a full one
    does not hide the full one)."""
    old, seen, total = {id(o) for o in before}, set(), 0
    for o in _optimizers():
        if id(o) in old:
            continue
        for s in o.state.values():
            for v in s.values():
                if torch.is_tensor(v) and v.dim() > 0 and (v.untyped_storage().data_ptr(), v.numel()) not in seen:
                    seen.add((v.untyped_storage().data_ptr(), v.numel()))
                    total += v.numel() * v.element_size()
    return total


def _rank_job(fn, trials):
    rank = dist.get_rank()
    for i, t in enumerate(trials):
        sealed.begin(i)
        before = _optimizers()                                          # kept alive: their ids stay theirs
        made_groups = [dist.new_group(m) for m in t["members"]]          # every rank makes every group
        group = next(g for g, m in zip(made_groups, t["members"]) if rank in m)
        params = [torch.nn.Parameter(x.clone()) for x in t["start"]]
        made = []

        def param_group(indices, options):
            return {"params": [params[j] for j in indices], **options}
        keywords = dict(t["defaults"]) if len(t["members"]) == 1 else {"group": group, **t["defaults"]}
        optimizer = fn([param_group(*g) for g in t["groups"]], _recording(t["optimizer"], made), **keywords)
        active = [j for indices, _ in t["groups"] for j in indices]
        if t["load"] is not None:                                       # a resume
            optimizer.add_param_group(param_group(*t["added"]))
            active += t["added"][0]
            with torch.no_grad():
                for p, x in zip(params, t["resume"]):
                    p.copy_(x)                                           # as model.load_state_dict does
            optimizer.load_state_dict(t["load"])
        history, leftover = [], []
        for step, grads in enumerate(t["grads"]):
            if step == t["add_at"]:
                optimizer.add_param_group(param_group(*t["added"]))
                active += t["added"][0]
            optimizer.zero_grad()
            leftover.append([j for j in active if params[j].grad is not None and bool(params[j].grad.any())])
            sum((params[j] * grads[j]).sum() for j in active).backward()      # .grad = this rank's gradient
            optimizer.step()
            history.append([p.detach().clone() for p in params])
        index = {id(p): j for j, p in enumerate(params)}
        held = sorted({index[id(q)] for o in made for g in o.param_groups for q in g["params"] if id(q) in index})
        state = sum(v.numel() * v.element_size() for o in made for s in o.state.values() for v in s.values()
                    if torch.is_tensor(v) and v.dim() > 0)
        resident = _resident_bytes(before)
        sealed.observe(i, {"history": history, "leftover": leftover, "held": held, "state_bytes": state,
                           "resident_bytes": resident,
                           "state_dict": optimizer.state_dict() if t["save"] else None})


def _refuse_library_optimizers(fn) -> None:
    """In the sealed rank: Forbidden if the answer uses a library's sharded optimizer. torch's is
    looked for only where the answer imported it (importing it here would cost seconds per check)."""
    import importlib
    zero = importlib.import_module("pplab.zero")
    if unavailable(zero):                                   # a graded check: the answer cannot reach it
        return
    ZeroOptimizer = zero.ZeroOptimizer
    torch_optim = sys.modules.get("torch.distributed.optim")
    refuse_library(fn, "sharded_optimizer", "the sharding of the optimizer",
                   {"ZeroOptimizer": ZeroOptimizer,
                    "ZeroRedundancyOptimizer": getattr(torch_optim, "ZeroRedundancyOptimizer", ZeroOptimizer)},
                   "a library's sharded optimizer")
