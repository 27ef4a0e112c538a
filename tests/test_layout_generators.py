"""The layout exercises' problem generators keep their promises on every seed, not only on the
tests' (issue 38): find_layout's problems show every common slip by more than 1%, and
place_layout's include one where the rule of thumb loses, one where the pipeline crosses nodes,
and a ring of 3 or more ranks. Checked over many seeds against this file's own formulas (the
generators are pure functions: no ranks, a few seconds in all)."""
import itertools

import pytest

from pplab.checks.ch10_at_scale import find_layout as at_scale, place_layout as cluster

SEEDS = range(150)


# ----------------------------------------------------------------------------------
# find_layout: the memory of the first pipeline GPU, from the exercise's formulas


def memory(p, slip=None):
    """Model state + activations of the first pipeline rank, written out from at_scale's docstring."""
    h, a, L, s, b = p["hidden"], p["heads"], p["layers"], p["seq"], p["micro_batch"]
    tp, pp, dp, zero = p["tp"], p["pp"], p["dp"], p["zero"]
    psi = (L / pp) * 12 * h * h / tp + (0 if slip == "no_embedding" else p["vocab"] * h / tp)
    if slip == "no_zero":
        zero = 0
    shard = {"params": zero >= 3 or (slip == "zero2_shards_parameters" and zero == 2), "grads": zero >= 2,
             "optimizer": zero >= 1}
    state = psi * (2 / (dp if shard["params"] else 1) + 2 / (dp if shard["grads"] else 1)
                   + 12 / (dp if shard["optimizer"] else 1))
    mode = "none" if slip == "selective_keeps_scores" and p["recompute"] == "selective" else p["recompute"]
    layer = {"none": s * b * h * (34 + 5 * a * s / h) / tp, "selective": 34 * s * b * h / tp,
             "full": 2 * s * b * h / tp}[mode]
    if slip == "scores_not_split" and mode == "none":
        layer = s * b * h * 34 / tp + 5 * a * s * s * b             # the scores whole on every rank
    if slip == "full_input_not_split" and mode == "full":
        layer = 2 * s * b * h
    held = {"gpipe_memory": p["m"], "pp_in_flight": pp}.get(slip, min(pp, p["m"]))
    return state + held * (L / pp) * layer


@pytest.mark.parametrize("seed", SEEDS[::15])
def test_find_layout_answers_are_the_formulas(seed):
    for problem, right in at_scale.problems(seed):
        assert right == pytest.approx(memory(problem), rel=1e-12)


def test_find_layout_problems_show_every_slip_on_every_seed():
    for seed in SEEDS:
        cases = at_scale.problems(seed)
        assert len(cases) >= 12
        shown = {slip for slip in at_scale.SLIPS for problem, _ in cases
                 if abs(memory(problem, slip) / memory(problem) - 1) > 0.01}
        assert shown == set(at_scale.SLIPS), f"seed {seed}: {sorted(set(at_scale.SLIPS) - shown)} never shows"


# ----------------------------------------------------------------------------------
# place_layout: bytes between nodes, counted link by link


def crossing(problem, order):
    """Bytes each dimension sends between nodes with ranks numbered row-major along `order`
    (outermost first), rank r on node r // ranks_per_node: rings for dp and tp, a chain for pp
    (activations forward, as many bytes of gradients back)."""
    sizes, traffic, per_node = problem["sizes"], problem["traffic"], problem["ranks_per_node"]
    dims = list(order) + [d for d in ("pp", "dp", "tp") if d not in order]       # size-1 ones anywhere
    out = {"pp": 0, "dp": 0, "tp": 0}
    for coords in itertools.product(*(range(sizes[d]) for d in dims)):
        at = dict(zip(dims, coords))
        rank = 0
        for d in dims:
            rank = rank * sizes[d] + at[d]
        for d in ("pp", "dp", "tp"):
            if sizes[d] == 1 or (d == "pp" and at[d] == sizes[d] - 1):
                continue
            nxt = dict(at, **{d: (at[d] + 1) % sizes[d]})
            peer = 0
            for e in dims:
                peer = peer * sizes[e] + nxt[e]
            if rank // per_node != peer // per_node:
                out[d] += traffic[d] * (2 if d == "pp" else 1)
    return out


@pytest.mark.parametrize("seed", SEEDS[::50])
def test_place_layout_bytes_are_counted_link_by_link(seed):
    for p in cluster.problems(seed):
        for o in itertools.permutations([d for d in ("pp", "dp", "tp") if p["sizes"][d] > 1]):
            assert crossing(p, o) == pytest.approx(cluster._reference(p, o), rel=1e-12), (p, o)


def test_place_layout_problems_keep_their_promises_on_every_seed():
    for seed in SEEDS[:60]:
        problems = cluster.problems(seed)
        assert len(problems) >= 12
        rule_loses = pp_crosses = long_ring = False
        for p in problems:
            used = [d for d in ("pp", "dp", "tp") if p["sizes"][d] > 1]
            totals = {o: sum(crossing(p, o).values()) for o in itertools.permutations(used)}
            rule = tuple(sorted(used, key=lambda d: p["traffic"][d]))
            rule_loses |= totals[rule] > min(totals.values())
            pp_crosses |= any(crossing(p, o)["pp"] > 0 for o in totals)
            long_ring |= any(p["sizes"][d] >= 3 for d in ("dp", "tp"))
        assert rule_loses, f"seed {seed}: the rule of thumb is the best order in every problem"
        assert pp_crosses, f"seed {seed}: the pipeline never crosses nodes"
        assert long_ring, f"seed {seed}: no ring of 3 or more ranks"
