"""Check of chapter 11d's exercise: DeepSeek-V3's node-limited top-k routing.

    node_limited_routing   node_limited_topk(scores, experts_per_rank, ranks_per_node, max_nodes, k)
                           -> each token's k experts, [n, k] (any order within a token)

No ranks: a pure function, called in one sealed rank. Experts sit on ranks in order
(experts_per_rank[r] of them on rank r, the first ones on rank 0), ranks on nodes (rank r on
node r // ranks_per_node). The reference, worked out here one token at a time in plain Python:
a node is worth the sum of its top min(ceil(k / M), its size) scores; the best M nodes are kept
(equal worth: the lower node); the top-k scores among their experts are chosen (equal: the
lower expert). Graded in two parts, each on problems of 2, 3 and 4 nodes of 1 or 2 ranks:

    routing   scores drawn at random (no two equal), nodes of equal and of unequal sizes
    ties      scores on a grid of 4 values: equal scores and equal node sums everywhere

The answers are sets of whole numbers: there is no tolerance to sit outside of. Every problem set
holds, whatever the seed, a problem that each of these slips gets wrong: ranks limited instead of
nodes, nodes ranked by their best score instead of the sum, nodes taken as equal blocks (right
when the experts divide evenly over nodes), only the worst node dropped (right when N - M = 1,
as at 2 nodes with M = 1), a tie broken towards the higher index, the last expert left out.
"""
from __future__ import annotations

import math
import random

import torch

from .. import sealed
from ..core import Fail, Parts, exercise, require_function
from .node_limited_routing_rank import _refuse_experts_at_scale

PARTS = ("routing", "ties")

# (experts_per_rank, ranks_per_node, max_nodes, k): every slip of the docstring shows on one of these
SHAPES = [
    ([4, 4], 1, 1, 2),                  # 2 nodes, even
    ([2, 2, 2, 2], 2, 1, 3),            # 2 nodes of 2 ranks: ranks limited instead of nodes shows
    ([3, 3, 3], 1, 1, 2),               # 3 nodes, M = 1: dropping the worst node keeps two
    ([3, 5, 2, 2], 1, 2, 4),            # 4 nodes of unequal sizes (12 experts: an equal view fits, wrongly)
    ([1, 3, 2, 2, 4, 2], 2, 2, 4),      # 3 nodes of 2 ranks, unequal: 4, 4, 6 experts
    ([2, 2, 2], 1, 3, 3),               # M = every node: plain top-k
]


def _node_sizes(experts_per_rank, ranks_per_node):
    return [sum(experts_per_rank[i:i + ranks_per_node]) for i in range(0, len(experts_per_rank), ranks_per_node)]


def reference(scores, experts_per_rank, ranks_per_node, max_nodes, k) -> list[list[int]]:
    """Each token's chosen experts, sorted, by the rule of the docstring, one token at a time."""
    sizes = _node_sizes(experts_per_rank, ranks_per_node)
    starts = [sum(sizes[:d]) for d in range(len(sizes))]
    per = math.ceil(k / max_nodes)
    out = []
    for row in scores.tolist():
        worth = [sum(sorted(row[a:a + s], reverse=True)[:per]) for a, s in zip(starts, sizes)]
        nodes = sorted(range(len(sizes)), key=lambda d: (-worth[d], d))[:max_nodes]
        experts = [e for d in nodes for e in range(starts[d], starts[d] + sizes[d])]
        out.append(sorted(sorted(experts, key=lambda e: (-row[e], e))[:k]))
    return out


def problems(seed: int, tokens: int = 48) -> list[dict]:
    """Every shape twice: random scores (part routing), then scores on a grid of 4 values (part ties)."""
    rng = random.Random(seed)
    out = []
    for part in PARTS:
        for experts_per_rank, r, m, k in SHAPES:
            g = torch.Generator().manual_seed(rng.randrange(2**31))
            E = sum(experts_per_rank)
            scores = torch.rand(tokens, E, generator=g, dtype=torch.float64) if part == "routing" else \
                torch.randint(0, 4, (tokens, E), generator=g).double() / 4
            out.append({"part": part, "scores": scores, "experts_per_rank": list(experts_per_rank),
                        "ranks_per_node": r, "max_nodes": m, "k": k})
    return out


def _describe(p) -> str:
    sizes = _node_sizes(p["experts_per_rank"], p["ranks_per_node"])
    return (f"{len(sizes)} nodes holding {sizes} experts (experts_per_rank={p['experts_per_rank']}, "
            f"ranks_per_node={p['ranks_per_node']}), max_nodes={p['max_nodes']}, k={p['k']}")


