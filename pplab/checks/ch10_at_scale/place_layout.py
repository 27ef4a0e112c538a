"""Check of chapter 10's exercise (a): place a layout on a two-tier cluster.

    place_layout   place_layout(problem) -> {"order": (outermost, ..., innermost),
                                             "cross_node_bytes": {"dp": ..., "tp": ..., "pp": ...}}

No ranks: each problem is a cluster (2 to 4 nodes of 2 or 4 ranks, 3 nodes included), a
dp × tp × pp layout of its ranks, and the bytes one rank sends per step along each dimension.
The answer picks the order of the dimensions (outermost first) and says how many bytes each
dimension then sends between nodes per step. Graded in two parts, against pplab.cluster.place:

    bytes   for the order the answer picked, its bytes between nodes, dimension by dimension
            (tp and dp: rings over each group; pp: a chain of stages, activations forward,
            gradients back), to 1e-9 relative
    order   an order that sends the fewest bytes between nodes in total (ties: any of them)

Problems are drawn so that each common slip shows: a ring that forgets its closing link, the
pipeline's gradients left out, the order read innermost first, and the rule of thumb (sort by
traffic) where it is not the best order.
"""
from __future__ import annotations

import itertools
import random

from .. import sealed
from ..core import Fail, exercise, problems_showing, require_function
from .place_layout_rank import _refuse_cluster


PARTS = ("bytes", "order")


DIMS = ("pp", "dp", "tp")


def _reference(problem, order) -> dict:
    """pplab.cluster's bytes between nodes for this order."""
    from ...cluster import Cluster, place
    c = Cluster(problem["n_nodes"], problem["ranks_per_node"])
    p = place(c, order=order, **problem["sizes"])
    return p.cross_node_bytes(problem["traffic"])


def _used(problem) -> list:
    return [d for d in DIMS if problem["sizes"][d] > 1]


def _totals(problem) -> dict:
    return {o: sum(_reference(problem, o).values()) for o in itertools.permutations(_used(problem))}


def _by_rule(problem) -> tuple:
    return tuple(sorted(_used(problem), key=lambda d: problem["traffic"][d]))


