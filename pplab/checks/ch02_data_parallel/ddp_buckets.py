"""Check of exercise ddp_buckets (exercises/02_ddp_buckets.ipynb): DDP's gradient averaging: buckets, hooks, async all-reduce.

    ddp_buckets          attach_ddp_hooks(model, cap_bytes) -> (buckets, finish)

ddp_buckets runs on 2 and 3 sealed ranks (sealed.py): a small random MLP, a random bucket
cap, two training steps each. It checks the buckets (reverse parameter order, filled up to
the cap), that each bucket's all-reduce was started asynchronously *during* backward, from
a hook, one per bucket and in bucket order (the checker's router records every all-reduce),
and that after finish() every .grad equals the single-process gradient of the global batch
(to 1e-5). Here the library all-reduce
is allowed: the lesson is buckets and hooks, not the collective.
"""
from __future__ import annotations

import copy
import random
import torch
import torch.nn.functional as F
from torch import nn

from .. import sealed
from ..core import Fail, exercise, first_difference, require_function
from ..core import random_mlp_and_cap
from .ddp_buckets_rank import _ddp_rank, _mlp


def _ddp_trials(seed: int, world_size: int) -> list[dict]:
    """Per trial: the MLP's widths and a bucket cap. One cap is below the largest weight, so
    that a parameter must get a bucket of its own; one holds at least a whole layer."""
    rng = random.Random(seed * 31 + world_size)
    trials = []
    for small_cap in (True, False):
        widths, cap = random_mlp_and_cap(rng, 4, small_cap)                 # float32
        trials.append({"widths": widths, "cap": cap, "seed": rng.randrange(2**31)})
    return trials


def _reference_buckets(model, cap) -> list[list[str]]:
    """Parameters in reverse order; a new bucket when the next one would not fit."""
    buckets, size = [], 0
    for name, p in reversed(list(model.named_parameters())):
        nbytes = p.numel() * p.element_size()
        if not buckets or size + nbytes > cap:
            buckets.append([])
            size = 0
        buckets[-1].append(name)
        size += nbytes
    return buckets


def _check_buckets(name, model, cap, got, problem):
    """In the checker's process: the expected buckets (as names), or a Fail saying how the
    rank's buckets (`got`, names) are wrong."""
    if problem is not None:
        raise Fail(f"{name} must return (buckets, finish): buckets a list of lists of the model's parameters "
                   f"(in the order they are all-reduced), finish a function to call after loss.backward(); "
                   f"{problem}.")
    want = _reference_buckets(model, cap)
    if [set(b) for b in got] == [set(b) for b in want]:
        return want
    flat = [n for b in got for n in b]
    order = [n for n, _ in model.named_parameters()]
    nbytes = dict((n, p.numel() * p.element_size()) for n, p in model.named_parameters())
    if sorted(flat) != sorted(order):
        missing = sorted(set(order) - set(flat))
        twice = sorted({n for n in flat if flat.count(n) > 1})
        raise Fail("every parameter must be in exactly one bucket: "
                   + (f"missing {missing}" if missing else f"{twice} appear more than once") + ".")
    if flat and flat[0] != order[-1]:
        raise Fail(f"bucket 0 starts with {flat[0]!r}, but buckets follow the *reverse* of model.parameters(), "
                   f"starting with {order[-1]!r}: backward produces the last layer's gradients first, so "
                   f"the first bucket to fill must hold them (yours: {got}).")
    i = next(i for i, (a, b) in enumerate(zip(got + [[]], want + [[]])) if set(a) != set(b))
    size = sum(nbytes[n] for n in (got[i] if i < len(got) else []))
    raise Fail(f"with cap_bytes={cap}, bucket {i} should hold {want[i] if i < len(want) else 'nothing'} "
               f"({sum(nbytes[n] for n in want[i]) if i < len(want) else 0} bytes), yours holds "
               f"{got[i] if i < len(got) else 'nothing'} ({size} bytes). Parameter sizes: {nbytes}. Add "
               f"parameters to a bucket while its total stays <= cap_bytes; start a new bucket when the next "
               f"would not fit (a parameter larger than the cap gets a bucket of its own).")


def _batch(seed, i, step, p, trial):
    g = torch.Generator().manual_seed(seed * 100 + i * 10 + step)
    return torch.randn(2 * p, trial["widths"][0], generator=g), torch.randn(2 * p, trial["widths"][-1], generator=g)


