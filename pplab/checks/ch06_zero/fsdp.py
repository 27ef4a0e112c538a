"""Check of chapter 6's second capstone: fully sharded data parallel (FSDP, ZeRO stage 3) from scratch.

    fsdp    FSDP(units, compute_dtype=torch.float32)     fsdp(ids) -> logits     fsdp.shards

units: the tiny GPT of pplab.models as its list of layers (Embed, the blocks, Head), one unit
each. Unit k's Ψ_k parameters (unit.parameters() order) end to end, zero-padded to N·S_k
(S_k = ceil(Ψ_k/N)), cut in N pieces: rank r keeps elements [r·S_k, (r+1)·S_k) as
fsdp.shards[k], an fp32 nn.Parameter. The check trains with torch.optim.AdamW(fsdp.shards):
after loss.backward() shards[k].grad must be the rank's piece of the mean gradient, fp32.

Two sealed launches, N = 2 then 3 (a GPT drawn from the seed, with a unit that N does not
divide), every rank on a batch of its own: 3 steps in fp32, then 3 from a fresh model with
compute_dtype fp16 (N = 2) or bf16 (N = 3). fsdp_rank.py holds what runs in the
ranks, fsdp_reference.py what they should give. Five parts, each judged on every rank
and step (the fp32 runs give the first four, the others the fifth); the first rank, unit and
parameter that differ are named:

* forward: the shards start laid out as above; each rank's loss equals the model's on its batch
  with the parameters the ranks hold (1e-6 relative);
* backward: each shard's .grad is its piece of the mean gradient (from the parameters the ranks
  hold: 1e-6 of the ranks' terms and of the unit's largest), and the shards after each step
  equal single-process AdamW's on the whole batch (1e-6·(|x| + the unit's largest));
* memory: (a) where a unit's compute starts (forward or backward), the full parameters held (the
  storages of every unit's tensors and of every all-gather output still alive) are at most
  that unit's and the prefetched neighbour's, in the compute dtype; (b) between steps (after
  optimizer.step()), what is reachable from the FSDP object plus AdamW's state is at most
  16·ΣS_k bytes: per shard element 4 (fp32 master) + 4 (its gradient) + 8 (AdamW's moments),
  16Ψ/N plus at most N - 1 elements of padding per unit (pplab.memory: each storage once);
* traffic (the router's record): per step and rank, an all-gather of every unit in forward,
  again in backward, a reduce-scatter of every unit's gradient, nothing else; all in the
  compute dtype (b bytes). As rings, each sends (N-1)·S_k·b bytes per rank, 3·(N-1)·ΣS_k·b =
  3Ψ·b·(N-1)/N a step (Ψ padded). Each unit's all-gather but the first starts (async_op=True)
  before its neighbour (the unit before it in forward, after it in backward) has computed;
* low precision: the compute_dtype run judged as above, against what casting as asked gives:
  each fp32 master cast to compute_dtype, forward and backward in it, the ranks' gradients
  summed in it (the reduce-scatter), then to fp32 and divided by N. Losses to 1e-5; gradients
  within two roundings of the dtype of the ranks' terms (another legal order of the casts and
  the division), plus two of its smallest steps (fp16's subnormals).
"""
from __future__ import annotations

import random
import torch

from .. import sealed
from ..core import Fail, Forbidden, Parts, exercise, require_function
from ..core import _fmt
from ...models import GPTConfig, gpt_layers
from .fsdp_rank import _refuse_library_fsdp, fsdp_rank
from .fsdp_reference import LOSS_TOL, NAMES, one_step, reference, single_threaded


PARTS = ("forward", "backward", "memory", "traffic", "low precision")


STEPS = 3


LOW = {2: torch.float16, 3: torch.bfloat16}           # the low-precision compute dtype at each world size


_AG, _RS = ("all_gather_into_tensor", "all_gather"), ("reduce_scatter_tensor", "reduce_scatter")


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
                off, allowed = abs(g[i].item() - w[i].item()), slack[k][piece][i].item()
                return (f"rank {r}'s shards[{k}] {what} at {i} ({_where(ref, k, r * size + i)}) is "
                        f"{_fmt(g[i].item())}, expected {_fmt(w[i].item())}" + (f" (off by {off:.2g}, more than the "
                        f"{allowed:.2g} allowed)" if allowed else "") + "." + (hint(r, k, g) if hint else ""))
    return None


