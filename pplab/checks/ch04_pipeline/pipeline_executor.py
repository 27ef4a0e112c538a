"""Check of chapter 4's harder exercise: the executor loop that runs a schedule on real ranks
(sealed ranks, sealed.py: the model and the micro-batches come from the checker).

    pipeline_executor   run_actions(actions, stage, microbatches, loss_fn, prev_rank, next_rank)

Rank r holds stage r of a float64 model (each stage Linear(d, d) + Tanh, the same width
all along, so a message has the shape of the micro-batch's input) and gets its list of
actions from a pplab.pipeline schedule: 1F1B with m = p and with m not a multiple of p,
and GPipe, on p = 2, 3 and 4 ranks. The answer runs the actions with pplab.comm's
point-to-point calls; the check watches what it does through the stage it is given: the
stage records every forward's input and, through a hook on the output, every gradient
that flows back into the output (which is when a backward runs). In the checker's process
these are matched against a single-process run of the whole model:

* every forward's input is the activation of one micro-batch at this stage (else: the
  previous rank sent the wrong tensor);
* every output gradient is d(loss)/d(output) of that micro-batch, for the loss of the
  whole step, the mean of the m micro-batch losses, or m times that (a loop may divide
  the gradients by m at the end instead); else the next rank sent the wrong tensor back;
* the order of F and B each rank ran is its list of actions, exactly;
* every parameter's .grad equals the single-process gradient of the whole batch
  (float64, to 1e-9 relative).

Ranks that stop, waiting on each other, are reported as a deadlock (or a hang) with where
each rank had got to.
"""
from __future__ import annotations

import random
import torch
from torch import nn

from .. import sealed
from ..core import Fail, exercise, first_difference, require_function
from ..core import _fmt
from .pipeline_executor_rank import _executor_rank, _refuse_executor


_ATOL, _RTOL = 1e-12, 1e-9


def _trials(seed: int, p: int) -> list[dict]:
    """1F1B with m not a multiple of p, 1F1B with m = p or 2p, GPipe: width d, micro-batch size b."""
    rng = random.Random(seed * 7 + p)
    ms = [("1f1b", p + rng.randint(1, p - 1)), ("1f1b", p * rng.randint(1, 2)), ("gpipe", rng.randint(2, 5))]
    return [{"schedule": name, "m": m, "d": rng.randint(3, 6), "b": rng.randint(1, 3), "seed": rng.randrange(2**31)}
            for name, m in ms]


def _stages(trial, p) -> list[nn.Module]:
    torch.manual_seed(trial["seed"])                     # the same model on every rank
    return [nn.Sequential(nn.Linear(trial["d"], trial["d"], dtype=torch.float64), nn.Tanh()) for _ in range(p)]


def _microbatches(trial, seed, t):
    g = torch.Generator().manual_seed(seed * 1000 + t)
    shape = (trial["m"], trial["b"], trial["d"])
    xs, ys = torch.randn(shape, generator=g, dtype=torch.float64), torch.randn(shape, generator=g, dtype=torch.float64)
    return [(x, y) for x, y in zip(xs, ys)]


def _reference(trial, seed, t, p):
    """Single process: each stage's input and output gradient per micro-batch (for a loss
    that is the mean of the m micro-batch losses), and each stage's parameter gradients
    from the whole batch at once."""
    stages, mbs = _stages(trial, p), _microbatches(trial, seed, t)
    m, loss_fn = len(mbs), nn.MSELoss()
    inputs, out_grads = [[None] * m for _ in range(p)], [[None] * m for _ in range(p)]
    for i, (x, y) in enumerate(mbs):
        h, outs = x, []
        for s, stage in enumerate(stages):
            inputs[s][i] = h.detach()
            h = stage(h)
            h.retain_grad()
            outs.append(h)
        (loss_fn(h, y) / m).backward()
        for s in range(p):
            out_grads[s][i] = outs[s].grad.detach()
    for stage in stages:
        stage.zero_grad()
    X, Y = torch.cat([x for x, _ in mbs]), torch.cat([y for _, y in mbs])
    h = X
    for stage in stages:
        h = stage(h)
    loss_fn(h, Y).backward()                              # the whole batch in one process
    grads = [{n: q.grad for n, q in stage.named_parameters()} for stage in stages]
    return inputs, out_grads, grads, m