def _all_reduces(collectives, step) -> list:
    """(elements, async, during backward) of each all-reduce of a step, from the router's record (float32)."""
    return [(c["bytes"] // 4, c["async"], c["phase"].endswith("backward")) for c in collectives
            if c["kind"] == "all_reduce" and c["phase"].startswith(f"step {step} ")]


def _check_launches(step, buckets, sizes, calls):
    where = f"step {step}: "
    seen = [n for n, _, _ in calls]
    if len(calls) != len(buckets) or seen != sizes:
        # elements are counted as float32 (4 bytes): a 2-byte buffer shows up as half of its bucket
        halved = len(seen) == len(sizes) and all(e in (2 * n, 2 * n + 1) for n, e in zip(seen, sizes))
        hint = (" Each carried half the bytes of its bucket's float32 gradients: all-reduce each bucket in "
                "the gradients' own dtype (a bfloat16 or float16 buffer halves the traffic but rounds every "
                "gradient)." if halved else "")
        raise Fail(f"{where}expected {len(buckets)} all-reduce(s), one per bucket in bucket order, of "
                   f"{sizes} elements; saw {len(calls)}, of {seen} elements (call "
                   f"comm.all_reduce or dist.all_reduce through its module, on one flat buffer per bucket).{hint}")
    for b, (_, async_op, during) in enumerate(calls):
        if not during:
            raise Fail(f"{where}bucket {b}'s all-reduce started only after loss.backward() returned: start it "
                       f"from a post-accumulate-grad hook as soon as the bucket's last gradient is in, so it "
                       f"overlaps with the rest of backward.")
        if not async_op:
            raise Fail(f"{where}bucket {b}'s all-reduce was blocking, so backward stopped until it was done: "
                       f"pass async_op=True, keep the handle and wait for it in finish().")


def _references(model, trial, seed, i, step, rank, p):
    """The single-process gradients of the global batch, and of this rank's part alone."""
    X, Y = _batch(seed, i, step, p, trial)
    single, local = copy.deepcopy(model), copy.deepcopy(model)
    for m, x, y in ((single, X, Y), (local, X[2 * rank:2 * rank + 2], Y[2 * rank:2 * rank + 2])):
        m.zero_grad()
        F.mse_loss(m(x), y).backward()
    return single, local


def _check_grads(step, rank, p, grads, single, local):
    for (pname, ref), mine in zip(single.named_parameters(), local.parameters()):
        where = f"step {step}: rank {rank}'s {pname}.grad"
        grad = grads[pname]
        if grad is None:
            raise Fail(f"{where} is None after finish(): copy the averaged bucket back into each .grad.")
        diff = first_difference(grad, ref.grad, atol=1e-5, rtol=1e-4)
        if diff is None:
            continue
        hint = ""
        if torch.allclose(grad, p * ref.grad, atol=1e-5, rtol=1e-4):
            hint = f" It is {p} times that: the all-reduce sums the ranks' gradients; divide by the world size."
        elif torch.allclose(grad, mine.grad, atol=1e-6, rtol=1e-5):
            hint = " It is this rank's own gradient: the averaged bucket never made it back into .grad."
        raise Fail(f"{where} differs from the single-process gradient of the whole global batch {diff}.{hint}")


def _check_ddp(name, trials, seed):
    def check(p, i, observed, traffic):
        trial = trials[p][i]
        model = _mlp(trial["widths"], trial["seed"])
        for rank, seen in sorted(observed.items()):
            buckets = _check_buckets(name, model, trial["cap"], seen["buckets"], seen["problem"])
            params = dict(model.named_parameters())
            sizes = [sum(params[n].numel() for n in b) for b in buckets]
            if len(seen["steps"]) != 2:
                raise Fail(f"rank {rank} did not finish its 2 training steps.")
            for step, done in enumerate(seen["steps"]):
                _check_launches(step, buckets, sizes, _all_reduces(traffic[rank]["collectives"], step))
                _check_grads(step, rank, p, done["grads"], *_references(model, trial, seed, i, step, rank, p))
    return check


@exercise("ddp_buckets", "DDP's gradient averaging: buckets, hooks, async all-reduce", answer="attach_ddp_hooks",
          notebook="02_ddp_buckets", sealed=True)
def check_ddp_buckets(fn, seed: int, timeout: float) -> str:
    """attach_ddp_hooks(model, cap_bytes) -> (buckets, finish): after loss.backward() and
    finish(), every rank's .grad is the mean over ranks (= the global batch's gradient)."""
    require_function(fn, "ddp_buckets", "model, cap_bytes", nn.Linear(1, 1), 100)
    trials = {p: _ddp_trials(seed, p) for p in (2, 3)}

    def describe(world_size, i):
        t = trials[world_size][i]
        return f"world_size={world_size}, MLP widths {t['widths']}, cap_bytes={t['cap']}"
    for p in trials:
        inputs = []
        for i, t in enumerate(trials[p]):
            parameters = [q.detach().clone() for q in _mlp(t["widths"], t["seed"]).parameters()]
            batches = [_batch(seed, i, step, p, t) for step in range(2)]
            expected = _reference_buckets(_mlp(t["widths"], 0), t["cap"])   # names only: the checker's rule stays here
            inputs.append([{"widths": t["widths"], "cap": t["cap"], "parameters": parameters, "expected": expected,
                            "batches": [(X[2 * r:2 * r + 2], Y[2 * r:2 * r + 2]) for X, Y in batches]}
                           for r in range(p)])
        sealed.run_sealed(_ddp_rank, fn, inputs, world_size=p, timeout=timeout, exercise=("ddp_buckets", "DDP"),
                          forbidden=(), describe=describe, check=_check_ddp(fn.__name__, trials, seed))
    return ("on world sizes 2 and 3 (4 random MLPs and bucket caps, 2 steps each: buckets in reverse order up to "
            "the cap, one async all-reduce per bucket started during backward, .grad = the global batch's "
            "gradient to 1e-5)")
