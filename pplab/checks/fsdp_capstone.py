"""Check of chapter 6's second capstone: fully sharded data parallel (FSDP, ZeRO stage 3) from scratch.

    fsdp    FSDP(units, compute_dtype=torch.float32)      fsdp(ids) -> logits      fsdp.shards

`units` is the tiny GPT of pplab.models as its list of layers (Embed, the blocks, Head), each
one unit. Unit k's parameters, in unit.parameters() order, laid end to end and zero-padded to
N·S_k elements (S_k = ceil(Ψ_k / N)), are cut into N equal pieces: rank r keeps elements
[r·S_k, (r+1)·S_k) as fsdp.shards[k], an fp32 nn.Parameter (the master). The check trains with
torch.optim.AdamW(fsdp.shards): after loss.backward() each shards[k].grad is the rank's piece
of the mean gradient over the ranks, in fp32.

Two sealed launches (N = 2, then 3; a GPT of sizes drawn from the seed, at least one unit that
N does not divide), each rank on a batch of its own, 3 steps in fp32, then 3 more from a fresh
model with compute_dtype fp16 (N = 2) or bf16 (N = 3). Five parts (fsdp_probes.py holds what
runs in the ranks):

* forward: the shards start as laid out above, and every rank's loss at every step equals the
  model's loss on that rank's batch (fp32: 1e-6 relative);
* backward: every shard's .grad after backward is the piece of the mean gradient, and AdamW
  moves every shard as single-process AdamW on the whole batch moves the model (fp32: 1e-6 +
  1e-6·|x|); the first step, rank, unit and parameter that differ are named;
* memory: (a) while a unit computes (forward or backward), the full parameters held (the
  storages of every unit's parameters and of every all-gather output still alive) are at most
  that unit's and the prefetched neighbour's; (b) between steps (after optimizer.step()),
  everything reachable from the FSDP object plus AdamW's state is at most 16·ΣS_k bytes: per
  shard element 4 (fp32 master) + 4 (its gradient) + 8 (AdamW's two moments), i.e. 16Ψ/N plus
  at most N - 1 padding elements per unit (pplab.memory.storage_bytes: each storage once);
* traffic (fp32 run, from the router's record): per step and rank, one all-gather of every unit
  in forward, one again in backward, one reduce-scatter of every unit's gradient, nothing else.
  Run as rings, an all-gather or reduce-scatter of unit k sends (N-1)·S_k·b bytes from each
  rank, so a step sends 3·(N-1)·ΣS_k·b = 3Ψ·b·(N-1)/N (Ψ padded, b the compute dtype's bytes:
  parameters gathered and gradients reduced in it). Every unit's all-gather but the first is
  started (async_op=True) before the unit that runs before it (in forward; after it in
  backward) has computed: prefetched;
* low precision: the compute_dtype run judged the same way (shards fp32, memory and traffic in
  the compute dtype's bytes) against a reference that casts as asked: each unit's fp32 master
  cast to compute_dtype, forward and backward in it, every rank's gradient summed in it (the
  reduce-scatter), then cast to fp32 and divided by N. Values to LOW_TOL of each tensor's
  largest element (a rounding of the compute dtype here and there, not a cast in the wrong place).
"""
from __future__ import annotations

import copy
import random

import torch

from . import sealed
from .core import Parts, exercise, first_difference, refuse_library, require_function
from .core import _fmt, Fail, Forbidden
from .fsdp_probes import fsdp_rank, flat_padded
from ..models import GPTConfig, gpt_layers, gpt_loss  # noqa: F401

PARTS = ("forward", "backward", "memory", "traffic", "low precision")
STEPS = 3
LOW = {2: torch.float16, 3: torch.bfloat16}           # the low-precision compute dtype at each world size
TOL = {torch.float32: 1e-6, torch.float16: 2**-9, torch.bfloat16: 2**-6}     # relative; see the docstring
LOSS_TOL = {torch.float32: 1e-6, torch.float16: 1e-5, torch.bfloat16: 1e-5}
_AG, _RS = ("all_gather_into_tensor", "all_gather"), ("reduce_scatter_tensor", "reduce_scatter")
_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


