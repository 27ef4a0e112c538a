"""Check of exercise row_parallel_linear (exercises/03_row_parallel_linear.ipynb): A row-parallel Linear layer from a dense one.

    row_parallel_linear   row_parallel_from_dense(dense, group=None) -> module
"""
from __future__ import annotations

import random
import torch
from torch import nn

from ..core import Fail, exercise, require_function
from .row_parallel_linear_rank import _refuse_row_parallel, _row_rank
from .tp_trials import TOL, _close, _comm, _data, _launch, _split, _trials, _where


def _member_ranks(members, p, rank):
    """The ranks of `rank`'s group: all of them, or the sub-group it is in."""
    return list(range(p)) if members is None else next(m for m in members if rank in m)


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
