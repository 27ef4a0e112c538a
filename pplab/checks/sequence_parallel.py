"""Checks of chapter 5's exercises: blockwise (flash) attention, Ulysses' all-to-all, a ring step.

    online_softmax_merge  blockwise_attention(q, k, v, block, causal) -> (out, lse)
    ulysses_all_to_all    ulysses_all_to_all(x, scatter_dim, gather_dim) -> tensor
    ring_attention_step   ring_step(q, k, v, out, lse, step) -> (out, lse, k_next, v_next)

online_softmax_merge runs the answer in one sealed rank on 4 random float64 trials (keys in
blocks that do not divide their number, v wider than q, scores in the hundreds, causal) and
compares out with torch's scaled_dot_product_attention and lse with torch.logsumexp of the
scores, to 1e-9. The last trial (S = n = 128 or 160, blocks of 8) is also measured: the bytes of
tensors its call held at once (pplab.memory.PeakMemory, in the rank) must stay under half
the n×S score matrix. Three parts, a point each: output, log-sum-exp, memory (credited only
when that trial's output is right). torch's own attention is refused.

ulysses_all_to_all runs on 2, 3 and 4 sealed ranks (sealed.py), both ways (sequence-sharded -> head-
sharded and back), on tensors whose entries name their head and token, so a misplaced
piece is named exactly. It must use point-to-point messages only, and send each other
rank exactly the piece it needs: (p-1)/p of the tensor.

ring_attention_step runs the ring on 2, 3 and 4 sealed ranks: the checker calls the answer
p times per rank (causal attention, contiguous layout) and compares the running output
after every step with attention over the blocks seen so far, and the block passed on
with the left neighbour's. The answer sees only its own queries and one visiting K/V
block; it may send only K and V to its right neighbour (no collective, no gathering).

Every rank job returns what the answer produced and what the rank saw; every comparison
is made here, in the checker.
"""
from __future__ import annotations

import math
import random

import torch

from . import sealed
from .sequence_parallel_rank import _blockwise_rank, _refuse_sdpa, _ring_rank, _ulysses_rank
from .core import Fail, Parts, exercise, first_difference, require_function
from .core import _fmt

TOL = 1e-9


def _attention(q, k, v, hidden=None):
    """softmax(q·kᵀ/√d)·v and its log-sum-exp, rows with every key hidden giving 0 and -inf."""
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if hidden is not None:
        s = s.masked_fill(hidden, -math.inf)
    lse = torch.logsumexp(s, -1)
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    return torch.exp(s - safe[..., None]) @ v, lse


def _pair(name, out, where):
    if not (isinstance(out, (tuple, list)) and len(out) == 2 and all(isinstance(t, torch.Tensor) for t in out)):
        raise Fail(f"{where}{name} must return a pair of tensors (o, lse), got {type(out).__name__}.")
    return out


def _compare(got, want, what, where, hint=""):
    if got.shape != want.shape:
        raise Fail(f"{where}{what} has shape {tuple(got.shape)}, expected {tuple(want.shape)}.")
    if torch.isnan(got).any() and not torch.isnan(want).any():
        raise Fail(f"{where}{what} contains nan at {first_difference(got.nan_to_num(1e300), want)[0]}{hint}")
    same_inf = torch.isinf(want) & (got == want)
    diff = first_difference(torch.where(same_inf, torch.zeros_like(got), got),
                            torch.where(same_inf, torch.zeros_like(want), want), atol=TOL, rtol=TOL)
    if diff is not None:
        index, g, w = diff
        raise Fail(f"{where}{what} differs at index {index} (got {_fmt(g)}, expected {_fmt(w)}).{hint}")


# ----------------------------------------------------------------------------------
# Exercise "online_softmax_merge": flash attention's forward, one block of keys at a time

BLOCKWISE_PARTS = ("output", "log-sum-exp", "memory")


def _rint(g, lo, hi):
    return int(torch.randint(lo, hi + 1, (1,), generator=g))


