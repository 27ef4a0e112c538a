"""Plausible wrong answers to chapter 7's exercise (the groups of a mesh), each a mistake a student could make.

WRONG[exercise_id] lists (function, regular expressions the check's message must match,
timeout for the check or None for the default), as in wrong_solutions_ch00_broadcast.py:
tests/test_checks.py checks that every one of them fails with that message.
"""


def _laid_out(rank, sizes, order):
    """This rank's groups when ranks are numbered row-major over `order` (outer first), not (pp, dp, tp)."""
    coords, r = {}, rank
    for d in reversed(order):
        r, coords[d] = divmod(r, sizes[d])

    def number(c):
        n = 0
        for d in order:
            n = n * sizes[d] + c[d]
        return n
    return {d: [number({**coords, d: i}) for i in range(sizes[d])] for d in ("pp", "dp", "tp")}


def mesh_groups_tp_outermost(rank, pp, dp, tp):
    """Numbers the grid as (tp, dp, pp): tp varies slowest, so its groups are strided."""
    return _laid_out(rank, {"pp": pp, "dp": dp, "tp": tp}, ("tp", "dp", "pp"))


def mesh_groups_dp_tp_swapped(rank, pp, dp, tp):
    """Order (pp, tp, dp): dp innermost, so the tp groups come out as the mesh's dp groups."""
    return _laid_out(rank, {"pp": pp, "dp": dp, "tp": tp}, ("pp", "tp", "dp"))


def mesh_groups_dp_pp_swapped(rank, pp, dp, tp):
    """Order (dp, pp, tp): dp outermost."""
    return _laid_out(rank, {"pp": pp, "dp": dp, "tp": tp}, ("dp", "pp", "tp"))


def mesh_groups_off_by_one(rank, pp, dp, tp):
    """The dp stride taken as tp + 1."""
    i_pp, rest = divmod(rank, dp * tp)
    i_dp, i_tp = divmod(rest, tp)
    base = i_pp * dp * tp + i_tp
    return {"pp": [p * dp * tp + i_dp * tp + i_tp for p in range(pp)],
            "dp": [base + d * (tp + 1) for d in range(dp)],
            "tp": [i_pp * dp * tp + i_dp * tp + t for t in range(tp)]}


def mesh_groups_rank_zero_only(rank, pp, dp, tp):
    """The groups of rank 0, whatever the rank: right on rank 0 only."""
    return {"pp": [p * dp * tp for p in range(pp)], "dp": [d * tp for d in range(dp)], "tp": list(range(tp))}


def mesh_groups_all_groups(rank, pp, dp, tp):
    """Every group of each dimension instead of this rank's."""
    return {"pp": [[(p * dp + d) * tp + t for p in range(pp)] for d in range(dp) for t in range(tp)],
            "dp": [[(p * dp + d) * tp + t for d in range(dp)] for p in range(pp) for t in range(tp)],
            "tp": [[(p * dp + d) * tp + t for t in range(tp)] for p in range(pp) for d in range(dp)]}


def mesh_groups_uses_the_library(rank, pp, dp, tp):
    from pplab.mesh import groups
    return {d: next(g for g in groups(d, pp=pp, dp=dp, tp=tp) if rank in g) for d in ("pp", "dp", "tp")}


def mesh_groups_tuple(rank, pp, dp, tp):
    """Returns the three groups as a tuple, not a dict."""
    return ([rank], [rank], [rank])


WRONG = {
    "mesh_groups": [
        (mesh_groups_tp_outermost, [r"group is \[", r"expected"], None),
        (mesh_groups_dp_tp_swapped, [r"tp is the innermost|tp groups are the mesh's dp groups|expected"], None),
        (mesh_groups_dp_pp_swapped, [r"expected"], None),
        (mesh_groups_off_by_one, [r"dp group is", r"tp groups are right"], None),
        (mesh_groups_rank_zero_only, [r"rank 0's groups are right"], None),
        (mesh_groups_all_groups, [r"expected"], None),
        (mesh_groups_uses_the_library, [r"pplab.mesh", r"work out the groups of a mesh yourself"], None),
        (mesh_groups_tuple, [r"must return a dict with keys 'pp', 'dp', 'tp'"], None),
    ],
}
