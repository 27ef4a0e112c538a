"""Check of chapter 5's second capstone: causal ring attention, forward and backward, zigzag layout.

    ring_attention   ring_attention(q, k, v, group=None) -> out, differentiable in q, k and v

The sequence of S = 2p·c tokens is cut into 2p chunks of c; rank r holds chunks r and 2p-1-r
(the zigzag layout), so q, k, v and out are [b, heads, 2c, d] on every rank. The answer
returns this rank's rows of causal softmax(q·kᵀ/√d)·v over the whole sequence, and its
backward gives this rank's dQ, dK and dV.

It runs on sealed ranks (sealed.py) in two launches, p = 2 and p = 3, on float64 data from
the checker, against torch's scaled_dot_product_attention(is_causal=True) on the whole
sequence, here. Four parts, each judged on every rank and reported separately (partial credit):

* forward: the output, to 1e-9 (relative, and absolute times max(1, max|want|));
* backward dQ: q.grad, the same tolerance;
* backward dK/dV: k.grad and v.grad, the same tolerance;
* traffic and memory: the router's record. Forward: only point-to-point messages, all to one
  neighbour, K and V of one block p-1 times, 2(p-1)·N bytes (N: one rank's K in bytes).
  Backward: K and V p-1 times more, and the dK, dV accumulators of the visiting blocks p-1
  times (the owner keeps its own part at home), 4(p-1)·N. No collective; no message larger
  than one block's K and V together (2N): no rank ever holds the whole sequence's K/V.

The message names the first part that failed, with the first rank and tensor that differ and
why (compared with what a common mistake would give), then the four parts' verdicts.
"""
from __future__ import annotations

import random
import torch
import torch.nn.functional as F

from .. import sealed
from ..core import Parts, exercise, first_difference, require_function
from .ring_attention_rank import _refuse_library_ring, _ring_rank


PARTS = ("forward", "backward dQ", "backward dK/dV", "traffic")


TOL = 1e-9


def zigzag_index(p: int, c: int, r: int) -> torch.Tensor:
    """The global positions rank r of p holds: chunks r and 2p-1-r of 2p chunks of c tokens."""
    return torch.cat([torch.arange(r * c, (r + 1) * c), torch.arange((2 * p - 1 - r) * c, (2 * p - r) * c)])


def traffic_blocks(p: int) -> dict:
    """How many blocks (each N bytes: one rank's K, or V, or dK, or dV) one rank sends per phase."""
    return {"forward": 2 * (p - 1), "backward": 4 * (p - 1)}


def _trials(seed):
    """(p, shape, seed) for p = 2 and 3: shape = (b, heads, c, d)."""
    rng = random.Random(seed)
    return [(p, (rng.randint(1, 2), rng.randint(1, 2), rng.randint(2, 3), rng.randint(2, 4)), rng.randrange(2**31))
            for p in (2, 3)]


def _attend(Q, K, V, dO, causal=True, rows=None):
    """out, dQ, dK, dV of torch's attention on the whole sequence, in float64; rows: the queries
    whose output gradient counts (None: all)."""
    Q, K, V = (t.clone().requires_grad_() for t in (Q, K, V))
    out = F.scaled_dot_product_attention(Q, K, V, is_causal=causal)
    if rows is not None:
        dO = torch.zeros_like(dO).index_copy(-2, rows, dO[..., rows, :])
    out.backward(dO)
    return {"out": out.detach(), "dq": Q.grad, "dk": K.grad, "dv": V.grad}


def _references(p, c, Q, K, V, dO):
    """What the right answer gives, and what some mistakes give instead, per rank."""
    idx = [zigzag_index(p, c, r) for r in range(p)]
    right = _attend(Q, K, V, dO)
    blind = _attend(Q, K, V, dO, causal=False)
    order = torch.cat(idx)                       # the shards side by side: how a contiguous mask sees them
    contiguous = _attend(*(t[..., order, :] for t in (Q, K, V, dO)))
    refs = []
    for r in range(p):
        own = _attend(Q, K, V, dO, rows=idx[r])             # only this rank's queries' share of dK, dV
        n = 2 * c
        refs.append({"want": {k: v[..., idx[r], :] for k, v in right.items()},
                     "no mask": blind["out"][..., idx[r], :],
                     "contiguous": contiguous["out"][..., r * n:(r + 1) * n, :],
                     "own dk": own["dk"][..., idx[r], :], "own dv": own["dv"][..., idx[r], :]})
    return refs


