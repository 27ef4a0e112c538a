"""What exercise ddp_buckets's checker (ddp_buckets.py) runs in its sealed ranks."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .. import sealed


def _mlp(widths, seed) -> nn.Module:
    torch.manual_seed(seed)                              # the same model on every rank
    layers = []
    for a, b in zip(widths, widths[1:]):
        layers += [nn.Linear(a, b), nn.Tanh()]
    return nn.Sequential(*layers[:-1])


def _bucket_names(model, returned):
    """In a rank: (the buckets as parameter names, None), or (None, what is wrong with their shape)."""
    names = {id(p): n for n, p in model.named_parameters()}
    if not (isinstance(returned, tuple) and len(returned) == 2 and callable(returned[1])):
        return None, f"got {type(returned).__name__}"
    buckets = returned[0]
    if not isinstance(buckets, (list, tuple)) or not all(isinstance(b, (list, tuple)) for b in buckets) or \
            not all(id(p) in names for b in buckets for p in b):
        return None, "buckets is not a list of lists of model.parameters()"
    return [[names[id(p)] for p in b] for b in buckets], None


def _ddp_rank(fn, trials):
    """Run on every sealed rank: two training steps per trial with the student's hooks on this
    rank's part of the batch; record the buckets and every .grad (the router records the
    all-reduces: size, async or not, in backward or in finish())."""
    for i, trial in enumerate(trials):
        sealed.begin(i)
        model = _mlp(trial["widths"], 0)
        with torch.no_grad():
            for q, value in zip(model.parameters(), trial["parameters"]):
                q.copy_(value)
        returned = fn(model, trial["cap"])
        names, problem = _bucket_names(model, returned)
        seen = {"buckets": names, "problem": problem, "steps": []}
        if problem is not None or [set(b) for b in names] != [set(b) for b in trial["expected"]]:
            sealed.observe(i, seen)                     # the checker says what is wrong; nothing more to run
            return
        finish = returned[1]
        for step, (x, y) in enumerate(trial["batches"]):
            model.zero_grad()
            loss = F.mse_loss(model(x), y)
            sealed.phase(f"step {step} backward")
            loss.backward()
            sealed.phase(f"step {step} finish")
            finish()
            sealed.phase("")
            seen["steps"].append({"grads": {n: None if q.grad is None else q.grad.clone()
                                            for n, q in model.named_parameters()}})
        sealed.observe(i, seen)