def _read(got, p) -> list[list[int]] | str:
    """The answer's rows as sorted lists, or what is wrong with its shape."""
    n, k, E = len(p["scores"]), p["k"], p["scores"].shape[1]
    try:
        rows = got.tolist() if isinstance(got, torch.Tensor) else [list(r) for r in got]
    except TypeError:
        return f"node_limited_topk must return each token's k experts, [n, k]; got {type(got).__name__}"
    if len(rows) != n or any(len(r) != k for r in rows):
        return f"node_limited_topk must return {n} rows of k={k} experts; got {len(rows)} rows"
    for i, r in enumerate(rows):
        if any(isinstance(e, bool) or not isinstance(e, int) or not 0 <= e < E for e in r) or len(set(r)) != k:
            return f"token {i}: {r} is not {k} different experts numbered 0..{E - 1}"
    return [sorted(r) for r in rows]


def _hint(row, got, want, p) -> str:
    sizes = _node_sizes(p["experts_per_rank"], p["ranks_per_node"])
    node = [d for d, s in enumerate(sizes) for _ in range(s)]
    if len({node[e] for e in got}) > p["max_nodes"]:
        return f" Your choice spans {len({node[e] for e in got})} nodes, more than max_nodes."
    per, starts = math.ceil(p["k"] / p["max_nodes"]), [sum(sizes[:d]) for d in range(len(sizes))]
    worth = [sum(sorted(row[a:a + n], reverse=True)[:per]) for a, n in zip(starts, sizes)]
    mine, right = sorted({node[e] for e in got}), sorted({node[e] for e in want})
    if mine != right and sorted(worth[d] for d in mine) == sorted(worth[d] for d in right):
        yours, kept = (f"node {mine[0]}", f"node {right[0]}") if len(mine) == 1 else (f"nodes {mine}", f"{right}")
        return (f" Your {yours} and the expected {kept} are worth the same (the sum of their top ceil(k/M) = {per} "
                f"scores): equal node sums go to the lower node, equal scores to the lower expert.")
    if sorted(row[e] for e in got) == sorted(row[e] for e in want):
        return " The same scores, other experts: equal scores go to the lower expert, equal node sums to the lower node."
    return ""


@exercise("node_limited_routing", "Node-limited top-k routing (DeepSeek-V3): at most M nodes per token",
          answer="node_limited_topk", notebook="11d_node_limited_routing", sealed=True, points=len(PARTS),
          preload=("pplab.experts_at_scale",))
def check_node_limited_routing(fn, seed: int, timeout: float) -> str:
    """node_limited_topk(scores, experts_per_rank, ranks_per_node, max_nodes, k) -> [n, k] experts:
    1 point for random scores, 1 for scores with ties."""
    cases = problems(seed)
    first = cases[0]
    require_function(fn, "node_limited_routing", "scores, experts_per_rank, ranks_per_node, max_nodes, k",
                     first["scores"][:2], first["experts_per_rank"], first["ranks_per_node"], first["max_nodes"],
                     first["k"])
    args = [(c["scores"], list(c["experts_per_rank"]), c["ranks_per_node"], c["max_nodes"], c["k"]) for c in cases]
    parts = Parts(PARTS)
    outs = sealed.call_each(fn, args, where=lambda i: f"problem {i} ({_describe(cases[i])}): ", timeout=timeout,
                            probe=_refuse_experts_at_scale)
    try:
        for i, (p, got) in enumerate(zip(cases, outs)):
            where = f"{p['part']}: problem {i} ({_describe(p)})"
            rows = _read(got, p)
            if isinstance(rows, str):
                raise Fail(f"{where}: {rows}.", seed_matters=False)
            want = reference(p["scores"], p["experts_per_rank"], p["ranks_per_node"], p["max_nodes"], p["k"])
            bad = next((t for t in range(len(want)) if rows[t] != want[t]), None)
            if bad is not None:
                row = p["scores"][bad].tolist()
                parts.note(p["part"], f"token {bad} (scores {[round(s, 3) for s in row]}): chose {rows[bad]}, "
                                      f"expected {want[bad]}.{_hint(row, rows[bad], want[bad], p)}", where)
    except Fail as failure:
        raise parts.aborted(failure) from None
    return parts.finish(f"{len(cases)} problems of 2 to 4 nodes (nodes of unequal sizes, 2 ranks per node, "
                        f"M = 1 to every node), {len(cases[0]['scores'])} tokens each, random scores and ties")
