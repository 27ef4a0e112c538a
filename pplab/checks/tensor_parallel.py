"""Checks of chapter 3's exercises: tensor parallelism.

    f_g                   f_and_g() -> (f, g), each called as f(x, group)
    row_parallel_linear   row_parallel_from_dense(dense, group=None) -> module
    vocab_parallel_ce     vocab_parallel_ce(logits_shard, targets, vocab_start, group=None) -> loss
    linear_traffic        linear_traffic(strategy, B, c_in, c_out) -> numbers sent per step

Every check runs the answer on sealed ranks (sealed.py; 2 and 3, and 4 ranks split into two
sub-groups for f_g and the row layer), in float64, against the dense computation on one
process (tolerance 1e-10). The checker's router records every collective the answer makes
(pplab.comm's and torch.distributed's), with its size and the phase the job named (forward
or backward); the checker then compares values *and* that communication with Megatron's: f is the identity
forward and one all-reduce backward, g the reverse; the row layer all-reduces once forward and
never backward; the cross-entropy never moves a [tokens, vocab] tensor. linear_traffic needs no
ranks: the table of CMU 15-418's lecture 25 (model and pipeline parallelism) for random shapes
(its notebook measures the same numbers from a trace).
"""
from __future__ import annotations

import random

import torch
import torch.nn.functional as F
from torch import nn

from . import sealed
from .tensor_parallel_rank import _ce_rank, _fg_rank, _refuse_row_parallel, _refuse_vocab_parallel_ce, _row_rank
from .core import Fail, check_number, exercise, first_difference, require_function
from .core import _fmt

TOL = 1e-10
_SHORT = {"all_gather_into_tensor": "all_gather", "reduce_scatter_tensor": "reduce_scatter",
          "all_to_all_single": "all_to_all"}