def _problem(rng) -> dict:
    n_nodes, r = rng.choice([(2, 2), (3, 2), (2, 4), (4, 2), (3, 4)])
    world = n_nodes * r
    splits = [(dp, tp, world // (dp * tp)) for dp in range(1, world + 1) for tp in range(1, world + 1)
              if world % (dp * tp) == 0 and sum(x > 1 for x in (dp, tp, world // (dp * tp))) >= 2]
    dp, tp, pp = rng.choice(splits)
    traffic = {"tp": rng.choice([40, 90, 160]) * 1000, "dp": rng.choice([10, 30, 60, 120]) * 1000,
               "pp": rng.choice([4, 20, 50, 100]) * 1000}
    return {"n_nodes": n_nodes, "ranks_per_node": r, "sizes": {"dp": dp, "tp": tp, "pp": pp}, "traffic": traffic}


def problems(seed: int, count: int = 12) -> list:
    """`count` problems, among them at least one where the rule of thumb is not the best order,
    one where the pipeline crosses, and one with rings of 3 or more that cross on some links only."""
    rng = random.Random(seed)

    def cases_shown(p):
        totals = _totals(p)
        shown = {"rule_loses": totals[_by_rule(p)] > min(totals.values()),
                 "pp_crosses": any(_reference(p, o)["pp"] for o in totals),
                 "long_ring": any(p["sizes"][d] >= 3 for d in ("dp", "tp"))}
        return {k for k, v in shown.items() if v}
    return problems_showing(lambda _: _problem(rng), cases_shown, ("rule_loses", "pp_crosses", "long_ring"), count)


def _read(got, problem, k):
    """(order, bytes) from what the answer returned, or Fail saying what shape it should have."""
    where = f"problem {k}: "
    if not isinstance(got, dict) or set(got) != {"order", "cross_node_bytes"}:
        raise Fail(f"{where}place_layout must return {{'order': (...), 'cross_node_bytes': {{...}}}}, got {got!r}.",
                   seed_matters=False)
    order = tuple(got["order"]) if isinstance(got["order"], (list, tuple)) else got["order"]
    used = _used(problem)
    if not isinstance(order, tuple) or sorted(order) != sorted(used):
        raise Fail(f"{where}the order must name each dimension larger than 1 once, outermost first: "
                   f"{sorted(used)} (sizes {problem['sizes']}), got {got['order']!r}.")
    crossed = got["cross_node_bytes"]
    if not isinstance(crossed, dict) or not all(isinstance(crossed.get(d), (int, float)) and
                                                not isinstance(crossed.get(d), bool) for d in DIMS):
        raise Fail(f"{where}cross_node_bytes must map each of 'dp', 'tp', 'pp' to a number of bytes, got {crossed!r}.")
    return order, crossed


@exercise("place_layout", "Place a layout on a two-tier cluster: the bytes each dimension sends between nodes",
          answer="place_layout", notebook="10d_place_layout", sealed=True, points=len(PARTS),
          preload=("pplab.cluster",))
def check_place_layout(fn, seed: int, timeout: float) -> str:
    """place_layout(problem) -> {"order": ..., "cross_node_bytes": {...}}: 1 point for the bytes of the
    chosen order, 1 for an order with the fewest bytes between nodes."""
    cases = problems(seed)
    require_function(fn, "place_layout", "problem", cases[0])
    outs = sealed.call_each(fn, [(dict(p),) for p in cases], where=lambda k: f"problem {k}: ",
                            timeout=timeout, probe=_refuse_cluster)
    wrong_bytes = wrong_order = None
    for k, (p, got) in enumerate(zip(cases, outs)):
        order, crossed = _read(got, p, k)
        want = _reference(p, order)
        if wrong_bytes is None and any(abs(crossed[d] - want[d]) > 1e-9 * max(1.0, want[d]) for d in DIMS):
            d = next(d for d in DIMS if abs(crossed[d] - want[d]) > 1e-9 * max(1.0, want[d]))
            wrong_bytes = (f"problem {k} ({p['n_nodes']} nodes × {p['ranks_per_node']} ranks, sizes {p['sizes']}, "
                           f"traffic per rank {p['traffic']}), order {order}: {d} sends {crossed[d]:,.0f} B between "
                           f"nodes by your count, {want[d]:,.0f} B by pplab.cluster. Check the numbering (row-major "
                           f"along the order, outermost first; rank r on node r // ranks_per_node) and the pattern: "
                           f"{_hint(d)}")
        totals = _totals(p)
        if wrong_order is None and totals[order] > min(totals.values()):
            best = min(totals, key=totals.get)
            wrong_order = (f"problem {k} ({p['n_nodes']} nodes × {p['ranks_per_node']} ranks, sizes {p['sizes']}, "
                           f"traffic per rank {p['traffic']}): your order {order} sends {totals[order]:,.0f} B between "
                           f"nodes, {best} only {totals[best]:,.0f} B"
                           + (" (sorting by traffic is a rule of thumb: compare every order's total)"
                              if order == _by_rule(p) else ""))
    if wrong_bytes or wrong_order:
        earned = (wrong_bytes is None) + (wrong_order is None)
        raise Fail("; ".join(f"{part}: {msg}" for part, msg in (("bytes", wrong_bytes), ("order", wrong_order)) if msg)
                   + ".", earned=earned or None)
    return f"{len(cases)} problems: the bytes between nodes of each dimension, and an order with the fewest"


def _hint(dim) -> str:
    if dim == "pp":
        return "a stage sends its activations to the next stage, and gets as many bytes of gradients back"
    return "each rank of a group sends its traffic to the next rank, the last one to the first"
