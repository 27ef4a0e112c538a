"""What exercise fsdp's checker (fsdp.py) runs in its sealed ranks: the job, and
what it measures.

The answer gets the GPT's layers each wrapped in a `_Unit`, a module that tells the router
where the rank is (sealed.phase: "0:F2" = step 0, unit 2's forward compute begins; "0:F2/" it
ended; "0:B2" / "0:B2/" the same in backward) and, where a unit's compute begins, counts the
full parameters the rank holds then. After every optimizer.step() the job counts what the rank
holds between steps. It only records; fsdp.py judges."""
from __future__ import annotations

import functools
import types
import weakref
import torch
from torch import nn

from .. import sealed
from ..sealed.failures import Fail
from ..sealed.forbidden import _filled, refuse_library  # _filled: a closure's cell that holds a value
from ..sealed.library_view import unavailable
from ...memory import storage_bytes
from ...models import GPTConfig, gpt_layers, gpt_loss


def flat_padded(tensors, p: int, dtype=torch.float32) -> torch.Tensor:
    """The tensors end to end, zero-padded to a multiple of p: a unit's flat parameters (or gradients)."""
    flat = torch.cat([t.detach().reshape(-1).to(dtype) for t in tensors])
    return torch.cat([flat, flat.new_zeros(-flat.numel() % p)])


class _Mark(torch.autograd.Function):
    """The identity; its backward tells the probe that backward reached this point."""

    @staticmethod
    def forward(ctx, x, name, probe):
        ctx.name, ctx.probe = name, probe
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.probe(ctx.name)
        return grad, None, None


class _Unit(nn.Module):
    """One layer as the answer gets it: its parameters are the layer's, in the layer's order."""

    def __init__(self, layer, k, probe):
        super().__init__()
        self.layer, self.k = layer, k
        object.__setattr__(self, "probe", probe)        # not a submodule, not a parameter

    def forward(self, x):
        self.probe(f"F{self.k}")
        if x.requires_grad:                             # unit 0's input (token ids) has no backward
            x = _Mark.apply(x, f"B{self.k}/", self.probe)
        out = self.layer(x)
        self.probe(f"F{self.k}/")
        return _Mark.apply(out, f"B{self.k}", self.probe) if out.requires_grad else out


def _module_tensors(layer):
    """A layer's tensors: parameters, buffers, and tensors set as plain attributes of its modules."""
    return [t for m in layer.modules() for t in [*m._parameters.values(), *m._buffers.values(), *vars(m).values()]
            if isinstance(t, torch.Tensor)]


class _Probe:
    """Names the phases (sealed.phase) and, where a unit's compute begins, counts the full parameters held:
    the storages of every unit's tensors, and of every all-gather output still alive, each once."""

    def __init__(self):
        self.layers, self.outputs, self.step, self.order, self.gathered = [], [], 0, [], []

    def watch(self, kind, into):
        if kind in ("all_gather_into_tensor", "all_gather") and into is not None:
            self.outputs += [weakref.ref(t) for t in (into if isinstance(into, list) else [into])]

    def __call__(self, name):
        sealed.phase(f"{self.step}:{name}")
        self.order.append(f"{self.step}:{name}")
        if name[0] in "FB" and not name.endswith("/"):
            seen: set = set()
            per_unit = [storage_bytes(_module_tensors(layer), seen) for layer in self.layers]
            alive = [t for ref in self.outputs if (t := ref()) is not None]
            self.gathered[-1].append((name, per_unit, storage_bytes(alive, seen)))


_ATOMS = (type, types.ModuleType, str, bytes, int, float, complex, bool, type(None), torch.dtype, torch.device)


def reachable_tensors(roots, limit: int = 100_000) -> list:
    """Every tensor reachable from `roots`: attributes, containers, closures, bound methods, partials,
    and each leaf tensor's .grad. What an object holds on to, as far as Python can see."""
    tensors, seen, todo = [], set(), list(roots)
    while todo and len(seen) < limit:
        obj = todo.pop()
        if isinstance(obj, _ATOMS) or id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            tensors.append(obj)
            if obj.is_leaf:
                todo.append(obj.grad)
        elif isinstance(obj, dict):
            todo += [*obj.keys(), *obj.values()]
        elif isinstance(obj, (list, tuple, set, frozenset)):
            todo += list(obj)
        elif isinstance(obj, types.FunctionType):
            todo += [c.cell_contents for c in obj.__closure__ or () if _filled(c)] + list(obj.__defaults__ or ())
        elif isinstance(obj, types.MethodType):
            todo.append(obj.__self__)
        elif isinstance(obj, functools.partial):
            todo += [obj.func, obj.args, obj.keywords]
        else:
            todo += list(getattr(obj, "__dict__", {}).values())
    return tensors


