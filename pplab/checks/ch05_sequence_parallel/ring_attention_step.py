"""Check of exercise ring_attention_step (exercises/05_ring_attention_step.ipynb): One step of causal ring attention.

    ring_attention_step   ring_step(q, k, v, out, lse, step) -> (out, lse, k_next, v_next)

ring_attention_step runs the ring on 2, 3 and 4 sealed ranks: the checker calls the answer
p times per rank (causal attention, contiguous layout) and compares the running output
after every step with attention over the blocks seen so far, and the block passed on
with the left neighbour's. The answer sees only its own queries and one visiting K/V
block; it may send only K and V to its right neighbour (no collective, no gathering).
"""
from __future__ import annotations

import math
import random
import torch

from .. import sealed
from ..core import Fail, exercise, first_difference, require_function
from .ring_attention_step_rank import _ring_rank
from .tolerance import TOL


def _attention(q, k, v, hidden=None):
    """softmax(q·kᵀ/√d)·v and its log-sum-exp, rows with every key hidden giving 0 and -inf."""
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if hidden is not None:
        s = s.masked_fill(hidden, -math.inf)
    lse = torch.logsumexp(s, -1)
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    return torch.exp(s - safe[..., None]) @ v, lse


def _compare(got, want, what, where, hint=""):
    if got.shape != want.shape:
        raise Fail(f"{where}{what} has shape {tuple(got.shape)}, expected {tuple(want.shape)}.")
    if torch.isnan(got).any() and not torch.isnan(want).any():
        raise Fail(f"{where}{what} contains nan at {first_difference(got.nan_to_num(1e300), want)[0]}{hint}")
    same_inf = torch.isinf(want) & (got == want)
    diff = first_difference(torch.where(same_inf, torch.zeros_like(got), got),
                            torch.where(same_inf, torch.zeros_like(want), want), atol=TOL, rtol=TOL)
    if diff is not None:
        raise Fail(f"{where}{what} differs {diff}.{hint}")


def _ring_trials(seed, p):
    rng = random.Random(seed * 17 + p)
    return [(rng.randint(1, 2), rng.randint(1, 3), rng.randint(1, 5), rng.randint(2, 6), rng.randrange(2**31))
            for _ in range(2)]


def _ring_qkv(shape, p):
    b, h, n, d, s = shape
    g = torch.Generator().manual_seed(s)
    return [torch.randn(b, h, n * p, d, generator=g, dtype=torch.float64) for _ in range(3)]


@exercise("ring_attention_step", "One step of causal ring attention", answer="ring_step",
          notebook="05_ring_attention_step", sealed=True)
def check_ring_attention_step(fn, seed: int, timeout: float) -> str:
    """ring_step(q, k, v, out, lse, step) -> (out, lse, k_next, v_next): merge causal attention of my
    queries over the visiting block (from rank (rank - step) % p) into (out, lse), pass the block on."""
    z = torch.zeros(1, 1, 1, 1, dtype=torch.float64)
    require_function(fn, "ring_attention_step", "q, k, v, out, lse, step", z, z, z, z, z[..., 0], 0)
    count = 0
    for p in (2, 3, 4):                             # rings of 2, 3 and 4
        trials = _ring_trials(seed, p)

        def describe(world_size, i, trials=trials):
            b, h, n, d, _ = trials[i]
            return f"world_size={world_size}, {n} tokens per rank, q/k/v of {b} x {h} heads x {n} x {d}"

        def check(world_size, i, observed, traffic, trials=trials):
            for rank, steps in sorted(observed.items()):
                _check_ring_steps(fn.__name__, rank, world_size, trials[i], steps, traffic[rank]["sends_in"])
        inputs = []
        for t in trials:
            mine = (lambda r, n=t[2]: slice(r * n, (r + 1) * n))
            Q, K, V = _ring_qkv(t, p)
            inputs.append([{"q": Q[:, :, mine(r)].contiguous(), "k": K[:, :, mine(r)].contiguous(),
                            "v": V[:, :, mine(r)].contiguous(), "p": p} for r in range(p)])
        sealed.run_sealed(_ring_rank, fn, inputs, world_size=p, timeout=timeout,
                          exercise=("ring_attention_step", "the ring's K/V passing"), describe=describe, check=check)
        count += len(trials)
    return (f"on world sizes 2, 3, 4 ({count} rings, causal: after every step the running output and "
            f"log-sum-exp equal attention over the blocks seen so far, to 1e-9; K and V passed only to the "
            f"right neighbour, one block per step)")


