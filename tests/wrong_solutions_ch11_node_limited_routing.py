"""Wrong answers to chapter 11d's exercise, node_limited_routing, each with what its message must say.

Each is the right computation with one plausible slip; pplab.checks.ch11_frontier.node_limited_routing's problems
hold, for every seed, one that each slip gets wrong (tests/test_experts_at_scale.py checks that over
many seeds). The answer is a set of whole numbers per token: there is no tolerance to sit just
outside of; the near misses here are the ones the concept has:

    right at 2 nodes, wrong at 3      only the worst node dropped (= the best M kept when N - M = 1)
    wrong on a token other than 0     the first token's nodes used for every token
    wrong on one node other than 0    the last node's last expert left out
    right when experts divide evenly  nodes taken as equal blocks of E / N experts
    a tie broken the other way        equal scores to the higher expert (part ties only)
    ranks limited instead of nodes    each rank treated as a node
    nodes by their best score         max instead of the sum of the top ⌈k/M⌉

CLOSE_BUT_RIGHT: answers that differ from the solution in form only (rows in another order, lists
instead of a tensor, the per-node worth summed in float32 from float64 scores on a grid) must pass.
"""
import math

import torch


def _top(x, m, lower_first=True):
    if lower_first:
        return torch.sort(x, dim=-1, descending=True, stable=True).indices[..., :m]
    flipped = torch.sort(x.flip(-1), dim=-1, descending=True, stable=True).indices[..., :m]
    return x.shape[-1] - 1 - flipped                  # equal values: the higher index first


