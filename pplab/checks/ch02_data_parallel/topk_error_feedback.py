"""Check of exercise topk_error_feedback (exercises/02_topk_error_feedback.ipynb): Top-k gradient compression with error feedback.

    topk_error_feedback  topk_ef_step(grad, memory, k) -> (values, indices, new_memory)

topk_error_feedback needs no ranks: a few seeded runs of 5 steps each, checking the
exact top-k by magnitude of grad + memory, and that what was sent plus the memory always
equals the sum of the gradients so far.

"""
from __future__ import annotations

import random
import torch

from .. import sealed
from ..core import Fail, exercise, first_difference, require_function
from ..core import _fmt
from .topk_error_feedback_rank import _topk_rank


def _unpack_topk(name, out, d, k, where):
    if not (isinstance(out, (tuple, list)) and len(out) == 3 and all(isinstance(t, torch.Tensor) for t in out)):
        raise Fail(f"{where}{name} must return three tensors (values, indices, new_memory), got "
                   f"{type(out).__name__}.", seed_matters=False)
    values, indices, memory = out
    if indices.dtype.is_floating_point or indices.dtype == torch.bool or tuple(indices.shape) != (k,):
        raise Fail(f"{where}indices must be an integer tensor of shape ({k},) (k entries), got "
                   f"{indices.dtype}{tuple(indices.shape)}.")
    if tuple(values.shape) != (k,) or tuple(memory.shape) != (d,):
        raise Fail(f"{where}values must have shape ({k},) and new_memory ({d},), like grad; got "
                   f"{tuple(values.shape)} and {tuple(memory.shape)}.")
    if not bool(((indices >= 0) & (indices < d)).all()) or len(set(indices.tolist())) != k:
        raise Fail(f"{where}indices must be {k} different positions in 0..{d - 1}, got {sorted(indices.tolist())}.")
    return values.double(), indices.long(), memory.double()


def _top(x, k) -> set:
    return set(x.topk(k).indices.tolist())


def _check_selection(grad, a, chosen, k, where):
    mags, rest = a.abs(), sorted(set(range(len(a))) - chosen)
    small = min(chosen, key=lambda i: mags[i])
    if not rest or mags[small] >= mags[rest].max():
        return
    big = max(rest, key=lambda i: mags[i])
    hints = []                                          # both can fit the same choice: say both
    if chosen == _top(a, k):
        hints.append(" You picked the k largest *values*: pick by magnitude, |a|, so that a large negative entry "
                     "counts as much as a large positive one (a.abs().topk(k)).")
    if chosen == _top(grad.abs(), k):
        hints.append(" You picked the k largest entries of |grad| alone: add the memory first, a = grad + memory, "
                     "and pick the k largest of |a| (that is how what was left out earlier gets sent).")
    hint = " Or:".join(hints)
    raise Fail(f"{where}you sent index {small} (grad + memory = {_fmt(a[small].item())}) but not index {big} "
               f"(grad + memory = {_fmt(a[big].item())}), which is larger in magnitude: top-k sends the k entries "
               f"of grad + memory largest in magnitude.{hint}")


@exercise("topk_error_feedback", "Top-k gradient compression with error feedback", answer="topk_ef_step",
          notebook="02_topk_error_feedback", sealed=True)
def check_topk_error_feedback(fn, seed: int, timeout: float) -> str:
    """topk_ef_step(grad, memory, k) -> (values, indices, new_memory): the k entries of
    a = grad + memory largest in magnitude, and new_memory = a - what was sent."""
    require_function(fn, "topk_error_feedback", "grad, memory, k", torch.zeros(3), torch.zeros(3), 1)
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    runs = [(rng.randint(20, 200), None) for _ in range(3)] + [(rng.randint(5, 20), "all")]
    steps = []                                          # (grad, k, first step of its run), computed here
    for run, (d, k) in enumerate(runs):
        k = d if k == "all" else [1, rng.randint(2, d // 4), rng.randint(d // 4, d - 1)][run]
        steps += [(torch.randn(d, generator=g) * rng.choice([0.1, 1.0, 10.0]), k, step == 0) for step in range(5)]

    def where_of(i):
        grad, k, _ = steps[i]
        return f"d={len(grad)}, k={k}, step {i % 5} of a run that starts from memory = 0: "
    outs = sealed.call_each(fn, steps, where=where_of, timeout=timeout, job=_topk_rank)
    for i, ((grad, k, first), out) in enumerate(zip(steps, outs)):
        d, where = len(grad), where_of(i)
        if first:
            memory = torch.zeros(d)
            grads_so_far, sent_so_far = torch.zeros(d, dtype=torch.float64), torch.zeros(d, dtype=torch.float64)
        values, indices, new_memory = _unpack_topk(fn.__name__, out, d, k, where)
        a = grad.double() + memory.double()
        _check_selection(grad.double(), a, set(indices.tolist()), k, where)
        diff = first_difference(values, a[indices], atol=1e-6, rtol=1e-6)
        if diff is not None:
            j, got, want = diff
            also = " (that is grad alone: send grad + memory)" if abs(got - grad[indices[j]].item()) < 1e-6 \
                else ""
            raise Fail(f"{where}values[{j}] is {_fmt(got)} but the entry at indices[{j}] = {indices[j].item()} "
                       f"of grad + memory is {_fmt(want)}{also}.")
        grads_so_far += grad.double()
        sent_so_far.index_add_(0, indices, values)
        diff = first_difference(sent_so_far + new_memory, grads_so_far, atol=1e-5, rtol=1e-5)
        if diff is not None:
            j, got, want = diff
            hint = " new_memory is all zeros: error feedback keeps what was not sent." if \
                not new_memory.any() and k < d else ""
            raise Fail(f"{where}what was sent so far + new_memory should equal the sum of the gradients so far "
                       f"(nothing lost, only late), but at index {j} it is {_fmt(got)}, not {_fmt(want)}: "
                       f"new_memory = (grad + memory) with the sent entries set to 0.{hint}")
        memory = new_memory.float()
    return (f"on {len(runs)} seeded runs of 5 steps (d from 5 to 200, k from 1 to d): exact top-k of |grad + memory|, "
            f"and sent + memory = the sum of the gradients at every step (to 1e-5)")
