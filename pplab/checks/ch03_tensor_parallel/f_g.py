"""Check of exercise f_g (exercises/03_f_g.ipynb): Megatron's f and g: conjugate autograd operators.

    f_g                   f_and_g() -> (f, g), each called as f(x, group)
"""
from __future__ import annotations

import torch

from ..core import Fail, exercise, require_function
from .f_g_rank import _fg_rank
from .tp_trials import TOL, _close, _comm, _data, _launch, _trials, _where


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