def _close(a, b) -> bool:
    return isinstance(a, torch.Tensor) and a.shape == b.shape and torch.allclose(a, b, atol=_ATOL, rtol=_RTOL)


def _order(events, inputs, r):
    """[("F", i) or ("B", i)] from what the stage saw, and the gradient each B brought."""
    ran, forwards, brought = [], [], []
    for e in events:
        if e[0] == "F":
            i = next((i for i, a in enumerate(inputs[r]) if _close(e[1], a)), None)
            if i is None:
                hint = ""
                if r > 0 and any(_close(e[1], a) for a in inputs[r - 1]):
                    hint = f" It is the input of rank {r - 1}'s stage: send on its output, out = stage(x)."
                raise Fail(f"forward {len(forwards)} of rank {r}'s stage got an input that is not the activation of "
                           f"any micro-batch at stage {r}: "
                           + ("stage 0 reads micro-batch i's input, microbatches[i][0]." if r == 0 else
                              f"it must be what rank {r - 1}'s stage output for that micro-batch.") + hint)
            forwards.append(i)
            ran.append(("F", i))
        else:
            i = forwards[e[1]]
            ran.append(("B", i))
            brought.append((i, e[2]))
    return ran, brought


def _check_gradient_in(r, p, m, i, grad, out_grads):
    want = out_grads[r][i]
    if _close(grad, want) or _close(grad, m * want):     # a loop may divide by m at the end instead
        return
    where = f"the gradient that reached rank {r}'s stage output for micro-batch {i}"
    if r == p - 1:
        raise Fail(f"{where} is not d(loss)/d(output) of loss_fn(output, target) / m: the last stage's backward "
                   f"starts from that loss, with the target microbatches[{i}][1].")
    hint = ""
    if _close(grad, out_grads[r + 1][i]):
        hint = (f" It is the gradient of rank {r + 1}'s *output*, which rank {r + 1} received: send back the "
                f"gradient of its stage's *input* (x.grad, after backward, with x.requires_grad_() set on receipt).")
    elif isinstance(grad, torch.Tensor) and grad.shape == want.shape and not grad.any():
        hint = f" It is all zeros: did rank {r + 1} set x.requires_grad_() on the activation it received?"
    raise Fail(f"{where} differs from d(loss)/d(output) of one process: rank {r + 1} must send back the gradient "
               f"of its stage's input for that micro-batch.{hint}")


def _shown(order) -> str:
    return " ".join(f"{k}{i}" for k, i in order) or "nothing"


