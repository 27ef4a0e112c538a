"""Check of chapter 11c's exercise: the document-aware split of a packed sequence.

    doc_split    doc_split(doc_lens, p) -> p ranges (start, stop), contiguous, in order, covering
                 the sequence, whose busiest range computes as few score pairs as any such split

No ranks. A range's work is the score pairs its queries compute under a causal document mask:
the t-th token of its document (t from 1) sees t keys. The best possible busiest range is found
here by dynamic programming over every cut (`best_busiest`), written apart from the library's
bisection; the answer passes when its ranges cover the sequence exactly once, in order, and its
busiest range's work equals that best (integers: no tolerance). Any split that reaches it passes,
whichever of several equally good ones it is.

Problems: random packings (1 to 6 documents of 1 to 30 tokens) on p = 2, 3 and 4, drawn so that
every slip below gets at least one of them wrong: the tokens balanced instead of the work, a
token that does not see itself (work t - 1), a document's count started one token late, and each
cut rounded on its own to the nearer token of k/p of the work (the best cut for p = 2, not for more).
"""
from __future__ import annotations

import random

from .. import sealed
from ..core import Fail, exercise, problems_showing, require_function
from .doc_split_rank import _refuse_packed

SLIPS = ("tokens", "forgets_itself", "late_reset", "cuts_alone")


def costs(docs, slip=None) -> list[int]:
    """Each token's score pairs: t for the t-th token of its document; with a slip, the slip's count."""
    out = []
    for d, n in enumerate(docs):
        for t in range(1, n + 1):
            if slip == "forgets_itself":
                out.append(t - 1)
            elif slip == "late_reset" and d > 0 and t == 1:
                out.append(out[-1] + 1)                 # the first token counted in the document before
            else:
                out.append(t)  # the t-th token of its document sees t keys
    return out


def best_busiest(docs, p, slip=None) -> tuple[int, list[int]]:
    """(the least possible work of the busiest of p contiguous ranges, its cut points), by dynamic
    programming: best[k][i] = the least busiest range of the first i tokens cut into k ranges."""
    c = costs(docs, slip)
    prefix = [0]
    for x in c:
        prefix.append(prefix[-1] + x)
    S, inf = len(c), float("inf")
    best = [[inf] * (S + 1) for _ in range(p + 1)]
    cut = [[0] * (S + 1) for _ in range(p + 1)]
    best[0][0] = 0
    for k in range(1, p + 1):
        for i in range(S + 1):
            for j in range(i + 1):                       # the k-th range is [j, i)
                w = max(best[k - 1][j], prefix[i] - prefix[j])
                if w < best[k][i]:
                    best[k][i], cut[k][i] = w, j
    cuts, i = [], S
    for k in range(p, 0, -1):
        cuts.append(i)
        i = cut[k][i]
    return int(best[p][S]), [0] + cuts[::-1]


def _ranges(cuts):
    return [(a, b) for a, b in zip(cuts, cuts[1:])]


