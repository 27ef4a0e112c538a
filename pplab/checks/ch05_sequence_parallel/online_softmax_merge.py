"""Check of exercise online_softmax_merge (exercises/05_online_softmax_merge.ipynb): Flash attention's forward: blockwise attention with the online-softmax merge.

    online_softmax_merge  blockwise_attention(q, k, v, block, causal) -> (out, lse)

online_softmax_merge runs the answer in one sealed rank on 4 random float64 trials (keys in
blocks that do not divide their number, v wider than q, scores in the hundreds, causal) and
compares out with torch's scaled_dot_product_attention and lse with torch.logsumexp of the
scores, to 1e-9. The last trial (S = n = 128 or 160, blocks of 8) is also measured: the bytes of
tensors its call held at once (pplab.memory.PeakMemory, in the rank) must stay under half
the n×S score matrix. Three parts, a point each: output, log-sum-exp, memory (credited only
when that trial's output is right). torch's own attention is refused.
"""
from __future__ import annotations

import math
import torch

from .. import sealed
from ..core import Fail, Parts, exercise, first_difference, require_function
from ..core import _fmt
from .online_softmax_merge_rank import _blockwise_rank, _refuse_sdpa
from .tolerance import TOL


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