def _blockwise_trials(seed):
    """(what, q, k, v, block, causal), float64: three trials of values, then the memory trial."""
    g = torch.Generator().manual_seed(seed)
    trials = []
    for what, causal, scale in (("more keys than queries", False, 1.0),
                                ("large scores (|s| in the hundreds)", False, 30.0), ("causal", True, 1.0)):
        b, h, d, block = _rint(g, 1, 2), _rint(g, 1, 3), _rint(g, 2, 5), _rint(g, 2, 4)
        dv = d + _rint(g, 1, 3)                           # out takes v's width, not q's
        S = block * _rint(g, 2, 4) + _rint(g, 1, block - 1)              # the last block is shorter
        n = S if causal else _rint(g, 2, S - 1)
        q = torch.randn(b, h, n, d, generator=g, dtype=torch.float64) * scale
        k = torch.randn(b, h, S, d, generator=g, dtype=torch.float64) * scale
        v = torch.randn(b, h, S, dv, generator=g, dtype=torch.float64)
        if scale > 1:                                     # a row whose exp(score) overflows float64
            q[0, 0, 0] = 1000 * d ** 0.5 * k[0, 0, -1] / k[0, 0, -1].norm() ** 2    # its score with the last key: 1000
        trials.append((what, q, k, v, block, causal))
    n, block = 32 * _rint(g, 4, 5), 8                     # S = n: the memory trial
    q, k, v = (torch.randn(1, 1, n, 4, generator=g, dtype=torch.float64) for _ in range(3))
    trials.append(("memory", q, k, v, block, True))
    return trials


def _blockwise_reference(q, k, v, causal, scale=True, keys=None):
    """torch's scaled_dot_product_attention and the rows' log-sum-exp (keys: only the first `keys`)."""
    if keys is not None:
        k, v = k[..., :keys, :], v[..., :keys, :]
    s = q @ k.transpose(-1, -2) / (math.sqrt(q.shape[-1]) if scale else 1.0)
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), -math.inf)
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                                            scale=None if scale else 1.0)
    return out, torch.logsumexp(s, -1), s


def _close(a, b):
    return a.shape == b.shape and torch.allclose(a, b, atol=1e-7, rtol=1e-7, equal_nan=False)


def _output_hint(got, q, k, v, block, causal, what):
    S, d = k.shape[-2], q.shape[-1]
    if torch.isnan(got).any() or torch.isinf(got).any():
        if causal:
            return (" In causal attention a row can have every key of a block in its future: that block's scores "
                    "are all -inf, its own max is -inf, and exp(-inf - (-inf)) is nan (softmax of such a block too). "
                    "Keep one running max per row over all the blocks seen so far (finite once the row has seen key "
                    "0) and subtract that.")
        return (" exp of scores this large overflows: subtract the row's running max m before exp, and when m grows "
                "rescale what you accumulated (the sum and the weighted values) by exp(m_old - m_new).")
    if S % block and _close(got, _blockwise_reference(q, k, v, causal, keys=S - S % block)[0]):
        return (f" It is attention over the first {S - S % block} keys only: S = {S} is not a multiple of the block "
                f"({block}), and the last, shorter block of {S % block} keys was never seen.")
    if causal and _close(got, _blockwise_reference(q, k, v, False)[0]):
        return " It is attention without the mask: query i may see keys 0..i only (mask key j > i with -inf)."
    if _close(got, _blockwise_reference(q, k, v, causal, scale=False)[0]):
        return f" It is attention without the scale: divide the scores q·kᵀ by √d = √{d}."
    return (" Check the rescaling: when a block raises a row's max from m_old to m_new, the running sum and the "
            "accumulated values must both be multiplied by exp(m_old - m_new), and the output is acc / sum at the end.")


def _lse_hint(got, s):
    m = s.amax(-1)
    if _close(got, m):
        return " It is the row's max score: the log-sum-exp is m + log(l), l the running sum of exp(s - m)."
    if _close(got, torch.logsumexp(s - m[..., None], -1)):
        return " It is log(l) alone: add the running max back, lse = m + log(l)."
    return " lse is log Σ_j exp(s_j) over every key the row may see: m + log(l) at the end of the loop."


