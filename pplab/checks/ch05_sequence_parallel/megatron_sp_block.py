"""Check of chapter 5's capstone: a whole Megatron transformer block with sequence parallelism.

    megatron_sp_block   megatron_sp_block(block, group=None) -> module; module(x_r) -> y_r

The student gets chapter 3's dense TransformerBlock (pre-LayerNorm: ln1, attn.qkv, attn.proj,
ln2, mlp.fc1, mlp.fc2) and returns this rank's share of it, with the dense block's parameter
names: the q, k and v rows of its heads, its ffn slice (split as torch.tensor_split does), the
LayerNorms and the row layers' biases whole. x_r and y_r are [s/t, b, h], this rank's tokens.

It runs on sealed ranks (sealed.py) in three launches: t = 2, t = 3 (ffn not divisible by 3),
and two groups of t = 2 among 4 ranks (each its own sequence), on float32 weights and data from
the checker, against the dense block computed here in float64. Four parts, each judged on every
rank of every trial and reported separately (partial credit):

* forward: the output, to |got - want| <= 1e-4·(|want| + max(1, max|want|)) (a correct float32
  answer stayed 20 times inside it over 70 seeds; a missing or doubled term is far outside);
* input grad: x_r.grad, the same tolerance;
* parameter grads: each of the 12 parameters' gradient against its shard of the dense gradient;
* traffic: the router's record of each rank's collectives against Korthikanti et al.'s
  (2022, "Reducing Activation Recomputation in Large Transformer Models"): forward 2 all-gathers
  of the sequence (s/t·b·h in per rank) and 2 reduce-scatters (s·b·h in); backward the mirror,
  plus all-reduces of the 6h gradients of the parameters that every rank holds whole but uses
  on its own tokens only (LayerNorms' weights and biases, the row layers' biases). With
  ring algorithms a rank sends (t-1)/t·s·b·h per collective: 4(t-1)/t·s·b·h forward,
  4(t-1)/t·s·b·h + 2(t-1)/t·6h backward; building the block sends nothing.

The message names the first part that failed, with the first rank and tensor that differ and
why (from the values and the recorded collectives), then the four parts' verdicts.
"""
from __future__ import annotations

import random
from fractions import Fraction
import torch
import torch.nn.functional as F
from torch import nn

from .. import sealed
from ..core import Fail, Parts, exercise, first_difference, require_function
from .megatron_sp_block_rank import _block_rank, _refuse_library_block


PARAMS = ("ln1.weight", "ln1.bias", "attn.qkv.weight", "attn.qkv.bias", "attn.proj.weight", "attn.proj.bias",
          "ln2.weight", "ln2.bias", "mlp.fc1.weight", "mlp.fc1.bias", "mlp.fc2.weight", "mlp.fc2.bias")


REPLICATED = ("ln1.weight", "ln1.bias", "attn.proj.bias", "ln2.weight", "ln2.bias", "mlp.fc2.bias")


PARTS = ("forward", "input grad", "parameter grads", "traffic")


RTOL, ATOL = 1e-4, 1e-4


_KIND = {"all_gather_into_tensor": "all_gather", "reduce_scatter_tensor": "reduce_scatter"}


def traffic_formula(t: int, s: int, b: int, h: int) -> dict:
    """Elements one rank sends per block with ring collectives: {"forward": ..., "backward": ...}."""
    step = Fraction(t - 1, t)
    return {"forward": 4 * step * s * b * h, "backward": 4 * step * s * b * h + 2 * step * 6 * h}


def _ring_sent(kind: str, nbytes: int, t: int) -> Fraction:
    """Bytes one rank sends in a ring `kind` whose input on that rank is `nbytes`."""
    return {"all_gather": (t - 1) * Fraction(nbytes), "reduce_scatter": Fraction(nbytes * (t - 1), t),
            "all_reduce": Fraction(2 * nbytes * (t - 1), t)}.get(kind, Fraction(nbytes))


