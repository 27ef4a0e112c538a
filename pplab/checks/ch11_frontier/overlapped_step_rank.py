"""The job that overlapped_step.py runs in its exercise's sealed ranks.

Kept apart from the checker, which holds the references: a graded check's ranks may import this
module and nothing of the checker (fresh_zygote.py), and there pplab.overlap.dualpipe_pair, the
library's own answer, is not available at all (denied.py)."""
from __future__ import annotations

from dataclasses import asdict

import torch
from torch import nn

from .. import sealed
from ..sealed.forbidden import refuse_module
from ... import trace
from ...overlap.stage import Chunk


def _stage(weight, bias, tanh):
    layer = nn.Linear(weight.shape[1], weight.shape[0])
    with torch.no_grad():
        layer.weight.copy_(weight)
        layer.bias.copy_(bias)
    return nn.Sequential(layer, nn.Tanh()) if tanh else layer


def _plain(event: dict) -> dict:
    """A trace event as plain data (what may come back from a sealed rank)."""
    out = {k: event[k] for k in ("rank", "kind", "category", "start", "end", "label", "bytes_sent",
                                 "bytes_recv", "peer", "seq")}
    out["group"] = list(event["group"]) if event["group"] is not None else None
    out["meta"] = {k: v for k, v in event["meta"].items() if isinstance(v, (int, float, str, bool))}
    return out


def _rank_job(fn, trials):
    """In every sealed rank: build this rank's two chunks, run the answer's step, record the
    gradients and the trace (compute spans padded to the trial's stand-in times)."""
    for i, t in enumerate(trials):
        sealed.begin(i)
        trace.reset(t["rank"])
        first = Chunk(_stage(t["w0"], t["b0"], True), "first", t_f=t["t_f"], on_compute=sealed.phase)
        last = Chunk(_stage(t["w1"], t["b1"], False), "last", t_f=t["t_f"], targets=list(t["targets"]),
                     scale=t["scale"], on_compute=sealed.phase)
        fn(first, last, [x.clone() for x in t["inputs"]])
        sealed.phase("done")
        grads = {name: [None if p.grad is None else p.grad.clone() for p in chunk.module.parameters()]
                 for name, chunk in (("first", first), ("last", last))}
        sealed.observe(i, {"grads": grads, "events": [_plain(asdict(e)) for e in trace.events()]})


def _refuse_dualpipe(fn) -> None:
    """In the sealed rank: Forbidden if the answer calls the library's own dualpipe_step."""
    refuse_module(fn, "overlapped_step", "the overlapped step", "pplab.overlap.dualpipe_pair", ("dualpipe_step",))