def _judge_blockwise(name, trial, seen, parts, where):
    """Note in `parts` what is wrong with one trial's answer (trial: what, q, k, v, block, causal)."""
    what, q, k, v, block, causal = trial
    want_o, want_lse, s = _blockwise_reference(q, k, v, causal)
    returned = seen["returned"]
    if not (isinstance(returned, (tuple, list)) and len(returned) == 2
            and all(isinstance(t, torch.Tensor) for t in returned)):
        raise Fail(f"{where}{name} must return a pair of tensors (out, lse), got {type(returned).__name__}.")
    out, lse = returned
    right = True
    for part, got, want, hint in (("output", out, want_o, lambda: _output_hint(out, q, k, v, block, causal, what)),
                                  ("log-sum-exp", lse, want_lse, lambda: _lse_hint(lse, s))):
        label = "out" if part == "output" else "lse"
        if got.shape != want.shape:
            extra = (f" out has one row per query and v's last dimension ({v.shape[-1]}, here not q's)."
                     if part == "output" else " lse has one number per query row: q.shape[:-1].")
            parts.note(part, f"{label} has shape {tuple(got.shape)}, expected {tuple(want.shape)}.{extra}", where)
            right = False
            continue
        diff = first_difference(got.nan_to_num(nan=1e300), want, atol=TOL, rtol=TOL)
        if diff is not None:
            index, g, w = diff
            shown = "nan" if g == 1e300 else _fmt(g)
            parts.note(part, f"{label} differs at index {index} (got {shown}, expected {_fmt(w)}).{hint()}", where)
            right = right and part != "output"
    return right, out


@exercise("online_softmax_merge", "Flash attention's forward: blockwise attention with the online-softmax merge",
          answer="blockwise_attention", notebook="05_online_softmax_merge", sealed=True, points=len(BLOCKWISE_PARTS))
def check_online_softmax_merge(fn, seed: int, timeout: float) -> str:
    """blockwise_attention(q, k, v, block, causal) -> (out, lse): softmax(q·kᵀ/√d)·v and each row's
    log-sum-exp, keys visited `block` at a time, never the whole score matrix at once."""
    z = torch.zeros(1, 1, 1, 1, dtype=torch.float64)
    require_function(fn, "online_softmax_merge", "q, k, v, block, causal", z, z, z, 1, False)
    trials = _blockwise_trials(seed)

    def where_of(i):
        what, q, k, _, block, causal = trials[i]
        return (f"trial {i} ({what}; q {tuple(q.shape)}, {k.shape[-2]} keys in blocks of {block}"
                f"{', causal' if causal else ''}): ")
    outs = sealed.call_each(fn, [t[1:] for t in trials], where=where_of, timeout=timeout, job=_blockwise_rank,
                            probe=_refuse_sdpa)
    parts = Parts(BLOCKWISE_PARTS)
    for i, (trial, seen) in enumerate(zip(trials, outs)):
        right, _ = _judge_blockwise(fn.__name__, trial, seen, parts, where_of(i).rstrip(": "))
        if i == len(trials) - 1:                            # the memory trial
            q, k = trial[1], trial[2]
            scores = q.shape[-2] * k.shape[-2] * q.element_size() * q.shape[:-2].numel()
            one_block = q.shape[-2] * trial[4] * q.element_size()
            peak = int(seen["peak"])
            if not right:
                parts.note("memory", "its output is wrong, so its memory is not credited.", where_of(i).rstrip(": "))
            elif peak > scores // 2:
                parts.note("memory", f"the call held {peak:,} bytes of tensors at once (pplab.memory.PeakMemory), "
                           f"against {scores:,} for the whole n×S score matrix: it kept (about) all the scores, or "
                           f"an n×S mask, alive together. Blockwise attention holds one block of scores at a time "
                           f"(n × block = {one_block:,} bytes) and a few rows of running statistics.",
                           where_of(i).rstrip(": "))
    return parts.finish(f"on {len(trials)} random trials (blocks that do not divide the keys, v wider than q, scores "
                        f"in the hundreds, causal; out and lse to 1e-9 of torch's scaled_dot_product_attention; "
                        f"at most half the bytes of the score matrix held at once)")


# ----------------------------------------------------------------------------------
# Exercise "ulysses_all_to_all"


def _ulysses_trials(seed, p):
    rng = random.Random(seed * 31 + p)
    return [(rng.randint(1, 2), p * rng.randint(1, 3), rng.randint(1, 4), rng.randint(1, 3)) for _ in range(3)]


def _labelled(b, heads, seq, d):
    """Entry (batch i, head h, token t, j) = 10⁶·i + 1000·h + t + j/10: a misplaced piece names itself."""
    i, h, t, j = torch.meshgrid(*(torch.arange(n, dtype=torch.float64) for n in (b, heads, seq, d)), indexing="ij")
    return 1e6 * i + 1000 * h + t + j / 10


