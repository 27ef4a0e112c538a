"""Check of chapter 11a's exercise: DualPipe's overlapped pair, one micro-batch's forward
computing while another's backward communicates.

    overlapped_step    overlapped_step(first, last, inputs)   on 2 ranks: four micro-batches, two
                                                              starting on each rank, DualPipe's order

Runs on 2 sealed ranks (the pair needs both ends of a two-way pipeline; more ranks would need
DualPipe's whole schedule), 3 trials with different sizes and stand-in compute times. Each rank
gets its two chunks (pplab.overlap.Chunk: the first stage for its own micro-batches, the last stage
for the other rank's; every forward and backward padded to the trial's t_f, 2 t_f), its own two
micro-batches, and nothing of the reference. Graded in two parts:

    gradients  every parameter gradient of both chunks on both ranks against one process's: the
               first chunk's from the rank's own two micro-batches, the last chunk's from the other
               rank's (relative tolerance 1e-4: the same float32 operations in another order agree
               to about 1e-6).
    overlap    on every rank, the gradient of the other rank's micro-batch 0 (from the last chunk's
               B0) is posted before the first chunk's F1 starts (the router's record: a message to
               the other rank between the two), and the time from its post to its wait lies under
               that rank's compute: the fraction read from the rank's own trace (pplab.overlap.hidden's
               definition, the send as the rank saw it) is at least 30% in one of the 3 trials. A
               correct answer measures about 90% (the wait comes after F1's stand-in 20-40 ms); a
               send waited for at once, 0%.
"""
from __future__ import annotations

import random

import torch

from ...overlap.hidden import hidden_fraction
from ...trace import Event, Timeline
from .overlapped_step_rank import _rank_job, _refuse_dualpipe
from .. import sealed
from ..core import Fail, Parts, exercise, require_function

PARTS = ("gradients", "overlap")
THRESHOLD = 0.3               # the best of the trials, per rank: loose, so that a loaded machine still passes


def _trials(seed):
    rng = random.Random(seed * 7 + 11)
    trials = []
    for t_f in (0.02, 0.03, 0.04):
        h, rows = rng.randint(3, 6), rng.randint(2, 4)
        g = torch.Generator().manual_seed(rng.randrange(2**31))
        trials.append({"h": h, "rows": rows, "t_f": t_f,
                       "w0": torch.randn(h, h, generator=g) / h ** 0.5, "b0": torch.randn(h, generator=g),
                       "w1": torch.randn(h, h, generator=g) / h ** 0.5, "b1": torch.randn(h, generator=g),
                       "x": torch.randn(2, 2, rows, h, generator=g),           # [rank it starts on, micro-batch]
                       "y": torch.randn(2, 2, rows, h, generator=g) * 2})
    return trials


def _inputs(t, rank):
    peer = 1 - rank
    return {"rank": rank, "t_f": t["t_f"], "w0": t["w0"], "b0": t["b0"], "w1": t["w1"], "b1": t["b1"],
            "inputs": [t["x"][rank, m] for m in range(2)], "targets": [t["y"][peer, m] for m in range(2)],
            "scale": float(4 * t["rows"])}


def _reference(t, start, swapped=False):
    """One process: the gradients of stage 0 and of stage 1 from the two micro-batches that start on
    rank `start` (swapped: stage 0's backward given the other micro-batch's output gradient)."""
    w0, b0, w1, b1 = (t[k].clone().requires_grad_() for k in ("w0", "b0", "w1", "b1"))
    acts = [torch.tanh(t["x"][start, m] @ w0.T + b0) for m in range(2)]
    outs = [a.detach().requires_grad_() for a in acts]
    loss = sum((((o @ w1.T + b1) - t["y"][start, m]) ** 2).sum() for m, o in enumerate(outs)) / (4 * t["rows"])
    loss.backward()
    grads = [o.grad for o in outs][::-1] if swapped else [o.grad for o in outs]
    torch.autograd.backward(acts, grads)
    return {"first": [w0.grad, b0.grad], "last": [w1.grad, b1.grad]}


def _judge_gradients(t, observed, parts, where):
    for rank in (0, 1):                                  # every rank, both chunks
        got = observed[rank]["grads"]
        for chunk, start in (("first", rank), ("last", 1 - rank)):
            want = _reference(t, start)[chunk]
            for name, g, w in zip(("weight", "bias"), got[chunk], want):
                if isinstance(g, torch.Tensor) and g.shape == w.shape and torch.allclose(g, w, rtol=1e-4, atol=1e-6):
                    continue
                whose = "its own micro-batches" if chunk == "first" else f"rank {1 - rank}'s micro-batches"
                if g is None:
                    problem = f"rank {rank}'s {chunk} chunk has no {name} gradient: run backward of both of " \
                              f"{whose} on it."
                elif not isinstance(g, torch.Tensor) or g.shape != w.shape:
                    problem = f"rank {rank}'s {chunk} chunk's {name} gradient is not a tensor of {list(w.shape)}."
                else:
                    k = int(((g - w).abs() - 1e-4 * w.abs()).argmax())
                    problem = (f"rank {rank}'s {chunk} chunk's {name} gradient differs from one process's (the "
                               f"gradient of {whose}) at index {k}: got {float(g.flatten()[k]):.6g}, expected "
                               f"{float(w.flatten()[k]):.6g}.")
                    swap = _reference(t, start, swapped=True)[chunk][0 if name == "weight" else 1]
                    if chunk == "first" and torch.allclose(g, swap, rtol=1e-4, atol=1e-6):
                        problem += (" That is the gradient with micro-batches 0 and 1 swapped: first.backward(0, g) "
                                    "takes the gradient the other rank computed for micro-batch 0.")
                    elif torch.allclose(g, 2 * w, rtol=1e-4, atol=1e-6):
                        problem += " That is twice the gradient: was a micro-batch's backward run twice?"
                parts.note("gradients", problem, where)
                return