def _trials(seed):
    """(t, sub-groups or None, shape, seed): t = 2, t = 3 (ffn = 1 mod 3), two groups of 2."""
    rng = random.Random(seed)
    trials = []
    for t, members in ((2, None), (3, None), (2, [[0, 2], [1, 3]])):
        heads = t * (2 if members else rng.randint(1, 2))     # 4 heads: a split over all 4 ranks still runs
        h = heads * rng.randint(2, 3)
        # on 3 ranks ffn = 1 (mod 3): tensor_split gives k+1, k, k rows, chunks of ceil(ffn/t) k+1, k+1, k-1
        ffn = t * rng.randint(2, 3) + (1 if t > 2 else rng.randint(0, 1))
        # s·b > 6: a whole activation (s·b·h) outnumbers the 6h replicated gradients, so the record tells
        # an all-reduce of the sequence from one of the gradients by its size
        shape = {"s": t * rng.randint(4, 5), "b": rng.randint(1, 2), "h": h, "heads": heads, "ffn": ffn}
        trials.append((t, members, shape, rng.randrange(2**31)))
    return trials


def _state(shape, seed):
    """Random float32 weights for every parameter (LayerNorm's too: ones and zeros would hide a mix-up)."""
    from ...tensor_parallel.transformer import TransformerBlock
    g = torch.Generator().manual_seed(seed)
    dense = TransformerBlock(shape["h"], shape["heads"], shape["ffn"])
    state = {}
    for name, p in dense.named_parameters():
        scale = p.shape[-1] ** -0.5 if p.dim() == 2 else 0.3
        state[name] = (torch.randn(p.shape, generator=g) * scale + (1.0 if name.endswith("ln1.weight") or
                                                                     name.endswith("ln2.weight") else 0.0))
    return state


def _reference(shape, state, X, dY):
    """The dense block in float64: output, gradients, and each replicated parameter's gradient
    per token (to tell a rank's own tokens' share from the whole sum)."""
    from ...tensor_parallel.transformer import TransformerBlock
    block = TransformerBlock(shape["h"], shape["heads"], shape["ffn"]).double()
    block.load_state_dict({k: v.double() for k, v in state.items()})
    X = X.double().requires_grad_()
    u1 = block.ln1(X)
    a = block.attn(u1)
    x2 = X + a
    u2 = block.ln2(x2)
    m = block.mlp(u2)
    y = x2 + m
    for v in (u1, a, u2, m):
        v.retain_grad()
    (y * dY.double()).sum().backward()
    hat1 = F.layer_norm(X.detach(), (shape["h"],), eps=block.ln1.eps)
    hat2 = F.layer_norm(x2.detach(), (shape["h"],), eps=block.ln2.eps)
    per_token = {"ln1.weight": u1.grad * hat1, "ln1.bias": u1.grad, "attn.proj.bias": a.grad,
                 "ln2.weight": u2.grad * hat2, "ln2.bias": u2.grad, "mlp.fc2.bias": m.grad}
    return {"y": y.detach(), "x_grad": X.grad, "grads": {n: p.grad for n, p in block.named_parameters()},
            "per_token": per_token}


def _biased_outputs(shape, state, X, dY, t):
    """{row layers: a function giving the output of the dense block with their biases t times larger}:
    what a block computes whose ranks each add a row layer's bias before the reduce-scatter."""
    done = {}

    def output(names):
        def y():
            if tuple(names) not in done:                    # once, and only if a wrong output asks
                done[tuple(names)] = _reference(shape, {**state, **{n: t * state[n] for n in names}}, X, dY)["y"]
            return done[tuple(names)]
        return y
    return {"attn.proj": output(["attn.proj.bias"]), "mlp.fc2": output(["mlp.fc2.bias"]),
            "attn.proj and mlp.fc2": output(["attn.proj.bias", "mlp.fc2.bias"])}