def _check_ulysses(trials):
    def check(p, i, observed, traffic):
        b, hp, n, d = trials[i]
        X, h = _labelled(b, hp, n * p, d), hp // p
        for rank, got in sorted(observed.items()):
            where = f"rank {rank}'s "
            for key, want, what, rule in (
                    ("to_heads", X[:, rank * h:(rank + 1) * h], "result of ulysses_all_to_all(x, 1, 2)",
                     f"heads {rank * h}..{(rank + 1) * h - 1} (its share) for all {n * p} tokens, tokens in "
                     f"order: the piece from rank i holds tokens i·{n}..(i+1)·{n}-1 and goes at place i"),
                    ("back", X[:, :, rank * n:(rank + 1) * n], "result of ulysses_all_to_all(y, 2, 1)",
                     f"all {hp} heads of its own tokens {rank * n}..{(rank + 1) * n - 1}: the piece from "
                     f"rank i holds heads i·{h}..(i+1)·{h}-1 and goes at place i")):
                value = got[key]
                if not isinstance(value, torch.Tensor) or value.shape != want.shape:
                    shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
                    raise Fail(f"{where}{what} is {shape}, expected shape {tuple(want.shape)}: {rule}.")
                diff = first_difference(value, want)
                if diff is not None:
                    index, g, w = diff
                    raise Fail(f"{where}{what} differs at index {index}: got head {int(g // 1000 % 1000)}, token "
                               f"{int(g % 1000)}, expected head {int(w // 1000 % 1000)}, token {int(w % 1000)}. "
                               f"It must hold {rule}.")
            for direction, phase in (("ulysses_all_to_all(x, 1, 2)", "to_heads"),
                                     ("ulysses_all_to_all(y, 2, 1)", "back")):
                piece = b * hp * n * d * 8 // p
                per_peer = {}
                for dst, nbytes in traffic[rank]["sends_in"].get(phase, []):
                    per_peer[dst] = per_peer.get(dst, 0) + nbytes
                want_sends = {j: piece for j in range(p) if j != rank}
                if per_peer != want_sends:
                    raise Fail(f"{where}{direction} sent {per_peer or 'nothing'} (bytes per destination rank); "
                               f"an all-to-all sends every other rank exactly the one piece it needs, "
                               f"{piece:,} bytes each ({want_sends}), and keeps its own piece: (p-1)/p of "
                               f"the tensor in all, never the whole tensor.")
            if p > 1 and not traffic[rank]["received"]:
                raise Fail(f"rank {rank} received no point-to-point message.")
    return check


@exercise("ulysses_all_to_all", "Ulysses' all-to-all: sequence-sharded to head-sharded and back",
          answer="ulysses_all_to_all", notebook="05_ulysses_all_to_all", sealed=True)
def check_ulysses_all_to_all(fn, seed: int, timeout: float) -> str:
    """ulysses_all_to_all(x, scatter_dim, gather_dim): cut x into p pieces along scatter_dim, piece j to
    rank j; concatenate the pieces received, in rank order, along gather_dim. Point-to-point only."""
    require_function(fn, "ulysses_all_to_all", "x, scatter_dim, gather_dim", torch.zeros(1, 1, 1, 1), 1, 2)
    count = 0
    for p in (2, 3, 4):                             # Ulysses: 3 heads' pieces do not halve
        trials = _ulysses_trials(seed, p)

        def describe(world_size, i, trials=trials):
            b, hp, n, d = trials[i]
            return f"world_size={world_size}, x of {b} x {hp} heads x {n} tokens per rank x {d}"
        inputs = []
        for b, hp, n, d in trials:
            X = _labelled(b, hp, n * p, d)
            inputs.append([{"mine": X[:, :, r * n:(r + 1) * n].contiguous(),
                            "heads": X[:, r * hp // p:(r + 1) * hp // p].contiguous()} for r in range(p)])
        sealed.run_sealed(_ulysses_rank, fn, inputs, world_size=p, timeout=timeout,
                          exercise=("ulysses_all_to_all", "all_to_all"), describe=describe,
                          check=_check_ulysses(trials))
        count += len(trials)
    return (f"on world sizes 2, 3, 4 ({count} trials, both directions: every entry in its place, every rank "
            f"sent each other rank exactly its piece with point-to-point messages)")


# ----------------------------------------------------------------------------------
# Exercise "ring_attention_step"


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
