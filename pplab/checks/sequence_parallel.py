"""Checks of chapter 5's exercises: the online-softmax merge, Ulysses' all-to-all, a ring step.

    online_softmax_merge  merge_partials(o1, lse1, o2, lse2) -> (o, lse)
    ulysses_all_to_all    ulysses_all_to_all(x, scatter_dim, gather_dim) -> tensor
    ring_attention_step   ring_step(q, k, v, out, lse, step) -> (out, lse, k_next, v_next)

online_softmax_merge needs no ranks: partial attention results over two random disjoint
sets of keys (some rows with no key in one set, or in both), large scores included, are
merged by the answer and compared with attention over all the keys (float64, 1e-9).

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
from .core import Fail, exercise, first_difference, require_function
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
# Exercise "online_softmax_merge"


def _merge_trials(seed):
    """(description, q, k, v, which keys are in part 1, hidden (query, key) pairs), 5 trials."""
    g = torch.Generator().manual_seed(seed)
    trials = []
    for what, scale, empty in (("random scores", 1.0, None), ("large scores (|s| in the thousands)", 300.0, None),
                               ("rows that saw no key in one part", 1.0, "one"),
                               ("rows that saw no key in either part (the accumulator's start)", 1.0, "both")):
        b, h, n, m, d = (int(torch.randint(lo, hi, (1,), generator=g)) for lo, hi in
                         ((1, 3), (1, 4), (2, 7), (3, 9), (2, 6)))
        q = torch.randn(b, h, n, d, generator=g, dtype=torch.float64) * scale
        k, v = (torch.randn(b, h, m, d, generator=g, dtype=torch.float64) for _ in range(2))
        if scale > 1:                                     # some row's exp(lse) must overflow float64
            q[0, 0, 0] = 1000 * d ** 0.5 * k[0, 0, 0] / k[0, 0, 0].norm() ** 2    # its score with key 0: 1000
        in_one = torch.randperm(m, generator=g)[:int(torch.randint(1, m, (1,), generator=g))]
        part = torch.zeros(m, dtype=torch.bool)
        part[in_one] = True
        hidden = torch.zeros(n, m, dtype=torch.bool)
        if empty == "one":
            hidden[0, part] = True                        # row 0 sees nothing of part 1
            hidden[-1, ~part] = True                      # the last row nothing of part 2
        elif empty == "both":
            hidden[0] = True                              # row 0 sees no key at all
        trials.append((what, q, k, v, part, hidden))
    return trials


@exercise("online_softmax_merge", "Merge two partial attention results (online softmax)", answer="merge_partials",
          notebook="05a_online_softmax_merge", sealed=True)
def check_online_softmax_merge(fn, seed: int, timeout: float) -> str:
    """merge_partials(o1, lse1, o2, lse2) -> (o, lse): attention over the union of two disjoint key sets."""
    z = torch.zeros(1, 1, 1, 1, dtype=torch.float64)
    require_function(fn, "online_softmax_merge", "o1, lse1, o2, lse2", z, z[..., 0], z, z[..., 0])
    trials, cases = _merge_trials(seed), []
    for what, q, k, v, part, hidden in trials:
        o1, lse1 = _attention(q, k[..., part, :], v[..., part, :], hidden[:, part])
        o2, lse2 = _attention(q, k[..., ~part, :], v[..., ~part, :], hidden[:, ~part])
        cases.append((o1, lse1, o2, lse2))

    def where_of(i):
        what, q, _, _, part, _ = trials[i]
        return f"trial {i} ({what}, q {tuple(q.shape)}, {int(part.sum())} + {int((~part).sum())} keys): "
    outs = sealed.call_each(fn, cases, where=where_of, timeout=timeout, job=sealed._call_rank_and_args)
    for i, ((what, q, k, v, part, hidden), (o1, lse1, o2, lse2), (returned, args)) in \
            enumerate(zip(trials, cases, outs)):
        where = where_of(i)
        o, lse = _attention(q, k, v, hidden)
        got_o, got_lse = _pair(fn.__name__, returned, where)
        if any(not isinstance(a, torch.Tensor) or a.shape != b.shape or not torch.equal(a, b)
               for a, b in zip(args, (o1, lse1, o2, lse2))):
            raise Fail(f"{where}{fn.__name__} changed its inputs: return new tensors, leave o1, lse1, o2, lse2 as "
                       f"they were (ring attention merges into a running result it still needs).")
        hint = ""
        if torch.isnan(got_o).any() or torch.isnan(got_lse).any() or torch.isinf(got_o).any():
            if "either" in what:
                hint = (" When lse1 = lse2 = -inf (no key seen yet), lse - max is -inf - (-inf) = nan: "
                        "subtract a finite reference instead (e.g. use 0 where the new lse is -inf), so the "
                        "row stays o = 0, lse = -inf.")
            elif "large" in what:
                hint = (" exp(lse) overflows for scores this large: never exponentiate lse itself, only "
                        "differences lse1 - lse and lse2 - lse, which are <= 0.")
        elif torch.allclose(got_o, (o1 + o2) / 2) and "no key" not in what:
            hint = (" It is the plain average of o1 and o2: weight each part by its share of the softmax "
                    "denominator, exp(lse_i - lse).")
        _compare(got_o, o, "o", where, hint)
        lse_hint = ""
        if torch.allclose(got_lse.nan_to_num(), torch.maximum(lse1, lse2).nan_to_num()):
            lse_hint = (" It is max(lse1, lse2): the merged log-sum-exp is log(exp(lse1) + exp(lse2)) "
                        "(torch.logaddexp), larger than both.")
        _compare(got_lse, lse, "lse", where, lse_hint)
    return ("on 4 random trials (random and large scores, rows with no key in one part or in both; o and lse "
            "to 1e-9 of attention over all the keys)")


# ----------------------------------------------------------------------------------
# Exercise "ulysses_all_to_all"


def _ulysses_trials(seed, p):
    rng = random.Random(seed * 31 + p)
    return [(rng.randint(1, 2), p * rng.randint(1, 3), rng.randint(1, 4), rng.randint(1, 3)) for _ in range(3)]


def _labelled(b, heads, seq, d):
    """Entry (batch i, head h, token t, j) = 10⁶·i + 1000·h + t + j/10: a misplaced piece names itself."""
    i, h, t, j = torch.meshgrid(*(torch.arange(n, dtype=torch.float64) for n in (b, heads, seq, d)), indexing="ij")
    return 1e6 * i + 1000 * h + t + j / 10


def _ulysses_rank(fn, trials):
    """In every sealed rank: both directions on this rank's shards; the router records what each sent."""
    for i, t in enumerate(trials):
        sealed.begin(i)
        sealed.phase("to_heads")
        y = fn(t["mine"], 1, 2)                           # sequence-sharded -> head-sharded
        sealed.phase("back")
        back = fn(t["heads"], 2, 1)                       # head-sharded -> sequence-sharded
        sealed.phase("")
        sealed.observe(i, {"to_heads": y, "back": back})


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
          answer="ulysses_all_to_all", notebook="05b_ulysses_all_to_all", sealed=True)
