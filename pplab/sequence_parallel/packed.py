"""Packed documents under context parallelism: the mask, the work each rank gets, and a split that balances it.

    docs = [9, 2, 5]                                  # three documents packed in one 16-token sequence
    document_mask(docs)                               # (16, 16): query i sees key j of its own document, j <= i
    work_per_rank(docs, 2, "zigzag")                  # the score pairs each rank's queries compute: [24, 39]
    ranges = doc_split(docs, 2)                       # [(0, 7), (7, 16)]: work [28, 35], the best cut
    ring_attention(q, k, v, causal=True, layout=as_layout(ranges), documents=docs)

Long-context training packs several documents into one sequence and masks attention so that
no token sees another document (Llama 3, section 3.2: "we use an attention mask that prevents
self-attention between different documents within the same sequence"). Under causal masking,
the t-th token of its document (counting from 1) attends to t keys; so a document of n tokens
costs n(n+1)/2 score pairs, and the work a rank does is the sum of t over its query tokens. It
depends only on which queries a rank holds, not on where the keys live.

Zigzag (chapter 5) balances one long causal document: rank r's early chunk and late chunk add
up to the same work on every rank. Packed documents break that: the work of a chunk depends on
where the documents start, so the ranks' work differs, and the slowest rank sets the step time
(`balance`: the busiest rank's work over the mean). A split that knows the documents cuts the
sequence into p contiguous ranges whose work, not whose tokens, is as even as possible
(`doc_split`, the exercise of notebook 11c). Its price: ranks then hold different numbers of
tokens, so their activation and K/V memory differ.

Work here counts the score pairs the mask lets through, as a kernel that skips masked tiles
(flash attention with a document mask) does up to its tile size. pplab's ring attention
computes a masked diagonal piece whole, so its trace's "scores" count more; its spans' "visible"
count is this one.
"""
from __future__ import annotations

import torch

from .ring_attention import document_starts, pieces


def _check(documents, p=None):
    """The document lengths as a list, checked; and p, if given."""
    try:
        docs = list(documents)
    except TypeError:
        raise ValueError(f"documents must be a list of document lengths, got {documents!r}") from None
    document_starts(docs, sum(n for n in docs if isinstance(n, int)), "documents")
    if p is not None and (isinstance(p, bool) or not isinstance(p, int) or p < 1):
        raise ValueError(f"p must be a positive whole number of ranks, got {p!r}")
    return docs


def document_ids(documents) -> torch.Tensor:
    """For every position of the packed sequence, the index of its document (0, 0, ..., 1, ...)."""
    docs = _check(documents)
    return torch.repeat_interleave(torch.arange(len(docs)), torch.tensor(docs))


def document_mask(documents, causal: bool = True) -> torch.Tensor:
    """(S, S) bool, True where query i may see key j: same document, and j <= i when causal.
    Pass it as attn_mask to torch's scaled_dot_product_attention for the one-process reference."""
    ids = document_ids(documents)
    mask = ids[:, None] == ids[None, :]
    return mask.tril() if causal else mask


def _tri(n: int) -> int:
    return n * (n + 1) // 2


def range_work(documents, start: int, stop: int, causal: bool = True) -> int:
    """Score pairs computed by the queries at positions [start, stop): each document's part of
    the range [x, y) costs T(y - s) - T(x - s) when causal (T(n) = n(n+1)/2, s: the document's
    start), (y - x)·n when each query sees its whole document of n tokens."""
    docs = _check(documents)
    work, s = 0, 0
    for n in docs:
        x, y = max(start, s), min(stop, s + n)
        if x < y:
            work += _tri(y - s) - _tri(x - s) if causal else (y - x) * n
        s += n
    return work


def work_per_rank(documents, p: int, layout="zigzag", causal: bool = True) -> list[int]:
    """The score pairs each of p ranks computes when the packed sequence is cut by `layout`
    ('contiguous', 'zigzag', or explicit runs: one list of (start, stop) per rank)."""
    docs = _check(documents, p)
    return [sum(range_work(docs, a, b, causal) for a, b in runs) for runs in pieces(sum(docs), p, layout)]


def balance(work) -> float:
    """The busiest rank's work over the mean: 1.0 is perfect; the step waits for the busiest."""
    work = list(work)
    return max(work) * len(work) / sum(work) if sum(work) else 1.0


def doc_split(documents, p: int, causal: bool = True) -> list[tuple[int, int]]:
    """p contiguous ranges [start, stop), in order, covering the sequence, whose busiest range
    has the least work possible (the best contiguous split; ranges may be empty).

    The smallest feasible bound B is found by bisection: a bound is feasible when a greedy cut,
    each range taking tokens while its work stays <= B, needs at most p ranges (taking as many as
    fit never hurts the ranges after it, so greedy decides feasibility exactly).
    """
    docs = _check(documents, p)
    seq = sum(docs)
    cost = torch.cat([torch.arange(1, n + 1) if causal else torch.full((n,), n) for n in docs]).tolist()

    def greedy(bound):
        cuts, work = [0], 0
        for i, c in enumerate(cost):
            if c > bound:
                return None
            if work + c > bound:                           # this token starts the next range
                cuts.append(i)
                work = 0
            work += c
        return cuts if len(cuts) <= p else None

    low, high = max(cost), sum(cost)                       # the answer lies in [low, high]
    while low < high:
        mid = (low + high) // 2
        low, high = (low, mid) if greedy(mid) else (mid + 1, high)
    cuts = greedy(low)
    cuts += [seq] * (p + 1 - len(cuts))                    # fewer ranges than ranks: the last ones are empty
    return [(cuts[r], cuts[r + 1]) for r in range(p)]


def as_layout(ranges) -> list[list[tuple[int, int]]]:
    """Contiguous ranges, one per rank, as ring attention's explicit layout (empty ranges hold no run)."""
    return [[(a, b)] if b > a else [] for a, b in ranges]


def tokens_per_rank(layout, seq_len: int, p: int) -> list[int]:
    """How many tokens each rank holds (its activations and K/V grow with it)."""
    return [sum(b - a for a, b in runs) for runs in pieces(seq_len, p, layout)]
