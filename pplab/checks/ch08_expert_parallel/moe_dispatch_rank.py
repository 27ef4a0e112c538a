"""What exercise moe_dispatch's checker (moe_dispatch.py) runs in its sealed ranks.

In a graded check pplab.expert_parallel is not available at all (denied.py), so the probe has
nothing to refuse."""
from __future__ import annotations

import torch
import torch.distributed as dist

from .. import sealed
from ..sealed.forbidden import refuse_module


def _rows(rank, n):
    """Row s of rank r's tokens reads [r, s]: what arrives says where it came from."""
    return torch.stack([torch.full((n,), float(rank)), torch.arange(n, dtype=torch.float64)], 1)


def _dispatch_rank(fn, trials):
    """In every sealed rank: the answer on this rank's choices, then the exchange it plans."""
    from ... import collectives
    rank, p = dist.get_rank(), dist.get_world_size()
    for i, trial in enumerate(trials):
        sealed.begin(i)
        expert = trial["expert"]
        got = fn(expert.clone(), trial["E"], p)
        seen = {"answer": tuple(got) if isinstance(got, (tuple, list)) else repr(type(got)), "received": None,
                "error": None}
        try:
            counts, order = got
            counts = [int(c) for c in counts]
            usable = len(counts) == p and isinstance(order, torch.Tensor) and sum(counts) == len(order)
        except Exception:                                   # noqa: BLE001 - judged in the checker
            usable = False
        flag = torch.tensor([int(usable)])
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)         # exchange only if every rank has something to send
        if flag.item():
            recv = torch.empty(p, dtype=torch.int64)
            collectives.all_to_all_single(recv, torch.tensor(counts))
            x = _rows(rank, len(expert))[order.long()]
            received = x.new_empty(int(recv.sum()), 2)
            try:
                collectives.all_to_all_single(received, x, recv.tolist(), counts)
                seen["received"] = received
            except ValueError as err:
                seen["error"] = str(err)
        sealed.observe(i, seen)


def _refuse_dispatch_plan(fn) -> None:
    """In the sealed rank: Forbidden if the answer uses the library's dispatch_plan."""
    refuse_module(fn, "moe_dispatch", "the dispatch", "pplab.expert_parallel", ("dispatch_plan",),    # loaded only now
                  shown="pplab.expert_parallel.dispatch_plan")
