"""Chapter 3b's exercise: one linear layer Y = XW by 3D tensor parallelism on 8 ranks (2 x 2 x 2).

    linear_3d   linear_3d(x, w, cube) -> this rank's piece of Y, differentiable in x and w

`cube` has q, this rank's place i, j, l (global rank i·q² + j·q + l) and the three lines of q
ranks through it: group_i (i varies), group_j (j varies), group_l (l varies). Rank (i, j, l)
holds X's rows i·q + j (of q² row pieces), columns l (of q) and W's rows l·q + i (of q²),
columns j (of q); it returns Y's rows i·q + l, columns j (pplab.tensor_parallel.tp3d's layout).

The check runs the answer on 8 real sealed ranks, in float64, for hidden random shapes, against
the dense product on one process (tolerance 1e-10), every rank. Graded in 3 parts (partial
credit): forward (y), backward (x.grad and w.grad), traffic: the bytes each rank puts on the wire
in each phase, from the router's record, at most the 3D algorithm's (q-1)·(B·in + in·out + B·out)/q³
elements forward and the same backward. A collective's wire bytes per rank are those of the
ring (all-gather: (g-1)·piece; reduce-scatter: (g-1)/g·input; all-reduce: twice that) and, for
broadcasts, reduces and all-to-alls, (g-1)/g·tensor, the average over the group. Traffic is
judged in a phase only where that phase's values are right.
"""
from __future__ import annotations

import random
import torch

from .. import sealed
from ..core import Fail, Parts, exercise, first_difference, require_function
from .linear_3d_rank import Q, WORLD, _place, _rank_job, _refuse_tp3d


TOL = 1e-10


PARTS = {"forward": "forward", "backward": "backward", "traffic": "traffic"}