def _route(scores, experts_per_rank, ranks_per_node, max_nodes, k, *, per_rank=False, worth="sum", blocks=False,
           drop_worst_only=False, lower_first=True, last_out=False, first_tokens_nodes=False):
    group = 1 if per_rank else ranks_per_node
    sizes = [sum(experts_per_rank[i:i + group]) for i in range(0, len(experts_per_rank), group)]
    if blocks:                                        # nodes as equal blocks: E / N each
        sizes = [scores.shape[1] // len(sizes)] * len(sizes)
    per_node = math.ceil(k / max_nodes)
    parts = scores.split(sizes, dim=1)
    if worth == "max":
        w = torch.stack([part.max(1).values for part in parts], 1)
    else:
        w = torch.stack([part.gather(1, _top(part, min(per_node, part.shape[1]), lower_first)).sum(1)
                         for part in parts], 1)
    if drop_worst_only:                               # every node but the worst: right when N - M = 1
        allowed = torch.ones_like(w, dtype=torch.bool).scatter(1, _top(-w, 1, lower_first), False)
        if max_nodes >= len(sizes):
            allowed[:] = True
    elif first_tokens_nodes:                          # written for one token: row 0's nodes for every token
        allowed = torch.zeros_like(w, dtype=torch.bool).scatter(1, _top(w[:1], max_nodes).expand(len(w), -1), True)
    else:
        allowed = torch.zeros_like(w, dtype=torch.bool).scatter(1, _top(w, max_nodes, lower_first), True)
    allowed = allowed.repeat_interleave(torch.tensor(sizes), dim=1)
    if last_out:
        allowed[:, -1] = False                        # the last node's last expert never chosen
    return _top(scores.masked_fill(~allowed, -math.inf), k, lower_first)


def limits_ranks_instead_of_nodes(scores, experts_per_rank, ranks_per_node, max_nodes, k):
    return _route(scores, experts_per_rank, ranks_per_node, max_nodes, k, per_rank=True)


def nodes_by_their_best_score(scores, experts_per_rank, ranks_per_node, max_nodes, k):
    return _route(scores, experts_per_rank, ranks_per_node, max_nodes, k, worth="max")


def nodes_as_equal_blocks(scores, experts_per_rank, ranks_per_node, max_nodes, k):
    return _route(scores, experts_per_rank, ranks_per_node, max_nodes, k, blocks=True)


def drops_only_the_worst_node(scores, experts_per_rank, ranks_per_node, max_nodes, k):
    return _route(scores, experts_per_rank, ranks_per_node, max_nodes, k, drop_worst_only=True)


def ties_to_the_higher_index(scores, experts_per_rank, ranks_per_node, max_nodes, k):
    return _route(scores, experts_per_rank, ranks_per_node, max_nodes, k, lower_first=False)


def last_expert_left_out(scores, experts_per_rank, ranks_per_node, max_nodes, k):
    return _route(scores, experts_per_rank, ranks_per_node, max_nodes, k, last_out=True)


def first_tokens_nodes_for_every_token(scores, experts_per_rank, ranks_per_node, max_nodes, k):
    """Right on token 0 of every problem, wrong on others: the analogue of a rank other than 0."""
    return _route(scores, experts_per_rank, ranks_per_node, max_nodes, k, first_tokens_nodes=True)


def plain_topk(scores, experts_per_rank, ranks_per_node, max_nodes, k):
    return scores.topk(k, dim=1).indices


def returns_one_row_per_node(scores, experts_per_rank, ranks_per_node, max_nodes, k):
    return _route(scores, experts_per_rank, ranks_per_node, max_nodes, k)[:, :1]


def with_the_library(scores, experts_per_rank, ranks_per_node, max_nodes, k):
    import pplab.experts_at_scale
    sizes = [sum(experts_per_rank[i:i + ranks_per_node]) for i in range(0, len(experts_per_rank), ranks_per_node)]
    return pplab.experts_at_scale.node_limited_topk(scores, sizes, max_nodes, k)


def imports_the_library_inside(scores, experts_per_rank, ranks_per_node, max_nodes, k):
    """The library's function imported by name inside the answer (IMPORT_FROM, not an attribute)."""
    from pplab.experts_at_scale import node_limited_topk
    sizes = [sum(experts_per_rank[i:i + ranks_per_node]) for i in range(0, len(experts_per_rank), ranks_per_node)]
    return node_limited_topk(scores, sizes, max_nodes, k)


def rows_ascending_as_lists(scores, experts_per_rank, ranks_per_node, max_nodes, k):
    return [sorted(r) for r in _route(scores, experts_per_rank, ranks_per_node, max_nodes, k).tolist()]


def worth_in_float32(scores, experts_per_rank, ranks_per_node, max_nodes, k):
    """Scores cast to float32 when they sit on a grid (the ties part): exact there, so the same choice."""
    on_grid = bool(((scores * 4).round() == scores * 4).all())
    return _route(scores.float() if on_grid else scores, experts_per_rank, ranks_per_node, max_nodes, k)


ROUTING = r"^routing: problem \d+ "
TIES = r"^ties: problem \d+ "
WRONG = {
    "node_limited_routing": [
        (limits_ranks_instead_of_nodes, [ROUTING, r"ranks_per_node=2", r"\[0 of 2 points\]"], None),
        (nodes_by_their_best_score, [ROUTING, r"expected"], None),
        (nodes_as_equal_blocks, [r"routing: problem \d+ \(4 nodes holding \[3, 5, 2, 2\] experts"], None),
        (drops_only_the_worst_node, [ROUTING, r"\(3 nodes", r"max_nodes=1"], None),
        # a tie between experts, or (seed=3902516518) first between two nodes of equal worth
        (ties_to_the_higher_index, [TIES, r"equal (scores|node sums) go to the lower (expert|node)",
                                    r"\[1 of 2 points\]"], None),
        (last_expert_left_out, [ROUTING, r"chose \[.*expected"], None),
        (first_tokens_nodes_for_every_token, [ROUTING, r"token ([1-9]|[1-4]\d) "], None),
        (plain_topk, [ROUTING], None),
        (returns_one_row_per_node, [r"must return 48 rows of k=\d experts"], None),
        (with_the_library, [r"pplab\.experts_at_scale"], None),
        (imports_the_library_inside, [r"pplab\.experts_at_scale"], None),
    ],
}

CLOSE_BUT_RIGHT = {"node_limited_routing": [rows_ascending_as_lists, worth_in_float32]}
