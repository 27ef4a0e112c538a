"""What exercise stage3_unit's checker (stage3_unit.py) runs in its sealed ranks."""
from __future__ import annotations

import contextlib
import gc
import torch

from .. import sealed


def _saved_by_autograd(y):
    """Every tensor autograd keeps for y's backward: saved tensors, and tensors a custom
    Function put on its ctx (lists and tuples too)."""
    found, seen, todo = [], set(), [y.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        values = []
        for attr in dir(node):
            if attr.startswith("_saved_") or attr in ("saved_tensors", "to_save"):
                with contextlib.suppress(Exception):
                    values.append(getattr(node, attr))
        with contextlib.suppress(TypeError):
            values += list(vars(node).values())
        while values:
            v = values.pop()
            if isinstance(v, torch.Tensor):
                found.append(v)
            elif isinstance(v, (list, tuple)):
                values += list(v)
            elif isinstance(v, dict):
                values += list(v.values())
        todo += [f for f, _ in getattr(node, "next_functions", ())]
    return found


def _unit_rank(fn, trials):
    """In every sealed rank: sharded_linear on this rank's input and shard, then backward; where the
    all-gathers wrote, and how much of it autograd keeps after forward."""
    for i, trial in enumerate(trials):
        sealed.begin(i)
        shard = torch.nn.Parameter(trial["shard"])
        x = trial["x"].requires_grad_(True)
        gathered = []                                   # (data_ptr, nbytes) of every all-gather's output

        def record(kind, into):
            if kind in ("all_gather_into_tensor", "all_gather") and into is not None:
                tensors = into if isinstance(into, list) else [into]
                gathered.extend((t.data_ptr(), t.numel() * t.element_size()) for t in tensors)
        with sealed.watch_collectives(record):
            y = fn(x, shard, trial["out"], trial["in"])
            gathers_in_forward = len(gathered)
            gc.collect()
            kept = 0
            if isinstance(y, torch.Tensor) and y.grad_fn is not None:
                for t in _saved_by_autograd(y):
                    s = t.untyped_storage()
                    if s.nbytes() and any(ptr <= s.data_ptr() < ptr + n or s.data_ptr() <= ptr < s.data_ptr()
                                          + s.nbytes() for ptr, n in gathered):
                        kept = max(kept, s.nbytes())
            result = {"y": y.detach().clone() if isinstance(y, torch.Tensor) else repr(type(y)),
                      "requires_grad": isinstance(y, torch.Tensor) and y.requires_grad,
                      "kept": kept, "gathers_in_forward": gathers_in_forward}
            if result["requires_grad"]:
                y.sum().backward()                      # this rank's loss; the shard's gradient = the mean over ranks
                result["x_grad"] = None if x.grad is None else x.grad.clone()
                result["shard_grad"] = None if shard.grad is None else shard.grad.clone()
        sealed.observe(i, result)