def check_ulysses_all_to_all(fn, seed: int, timeout: float) -> str:
    """ulysses_all_to_all(x, scatter_dim, gather_dim): cut x into p pieces along scatter_dim, piece j to
    rank j; concatenate the pieces received, in rank order, along gather_dim. Point-to-point only."""
    require_function(fn, "ulysses_all_to_all", "x, scatter_dim, gather_dim", torch.zeros(1, 1, 1, 1), 1, 2)
    count = 0
    for p in (2, 3, 4):
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


def _ring_rank(fn, trials):
    """In every sealed rank: p steps of the answer on this rank's q, k, v; each step a phase of its own."""
    for i, t in enumerate(trials):
        sealed.begin(i)
        q, k, v = t["q"], t["k"], t["v"]
        out = torch.zeros_like(q)
        lse = torch.full(q.shape[:-1], -math.inf, dtype=q.dtype)
        steps = []
        for step in range(t["p"]):
            sealed.phase(f"step {step}")
            returned = fn(q, k, v, out, lse, step)
            if not (isinstance(returned, (tuple, list)) and len(returned) == 4):
                steps.append({"bad": type(returned).__name__})
                break
            out, lse, k, v = returned
            steps.append({"out": out.clone() if isinstance(out, torch.Tensor) else out,
                          "lse": lse.clone() if isinstance(lse, torch.Tensor) else lse,
                          "k": k.clone() if isinstance(k, torch.Tensor) else k,
                          "v": v.clone() if isinstance(v, torch.Tensor) else v})
        sealed.phase("")
        sealed.observe(i, steps)


def _ring_qkv(shape, p):
    b, h, n, d, s = shape
    g = torch.Generator().manual_seed(s)
    return [torch.randn(b, h, n * p, d, generator=g, dtype=torch.float64) for _ in range(3)]


@exercise("ring_attention_step", "One step of causal ring attention", answer="ring_step",
          notebook="05c_ring_attention_step", sealed=True)
def check_ring_attention_step(fn, seed: int, timeout: float) -> str:
    """ring_step(q, k, v, out, lse, step) -> (out, lse, k_next, v_next): merge causal attention of my
    queries over the visiting block (from rank (rank - step) % p) into (out, lse), pass the block on."""
    z = torch.zeros(1, 1, 1, 1, dtype=torch.float64)
    require_function(fn, "ring_attention_step", "q, k, v, out, lse, step", z, z, z, z, z[..., 0], 0)
    count = 0
    for p in (2, 3, 4):
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