def _held(fsdp, shards, units, optimizer) -> dict:
    """Bytes the rank holds between steps, by kind, each storage counted once (in the first kind)."""
    seen: set = set()
    state = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
    in_units = [t for u in units for t in _module_tensors(u.layer)]
    return {"shards": storage_bytes(shards, seen), "their gradients": storage_bytes([s.grad for s in shards], seen),
            "AdamW state": storage_bytes(state, seen),
            "units' parameters and gradients": storage_bytes(in_units + [t.grad for t in in_units if t.is_leaf], seen),
            "other": storage_bytes(reachable_tensors([fsdp, units]), seen)}


def fsdp_rank(fn, trials):
    """The job: per run, a build trial (the shards as laid out) then a training trial (STEPS steps)."""
    probe = _Probe()
    with sealed.watch_collectives(probe.watch):
        for i, t in enumerate(trials):
            sealed.begin(i)
            if t["build"]:
                probe.layers = gpt_layers(GPTConfig(**t["cfg"]), seed=t["model_seed"], dtype=torch.float32)
                probe.outputs, probe.order = [], []
                units = [_Unit(layer, k, probe) for k, layer in enumerate(probe.layers)]
                fsdp = fn(units, compute_dtype=getattr(torch, t["dtype"].removeprefix("torch.")))
                shards = getattr(fsdp, "shards", None)
                if shards is None or not all(isinstance(s, torch.Tensor) for s in shards):
                    raise Fail("FSDP must keep this rank's fp32 piece of each unit as .shards, a list of "
                               "nn.Parameter (the optimizer steps them).")
                shards = list(shards)
                sealed.observe(i, {"shards": [(str(s.dtype), s.detach().clone()) for s in shards]})
                continue
            optimizer = torch.optim.AdamW(shards, **t["adamw"])
            steps = []
            for step in range(t["steps"]):
                probe.step, probe.gathered = step, probe.gathered + [[]]
                optimizer.zero_grad(set_to_none=True)
                probe("forward")
                logits = fsdp(t["ids"])
                want = (*t["ids"].shape, probe.layers[-1].out.out_features)
                if not isinstance(logits, torch.Tensor) or tuple(logits.shape) != want:
                    shape = list(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
                    raise Fail(f"fsdp(ids) returned {shape}; expected the logits, a tensor of shape {list(want)}.")
                loss = gpt_loss(logits.float(), t["targets"])
                probe("backward")
                loss.backward()
                grads = [None if s.grad is None else s.grad.detach().clone() for s in shards]
                probe("step")
                optimizer.step()
                record = {"loss": loss.item(), "grads": grads, "after": [s.detach().clone() for s in shards],
                          "gathered": probe.gathered[-1]}
                del logits, loss
                record["held"] = _held(fsdp, shards, units, optimizer)
                steps.append(record)
            sealed.observe(i, {"steps": steps, "order": probe.order})


def _refuse_library_fsdp(fn) -> None:
    """In the sealed rank: Forbidden if the answer uses a library's FSDP (torch's only if imported)."""
    import importlib
    import sys
    zero = importlib.import_module("pplab.zero")
    fsdp = sys.modules.get("torch.distributed.fsdp")
    library = {n: getattr(zero, n) for n in ("FullyShardedModule", "FlatBucket", "ZeroOptimizer")}
    library = {n: v for n, v in library.items() if not unavailable(v)}     # graded: not there at all
    library.update({n: getattr(fsdp, n) for n in ("FullyShardedDataParallel", "fully_shard") if hasattr(fsdp, n)})
    refuse_library(fn, "fsdp", "the sharding, gathering and reduce-scattering", library,
                   "pplab.zero's FullyShardedModule or a library's FSDP")