def _check_ring_steps(name, rank, p, shape, steps, sends_in):
    b, h, n, d, s = shape
    Q, K, V = _ring_qkv(shape, p)
    pos = torch.arange(n * p)
    q = Q[:, :, rank * n:(rank + 1) * n]
    right = (rank + 1) % p
    for step, got in enumerate(steps):
        where = f"rank {rank}, step {step}: "
        if "bad" in got:
            raise Fail(f"{where}{name} must return (out, lse, k_next, v_next), got {got['bad']}.")
        src = (rank - step) % p
        seen = [(rank - t) % p for t in range(step + 1)]
        cols = torch.cat([pos[j * n:(j + 1) * n] for j in seen])
        hidden = pos[rank * n:(rank + 1) * n][:, None] < cols[None, :]
        want_o, want_lse = _attention(q, K[:, :, cols], V[:, :, cols], hidden)
        blocks = ", ".join(str(j) for j in seen)
        rule = (f" After step {step} it must be causal attention of this rank's queries (tokens {rank * n}.."
                f"{(rank + 1) * n - 1}) over the K/V blocks of ranks {blocks} (step t holds rank (rank - t) % p's "
                f"block, tokens j·{n}..(j+1)·{n}-1 for block j; a query at position i sees keys at positions <= i).")
        for what, value, want in (("out", got["out"], want_o), ("lse", got["lse"], want_lse)):
            if not isinstance(value, torch.Tensor):
                raise Fail(f"{where}the {what} returned is {type(value).__name__}, not a tensor.")
            hint = rule
            if torch.isnan(value).any():
                hint = (f" The block of rank {src} is entirely in this rank's future (every key hidden): its scores "
                        f"are all -inf, and exp(-inf - (-inf)) is nan. Skip a block whose keys all come after "
                        f"every query, or merge with a finite reference." if src > rank else rule)
            _compare(value, want, what, where, hint)
        sends = sends_in.get(f"step {step}", [])
        others = sorted({dst for dst, _ in sends if dst != right})
        if others:
            raise Fail(f"{where}sent to rank{'s' if len(others) > 1 else ''} {', '.join(map(str, others))}: in a ring "
                       f"each rank passes K and V only to its right neighbour, (rank + 1) % p = {right}; no rank "
                       f"may gather every block.")
        block = 2 * K[:, :, :n].numel() * 8
        total = sum(b for _, b in sends)
        if step < p - 1:
            if total != block:
                raise Fail(f"{where}sent {total:,} bytes to the right; a step passes on exactly the K and V block "
                           f"it holds ({block:,} bytes), no more (no gathering) and no less.")
            left = (rank - 1) % p
            for what, value, full in (("k_next", got["k"], K), ("v_next", got["v"], V)):
                want = full[:, :, ((left - step) % p) * n:((left - step) % p + 1) * n]
                if not isinstance(value, torch.Tensor) or value.shape != want.shape or \
                        first_difference(value, want) is not None:
                    raise Fail(f"{where}{what} is not the block of rank {(left - step) % p}: the block to use next "
                               f"comes from the left neighbour, rank {left}, which passes on the block it held "
                               f"this step.")
        elif total:
            raise Fail(f"{where}the last step sent {total:,} bytes: after p - 1 passes every rank has seen every "
                       f"block; the last step sends nothing (return None for k_next and v_next).")