def _layout_problem(obs, ref, p, sizes):
    for r in range(p):
        shards = obs[r]["shards"]
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
        g, m = got.double(), mean.double()
        c = float((g * m).sum() / (m * m).sum()) if bool(m.any()) else 1.0       # the best-fitting factor
        if abs(c - 1) > 1e-6 and bool(((g - c * m).abs() <= want["slack"][k][piece]).all()):
            return (f" Every element is {c:.7g} times that: the mean's division by N = {p} is off (divide by "
                    f"{p}; a rounded 1/{p} is not exact).")
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
        want = single_threaded(lambda: one_step(t, p, dtype, masters))
        for r in range(p):
            got, loss = obs[r]["steps"][step]["loss"], want["losses"][r]
            if abs(got - loss) > LOSS_TOL[dtype] * abs(loss):
                return (f"step {step + 1}, rank {r}'s loss is {got:.7f}, expected {loss:.7f} (relative difference "
                        f"{abs(got - loss) / abs(loss):.1e}): the model's loss on rank {r}'s batch, computed in "
                        f"{NAMES[dtype]} with the parameters the ranks hold."), "not judged: the forward differs."
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
                            f"unit {k}{f' and the prefetched unit {nxt}' if 0 <= nxt < len(sizes) else ''}: free each "
                            f"unit's full parameters after its use.")
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
            reduced.sort(key=lambda c: c["bytes"])            # in whatever order the units' backwards end
            for what, got, want in (("all-gather in forward", forward, sizes), ("all-gather in backward", backward,
                                    sizes[::-1]), ("reduce-scatter", reduced, sorted(sizes))):
                if not got and what == "all-gather in backward":
                    return (f"{say} made no all-gather in backward: the full parameters were kept from forward. Free "
                            f"each unit after its forward, and gather it again before its backward.")
                if len(got) != n:
                    return f"{say} made {len(got)} {what}(s); the model has {n} units: one each."
                scale = p if what == "reduce-scatter" else 1
                for c, size in zip(got, want):
                    if c["bytes"] != scale * size * b:
                        fix = "reduce-scatter the gradients in" if scale > 1 else "all-gather the shard cast to"
                        return (f"{say}'s {what} of a unit of {size} elements per shard put in {c['bytes']:,} bytes, "
                                f"{c['bytes'] / (scale * size):g} per element, expected {b}: {fix} compute_dtype.")
            for k, c in enumerate(forward[1:], 1):
                if at[c["phase"]] >= at[f"{step}:F{k - 1}/"] or not c["async"]:
                    when = "without async_op=True" if not c["async"] else f"after unit {k - 1} computed"
                    return (f"{say} did not prefetch unit {k} in forward: its all-gather started {when}. Start unit "
                            f"k+1's all-gather (async_op=True) before unit k computes; wait for it when k+1 starts.")
            for i, c in enumerate(backward[1:], 1):
                k = n - 1 - i
                if at[c["phase"]] >= at[f"{step}:B{k + 1}/"] or not c["async"]:
                    when = "without async_op=True" if not c["async"] else f"after unit {k + 1}'s backward computed"
                    return (f"{say} did not prefetch unit {k} in backward: its all-gather started {when}. Start its "
                            f"all-gather (async_op=True) before unit {k + 1}'s backward computes.")
    return None


def _describe(t, p, dtype):
    c = t["cfg"]
    return (f"world_size={p}, compute_dtype={NAMES[dtype]}, GPT(vocab={c.vocab}, seq={c.seq}, hidden={c.hidden}, "
            f"heads={c.heads}, ffn={c.ffn}, {c.layers} block(s)), {t['rows']} sequence(s) per rank")


@exercise("fsdp", "FSDP from scratch: a whole GPT, per-unit gather, free, prefetch, reduce-scatter, mixed precision",
          answer="FSDP", notebook="06_fsdp", sealed=True, points=len(PARTS),
          preload=("pplab.models", "pplab.zero", "pplab.memory", "torch._dynamo"))
def check_fsdp(fn, seed: int, timeout: float) -> str:
    require_function(fn, "fsdp", "units, compute_dtype=torch.float32", [], torch.float32)
    parts = Parts(PARTS)
    for p in (2, 3):
        t = _trial(seed, p)
        ref = single_threaded(lambda: reference(t, p, STEPS))
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
        except Fail as failure:
            if isinstance(failure, Forbidden) or not (judged or any(parts.problems.values())):
                raise                                        # nothing judged yet: the failure is the message
            for part in PARTS:
                if part not in judged:                       # what the launch could not show
                    parts.note(part, str(failure))
    return parts.finish("on world sizes 2 and 3 (a tiny GPT, every unit a shard per rank with padding, 3 AdamW "
                        "steps in fp32 then in fp16 / bf16: losses, gradients and updates equal single-process AdamW, "
                        "fp32 to 1e-6; full parameters held only for the unit computing and the prefetched one; "
                        "16·ΣS bytes held between steps; per step 3·(N-1)·ΣS·b bytes sent: an all-gather per unit in "
                        "forward and in backward, prefetched, and a reduce-scatter)")