# ----------------------------------------------------------------------------------
# The inputs and the reference


def _trial(seed, p):
    """A GPT whose units are not all divisible by p (padding), AdamW options and every rank's batch."""
    rng = random.Random(seed * 7 + p)
    while True:
        heads = rng.choice([1, 3])
        cfg = GPTConfig(vocab=rng.randint(9, 17), seq=rng.randint(5, 8), hidden=heads * rng.choice([3, 5]),
                        heads=heads, ffn=rng.randint(9, 21), layers=rng.randint(1, 2))
        sizes = [sum(q.numel() for q in layer.parameters()) for layer in gpt_layers(cfg)]
        if any(n % p for n in sizes):
            break
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    b = rng.randint(1, 2)
    ids = torch.randint(0, cfg.vocab, (p, b, cfg.seq + 1), generator=g)
    return {"cfg": cfg, "model_seed": rng.randrange(2**31), "rows": b, "ids": ids[:, :, :-1], "targets": ids[:, :, 1:],
            "adamw": {"lr": rng.choice([0.01, 0.02]), "betas": (0.9, 0.99), "eps": 1e-3, "weight_decay": 0.1}}


def _ranks_step(layers, t, p, dtype):
    """What each rank's forward and backward give with `layers` (in dtype): its loss and, per unit,
    its gradient as a padded flat vector in dtype."""
    losses, grads = [], []
    for r in range(p):
        for layer in layers:
            layer.zero_grad(set_to_none=True)
        x = t["ids"][r]
        for layer in layers:
            x = layer(x)
        loss = gpt_loss(x.float(), t["targets"][r])
        loss.backward()
        losses.append(loss.item())
        grads.append([flat_padded([q.grad for q in layer.parameters()], p, dtype) for layer in layers])
    return losses, grads


def _expected(losses, grads, p, dtype):
    """One step as FSDP gives it: each rank's loss and own gradient; per unit the mean gradient
    (summed in dtype, then fp32 / p) and the difference allowed at each element (`slack`)."""
    units = range(len(grads[0]))
    mean = [torch.stack([g[k] for g in grads]).sum(0).float() / p for k in units]
    terms = [torch.stack([g[k].float().abs() for g in grads]).sum(0) / p for k in units]
    info = torch.finfo(dtype)                      # + two of the dtype's smallest steps (fp16's subnormals)
    slack = [TOL[dtype] * (a + (m.abs().max() if dtype == torch.float32 else 0)) + 2 * info.tiny * info.eps
             for a, m in zip(terms, mean)]
    return {"losses": losses, "grads": mean, "slack": slack, "local": [[x.float() for x in g] for g in grads]}


