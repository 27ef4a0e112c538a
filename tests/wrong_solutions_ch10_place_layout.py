"""Wrong answers to chapter 10's exercise (a), place_layout, each with what its message must say.

Each is the right computation with one plausible slip (pplab.checks.ch10_at_scale.place_layout's problems include,
for every seed, one that each slip gets wrong)."""
import itertools


def _place(problem, ring_closes=True, gradients_back=True, innermost_first=False, round_robin=False,
           pick="fewest"):
    sizes, traffic, r, n = problem["sizes"], problem["traffic"], problem["ranks_per_node"], problem["n_nodes"]
    used = [d for d in ("pp", "dp", "tp") if sizes[d] > 1]

    def node(rank):
        return rank % n if round_robin else rank // r

    def rank_of(coords, order):
        rank = 0
        for d in (order[::-1] if innermost_first else order):
            rank = rank * sizes[d] + coords[d]
        return rank

    def crossing(order):
        out = {"dp": 0, "tp": 0, "pp": 0}
        for dim in used:
            others = [d for d in used if d != dim]
            for fixed in itertools.product(*(range(sizes[d]) for d in others)):
                g = [rank_of({**dict(zip(others, fixed)), dim: i}, order) for i in range(sizes[dim])]
                if dim == "pp":
                    pairs = list(zip(g, g[1:])) + (list(zip(g[1:], g)) if gradients_back else [])
                else:
                    pairs = [(g[i], g[(i + 1) % len(g)]) for i in range(len(g) - (0 if ring_closes else 1))]
                out[dim] += sum(traffic[dim] for a, b in pairs if node(a) != node(b))
        return out
    if pick == "rule":
        order = tuple(sorted(used, key=lambda d: traffic[d]))
    else:
        order = min(itertools.permutations(used), key=lambda o: sum(crossing(o).values()))
    return {"order": order, "cross_node_bytes": crossing(order)}


def ring_without_its_closing_link(problem):
    return _place(problem, ring_closes=False)


def pipeline_without_gradients(problem):
    return _place(problem, gradients_back=False)


def order_read_innermost_first(problem):
    return _place(problem, innermost_first=True)


def nodes_dealt_round_robin(problem):
    """Rank r on node r mod n_nodes: the ranks of a node are not neighbours."""
    return _place(problem, round_robin=True)


def order_by_the_rule_of_thumb(problem):
    """The bytes are right; the order is the sort by traffic, not the best."""
    return _place(problem, pick="rule")


def returns_a_list_of_groups(problem):
    return [[0, 1], [2, 3]]


def with_the_library(problem):
    import pplab.cluster
    placed = pplab.cluster.place(pplab.cluster.Cluster(problem["n_nodes"], problem["ranks_per_node"]), **problem["sizes"])
    return {"order": placed.order, "cross_node_bytes": placed.cross_node_bytes(problem["traffic"])}


BYTES = r"^bytes: problem \d+ .* by your count, .* by pplab\.cluster"
WRONG = {
    "place_layout": [
        (ring_without_its_closing_link, [BYTES, r"the last one to the first", r"\[0 of 2 points\]|\[1 of 2 points\]"], None),
        (pipeline_without_gradients, [BYTES, r"gradients back"], None),
        (order_read_innermost_first, [BYTES], None),
        (nodes_dealt_round_robin, [BYTES], None),
        (order_by_the_rule_of_thumb, [r"^order: problem \d+", r"rule of thumb", r"\[1 of 2 points\]"], None),
        (returns_a_list_of_groups, [r"must return \{'order'"], None),
        (with_the_library, [r"pplab\.cluster or pplab\.mesh"], None),
    ],
}