def slip_answer(docs, p, slip) -> list[tuple[int, int]]:
    """What an answer with `slip` returns (used to draw problems that tell each slip from the right answer)."""
    S = sum(docs)
    if slip == "tokens":
        sizes = [S // p + (r < S % p) for r in range(p)]
        return _ranges([sum(sizes[:r]) for r in range(p + 1)])
    if slip == "cuts_alone":
        c = costs(docs)
        prefix = [0]
        for x in c:
            prefix.append(prefix[-1] + x)
        cuts = [0]
        for k in range(1, p):
            goal = k * prefix[-1] / p
            after = next(i for i in range(S + 1) if prefix[i] >= goal)
            cuts.append(after if after == 0 or prefix[after] - goal <= goal - prefix[after - 1] else after - 1)
        return _ranges(sorted(cuts) + [S])
    return _ranges(best_busiest(docs, p, slip)[1])


def _looks_like(slip, docs, p, ranges) -> bool:
    """Whether the answer's ranges are what `slip` gives (any of its equally good splits)."""
    if slip == "tokens":
        return max(b - a for a, b in ranges) - min(b - a for a, b in ranges) <= 1
    if slip == "cuts_alone":
        return ranges == slip_answer(docs, p, slip)
    c = costs(docs, slip)
    return max(sum(c[a:b]) for a, b in ranges) == best_busiest(docs, p, slip)[0]


def busiest(docs, ranges) -> int:
    c = costs(docs)
    return max(sum(c[a:b]) for a, b in ranges)


def problems(seed: int, count: int = 12):
    """`count` (docs, p) problems, p = 2, 3 and 4 each, and for every slip at least one it gets wrong."""
    rng = random.Random(seed)

    def draw(i):
        p = (2, 3, 4)[i % 3]
        docs = [rng.randint(1, 30) for _ in range(rng.randint(1, 6))]
        return (docs, p) if sum(docs) >= p else None

    def slips_wrong(case):
        docs, p = case
        best = best_busiest(docs, p)[0]
        return {s for s in SLIPS if busiest(docs, slip_answer(docs, p, s)) > best}
    return problems_showing(draw, slips_wrong, SLIPS, count, enough=lambda out: {p for _, p in out} == {2, 3, 4})


HINTS = {"tokens": "that balances tokens, not work: a token deep in a long document computes many more "
                   "score pairs than one near a document's start.",
         "forgets_itself": "that counts t - 1 pairs for the t-th token of a document: a token sees itself too "
                           "(causal: j <= i), so it is t.",
         "late_reset": "that starts a document's count one token late: the first token of every document "
                       "sees 1 key, itself.",
         "cuts_alone": "that rounds each cut on its own to k/p of the work: for one cut (p = 2) that is the "
                       "best, for more the cuts must be chosen together (bisect on the busiest range's work, "
                       "or try every cut with dynamic programming)."}


def _read(got, S, p, where):
    """The answer's ranges as [(start, stop)], or Fail saying what is wrong with their shape."""
    if not isinstance(got, (list, tuple)) or len(got) != p:
        raise Fail(f"{where}doc_split must return a list of p = {p} ranges (start, stop), got {got!r}")
    ranges = []
    for r, item in enumerate(got):
        if not (isinstance(item, (list, tuple)) and len(item) == 2
                and all(isinstance(x, int) and not isinstance(x, bool) for x in item)):
            raise Fail(f"{where}rank {r}'s range must be two whole numbers (start, stop), got {item!r}")
        ranges.append((item[0], item[1]))
    for r, (a, b) in enumerate(ranges):
        start = 0 if r == 0 else ranges[r - 1][1]
        if a != start or b < a or b > S:
            before = "0, the first token" if r == 0 else f"rank {r - 1}'s stop, {start}"
            raise Fail(f"{where}rank {r}'s range is ({a}, {b}): it must start at {before}, and stop no "
                       f"earlier than it starts and no later than {S} (ranges are [start, stop): the "
                       f"stop is the first token not included). Ranges: {ranges}")
    if ranges[-1][1] != S:
        raise Fail(f"{where}the last rank's range stops at {ranges[-1][1]}, but the sequence has {S} tokens: "
                   f"every token must belong to a range. Ranges: {ranges}")
    return ranges


@exercise("doc_split", "A document-aware split of packed sequences: balance attention work over p ranks",
          answer="doc_split", notebook="11c_doc_split", sealed=True, preload=("pplab.sequence_parallel.packed",))
def check_doc_split(fn, seed: int, timeout: float) -> str:
    """doc_split(doc_lens, p) -> p contiguous ranges whose busiest computes the least work possible."""
    cases = problems(seed)
    require_function(fn, "doc_split", "doc_lens, p", [3, 2], 2)
    outs = sealed.call_each(fn, [(list(docs), p) for docs, p in cases],
                            where=lambda k: f"problem {k} (documents {cases[k][0]}, p = {cases[k][1]}): ",
                            timeout=timeout, probe=_refuse_packed)
    for k, ((docs, p), got) in enumerate(zip(cases, outs)):
        where = f"problem {k} (documents {docs}, p = {p}): "
        ranges = _read(got, sum(docs), p, where)
        best, cuts = best_busiest(docs, p)
        c = costs(docs)
        work = [sum(c[a:b]) for a, b in ranges]
        if max(work) != best:
            hints = [HINTS[s] for s in SLIPS if _looks_like(s, docs, p, ranges)]
            raise Fail(f"{where}your ranges {ranges} give the ranks {work} score pairs; the busiest has "
                       f"{max(work)}, but a split whose busiest has {best} exists, e.g. {_ranges(cuts)} "
                       f"(work {[sum(c[a:b]) for a, b in _ranges(cuts)]})."
                       + "".join("\nYours is " + h for h in hints))
    return f"on {len(cases)} random packings over 2, 3 and 4 ranks (each common slip among them gets one wrong)"