def _single_threaded(compute):
    """compute() on one thread, as in the ranks: the same roundings."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return compute()
    finally:
        torch.set_num_threads(threads)


def _reference(t, p):
    """fp32: single-process AdamW on the whole batch, every step, per unit as padded flat vectors."""
    layers = gpt_layers(t["cfg"], seed=t["model_seed"], dtype=torch.float32)
    params = [list(layer.parameters()) for layer in layers]
    optimizer = torch.optim.AdamW([q for ps in params for q in ps], **t["adamw"])
    ref = {"start": [flat_padded(ps, p) for ps in params], "steps": [],
           "names": [[(n, q.shape) for n, q in layer.named_parameters()] for layer in layers],
           "kinds": [type(layer).__name__ for layer in layers]}
    for _ in range(STEPS):
        step = _expected(*_ranks_step(layers, t, p, torch.float32), p, torch.float32)
        for ps, g in zip(params, step["grads"]):
            _unflatten(ps, g, grad=True)
        optimizer.step()
        after = [flat_padded(ps, p) for ps in params]
        ref["steps"].append({"after": after, "slack": [TOL[torch.float32] * (a.abs() + a.abs().max()) for a in after]})
    return ref


def _one_step(t, p, dtype, masters):
    """One step's losses and gradients from the fp32 masters the ranks hold, cast to dtype as the
    docstring says (a drift of the masters within tolerance does not pile up over the steps)."""
    layers = gpt_layers(t["cfg"], seed=t["model_seed"], dtype=torch.float32)
    for layer, flat in zip(layers, masters):
        _unflatten(list(layer.parameters()), flat)
    return _expected(*_ranks_step([layer.to(dtype) for layer in layers], t, p, dtype), p, dtype)


def _unflatten(params, flat, grad=False):
    at = 0
    with torch.no_grad():
        for q in params:
            piece = flat[at:at + q.numel()].view_as(q).clone()
            if grad:
                q.grad = piece
            else:
                q.copy_(piece)
            at += q.numel()


def _refuse_library_fsdp(fn) -> None:
    """In the sealed rank: Forbidden if the answer uses a library's FSDP (torch's only if imported)."""
    import sys
    from ..zero import FlatBucket, FullyShardedModule, ZeroOptimizer
    fsdp = sys.modules.get("torch.distributed.fsdp")
    library = {"FullyShardedModule": FullyShardedModule, "FlatBucket": FlatBucket, "ZeroOptimizer": ZeroOptimizer}
    library.update({n: getattr(fsdp, n) for n in ("FullyShardedDataParallel", "fully_shard") if hasattr(fsdp, n)})
    refuse_library(fn, "fsdp", "the sharding, gathering and reduce-scattering", library,
                   "pplab.zero's FullyShardedModule or a library's FSDP")


# ----------------------------------------------------------------------------------
# The verdicts, from what the ranks recorded


def _where(ref, k, j):
    """'unit 2 (TransformerBlock), element 17: attn.qkv.weight[1, 4]'."""
    at = 0
    for name, shape in ref["names"][k]:
        if j < at + shape.numel():
            index = list(torch.unravel_index(torch.tensor(j - at), shape)) if len(shape) else []
            return f"unit {k} ({ref['kinds'][k]}), {name}{[int(i) for i in index]}"
        at += shape.numel()
    return f"unit {k} ({ref['kinds'][k]}), padding element {j - at}"


def _values_problem(what, got, want, slack, p, sizes, ref, hint=None):
    """The first rank and element of its shards (got: rank -> [tensor per unit]) farther than slack
    from its piece of the flat `want` (per unit)."""
    for r in range(p):
        for k, size in enumerate(sizes):
            piece = slice(r * size, (r + 1) * size)
            g, w = got[r][k], want[k][piece]
            if g is None:
                return f"rank {r}'s shards[{k}] has no {what} (None)." + (hint(r, k, None) if hint else "")
            if tuple(g.shape) != tuple(w.shape):
                return f"rank {r}'s shards[{k}] {what} has shape {list(g.shape)}, expected [{size}]."
            bad = ((g.float() - w).abs() > slack[k][piece]).nonzero()
            if len(bad):
                i = int(bad[0])
                return (f"rank {r}'s shards[{k}] {what} at {i} ({_where(ref, k, r * size + i)}) is "
                        f"{_fmt(g[i].item())}, expected {_fmt(w[i].item())}." + (hint(r, k, g) if hint else ""))
    return None


def _layout_problem(obs, ref, p, sizes):
    for r in range(p):
        shards = obs[r]["shards"]
        if isinstance(shards, str):
            return f"rank {r}: {shards}"
        if len(shards) != len(sizes):
            return f"rank {r} has {len(shards)} shards; the model has {len(sizes)} units: one shard per unit."
        for k, (dtype, shard) in enumerate(shards):
            if dtype != "torch.float32":
                return (f"rank {r}'s shards[{k}] is {dtype}: the sharded master stays fp32 whatever the compute "
                        f"dtype (cast a copy for the all-gather).")
            if shard.numel() != sizes[k]:
                numel = sum(s.numel() for _, s in ref["names"][k])
                return (f"rank {r}'s shards[{k}] has {shard.numel()} elements; unit {k} ({ref['kinds'][k]}) has "
                        f"{numel} parameters, padded with zeros to {p} × {sizes[k]} = {p * sizes[k]}: every rank's "
                        f"shard has ceil({numel}/{p}) = {sizes[k]} elements, the last rank's ending in "
                        f"{p * sizes[k] - numel} zero(s).")
    return _values_problem("value", {r: [s for _, s in obs[r]["shards"]] for r in range(p)}, ref["start"],
                           [0 * v for v in ref["start"]], p, sizes, ref, lambda r, k, g: " Rank r keeps elements "
                           "[r·S, (r+1)·S) of the unit's parameters laid end to end (unit.parameters() order), "
                           "zero-padded.")


def _grad_hint(p, sizes, want):
    def hint(r, k, got):
        if got is None:
            return (" After backward every rank's shards must hold its piece of the mean gradient: each rank "
                    "steps its own shard.")
        piece = slice(r * sizes[k], (r + 1) * sizes[k])
        mean, own = want["grads"][k][piece], want["local"][r][k][piece]
        if torch.allclose(got.float(), mean * p, rtol=1e-3, atol=1e-9):
            return f" It is {p} times that: the reduce-scatter sums over the ranks; divide by N = {p} for the mean."
        if any(torch.allclose(got.float(), own / d, rtol=1e-3, atol=1e-9) for d in (1, p)):
            return (f" It is rank {r}'s own gradient (of its batch only): reduce-scatter the unit's gradient, so that "
                    f"each rank gets its piece of the sum over all ranks.")
        return ""
    return hint


def _training_problems(obs, t, ref, p, sizes, dtype):
    """(forward problem, backward problem): the first step whose loss, gradient or update differs.
    Losses and gradients from the masters the ranks hold; fp32 updates against single-process AdamW."""
    for step in range(STEPS):
        masters = ref["start"] if step == 0 else \
            [torch.cat([obs[r]["steps"][step - 1]["after"][k].float() for r in range(p)]) for k in range(len(sizes))]
        want = _single_threaded(lambda: _one_step(t, p, dtype, masters))
        for r in range(p):
            got, loss = obs[r]["steps"][step]["loss"], want["losses"][r]
            if abs(got - loss) > LOSS_TOL[dtype] * abs(loss):
                return (f"step {step + 1}, rank {r}'s loss is {_fmt(got)}, expected {_fmt(loss)} (the model's loss on "
                        f"rank {r}'s batch, with every unit's full parameters)."), "not judged: the forward differs."
        grads = {r: obs[r]["steps"][step]["grads"] for r in range(p)}
        problem = _values_problem(".grad", grads, want["grads"], want["slack"], p, sizes, ref,
                                  _grad_hint(p, sizes, want))
        if problem is None and dtype == torch.float32:
            problem = _values_problem("value after optimizer.step()", {r: obs[r]["steps"][step]["after"] for r in
                                      range(p)}, ref["steps"][step]["after"], ref["steps"][step]["slack"], p, sizes,
                                      ref)
        if problem:
            return None, f"step {step + 1}, {problem}"
    return None, None


def _memory_problem(obs, p, sizes, b):
    full = [p * s * b for s in sizes]
    for step in range(STEPS):
        for r in range(p):
            for name, per_unit, other in obs[r]["steps"][step]["gathered"]:
                k = int(name[1:])
                nxt = k + 1 if name[0] == "F" else k - 1
                bound = full[k] + (full[nxt] if 0 <= nxt < len(sizes) else 0)
                if sum(per_unit) + other > bound:
                    units = ", ".join(str(j) for j, n in enumerate(per_unit) if n) or "none"
                    phase = "forward" if name[0] == "F" else "backward"
                    return (f"step {step + 1}, rank {r}: while unit {k} computed its {phase}, it held "
                            f"{sum(per_unit) + other:,} bytes of full parameters (the parameters of units {units}, "
                            f"and {other:,} bytes of all-gather output not in any unit's), more than the {bound:,} of "
                            f"unit {k} and {'the prefetched unit ' + str(nxt) if 0 <= nxt < len(sizes) else 'none'}"
                            f": free each unit's full parameters after its use.")
            held, bound = obs[r]["steps"][step]["held"], 16 * sum(sizes)
            if sum(held.values()) > bound:
                parts = ", ".join(f"{what} {n:,}" for what, n in held.items())
                hint = (" The units' full parameters or gradients are still held: free them after use." if
                        held["units' parameters and gradients"] else " A shard or its gradient that is a slice of the "
                        "unit's whole flat buffer keeps the whole buffer: clone the piece." if
                        max(held["shards"], held["their gradients"]) > 4 * sum(sizes) else "")
                return (f"after step {step + 1}, rank {r} held {sum(held.values()):,} bytes ({parts}); FSDP holds "
                        f"16 bytes per shard element (4 fp32 master + 4 its gradient + 8 AdamW's moments): 16 × "
                        f"{sum(sizes)} = {bound:,}.{hint}")
    return None


def _traffic_problem(traffic, order, p, sizes, b):
    """The first step whose collectives on some rank are not FSDP's, or not prefetched."""
    at = {name: i for i, name in enumerate(order)}
    n = len(sizes)
    for step in range(STEPS):
        for r in range(p):
            calls = [c for c in traffic[r]["collectives"] if c["phase"].startswith(f"{step}:")]
            where = lambda c: c["phase"].split(":")[1]                       # noqa: E731
            forward = [c for c in calls if c["kind"] in _AG and where(c)[0] in "fF"]
            backward = [c for c in calls if c["kind"] in _AG and where(c)[0] in "bB"]
            reduced = [c for c in calls if c["kind"] in _RS]
            other = [c for c in calls if c["kind"] not in _AG + _RS]
            say = f"step {step + 1}, rank {r}"
            if other:
                kind = other[0]["kind"]
                why = (" on the gradients: an all-reduce sends twice a reduce-scatter's bytes and leaves every rank "
                       "the whole gradient, when its shard needs only its piece" if kind == "all_reduce" else "")
                return f"{say} called {kind}{why}; FSDP needs only all-gathers and reduce-scatters."
            for what, got, want in (("all-gather in forward", forward, sizes), ("all-gather in backward", backward,
                                    sizes[::-1]), ("reduce-scatter", reduced, sizes[::-1])):
                if not got and what == "all-gather in backward":
                    return (f"{say} made no all-gather in backward: the full parameters were kept from forward. Free "
                            f"each unit after its forward, and gather it again before its backward.")
                if len(got) != n:
                    return f"{say} made {len(got)} {what}(s); the model has {n} units: one each."
                scale = p if what == "reduce-scatter" else 1
                for c, s in zip(got, want):
                    if c["bytes"] != scale * s * b:
                        per = c["bytes"] / (scale * s)
                        return (f"{say}'s {what} of a unit of {s} elements per shard put in {c['bytes']:,} bytes, "
                                f"{per:g} per element, expected {b} (the compute dtype's); "
                                f"{'cast the shard to compute_dtype before the all-gather' if per > b else ''}"
                                f"{'reduce the gradients in compute_dtype' if per > b and scale > 1 else ''}.")
            for k, c in enumerate(forward[1:], 1):
                if at[c["phase"]] >= at[f"{step}:F{k - 1}/"] or not c["async"]:
                    return (f"{say} did not prefetch unit {k} in forward: its all-gather started "
                            f"{'without async_op=True' if c['async'] is False else 'after unit ' + str(k - 1) + ' computed'}. "
                            f"Start unit k+1's all-gather (async_op=True) before unit k computes, wait for it when "
                            f"unit k+1 starts.")
            for i, c in enumerate(backward[1:], 1):
                k = n - 1 - i
                if at[c["phase"]] >= at[f"{step}:B{k + 1}/"] or not c["async"]:
                    return (f"{say} did not prefetch unit {k} in backward: start its all-gather (async_op=True) "
                            f"before unit {k + 1}'s backward computes.")
    return None