def _check_executor(trials, seed, stuck):
    def check(p, t, observed, traffic):
        stuck.clear()
        trial = trials[p][t]
        inputs, out_grads, grads, m = _reference(trial, seed, t, p)
        from ...pipeline import make_schedule
        schedule = make_schedule(trial["schedule"], p, trial["m"])
        ran = {}
        for r in sorted(observed):                       # forward direction: inputs
            ran[r] = _order(observed[r]["events"], inputs, r)
        for r in sorted(observed, reverse=True):         # backward direction: gradients
            for i, grad in ran[r][1]:
                _check_gradient_in(r, p, m, i, grad, out_grads)
        for r in sorted(observed):
            order, want = ran[r][0], [(a.kind, a.microbatch) for a in schedule.actions[r]]
            done = observed[r]["done"]
            if order == want[:len(order)] and (not done or len(order) == len(want)):
                stuck[r] = f"rank {r} had run {_shown(order)}" + \
                    (f", next {_shown(want[len(order):len(order) + 1])}" if len(order) < len(want) else "")
                continue
            j = next((j for j, (a, b) in enumerate(zip(order, want)) if a != b), min(len(order), len(want)))
            did = f"ran {_shown(order[j:j + 1])}" if j < len(order) else "stopped"
            says = f"the schedule says {_shown(want[j:j + 1])}" if j < len(want) else "its actions were all done"
            raise Fail(f"rank {r} ran {_shown(order)}, but its actions are {_shown(want)}: at step {j} it {did} where "
                       f"{says}. Run this rank's actions in their order, each once (a forward is a call of stage(x), "
                       f"a backward is the backward through that forward's output).")
        for r in sorted(r for r in observed if observed[r]["done"]):
            for name, want in grads[r].items():
                got = observed[r]["grads"][name]
                where = f"rank {r}'s stage {name}.grad"
                if got is None:
                    raise Fail(f"{where} is None: a backward must accumulate the weights' gradients too (torch."
                               f"autograd.backward(out, grad), or loss.backward() on the last stage), not only the "
                               f"input's (torch.autograd.grad does not fill .grad).")
                diff = first_difference(got, want, atol=_ATOL, rtol=_RTOL)
                if diff is None:
                    continue
                index, g, w = diff
                if _close(got, m * want):
                    hint = (f" It is {m} times that: the step's loss is the mean of the m = {m} micro-batch losses, so "
                            f"divide each micro-batch's loss by m before its backward.")
                else:
                    hint = " Every micro-batch's backward must add into .grad (do not zero it between micro-batches)."
                raise Fail(f"{where} at {index} is {_fmt(g)}, but the single-process gradient of the whole batch "
                           f"is {_fmt(w)}.{hint}")
    return check


@exercise("pipeline_executor", "The 1F1B executor loop on real ranks", answer="run_actions",
          notebook="04_pipeline_executor", sealed=True,
          preload=('pplab.pipeline',))
def check_pipeline_executor(fn, seed: int, timeout: float) -> str:
    """run_actions(actions, stage, microbatches, loss_fn, prev_rank, next_rank) on every rank."""
    require_function(fn, "pipeline_executor", "actions, stage, microbatches, loss_fn, prev_rank, next_rank",
                     [], None, [], None, None, None)
    trials = {p: _trials(seed, p) for p in (2, 3, 4)}

    def describe(p, t):
        tr = trials[p][t]
        return f"p={p} ranks, {tr['schedule']} with m={tr['m']} micro-batches of {tr['b']}x{tr['d']}"
    for p in trials:
        stuck = {}
        inputs = [[{"schedule": tr["schedule"], "m": tr["m"], "d": tr["d"], "microbatches": _microbatches(tr, seed, t),
                    "parameters": [q.detach().clone() for q in stage.parameters()]}
                   for stage in _stages(tr, p)] for t, tr in enumerate(trials[p])]
        try:
            sealed.run_sealed(_executor_rank, fn, inputs, world_size=p, timeout=timeout,
                              exercise=("pipeline_executor", "the executor"), forbidden=(), probe=_refuse_executor,
                              describe=describe, check=_check_executor(trials, seed, stuck))
        except Fail as failure:
            if stuck and ("still" in str(failure) or "a deadlock" in str(failure)):   # say where each rank got to
                raise Fail(f"{failure} Where the ranks stopped: {'; '.join(stuck[r] for r in sorted(stuck))}. A send "
                           f"that waits for its receiver (comm.send) can deadlock a schedule: post sends with "
                           f"send(...) (comm.isend) and wait for them at the end of the step.") from None
            raise
    return ("on p = 2, 3, 4 ranks (1F1B with m = p or 2p and m not a multiple of p, GPipe): every rank ran its "
            "actions in order, every message was the right tensor, and every .grad equals the single-process "
            "gradient of the whole batch (float64, to 1e-9)")
