"""Plausible wrong answers to chapter 8's exercises (expert parallelism), each a mistake a student could make.

WRONG[exercise_id] lists (function, regular expressions the check's message must match,
timeout for the check or None for the default), as in wrong_solutions_ch00_broadcast.py:
tests/test_checks.py checks that every one of them fails with that message.
"""
import math

import torch

from pplab import comm

# ----------------------------------------------------------------------------------
# 8a: the dispatch


def _kept_sorted(expert):
    kept = (expert >= 0).nonzero().flatten()
    return kept[torch.argsort(expert[kept], stable=True)]


def dispatch_counts_per_expert(expert, num_experts, world_size):
    """One count per expert, not per rank."""
    order = _kept_sorted(expert)
    return torch.bincount(expert[order], minlength=num_experts).tolist(), order


def dispatch_round_robin(expert, num_experts, world_size):
    """Expert e on rank e % p (as if dealt out), sorted accordingly."""
    kept = (expert >= 0).nonzero().flatten()
    order = kept[torch.argsort(expert[kept] % world_size * num_experts + expert[kept], stable=True)]
    return torch.bincount(expert[kept] % world_size, minlength=world_size).tolist(), order


def dispatch_keeps_dropped(expert, num_experts, world_size):
    """Dropped choices (-1) sent along, to rank 0."""
    order = torch.argsort(expert.clamp(min=0), stable=True)
    return torch.bincount(expert.clamp(min=0) // (num_experts // world_size), minlength=world_size).tolist(), order


def dispatch_my_experts_first(expert, num_experts, world_size):
    """Right on rank 0: the block for this rank's own experts first, then the next rank's, ...,
    so on rank 1 the blocks are out of rank order."""
    per_rank, rank = num_experts // world_size, comm.rank()
    kept = (expert >= 0).nonzero().flatten()
    order = kept[torch.argsort((expert[kept] - rank * per_rank) % num_experts, stable=True)]
    return torch.bincount(expert[kept] // per_rank, minlength=world_size).tolist(), order


def dispatch_unstable(expert, num_experts, world_size):
    """Sorted by expert, but choices of one expert in reverse order."""
    kept = (expert >= 0).nonzero().flatten().flip(0)
    order = kept[torch.argsort(expert[kept], stable=True)]
    return torch.bincount(expert[order] // (num_experts // world_size), minlength=world_size).tolist(), order


def dispatch_drops_last_choice_on_rank_2(expert, num_experts, world_size):
    """Right on ranks 0 and 1; on rank 2 the last kept choice is left out (a loop bound
    off by one that only that rank's code path hits). Only a check of every rank sees it."""
    order = _kept_sorted(expert)
    if comm.rank() == 2:
        last = (expert >= 0).nonzero().flatten()[-1]
        order = order[order != last]
    return torch.bincount(expert[order] // (num_experts // world_size), minlength=world_size).tolist(), order


def dispatch_owner_by_comparison(expert, num_experts, world_size):
    """The owner of expert e as `e >= E/p` (the first half or the second, two ranks in mind): right
    on 2 ranks; on 3, rank 2's experts go to rank 1. The order (sorted by expert) stays right."""
    order = _kept_sorted(expert)
    owner = (expert[order] >= num_experts // world_size).long()
    return torch.bincount(owner, minlength=world_size).tolist(), order


def dispatch_from_the_library(expert, num_experts, world_size):
    from pplab import expert_parallel
    return expert_parallel.dispatch_plan(expert, num_experts, world_size)


# ----------------------------------------------------------------------------------
# 8b: every rank's bytes under a skewed routing


def _rows(choices, E, capacity_factor, capacity=None):
    """rows[r][j]: rank r's kept choices for rank j's experts (the right rule, with knobs)."""
    p, rows = len(choices), []
    for c in choices:
        n, k = c.shape
        cap = capacity(c) if capacity else n * k if capacity_factor is None else math.ceil(capacity_factor * n * k / E)
        taken, to = [0] * E, [0] * p
        for e in c.T.flatten().tolist():
            if taken[e] < cap:
                taken[e] += 1
                to[e // (E // p)] += 1
        rows.append(to)
    return rows


def _bytes(rows, E, row, counts=None):
    p = len(rows)
    return [(counts if counts is not None else (p - 1) * (E // p) * 8,
             sum(rows[r][j] for j in range(p) if j != r) * row, sum(rows[i][r] for i in range(p) if i != r) * row)
            for r in range(p)]


def traffic_even_formula(choices, num_experts, capacity_factor, hidden, element_size):
    """The formula of an even router, whatever the routing: right only where the router is even."""
    p = len(choices)
    return [((p - 1) * (num_experts // p) * 8,) + (len(c) * c.shape[1] * (p - 1) / p * hidden * element_size,) * 2
            for c in choices]


def traffic_ignores_capacity(choices, num_experts, capacity_factor, hidden, element_size):
    """Every choice sent, as if no expert had a capacity."""
    return _bytes(_rows(choices, num_experts, None), num_experts, hidden * element_size)


def traffic_combine_is_own_dispatch(choices, num_experts, capacity_factor, hidden, element_size):
    """The combine taken as the same rows as this rank's dispatch, coming back."""
    return [(c, d, d) for c, d, _ in _bytes(_rows(choices, num_experts, capacity_factor), num_experts,
                                            hidden * element_size)]


def traffic_capacity_of_rank_0(choices, num_experts, capacity_factor, hidden, element_size):
    """Every rank's capacity computed from rank 0's number of tokens: right on rank 0."""
    n0, k = choices[0].shape
    cap = None if capacity_factor is None else (lambda c: math.ceil(capacity_factor * n0 * k / num_experts))
    return _bytes(_rows(choices, num_experts, capacity_factor, capacity=cap), num_experts, hidden * element_size)


def traffic_all_counts_to_everyone(choices, num_experts, capacity_factor, hidden, element_size):
    """Sends every other rank the counts of all E experts."""
    return _bytes(_rows(choices, num_experts, capacity_factor), num_experts, hidden * element_size,
                  counts=(len(choices) - 1) * num_experts * 8)


def traffic_one_peer(choices, num_experts, capacity_factor, hidden, element_size):
    """The dispatch counted to the next rank only and the combine from it (the one other rank there
    is on 2 ranks): right on 2 ranks, short on 3 and 4."""
    p, row = len(choices), hidden * element_size
    rows = _rows(choices, num_experts, capacity_factor)
    return [((p - 1) * (num_experts // p) * 8, rows[r][(r + 1) % p] * row, rows[(r + 1) % p][r] * row)
            for r in range(p)]


def traffic_combine_skips_rank_0(choices, num_experts, capacity_factor, hidden, element_size):
    """The combine summed over source ranks range(1, p), as if rank 0's rows never left it: right
    on rank 0 (whose sources are 1..p-1 anyway), short on every other rank."""
    p, row = len(choices), hidden * element_size
    rows = _rows(choices, num_experts, capacity_factor)
    return [((p - 1) * (num_experts // p) * 8, sum(rows[r][j] for j in range(p) if j != r) * row,
             sum(rows[i][r] for i in range(1, p) if i != r) * row) for r in range(p)]


def traffic_rows_of_float32(choices, num_experts, capacity_factor, hidden, element_size):
    """Every row counted as hidden float32 numbers, 4 bytes each, whatever element_size says."""
    return _bytes(_rows(choices, num_experts, capacity_factor), num_experts, hidden * 4)


def traffic_from_the_library(choices, num_experts, capacity_factor, hidden, element_size):
    from pplab import expert_parallel
    b = expert_parallel.all_to_all_bytes(len(choices[0]), choices[0].shape[1], num_experts, len(choices), hidden,
                                         element_size)
    return [(0, b, 0)] * len(choices)


TRAFFIC = r"^p=[234], E=\d+, k=[12], .*, tokens per rank \[[\d, ]+\], "
WHERE = r"^world_size=2, E=\d+ experts, \[\d+, \d+\] choices per rank: rank \d"
WRONG = {
    "moe_dispatch": [
        (dispatch_counts_per_expert, [r"'s send_counts is \[", r"one count per expert|Those are the counts"], None),
        (dispatch_round_robin, [r"rank \d's (send_counts|order) is", r"round-robin"], None),
        (dispatch_keeps_dropped, [WHERE + r"'s send_counts is", r"expert -1 were dropped"], None),
        (dispatch_my_experts_first, [r"^world_size=\d, .*: rank [1-3]'s order is", r"whatever rank you are"], None),
        (dispatch_unstable, [WHERE + r"'s order is", r"sort stably"], None),
        (dispatch_drops_last_choice_on_rank_2, [r"^world_size=3, .*: rank 2's send_counts is"], None),
        (dispatch_owner_by_comparison, [r"^world_size=[34], .*: rank \d's send_counts is \[[\d, ]+\], expected"],
         None),
        (dispatch_from_the_library, [r"pplab\.expert_parallel\.dispatch_plan, the library's answer"], None),
    ],
    "moe_bytes": [
        (traffic_even_formula, [TRAFFIC + r"rank \d sends [\d,.]+ bytes in the (dispatch|combine), measured",
                                r"That is the even router's formula", r"counts ✔"], None),
        (traffic_ignores_capacity, [r"capacity factor [\d.]+, .*, rank \d sends [\d,]+ bytes in the dispatch",
                                    r"That counts every choice", r"counts ✔ · dispatch ✘ · combine ✘ \(1 of 3\)"],
         None),
        (traffic_combine_is_own_dispatch, [TRAFFIC + r"rank \d sends [\d,]+ bytes in the combine",
                                           r"That is what rank \d dispatched", r"\(2 of 3\)"], None),
        (traffic_capacity_of_rank_0, [TRAFFIC + r"rank \d sends [\d,]+ bytes in the (dispatch|combine)",
                                      r"Capacity is per rank-local batch"], None),
        (traffic_all_counts_to_everyone, [TRAFFIC + r"rank \d sends [\d,]+ bytes in the counts",
                                          r"only the counts for that rank's E/p experts",
                                          r"counts ✘ · dispatch ✔ · combine ✔ \(2 of 3\)"], None),
        (traffic_one_peer, [r"^p=[34], E=\d+, .*rank \d sends [\d,.]+ bytes in the (dispatch|combine), measured",
                             r"counts ✔ · dispatch ✘ · combine ✘"], None),
        (traffic_combine_skips_rank_0, [TRAFFIC + r"rank [1-3] sends [\d,.]+ bytes in the combine, measured",
                                         r"counts ✔ · dispatch ✔ · combine ✘"], None),
        (traffic_rows_of_float32, [r"element_size=[28], .*rank \d sends [\d,.]+ bytes in the (dispatch|combine), "
                                   r"measured", r"counts ✔ · dispatch ✘ · combine ✘"], None),
        (traffic_from_the_library, [r"pplab\.expert_parallel\.all_to_all_bytes, the library's answer"], None),
    ],
}