def _own_timeline(observed, rank):
    """The rank's own events alone: a send lasts from its post to its wait, as the rank saw it (a launch's
    merged timeline would end it when the other rank's receive ended, which depends on that rank's pace)."""
    events = [Event(**{**e, "group": tuple(e["group"]) if e["group"] is not None else None})
              for e in observed[rank]["events"] if e["rank"] == rank]
    return Timeline(events, world_size=2)


def _pair_window(timeline, rank):
    spans = {e.label: e for e in timeline.select(rank, "compute")}
    if "B0l" not in spans or "F1f" not in spans:
        raise Fail(f"rank {rank}'s trace has no compute span of B0 on its last chunk or of F1 on its first: "
                   f"call last.backward(0) and first.forward(1, ...) once each.")
    return spans["B0l"].end, spans["F1f"].start


def _judge_overlap(t, observed, traffic, parts, where, best):
    """The router's record: the gradient was posted between B0 (last) and F1 (first). The trace: how much
    of its time in flight lay under the rank's compute (kept in `best`, judged after every trial)."""
    for rank in (0, 1):                                  # every rank's pair
        peer = 1 - rank
        timeline = _own_timeline(observed, rank)
        posted = traffic.get(rank, {}).get("sends_in", {}).get("after B0 last", [])
        if not any(dst == peer for dst, _ in posted):
            parts.note("overlap", f"rank {rank} sent nothing to rank {peer} between B0 on its last chunk and F1 on "
                       f"its first: post the gradient's send (comm.isend) right after last.backward(0), before "
                       f"first.forward(1, ...).", where)
            return
        start, end = _pair_window(timeline, rank)
        if end < start:
            parts.note("overlap", f"rank {rank} ran F1 on its first chunk before B0 on its last: the pair is B0, "
                       f"post the gradient's send, then F1 while it travels.", where)
            return
        try:
            fraction = hidden_fraction(timeline, rank, kinds=("send",), start=start, end=end + 1e-9)
        except ValueError:
            parts.note("overlap", f"rank {rank}'s trace has no send of the gradient in flight between B0 on its "
                       f"last chunk and F1 on its first: send it with pplab.comm.isend (the trace records "
                       f"pplab.comm's calls) and wait for it after F1.", where)
            return
        best[rank] = max(best.get(rank, 0.0), fraction)


@exercise("overlapped_step", "DualPipe's overlapped pair: a forward under a backward's communication",
          answer="overlapped_step", notebook="11a_overlapped_step", sealed=True, points=len(PARTS))
def check_overlapped_step(fn, seed: int, timeout: float) -> str:
    """overlapped_step(first, last, inputs): DualPipe's step on 2 ranks with the gradient's send under F1."""
    require_function(fn, "overlapped_step", "first, last, inputs", None, None, [])
    parts = Parts(PARTS)
    trials = _trials(seed)
    inputs = [[_inputs(t, r) for r in (0, 1)] for t in trials]
    best: dict[int, float] = {}

    def describe(world_size, i):
        t = trials[i]
        return f"world_size={world_size}, trial {i + 1}: micro-batches of {t['rows']}×{t['h']}, t_f={t['t_f']} s"

    def check(world_size, i, observed, traffic):
        if len(observed) != 2:
            return
        try:
            _judge_gradients(trials[i], observed, parts, describe(world_size, i))
            _judge_overlap(trials[i], observed, traffic, parts, describe(world_size, i), best)
        except (KeyError, IndexError, TypeError, AttributeError) as e:
            raise Fail(f"what the ranks recorded could not be read ({type(e).__name__}: {e}).")

    try:
        sealed.run_sealed(_rank_job, fn, inputs, world_size=2, timeout=timeout,
                          exercise=("overlapped_step", "the overlapped step"), forbidden=(),
                          probe=_refuse_dualpipe, describe=describe, check=check)
    except Fail as failure:
        raise parts.aborted(failure) from None
    for rank in (0, 1):                                  # every rank's best trial
        if rank in best and best[rank] < THRESHOLD:
            parts.note("overlap", f"on rank {rank} at most {best[rank]:.0%} of the gradient's send lay under "
                       f"compute (best of {len(trials)} trials; at least {THRESHOLD:.0%} expected): it was waited "
                       f"for before first.forward(1, ...) ran. Post the isend, run F1, then wait.",
                       f"world_size=2, {len(trials)} trials")
    return parts.finish(f"on world size 2 ({len(trials)} trials: random sizes, stand-in compute of 20-40 ms per "
                        f"forward; the gradient's send under F1: at best {best.get(0, 0):.0%} on rank 0, {best.get(1, 0):.0%} "
                        f"on rank 1)")
