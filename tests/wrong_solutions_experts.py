"""Plausible wrong answers to chapter 8's exercises (expert parallelism), each a mistake a student could make.

WRONG[exercise_id] lists (function, regular expressions the check's message must match,
timeout for the check or None for the default), as in wrong_solutions.py:
tests/test_checks.py checks that every one of them fails with that message.
"""
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


def dispatch_from_the_library(expert, num_experts, world_size):
    from pplab import expert_parallel
    return expert_parallel.dispatch_plan(expert, num_experts, world_size)


# ----------------------------------------------------------------------------------
# 8b: the bytes


def bytes_without_counts(tokens, k, experts, ranks, hidden, element_size):
    return 2 * tokens * k * (ranks - 1) / ranks * hidden * element_size


def bytes_dispatch_only(tokens, k, experts, ranks, hidden, element_size):
    return (ranks - 1) * experts // ranks * 8 + tokens * k * (ranks - 1) / ranks * hidden * element_size


def bytes_forgets_k(tokens, k, experts, ranks, hidden, element_size):
    return (ranks - 1) * experts // ranks * 8 + 2 * tokens * (ranks - 1) / ranks * hidden * element_size


def bytes_sends_own_rows(tokens, k, experts, ranks, hidden, element_size):
    return (ranks - 1) * experts // ranks * 8 + 2 * tokens * k * hidden * element_size


def bytes_all_counts_to_everyone(tokens, k, experts, ranks, hidden, element_size):
    return (ranks - 1) * experts * 8 + 2 * tokens * k * (ranks - 1) / ranks * hidden * element_size


def bytes_from_the_library(tokens, k, experts, ranks, hidden, element_size):
    from pplab import expert_parallel
    return expert_parallel.all_to_all_bytes(tokens, k, experts, ranks, hidden, element_size)


WHERE = r"^world_size=2, E=\d+ experts, \[\d+, \d+\] choices per rank: rank \d"
WRONG = {
    "moe_dispatch": [
        (dispatch_counts_per_expert, [r"'s send_counts is \[", r"one count per expert|Those are the counts"], None),
        (dispatch_round_robin, [r"rank \d's (send_counts|order) is", r"round-robin"], None),
        (dispatch_keeps_dropped, [WHERE + r"'s send_counts is", r"expert -1 were dropped"], None),
        (dispatch_my_experts_first, [r"^world_size=\d, .*: rank [1-3]'s order is", r"whatever rank you are"], None),
        (dispatch_unstable, [WHERE + r"'s order is", r"sort stably"], None),
        (dispatch_drops_last_choice_on_rank_2, [r"^world_size=3, .*: rank 2's send_counts is"], None),
        (dispatch_from_the_library, [r"pplab\.expert_parallel\.dispatch_plan, the library's answer"], None),
    ],
    "moe_bytes": [
        (bytes_without_counts, [r"^tokens=4096, k=2, experts=8, ranks=4, hidden=1024, element_size=2: bytes one "
                                r"rank sends is", r"The counts are missing"], None),
        (bytes_dispatch_only, [r"That is the dispatch only"], None),
        (bytes_forgets_k, [r"k rows per token"], None),
        (bytes_sends_own_rows, [r"only \(ranks-1\)/ranks"], None),
        (bytes_all_counts_to_everyone, [r"only the counts of that rank's E/ranks experts"], None),
        (bytes_from_the_library, [r"pplab\.expert_parallel\.all_to_all_bytes, the library's answer"], None),
    ],
}