# ----------------------------------------------------------------------------------
# The exercise


def _describe(t, p, dtype):
    c = t["cfg"]
    return (f"world_size={p}, compute_dtype={_NAMES[dtype]}, GPT(vocab={c.vocab}, seq={c.seq}, hidden={c.hidden}, "
            f"heads={c.heads}, ffn={c.ffn}, {c.layers} block(s)), {t['rows']} sequence(s) per rank")


@exercise("fsdp", "FSDP from scratch: a whole GPT, per-unit gather, free, prefetch, reduce-scatter, mixed precision",
          answer="FSDP", notebook="06e_fsdp", sealed=True, points=len(PARTS),
          preload=("pplab.models", "pplab.zero", "pplab.memory", "torch._dynamo"))
def check_fsdp(fn, seed: int, timeout: float) -> str:
    require_function(fn, "fsdp", "units, compute_dtype=torch.float32", [], torch.float32)
    parts = Parts(PARTS)
    for p in (2, 3):
        t = _trial(seed, p)
        ref = _single_threaded(lambda: _reference(t, p))
        dtypes = (torch.float32, LOW[p])
        sizes = [v.numel() // p for v in ref["start"]]             # S_k: the padded flat is p·S_k long
        judged, layout = set(), {}

        def judge(world_size, i, observed, traffic):
            if len(observed) < world_size:
                return
            dtype = dtypes[i // 2]
            low = dtype != torch.float32
            name = lambda part: "low precision" if low else part       # noqa: E731
            where = _describe(t, p, dtype)
            if i % 2 == 0:
                layout[dtype] = _layout_problem(observed, ref, p, sizes)
                parts.note(name("forward"), layout[dtype], where)
                return
            forward, backward = (None, None) if layout[dtype] and low else \
                _training_problems(observed, t, ref, p, sizes, dtype)
            b = torch.empty(0, dtype=dtype).element_size()
            for part, problem in (("forward", forward), ("backward", backward),    # traffic first: it names a dtype
                                  ("traffic", _traffic_problem(traffic, observed[0]["order"], p, sizes, b)),
                                  ("memory", _memory_problem(observed, p, sizes, b))):
                parts.note(name(part), problem, where)
                judged.add(name(part))

        inputs = [[{"cfg": vars(t["cfg"]), "model_seed": t["model_seed"], "dtype": str(dtype), "adamw": t["adamw"],
                    "ids": t["ids"][r], "targets": t["targets"][r], "steps": STEPS, "build": i == 0}
                   for r in range(p)] for dtype in dtypes for i in (0, 1)]
        try:
            sealed.run_sealed(fsdp_rank, fn, inputs, world_size=p, timeout=timeout, exercise=("fsdp", "FSDP"),
                              forbidden=(), probe=_refuse_library_fsdp, check=judge,
                              describe=lambda w, i: _describe(t, p, dtypes[i // 2]))
        except Forbidden:
            raise
        except Fail as failure:
            for part in PARTS:
                if part not in judged:
                    parts.note(part, str(failure))
    return parts.finish("on world sizes 2 and 3 (a tiny GPT, every unit a shard per rank with padding, 3 AdamW steps "
                        "in fp32 then in fp16 / bf16: losses, gradients and updates equal single-process AdamW, fp32 "
                        "to 1e-6; full parameters held only for the unit computing and the prefetched one; 16·ΣS bytes "
                        "held between steps; per step 3·(N-1)·ΣS·b bytes sent: an all-gather per unit in forward and "
                        "in backward, prefetched, and a reduce-scatter)")