def _data(seed, *shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _trials(seed, sizes, sub_groups=True):
    rng = random.Random(seed)
    trials = [(p, None, rng.randrange(2**31)) for p in sizes]
    if sub_groups:
        trials.append((4, [[0, 2], [1, 3]], rng.randrange(2**31)))
    return trials


def _where(t):
    p, members = t[0], t[1]
    return f"world_size={p}" + (f", sub-groups {members}" if members else "")


def _launch(job, fn, t, inputs, timeout, exercise_id, probe=None):
    """One trial on sealed ranks (inputs[rank]: that rank's only); each rank's observation, with
    "calls": [(phase, collective, elements)] from the router's record (the data is float64 and
    int64: 8 bytes an element)."""
    kept = {}

    def keep(p, i, observed, traffic):
        kept.update({r: {**o, "calls": [(c["phase"], _SHORT.get(c["kind"], c["kind"]), c["bytes"] // 8)
                                        for c in traffic[r]["collectives"]]}
                     for r, o in observed.items()})
    sealed.run_sealed(job, fn, [inputs], world_size=t[0], timeout=timeout, exercise=(exercise_id, ""), forbidden=(),
                      probe=probe, describe=lambda world_size, i: _where(t), check=keep)
    return [kept[r] for r in range(t[0])]


def _member_ranks(members, p, rank):
    """The ranks of `rank`'s group: all of them, or the sub-group it is in."""
    return list(range(p)) if members is None else next(m for m in members if rank in m)


def _close(got, want, what, where, hint=""):
    if got is None:
        raise Fail(f"{where}: {what} is None.{hint}")
    if got.shape != want.shape:
        raise Fail(f"{where}: {what} has shape {list(got.shape)}, expected {list(want.shape)}.")
    diff = first_difference(got, want, atol=TOL, rtol=0)
    if diff is not None:
        index, g, w = diff
        raise Fail(f"{where}: {what} differs from the single-process value at index {index} "
                   f"(got {_fmt(g)}, expected {_fmt(w)}).{hint}")


def _comm(calls, phase):
    return [(name, n) for ph, name, n in calls if ph == phase]


# ----------------------------------------------------------------------------------
# Exercise "f_g"


def _fg_shape(seed):
    return (1 + seed % 3, 2 + seed % 5)


@exercise("f_g", "Megatron's f and g: conjugate autograd operators", answer="f_and_g", notebook="03_f_g", sealed=True)
def check_f_g(fn, seed: int, timeout: float) -> str:
    require_function(fn, "f_g", "")
    trials = _trials(seed, (2, 3))                  # f and g: 2 and 3 ranks, two sub-groups of 4
    for t in trials:
        seed_t, shape = t[2], _fg_shape(t[2])
        inputs = [{"members": t[1], "x": _data(seed_t, *shape), "w": _data(seed_t + 1 + r, *shape),
                   "xg": _data(seed_t + 100 + r, *shape)} for r in range(t[0])]   # each rank's own gradient, part
        results = _launch(_fg_rank, fn, t, inputs, timeout, "f_g")
        for r, res in enumerate(results):           # every rank of f and g
            if "error" in res:
                raise Fail(res["error"] + ".", seed_matters=False)
            where = f"{_where(t)}, rank {r}"
            shape, ranks, n = tuple(res["x"].shape), res["ranks"], res["numel"]
            w_sum = sum(_data(seed_t + 1 + s, *shape) for s in ranks)
            world_sum = sum(_data(seed_t + 1 + s, *shape) for s in range(t[0]))
            own = _data(seed_t + 1 + r, *shape)
            # f: identity forward, no communication
            if _comm(res["calls"], "f forward"):
                raise Fail(f"{where}: f's forward communicated ({_comm(res['calls'], 'f forward')}): every rank "
                           f"already holds the same X, so f's forward is the identity (return x.view_as(x)).")
            _close(res["y"], res["x"], "f(x)", where, " f's forward must return x unchanged.")
            hint = ""
            if res["x_grad"] is not None and res["x_grad"].shape == own.shape:
                if torch.allclose(res["x_grad"], own, atol=TOL) and len(ranks) > 1:
                    hint = (" It is this rank's own gradient: X is used by every rank, so dL/dX is the sum of "
                            "every rank's gradient; f's backward must all-reduce it (it is g's forward).")
                elif torch.allclose(res["x_grad"], w_sum / len(ranks), atol=TOL):
                    hint = " It is the mean over the ranks: f's backward sums (all-reduce), it does not average."
                elif t[1] and torch.allclose(res["x_grad"], world_sum, atol=TOL):
                    hint = (" It is the sum over all ranks of the world: all-reduce over `group` only "
                            "(pass group=group).")
            _close(res["x_grad"], w_sum, "x.grad after f's backward", where, hint)
            if _comm(res["calls"], "f backward") != [("all_reduce", n)]:
                raise Fail(f"{where}: f's backward should make exactly one all-reduce of the gradient ({n} "
                           f"elements); yours made {_comm(res['calls'], 'f backward') or 'none'}.")
            # g: all-reduce forward, identity backward
            z_sum = sum(_data(seed_t + 100 + s, *shape) for s in ranks)
            hint = (" all-reduce over `group` only (pass group=group)." if t[1] and torch.allclose(
                res["z"], sum(_data(seed_t + 100 + s, *shape) for s in range(t[0])), atol=TOL) else
                    " g's forward is the sum over the ranks of the partial results: an all-reduce.")
            _close(res["z"], z_sum, "g(x)", where, hint)
            if _comm(res["calls"], "g forward") != [("all_reduce", n)]:
                raise Fail(f"{where}: g's forward should make exactly one all-reduce ({n} elements); yours made "
                           f"{_comm(res['calls'], 'g forward') or 'none'}.")
            if _comm(res["calls"], "g backward"):
                raise Fail(f"{where}: g's backward communicated ({_comm(res['calls'], 'g backward')}): the summed "
                           f"result is used whole on every rank, so each partial result's gradient is the "
                           f"incoming gradient unchanged. g's backward is the identity (f's forward).")
            _close(res["xg_grad"], own, "x.grad after g's backward", where,
                   " g's backward must return the incoming gradient unchanged.")
    return ("on world sizes 2 and 3 and on two sub-groups of 4 ranks (forward values, gradients, and one "
            "all-reduce exactly where Megatron puts it: f backward, g forward)")


# ----------------------------------------------------------------------------------
# Exercise "row_parallel_linear"


def _split(n, p, r):
    sizes = [n // p + (k < n % p) for k in range(p)]
    return sum(sizes[:r]), sum(sizes[:r + 1])


def _row_shapes(seed, p):
    """in, out, batch, bias. On 3 ranks in_features = 1 (mod 3): 3 ranks get k+1, k, k columns,
    where chunks of ceil(n/p) would give k+1, k+1, k-1. The 2-rank trial always has a bias (a
    bias added on every rank must always be caught); the others have one or not, at random."""
    rng = random.Random(seed)
    c_in = 3 * rng.randint(2, 3) + 1 if p == 3 else rng.randint(5, 11)
    return c_in, rng.randint(2, 6), rng.randint(1, 4), p == 2 or rng.random() < 0.75


@exercise("row_parallel_linear", "A row-parallel Linear layer from a dense one", answer="row_parallel_from_dense",
          notebook="03_row_parallel_linear", sealed=True,
          preload=('pplab.tensor_parallel',))
def check_row_parallel(fn, seed: int, timeout: float) -> str:
    require_function(fn, "row_parallel_linear", "dense, group", nn.Linear(1, 1), None)
    trials = _trials(seed, (2, 3))                  # the row layer: 2 and 3 ranks, two sub-groups of 4
    for t in trials:
        c_in, c_out, batch, bias = _row_shapes(t[2], t[0])
        torch.manual_seed(t[2])
        dense = nn.Linear(c_in, c_out, bias=bias).double()
        x = _data(t[2] + 1, batch, c_in).requires_grad_()
        inputs = []
        for rank in range(t[0]):
            ranks = _member_ranks(t[1], t[0], rank)
            a, e = _split(c_in, len(ranks), ranks.index(rank))
            inputs.append({"members": t[1], "r": ranks.index(rank), "c_in": c_in, "c_out": c_out,
                           "weight": dense.weight.detach().clone(),
                           "bias": dense.bias.detach().clone() if bias else None,
                           "x": x.detach()[:, a:e].clone(), "upstream": _data(t[2] + 2, batch, c_out)})
        results = _launch(_row_rank, fn, t, inputs, timeout, "row_parallel_linear", probe=_refuse_row_parallel)
        y = dense(x)
        (y * _data(t[2] + 2, batch, c_out)).sum().backward()

        def where(g_rank):
            return f"{_where(t)}, in_features={c_in}, out_features={c_out}, rank {g_rank}"
        for g_rank, res in enumerate(results):                  # first the layout, on every rank
            r, q = res["r"], len(res["ranks"])
            a, e = _split(c_in, q, r)
            if not res["is_module"]:
                raise Fail(f"{where(g_rank)}: row_parallel_from_dense must return an nn.Module (so that its "
                           f"parameters can be trained).")
            if res["weight"] is None or tuple(res["weight"].shape) != (c_out, e - a):
                got = "no .weight" if res["weight"] is None else f"a .weight of shape {list(res['weight'].shape)}"
                raise Fail(f"{where(g_rank)}: the module has {got}; rank {r} of {q} should hold columns {a}..{e - 1}"
                           f" of dense.weight, shape [{c_out}, {e - a}] (split in_features as torch.tensor_split "
                           f"does: the first in_features % p ranks get one more).")
        for g_rank, res in enumerate(results):  # then the values, on every rank
            r, q = res["r"], len(res["ranks"])
            a, e = _split(c_in, q, r)
            where_ = where(g_rank)
            _close(res["weight"], dense.weight.detach()[:, a:e], ".weight", where_)
            if bias and res["bias"] is None:
                raise Fail(f"{where_}: the dense layer has a bias; keep it as .bias (shape [{c_out}]) on every rank.")
            hint = ""
            if bias and torch.allclose(res["y"], y.detach() + (q - 1) * dense.bias.detach(), atol=TOL):
                hint = (f" It is y plus {q - 1} extra biases: every rank added the bias before the sum; add it "
                        f"once, after the all-reduce.")
            _close(res["y"], y.detach(), "the output", where_, hint)
            if _comm(res["calls"], "backward"):
                raise Fail(f"{where_}: backward communicated ({_comm(res['calls'], 'backward')}): the output's "
                           f"gradient is already whole on every rank, and each rank's input slice and weight "
                           f"columns need only it. The all-reduce's backward is the identity (g).")
            _close(res["x_grad"], x.grad[:, a:e], "the gradient of this rank's input slice", where_)
            _close(res["w_grad"], dense.weight.grad[:, a:e], ".weight.grad", where_)
            if bias:
                _close(res["b_grad"], dense.bias.grad, ".bias.grad", where_,
                       " Every rank keeps the whole bias and must get its whole gradient (add it after the "
                       "all-reduce, on every rank).")
            if _comm(res["calls"], "forward") != [("all_reduce", batch * c_out)]:
                raise Fail(f"{where_}: forward should make exactly one all-reduce, of the partial outputs "
                           f"({batch}x{c_out} = {batch * c_out} elements); yours made "
                           f"{_comm(res['calls'], 'forward') or 'none'}.")
    return ("on world sizes 2 and 3 and on two sub-groups of 4 ranks (uneven in_features; weights, output and "
            "every gradient to 1e-10; one all-reduce forward, none backward)")


# ----------------------------------------------------------------------------------
# Exercise "vocab_parallel_ce"


def _ce_shapes(seed, big):
    rng = random.Random(seed)
    return rng.randint(3, 9), rng.randint(7, 40), (800.0 if big else 0.0)       # tokens, vocab, logit offset


@exercise("vocab_parallel_ce", "Vocabulary-parallel cross-entropy that never gathers the logits",
          answer="vocab_parallel_ce", notebook="03_vocab_parallel_ce", sealed=True,
          preload=('pplab.tensor_parallel.transformer',))
def check_vocab_parallel_ce(fn, seed: int, timeout: float) -> str:
    require_function(fn, "vocab_parallel_ce", "logits_shard, targets, vocab_start, group",
                     torch.zeros(1, 1), torch.zeros(1, dtype=torch.long), 0, None)
    rng = random.Random(seed)
    trials = [(p, None, rng.randrange(2**31), big) for p, big in ((2, False), (3, False), (3, True))]
    for t in trials:
        n, vocab, offset = _ce_shapes(t[2], t[3])
        logits = (_data(t[2], n, vocab) * 3 + offset).requires_grad_()
        targets = torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(t[2] + 1))
        for r in range(t[0]):                   # token r's target in rank r's slice: every rank's mask is tried
            a, e = _split(vocab, t[0], r)
            targets[r] = a + t[2] % (e - a)
        inputs = [{"shard": logits.detach()[:, a:e].clone(), "targets": targets, "start": a}
                  for a, e in (_split(vocab, t[0], r) for r in range(t[0]))]
        results = _launch(_ce_rank, fn, t, inputs, timeout, "vocab_parallel_ce", probe=_refuse_vocab_parallel_ce)
        loss = F.cross_entropy(logits, targets)
        loss.backward()
        for r, res in enumerate(results):           # every rank of the vocabulary split
            where = (f"world_size={t[0]}, {n} tokens, vocabulary {vocab}" + (f" (logits around {offset:g})"
                     if offset else "") + f", rank {r}")
            if "error" in res:
                raise Fail(f"{where}: {res['error']}.")
            for ph, name, numel in res["calls"]:
                if name in ("all_gather", "gather", "all_to_all") and numel >= res["shard"] * n:
                    raise Fail(f"{where}: you {name.replace('_', '-')}ed the logits ({numel} elements per rank, in "
                               f"{ph}): the point of this loss is never to build [tokens, vocab] anywhere. All-reduce "
                               f"a max, a sum of exps and the target's logit instead: a few numbers per token.")
                if numel > 3 * n:
                    raise Fail(f"{where}: your {name} of {numel} elements (in {ph}) moves as much as the logits "
                               f"({n} tokens x {res['shard']} on this rank); every all-reduce here should hold at "
                               f"most a few numbers per token.")
            a, e = _split(vocab, t[0], r)
            hint = ""
            if not torch.isfinite(res["loss"]):
                hint = (" It is not finite: exp() overflowed. Subtract the max over the *whole* vocabulary "
                        "(an all-reduce with op=MAX) before exp.")
            _close(res["loss"], loss.detach(), "the loss", where, hint or
                   " Check the three pieces: the global max (all-reduce MAX), the global sum of exp(logit - max), "
                   "and the target's logit, which only the rank whose slice holds it may contribute.")
            _close(res["grad"], logits.grad[:, a:e], "the gradient of logits_shard", where,
                   f" It must be (softmax - one_hot(target)) / tokens on this rank's columns {a}..{e - 1}; the "
                   f"target's column is target - vocab_start on the rank that owns it.")
    return ("on world sizes 2 and 3, uneven vocabularies, logits near 0 and near 800 (loss and gradient to "
            "1e-10; no collective larger than 3 numbers per token)")


# ----------------------------------------------------------------------------------
# Exercise "linear_traffic"

_STRATEGIES = ("data parallel", "column", "row")


def _traffic(strategy, B, c_in, c_out):
    """The table of CMU 15-418's lecture 25 (model and pipeline parallelism), in numbers per step; an all-reduce of N counts 2N."""
    return {"data parallel": 2 * c_out * c_in, "column": 2 * B * c_in, "row": 2 * B * c_out}[strategy]


_TRAFFIC_MISTAKES = [      # (what a wrong answer computes, the hint)
    (lambda s, B, i, o: _traffic(s, B, i, o) // 2,
     "That is the size of the tensor that is all-reduced; the table counts an all-reduce of N numbers as 2N (a "
     "reduce and a broadcast), and the column split moves B·C_in forward and again backward."),
    (lambda s, B, i, o: {"data parallel": 2 * B * i * o, "column": 2 * B * i, "row": 2 * B * o}[s],
     "Data parallelism synchronises the weight gradient, C_out x C_in numbers, whatever the batch."),
    (lambda s, B, i, o: {"data parallel": 2 * o * i, "column": 2 * B * o, "row": 2 * B * i}[s],
     "Column and row are swapped: the column split (each rank computes some outputs) needs all of X, B x C_in, "
     "and its gradient; the row split (each rank a partial sum of the output) all-reduces B x C_out."),
]


def _hints_apart(strategy, B, c_in, c_out) -> bool:
    """The mistakes that give a wrong number here give different wrong numbers."""
    want = _traffic(strategy, B, c_in, c_out)
    wrong = [w(strategy, B, c_in, c_out) for w, _ in _TRAFFIC_MISTAKES]
    wrong = [v for v in wrong if v != want]
    return len(set(wrong)) == len(wrong)


@exercise("linear_traffic", "The lecture's table: what each strategy sends for one Linear layer",
          answer="linear_traffic", notebook="03_linear_traffic", sealed=True)
def check_linear_traffic(fn, seed: int, timeout: float) -> str:
    require_function(fn, "linear_traffic", "strategy, B, c_in, c_out", "row", 1, 1, 1)
    rng = random.Random(seed)
    shapes = []
    while len(shapes) < 3:                                    # shapes on which every mistake has its own number,
        shape = (rng.randint(1, 64), rng.randint(1, 64) * 16, rng.randint(1, 64) * 8)    # so its hint is the right one
        if all(_hints_apart(st, *shape) for st in _STRATEGIES):
            shapes.append(shape)
    shapes.append((4096, 64, 48))                             # a big batch: data parallelism wins
    cases = [(strategy, B, c_in, c_out) for B, c_in, c_out in shapes for strategy in _STRATEGIES]

    def where_of(strategy, B, c_in, c_out):
        return f"B={B}, C_in={c_in}, C_out={c_out}, strategy {strategy!r}: "
    outs = sealed.call_each(fn, cases, where=lambda i: where_of(*cases[i]), timeout=timeout)
    for (strategy, B, c_in, c_out), got in zip(cases, outs):
        where = where_of(strategy, B, c_in, c_out)
        want = _traffic(strategy, B, c_in, c_out)
        try:
            check_number(got, want, what=f"{where}linear_traffic", rel_tol=1e-9, abs_tol=0.5)
        except Fail as failure:
            hint = next((h for wrong, h in _TRAFFIC_MISTAKES
                         if isinstance(got, (int, float)) and got == wrong(strategy, B, c_in, c_out) != want), "")
            raise Fail(f"{failure} {hint}".rstrip(), seed_matters=failure.seed_matters) from None
    return f"({len(shapes)} shapes x 3 strategies, each equal to the lecture's table (CMU 15-418, lecture 25: model and pipeline parallelism))"
