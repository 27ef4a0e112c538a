"""Near misses of the layout exercises (issue 38): chapter 7's mesh groups and chapter 10's
placement, each right on the easy shapes (powers of two, two nodes) or on rank 0, and wrong
elsewhere. WRONG[exercise_id] lists (function, regexes the message must match, timeout or None),
as in wrong_solutions_ch00_broadcast.py; tests/test_checks.py collects this file with the others.
"""
import itertools

from pplab.checks.ch10_at_scale.find_layout import reference


# ----------------------------------------------------------------------------------
# mesh_groups


def mesh_groups_power_of_two_mask(rank, pp, dp, tp):
    """Coordinates with a bit mask, `rank & (tp - 1)`, as for power-of-two sizes: right on 4 and 8
    ranks (sizes 1, 2, 4), wrong wherever a dimension has size 3."""
    i_tp, i_dp, i_pp = rank & (tp - 1), (rank // tp) & (dp - 1), (rank // (dp * tp)) & (pp - 1)
    at = lambda p, d, t: (p * dp + d) * tp + t                               # noqa: E731
    return {"pp": [at(p, i_dp, i_tp) for p in range(pp)], "dp": [at(i_pp, d, i_tp) for d in range(dp)],
            "tp": [at(i_pp, i_dp, t) for t in range(tp)]}


def mesh_groups_pp_forgets_dp_index(rank, pp, dp, tp):
    """The pp group built from the tp index only (p·dp·tp + rank % tp): right on rank 0 and on every
    rank of dp index 0, wrong on the others."""
    i_pp, rest = divmod(rank, dp * tp)
    i_dp, i_tp = divmod(rest, tp)
    return {"pp": [p * dp * tp + i_tp for p in range(pp)],
            "dp": [(i_pp * dp + d) * tp + i_tp for d in range(dp)],
            "tp": [(i_pp * dp + i_dp) * tp + t for t in range(tp)]}


# ----------------------------------------------------------------------------------
# place_layout


def place_layout_two_crossings_per_ring(problem):
    """A ring that spans nodes counted as crossing twice (over and back), as it does on two nodes:
    right on clusters of 2 nodes, wrong where a ring spans 3 or 4."""
    sizes, traffic, r = problem["sizes"], problem["traffic"], problem["ranks_per_node"]
    used = [d for d in ("pp", "dp", "tp") if sizes[d] > 1]

    def rank_of(coords, order):
        rank = 0
        for d in order:
            rank = rank * sizes[d] + coords[d]
        return rank

    def crossing(order):
        out = {"dp": 0, "tp": 0, "pp": 0}
        for dim in used:
            others = [d for d in used if d != dim]
            for fixed in itertools.product(*(range(sizes[d]) for d in others)):
                g = [rank_of({**dict(zip(others, fixed)), dim: i}, order) for i in range(sizes[dim])]
                if dim == "pp":
                    out[dim] += 2 * sum(traffic[dim] for a, b in zip(g, g[1:]) if a // r != b // r)
                elif len({x // r for x in g}) > 1:
                    out[dim] += 2 * traffic[dim]
        return out
    order = min(itertools.permutations(used), key=lambda o: sum(crossing(o).values()))
    return {"order": order, "cross_node_bytes": crossing(order)}


# ----------------------------------------------------------------------------------
# find_layout


def memory_as_printed(problem):
    """The right bytes, passed through a print with 6 significant digits (f"{x:.6g}"): off by up
    to 5e-6 relative, over the check's 1e-6 and well under 1e-4."""
    return float(f"{sum(reference(problem)):.6g}")


WRONG = {
    "find_layout": [
        (memory_as_printed, [r"^problem \d+: you said [\d.]+ GB, the answer is [\d.]+ GB"], None),
    ],
    "mesh_groups": [
        (mesh_groups_power_of_two_mask,
         [r"^pp=\d, dp=\d, tp=\d on 6 ranks: rank [1-5]'s (pp|dp|tp) group is \[[\d, ]+\], expected \[[\d, ]+\] "
          r"\(rank 0's groups are right: do the others depend on the rank\?\)"], None),
        (mesh_groups_pp_forgets_dp_index,
         [r"^pp=\d, dp=\d, tp=\d on \d ranks: rank [1-7]'s pp group is \[[\d, ]+\], expected \[[\d, ]+\] \(rank 0's groups are right"],
         None),
    ],
    "place_layout": [
        (place_layout_two_crossings_per_ring,
         [r"^bytes: problem \d+ \([34] nodes × [24] ranks, .* (dp|tp) sends [\d,]+ B between nodes by your count, "
          r"[\d,]+ B by pplab\.cluster", r"each rank of a group sends its traffic to the next rank, the last one to "
          r"the first"], None),
    ],
}