def _close(got, want):
    """None if got matches want within the tolerance, else (index, got, want) of the first difference."""
    if got is None or tuple(got.shape) != tuple(want.shape):
        return (None, got, want)
    return first_difference(got.double(), want, atol=TOL * max(1.0, want.abs().max().item()), rtol=TOL)


def _differs(what, got, want, hint=""):
    diff = _close(got, want)
    if diff is None:
        return None
    if got is None:
        return f"{what} is None after backward: the answer's backward must return a gradient for q, k and v."
    if diff[0] is None:
        return f"{what} has shape {list(got.shape)}, expected {list(want.shape)}."
    return f"{what} differs from the single-process value {diff}.{hint}"


def _forward_problem(res, ref, p, c, rank):
    want = ref["want"]["out"]
    if res.get("out") is None:
        if res["out_shape"] == list(want.shape) and not res["requires_grad"]:
            return ("the output does not require grad, so no backward can run through it: compute it inside a "
                    "torch.autograd.Function (its forward's result is tracked) and give that Function a backward.")
        return (f"ring_attention returned {res['out_shape']}, not this rank's rows of the output, a tensor of q's "
                f"shape {list(want.shape)} [b, heads, 2c, d].")
    hint = ""
    if _close(res["out"], ref["no mask"]) is None:
        hint = (" It is attention without the causal mask: a query at position i may see only keys at positions "
                "<= i. Skip the blocks whose keys all come after the queries, and mask the upper triangle of the "
                "diagonal ones (same chunk).")
    elif _close(res["out"], ref["contiguous"]) is None:
        hint = (f" It is what a contiguous layout would give: the mask took rank r's tokens for positions "
                f"r·2c .. (r+1)·2c-1. In the zigzag layout rank r holds chunks r and 2p-1-r: tokens "
                f"{rank * c}..{(rank + 1) * c - 1} and {(2 * p - 1 - rank) * c}..{(2 * p - rank) * c - 1} here "
                f"(c = {c}); mask by those positions.")
    elif rank == 0 and _close(res["out"][..., :c, :], want[..., :c, :]) is None:
        hint = (" The rows that see only this rank's own keys (chunk 0) are right, the rows that see keys of "
                "several blocks are not: the merge of partial results is wrong. Each block gives o_b (normalised "
                "over its keys) and lse_b; merge as lse = logaddexp(lse, lse_b), o = exp(lse_old - lse)·o + "
                "exp(lse_b - lse)·o_b (rescale both by their log-sum-exp).")
    return _differs("the output", res["out"], want, hint)


def _dq_problem(got, want):
    hint = ""
    d = got.shape[-1] if got is not None else 1
    if got is not None and got.shape == want.shape and _close(got, want * d ** 0.5) is None:
        hint = (" It is √d times too large: dQ = dS·K/√d, the scale of the scores applies to their gradient "
                "too (and to dK = dSᵀ·Q/√d).")
    return _differs("dQ (q.grad)", got, want, hint)


def _dkv_problem(res, ref):
    for name in ("dk", "dv"):
        hint = ""
        got = res.get(name)
        if got is not None and _close(got, ref[f"own {name}"]) is None:
            hint = (f" It is the gradient from this rank's own queries only: the partial {name[1].upper()} "
                    f"gradients the other ranks computed for this rank's block never came back. Pass dK and dV "
                    f"round the ring with the visiting block, each rank adding its part, to the block's owner.")
        problem = _differs(f"{name[0]}{name[1].upper()} ({name[1]}.grad)", got, ref["want"][name], hint)
        if problem:
            return problem
    return None