def _split(n, t, r):
    sizes = [n // t + (k < n % t) for k in range(t)]
    return sum(sizes[:r]), sum(sizes[:r + 1])


def _shard_index(name, shape, t, r):
    """How rank r of t indexes the dense tensor `name`: (rows, cols), None meaning all."""
    h, heads = shape["h"], shape["heads"]
    d, n = h // heads, heads // t
    mine = torch.cat([torch.arange(k * h + r * n * d, k * h + (r + 1) * n * d) for k in range(3)])
    a, e = _split(shape["ffn"], t, r)
    return {"attn.qkv.weight": (mine, None), "attn.qkv.bias": (mine, None),
            "attn.proj.weight": (None, torch.arange(r * n * d, (r + 1) * n * d)),
            "mlp.fc1.weight": (torch.arange(a, e), None), "mlp.fc1.bias": (torch.arange(a, e), None),
            "mlp.fc2.weight": (None, torch.arange(a, e))}.get(name, (None, None))


def _shard(tensor, name, shape, t, r):
    rows, cols = _shard_index(name, shape, t, r)
    tensor = tensor if rows is None else tensor[rows]
    return tensor if cols is None else tensor[:, cols]


def _ranges(indices) -> str:
    """[0, 1, 2, 6, 7] -> '0..2, 6..7'."""
    out, start = [], None
    for i, k in enumerate(indices):
        if start is None:
            start = k
        if i + 1 == len(indices) or indices[i + 1] != k + 1:
            out.append(f"{start}..{k}" if k != start else f"{k}")
            start = None
    return ", ".join(out)


def _close(got, want):
    """None if got matches want within the tolerance, else (index, got, want) of the first difference."""
    atol = ATOL * max(1.0, want.abs().max().item()) if want.numel() else ATOL
    return first_difference(got.double(), want, atol=atol, rtol=RTOL)


def _layout_problem(res, shape, state, t, r):
    """What is wrong with the parameters rank r of t built from the dense block, or None."""
    params = res["params"]
    missing = [n for n in PARAMS if n not in params]
    if missing:
        return (f"the module has no parameter {missing[0]} (its parameters: {sorted(params) or 'none'}). Name them "
                f"as the dense block does (module.ln1, module.attn.qkv, module.attn.proj, module.ln2, module.mlp.fc1, "
                f"module.mlp.fc2, each with .weight and .bias), so that each can be compared with its dense twin.")
    extra = sorted(set(params) - set(PARAMS))
    if extra:
        return f"the module has parameters the dense block does not: {extra}."
    for name in PARAMS:
        want = _shard(state[name], name, shape, t, r)
        got = params[name]
        if tuple(got.shape) != tuple(want.shape) or first_difference(got.double(), want.double()) is not None:
            return f"{name} is not this rank's share of the dense {name}: " + _which_share(name, got, state[name],
                                                                                         shape, t, r)
    return None


def _which_share(name, got, dense, shape, t, r):
    """Words for what rank r holds of the dense tensor and what it should hold."""
    rows, cols = _shard_index(name, shape, t, r)
    h, heads = shape["h"], shape["heads"]
    n, d = heads // t, h // heads
    if name.startswith("attn.qkv"):
        rule = (f"rows of W_qkv are [q | k | v], each head-major ({heads} heads of {d}): rank {r} of {t} keeps the q, "
                f"k and v rows of its heads {r * n}..{(r + 1) * n - 1}, rows {_ranges(rows.tolist())} (e.g. "
                f"W.view(3, heads, d, h)[:, mine])")
    elif name == "attn.proj.weight":
        rule = f"rank {r} keeps the columns of its heads' outputs, {_ranges(cols.tolist())}"
    elif name.startswith("mlp.fc1"):
        rule = (f"rank {r} keeps rows {_ranges(rows.tolist())} of {shape['ffn']} (the ffn split as torch.tensor_split "
                f"does: the first ffn % t ranks get one more)")
    elif name == "mlp.fc2.weight":
        rule = f"rank {r} keeps the columns of its ffn slice, {_ranges(cols.tolist())}"
    else:
        rule = "every rank keeps it whole"
    held = ""
    if got.dim() == dense.dim() and got.dim() >= 1 and got.shape[-1:] == dense.shape[-1:] and got.numel():
        found = [next((i for i in range(dense.shape[0]) if torch.equal(row, dense[i])), None) for row in got]
        if all(i is not None for i in found):
            held = f"it holds rows {_ranges(found)} of it; "
    return f"shape {list(got.shape)}, {held}{rule}."


def _forward_problem(res, want, biased, layout, foreign):
    if res.get("y") is None:
        shape = res.get("y_shape")
        return (f"the block returned {shape}, not a tensor of this rank's shape {list(want.shape)}: it takes and "
                f"returns this rank's s/t tokens, [s/t, b, h] (ḡ's reduce-scatter leaves each rank its own).")
    diff = _close(res["y"], want)
    if diff is None:
        return None
    hint = ""
    if foreign:
        hint = f" {foreign}"
    elif layout:
        hint = f" The parameters are not this rank's share: {layout}"
    else:
        for what, alternative in biased.items():
            if _close(res["y"], alternative()) is None:
                hint = (f" It is the output of a block whose {what} bias{'es are' if ' and ' in what else ' is'} t "
                        f"times larger: every rank added the row layer's bias to its partial sum before the "
                        f"reduce-scatter. Add it once, after the reduce-scatter, to this rank's tokens.")
    return f"the output differs from the single-process block's {diff}.{hint}"


def _input_grad_problem(res, want, calls):
    got = res.get("x_grad")
    if got is None:
        return "x.grad is None after backward: the input's gradient must flow back through g and ḡ."
    diff = _close(got, want)
    if diff is None:
        return None
    hint = ""
    if not any(k == "reduce_scatter" for ph, k, _ in calls if ph == "backward"):
        hint = (" Your backward made no reduce-scatter: every rank's column layers give a partial gradient of the "
                "whole gathered sequence, so g's backward must sum them over the ranks and keep this rank's tokens "
                "(a reduce-scatter), not just take its own slice.")
    return f"x.grad differs from the single-process gradient {diff}.{hint}"


def _param_grad_problem(res, ref, mine, shape, t, r):
    grads = res.get("grads") or {}
    for name in PARAMS:
        want = _shard(ref["grads"][name], name, shape, t, r)
        got = grads.get(name)
        shared = name in REPLICATED
        rule = (f" Every rank holds {name} whole but uses it on its own tokens only, so its gradient here is this "
                f"rank's share: all-reduce it over the group in backward (f on the weight)." if shared else "")
        if got is None:
            return f"{name}.grad is None after backward.{rule}"
        if tuple(got.shape) != tuple(want.shape):
            return f"{name}.grad has shape {list(got.shape)}, expected {list(want.shape)}."
        diff = _close(got, want)
        if diff is None:
            continue
        hint = rule
        if shared:
            own = ref["per_token"][name][mine].sum((0, 1))
            if _close(got, own) is None:
                hint = (f" It is the sum over this rank's tokens only: {name} sees s/t tokens on each rank; "
                        f"all-reduce its gradient over the group (f: identity forward, all-reduce backward).")
            elif _close(got, torch.zeros_like(want)) is None:
                hint = f" It is zero on this rank, which uses {name} too.{rule}"
            elif _close(got, want / t) is None:
                hint = f" It is the gradient divided by {t}: sum over the ranks, do not average."
        return f"{name}.grad differs from its share of the single-process gradient {diff}.{hint}"
    return None


def _traffic_problem(calls, sends, t, shape):
    """calls: [(phase, kind, bytes in)] of one rank; sends: {phase: [(dst, bytes)]} point to point."""
    s, b, h = shape["s"], shape["b"], shape["h"]
    A = 4 * s * b * h                                   # one whole activation, float32 bytes
    formula = {ph: 4 * n for ph, n in traffic_formula(t, s, b, h).items()}
    setup = [(k, n) for ph, k, n in calls if ph == "setup"]
    if setup or sends.get("setup"):
        return (f"building the block communicated ({setup or sends['setup']}): every rank was given the whole dense "
                f"block, so each cuts its own share out of it with no message.")
    for phase in ("forward", "backward"):
        mine = [(k, n) for ph, k, n in calls if ph == phase]
        p2p = sum(n for _, n in sends.get(phase, []))
        if p2p:
            return (f"{phase} sent {p2p:,} bytes point to point: use the collectives (all-gather, reduce-scatter, "
                    f"all-reduce), whose traffic the formula counts.")
        odd = sorted({k for k, _ in mine} - {"all_gather", "reduce_scatter", "all_reduce"})
        if odd:
            return (f"{phase} made a {odd[0]}: Megatron SP needs only all-gathers and reduce-scatters of the "
                    f"sequence, and in backward one all-reduce of the replicated parameters' gradients.")
        sent = sum(_ring_sent(k, n, t) for k, n in mine)
        gathers = [n for k, n in mine if k == "all_gather"]
        scatters = [n for k, n in mine if k == "reduce_scatter"]
        big_reduces = [n for k, n in mine if k == "all_reduce" and n >= A]
        small_reduces = sum(n for k, n in mine if k == "all_reduce" and n < A)
        shown = ", ".join(f"{k} of {n // 4} elements" for k, n in mine) or "nothing"
        head = (f"in {phase} this rank sent {float(sent):,.0f} bytes with ring collectives ({shown}); the formula "
                f"says {float(formula[phase]):,.0f}")
        want_small = 0 if phase == "forward" else 4 * 6 * h
        if sent == formula[phase] and sorted(gathers) == [A // t] * 2 and scatters == [A, A] and not big_reduces \
                and small_reduces == want_small:
            continue
        if big_reduces and len(gathers) >= 2 and phase == "forward":
            why = (f"an all-reduce of the whole sequence (s·b·h = {A // 4} elements) where ḡ makes a reduce-scatter. "
                   f"The values are right, but each rank keeps only its s/t tokens of the sum, so the all-reduce "
                   f"sends t-1 shards for nothing: 2(t-1)/t·s·b·h instead of (t-1)/t·s·b·h.")
        elif big_reduces and len(gathers) < 2 and phase == "forward":
            why = ("the sequence was gathered once and the block ran on the whole of it (LayerNorm and the residual "
                   "adds on [s, b, h], all-reduces after the row layers: chapter 3's block). Megatron SP keeps the "
                   "residual path on this rank's s/t tokens, where its activations take t times less memory, and "
                   "gathers only the inputs of the column layers.")
        elif len(gathers) > 2 and phase == "forward":
            why = (f"{len(gathers)} all-gathers where g makes 2 (one before each column layer): an all-gather in the "
                   f"residual path holds the whole sequence where Megatron SP keeps s/t of it.")
        elif phase == "backward" and not scatters:
            why = ("no reduce-scatter: g's backward must sum the ranks' partial gradients of the gathered sequence "
                   "and keep this rank's tokens.")
        elif phase == "backward" and big_reduces:
            why = "an all-reduce of the sequence's gradient where g's backward makes a reduce-scatter."
        elif phase == "backward" and len(gathers) == 4:
            why = ("4 all-gathers: the column layers' inputs were gathered again in backward. Korthikanti et al. do "
                   "that to save memory, but this exercise keeps the gathered input (autograd does when the linear "
                   "layer uses it), and its formula counts 2.")
        elif phase == "backward" and small_reduces != want_small:
            why = (f"all-reduces of {small_reduces // 4} parameter-gradient elements; the parameters every rank holds "
                   f"whole but uses on its own tokens are 6 vectors of h = {h}: the two LayerNorms' weight and bias "
                   f"and the two row layers' biases, {6 * h} elements (all-reduce each gradient once).")
        else:
            also = f", and all-reduces of {6 * h} parameter-gradient elements" if want_small else ""
            why = (f"expected 2 all-gathers of s/t·b·h = {A // t // 4} elements and 2 reduce-scatters of s·b·h = "
                   f"{A // 4}{also}.")
        return f"{head}: {why}"
    return None


def _judge(t, members, shape, state, refs, results, traffic):
    """{part: first message or None} for one trial (each rank checked, in rank order)."""
    found = dict.fromkeys(PARTS)
    world = len(results)
    for rank in range(world):                           # every rank's parts
        ranks = list(range(world)) if members is None else next(m for m in members if rank in m)
        r, group_id = ranks.index(rank), 0 if members is None else members.index(ranks)
        ref, lo, hi = refs[group_id], r * shape["s"] // t, (r + 1) * shape["s"] // t
        res = results[rank]
        calls = [(c["phase"], _KIND.get(c["kind"], c["kind"]), c["bytes"]) for c in traffic[rank]["collectives"]]
        where = f"rank {rank}" + (f" (rank {r} of group {ranks})" if members else "")
        if not res["is_module"]:
            raise Fail(f"{where}: megatron_sp_block must return an nn.Module (so that its parameters can be "
                       f"trained).", seed_matters=False)
        layout = _layout_problem(res, shape, state, t, r)
        groups = sorted({tuple(c["group"]) for c in traffic[rank]["collectives"]
                         if c["phase"] in ("forward", "backward")} - {tuple(ranks)})
        foreign = groups and (f"Its collectives ran over ranks {list(groups[0])}, not over its group {ranks}: pass "
                              f"group=group to every collective, and split by comm.world_size(group) and "
                              f"comm.rank(group).")
        biased = {k: (lambda v=v: v()[lo:hi]) for k, v in ref["biased"].items()}
        problems = {"forward": _forward_problem(res, ref["y"][lo:hi], biased, layout, foreign)}
        if res.get("y") is None:
            problems.update({"input grad": "no backward ran (the output had the wrong shape).",
                             "parameter grads": "no backward ran (the output had the wrong shape)."})
        else:
            problems["input grad"] = _input_grad_problem(res, ref["x_grad"][lo:hi], calls)
            problems["parameter grads"] = (layout and f"the parameters are not this rank's share: {layout}") or \
                _param_grad_problem(res, ref, slice(lo, hi), shape, t, r)
        problems["traffic"] = foreign or _traffic_problem(calls, traffic[rank]["sends_in"], t, shape)
        for part in PARTS:
            if problems[part] and not found[part]:
                found[part] = f"{where}: {problems[part]}"
    return found


def _describe(t, members, shape):
    where = f"t={t}" + (f" (sub-groups {members} of 4 ranks)" if members else "")
    return (f"{where}, s={shape['s']}, b={shape['b']}, h={shape['h']}, {shape['heads']} heads, "
            f"ffn={shape['ffn']}")


@exercise("megatron_sp_block", "A Megatron transformer block with sequence parallelism", answer="megatron_sp_block",
          notebook="05_megatron_sp_block", sealed=True, points=len(PARTS),
          preload=("pplab.tensor_parallel.transformer", "pplab.sequence_parallel.megatron"))
def check_megatron_sp_block(fn, seed: int, timeout: float) -> str:
    require_function(fn, "megatron_sp_block", "block, group", nn.Linear(1, 1), None)
    parts = Parts(PARTS)
    for t, members, shape, trial_seed in _trials(seed):
        world = 4 if members else t
        state = _state(shape, trial_seed)
        g = torch.Generator().manual_seed(trial_seed + 1)
        sequences = [(torch.randn(shape["s"], shape["b"], shape["h"], generator=g),
                      torch.randn(shape["s"], shape["b"], shape["h"], generator=g)) for _ in (members or [None])]
        refs = [_reference(shape, state, X, dY) for X, dY in sequences]
        for ref, (X, dY) in zip(refs, sequences):       # only for a wrong output: a row bias added on every rank
            ref["biased"] = _biased_outputs(shape, state, X, dY, t)
        inputs = []
        for rank in range(world):
            ranks = list(range(world)) if members is None else next(m for m in members if rank in m)
            r, (X, dY) = ranks.index(rank), sequences[0 if members is None else members.index(ranks)]
            cut = slice(r * shape["s"] // t, (r + 1) * shape["s"] // t)
            inputs.append({"members": members, "shape": shape, "state": state, "x": X[cut].clone(),
                           "dy": dY[cut].clone()})
        found = {}

        def judge(p, i, observed, traffic):         # in run_sealed: data it cannot read is a Fail
            if len(observed) == p:                  # (a launch that failed, run_sealed reports itself)
                found.update(_judge(t, members, shape, state, refs, [observed[r] for r in range(p)], traffic))
        sealed.run_sealed(_block_rank, fn, [inputs], world_size=world, timeout=timeout,
                          exercise=("megatron_sp_block", ""), forbidden=(), probe=_refuse_library_block,
                          describe=lambda p, i: _describe(t, members, shape), check=judge)
        for part in PARTS:
            parts.note(part, found.get(part), where=_describe(t, members, shape))
    return parts.finish("on t = 2, t = 3 and two groups of 2 among 4 ranks (output, input gradient and all 12 "
                        "parameter gradients within float32 tolerance of the dense block; per rank, forward 2 "
                        "all-gathers + 2 reduce-scatters and backward their mirror + all-reduces of 6h gradients, "
                        "as the formula says)")