def _data(seed, *shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _piece(t, row_parts, row, col_parts, col):
    r, c = t.shape[0] // row_parts, t.shape[1] // col_parts
    return t[row * r:(row + 1) * r, col * c:(col + 1) * c].clone()


def _problem(rng):
    B, c_in, c_out = Q * Q * rng.randint(1, 3), Q * Q * rng.randint(1, 3), Q * rng.randint(1, 3)
    x, w, up = _data(rng.randrange(2**31), B, c_in), _data(rng.randrange(2**31), c_in, c_out), \
        _data(rng.randrange(2**31), B, c_out)
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = xr @ wr
    (y * up).sum().backward()
    return {"B": B, "in": c_in, "out": c_out, "x": x, "w": w, "up": up, "y": y.detach(), "dx": xr.grad, "dw": wr.grad}


def _inputs(prob, rank):
    i, j, l = _place(rank)
    return {"x": _piece(prob["x"], Q * Q, i * Q + j, Q, l), "w": _piece(prob["w"], Q * Q, l * Q + i, Q, j),
            "up": _piece(prob["up"], Q * Q, i * Q + l, Q, j)}


def _expected(prob, rank):
    i, j, l = _place(rank)
    return {"y": _piece(prob["y"], Q * Q, i * Q + l, Q, j), "x.grad": _piece(prob["dx"], Q * Q, i * Q + j, Q, l),
            "w.grad": _piece(prob["dw"], Q * Q, l * Q + i, Q, j)}


def _own_terms(prob, rank):
    """What a rank holds before the sums over l (forward), j (dX) and i (dW): the usual mistake."""
    i, j, l = _place(rank)
    x_il = _piece(prob["x"], Q, i, Q, l)
    w_lj = _piece(prob["w"], Q, l, Q, j)
    dy_ij = _piece(prob["up"], Q, i, Q, j)
    return {"y": _piece(x_il @ w_lj, Q, l, 1, 0), "x.grad": _piece(dy_ij @ w_lj.T, Q, j, 1, 0),
            "w.grad": _piece(x_il.T @ dy_ij, Q, i, 1, 0)}


_SUM_HINT = {"y": "the l-th row piece of this rank's own term X_il·W_lj: Y_ij is the sum of the q terms over l "
                  "(reduce-scatter along group_l)",
             "x.grad": "this rank's piece of its own term dY_ij·W_lj^T: dX_il sums those over j (reduce-scatter "
                       "along group_j)",
             "w.grad": "this rank's piece of its own term X_il^T·dY_ij: dW_lj sums those over i (reduce-scatter "
                       "along group_i)"}


def _wire(kind, nbytes, g):
    """Bytes one rank puts on the wire for a collective of `nbytes` (its input) over g ranks."""
    if kind in ("all_gather_into_tensor", "all_gather"):
        return (g - 1) * nbytes
    if kind == "all_reduce":
        return 2 * (g - 1) / g * nbytes
    return (g - 1) / g * nbytes                 # reduce-scatter (ring), broadcast, reduce, all-to-all (average)


def _sent(traffic, phase):
    coll = sum(_wire(c["kind"], c["bytes"], len(c["group"])) for c in traffic["collectives"] if c["phase"] == phase)
    return coll + sum(n for _, n in traffic["sends_in"].get(phase, []))


def formula_bytes(B, c_in, c_out, q=Q):
    """3D's bytes per rank in one phase (forward or backward), float64."""
    return (q - 1) * (B * c_in + c_in * c_out + B * c_out) / q ** 3 * 8


def _judge_values(prob, observed, parts, where):
    for part, names in (("forward", ("y",)), ("backward", ("x.grad", "w.grad"))):
        for rank in sorted(observed):                   # every rank's values
            want, own = _expected(prob, rank), _own_terms(prob, rank)
            problem = None
            for name in names:
                got = observed[rank].get(name)
                if not torch.is_tensor(got):
                    problem = (f"{name} is {got!r}" + (": return this rank's piece of Y, a tensor computed from "
                               "x and w so that backward reaches them" if name == "y" else
                               ": y's backward never reached it (build y from x and w with autograd, or an "
                               "autograd.Function whose backward returns both gradients)"))
                elif got.shape != want[name].shape:
                    problem = f"{name} has shape {list(got.shape)}, expected {list(want[name].shape)}"
                else:
                    diff = first_difference(got, want[name], atol=TOL)
                    if diff is not None:
                        hint = ""
                        if torch.allclose(got, own[name], atol=TOL, rtol=0):
                            hint = f" It is {_SUM_HINT[name]}."
                        problem = (f"{name} differs from the single-process value {diff}.{hint}")
                if problem:
                    break
            if problem:
                i, j, l = _place(rank)
                parts.note(part, f"rank {rank} (i={i}, j={j}, l={l}): {problem}" + ("" if problem.endswith(".") else "."), where)
                break


def _traffic_problem(prob, observed, traffic, right):
    """What is wrong with the bytes the ranks sent in the phases that computed the right values
    (`right`: phase -> bool), or None: 3D's bytes per rank are the bound."""
    if not any(right.values()):
        return "no phase computed the right values, so its traffic cannot be judged."
    limit = formula_bytes(prob["B"], prob["in"], prob["out"])
    over = [(phase, rank, _sent(traffic[rank], phase)) for phase in ("forward", "backward") if right[phase]
            for rank in sorted(observed)]                   # every rank's bytes
    phase, rank, got = next(((ph, r, b) for ph, r, b in over if b > limit * (1 + 1e-9)), (None, None, 0))
    if phase is None:
        return None
    kinds = sorted({c["kind"] for c in traffic[rank]["collectives"] if c["phase"] == phase})
    how = ("an all-reduce sends twice a reduce-scatter's bytes, and each rank keeps only its piece of "
           "the sum: reduce-scatter the terms instead" if "all_reduce" in kinds else
           "gather only the blocks one product needs (X_il along group_j, W_lj along group_i) and "
           "reduce-scatter, rather than gathering whole matrices")
    return (f"rank {rank} put {got:.0f} bytes on the wire in the {phase} ({', '.join(kinds)}), where 3D needs "
            f"(q-1)·(B·in + in·out + B·out)/q³ · 8 = {limit:.0f}: {how}.")


@exercise("linear_3d", "3D tensor parallelism: one linear layer on a 2x2x2 cube", answer="linear_3d",
          notebook="03b_linear_3d", sealed=True, points=len(PARTS),
          preload=("pplab.tensor_parallel.tp3d",))
def check_linear_3d(fn, seed: int, timeout: float) -> str:
    """linear_3d(x, w, cube): Y = XW by 3D tensor parallelism, forward and backward, on every rank."""
    require_function(fn, "linear_3d", "x, w, cube", None, None, None)
    rng = random.Random(seed)
    problems = [_problem(rng) for _ in range(2)]
    parts = Parts(list(PARTS.values()))

    def describe(p, n):
        t = problems[n]
        return f"world_size={p} (2x2x2 cube), X [{t['B']}, {t['in']}], W [{t['in']}, {t['out']}]"

    def check(p, n, observed, traffic):
        if len(observed) < p:
            return
        _judge_values(problems[n], observed, parts, describe(p, n))
        problem = _traffic_problem(problems[n], observed, traffic,
                                   {ph: not parts.problems[ph] for ph in ("forward", "backward")})
        if problem:
            parts.note("traffic", problem, describe(p, n))

    inputs = [[_inputs(prob, r) for r in range(WORLD)] for prob in problems]
    try:
        sealed.run_sealed(_rank_job, fn, inputs, world_size=WORLD, timeout=timeout,
                          exercise=("linear_3d", "the 3D linear layer"), forbidden=(), probe=_refuse_tp3d,
                          describe=describe, check=check)
    except Fail as failure:
        raise parts.aborted(failure) from None
    return parts.finish(f"on {WORLD} ranks (a 2x2x2 cube, two hidden shapes): y, x.grad and w.grad on every rank "
                        f"equal one process's to {TOL:g}, and each rank's bytes on the wire within 3D's "
                        f"(q-1)·(B·in + in·out + B·out)/q³ per phase")