def _traffic_problem(traffic, p, N, rank):
    """traffic: the router's record for this rank; N: one rank's K block in bytes."""
    left, right = (rank - 1) % p, (rank + 1) % p
    calls = [c for c in traffic["collectives"] if c["phase"] in ("forward", "backward")]
    if calls:
        c = calls[0]
        return (f"{c['phase']} made a collective call, {c['kind']} ({c['bytes']:,} bytes in): ring attention "
                f"needs no collective. "
                f"An all-gather of K/V holds the whole sequence's keys and values on every rank, p times the "
                f"memory; pass one block at a time to the next rank with send/recv (or isend/irecv).")
    big = max((n for _, n in traffic["received"]), default=0)
    if big > 2 * N:
        return (f"this rank received a message of {big:,} bytes; one block's K and V together are {2 * N:,}. A ring "
                f"holds only its own block and one visitor, never the whole sequence's K/V ({2 * p * N:,} bytes).")
    for phase, blocks in traffic_blocks(p).items():
        sends = traffic["sends_in"].get(phase, [])
        peers = sorted({dst for dst, _ in sends})
        if len(peers) > 1 or not set(peers) <= {left, right}:
            return (f"in {phase} this rank sent to rank{'s' if len(peers) > 1 else ''} "
                    f"{' and '.join(map(str, peers))}: a ring passes blocks one way, to one neighbour (rank "
                    f"{right}); sending a block to every rank is an all-gather, after which each holds them all.")
        sent = sum(n for _, n in sends)
        if sent == blocks * N:
            continue
        head = (f"in {phase} this rank sent {sent:,} bytes, {sent / N:g} blocks of {N:,} bytes (one rank's K); "
                f"a ring sends {blocks} ({blocks * N:,} bytes)")
        if phase == "forward":
            why = "K and V of the visiting block, p-1 times (the last block needs no further hop)."
        elif sent == 2 * (p - 1) * N:
            why = ("K and V p-1 times, and the dK and dV accumulators p-1 times: this rank sent no dK/dV, so the "
                   "gradients computed for a visiting block never reached its owner.")
        elif sent == (4 * p - 2) * N:
            why = ("one dK/dV hop too many: the owner computes its own part at home (step 0), so a block's "
                   "accumulator starts at its first visitor and reaches the owner after p-1 hops.")
        else:
            why = "K and V p-1 times, and the dK and dV accumulators p-1 times."
        return f"{head}: {why}"
    return None


def _judge(p, c, refs, results, traffic, N):
    found = dict.fromkeys(PARTS)
    for rank in range(p):
        res, ref = results[rank], refs[rank]
        problems = {"forward": _forward_problem(res, ref, p, c, rank)}
        if res.get("out") is None:
            problems["backward dQ"] = problems["backward dK/dV"] = "no backward ran (the output was unusable)."
        else:
            problems["backward dQ"] = _dq_problem(res.get("dq"), ref["want"]["dq"])
            problems["backward dK/dV"] = _dkv_problem(res, ref)
        problems["traffic"] = _traffic_problem(traffic[rank], p, N, rank)
        for part in PARTS:
            if problems[part] and not found[part]:
                found[part] = f"rank {rank}: {problems[part]}"
    return found


def _describe(p, shape):
    b, heads, c, d = shape
    return f"p={p}, S={2 * p * c} tokens in {2 * p} chunks of {c}, b={b}, {heads} heads, d={d}"


@exercise("ring_attention", "Causal ring attention, forward and backward, zigzag layout", answer="ring_attention",
          notebook="05_ring_attention", sealed=True, points=len(PARTS),
          preload=("pplab.sequence_parallel.ring_attention",))
def check_ring_attention(fn, seed: int, timeout: float) -> str:
    z = torch.zeros(1, 1, 2, 1, dtype=torch.float64)
    require_function(fn, "ring_attention", "q, k, v, group=None", z, z, z, None)
    parts = Parts(PARTS)
    for p, shape, trial_seed in _trials(seed):
        b, heads, c, d = shape
        g = torch.Generator().manual_seed(trial_seed)
        Q, K, V, dO = (torch.randn(b, heads, 2 * p * c, d, generator=g, dtype=torch.float64) for _ in range(4))
        refs = _references(p, c, Q, K, V, dO)
        N = b * heads * 2 * c * d * 8                         # one rank's K block, float64
        idx = [zigzag_index(p, c, r) for r in range(p)]
        inputs = [{"q": Q[..., idx[r], :].contiguous(), "k": K[..., idx[r], :].contiguous(),
                   "v": V[..., idx[r], :].contiguous(), "dout": dO[..., idx[r], :].contiguous()} for r in range(p)]
        found = {}

        def judge(world, i, observed, traffic):     # in run_sealed: data it cannot read is a Fail
            if len(observed) == world:
                found.update(_judge(p, c, refs, [observed[r] for r in range(world)], traffic, N))
        sealed.run_sealed(_ring_rank, fn, [inputs], world_size=p, timeout=timeout,
                          exercise=("ring_attention", "ring attention"), forbidden=(), probe=_refuse_library_ring,
                          describe=lambda world, i: _describe(p, shape), check=judge)
        for part in PARTS:
            parts.note(part, found.get(part), where=_describe(p, shape))
    return parts.finish(f"on p = 2 and p = 3, zigzag layout, causal (output, dQ, dK and dV within {TOL:g} of torch's "
                        f"scaled_dot_product_attention on the whole sequence; per rank, forward K/V sent 2(p-1) blocks "
                        f"and backward 4(p-1), point to point to a neighbour, no message larger than one block's K "
                        f"and V)")
