"""pplab.experts_at_scale: node-limited routing against a plain-Python reference (ties included, nodes
of unequal sizes), the balancing bias against hand values, the expected node count against an
enumeration, and the dropless two-hop layer on real ranks (p = 2, 3, 4, batches of unequal sizes)
against the same layer on one process: outputs, input gradients, router and expert gradients
(float64, 1e-12: only the order of additions differs), with the bytes between nodes read from the
trace equal to the formula. Bad input gets a clear error.
"""
import itertools

import pytest
import torch
import torch.distributed as dist

import pplab
from pplab.checks.ch11_frontier.node_limited_routing import reference as node_limited_reference
from pplab.cluster import Cluster, cross_node_bytes
from pplab.experts_at_scale import (DroplessMoE, bias_update, cross_node_bytes_formula, expected_nodes, imbalance,
                                    node_limited_topk, nodes_per_token)

pytestmark = pytest.mark.usefixtures("no_leftover_processes")

TOL = 1e-12
H, FFN = 6, 5


def reference_routing(scores, sizes, max_nodes, k):
    """The rule in plain Python, one token at a time (sorted sets of chosen experts): the grader's own
    reference for exercise node_limited_routing, with one rank per node. Checking the library's
    torch version against it checks that reference too."""
    return node_limited_reference(scores, sizes, 1, max_nodes, k)


@pytest.mark.parametrize("sizes, max_nodes, k", [([4, 4], 1, 2), ([4, 4, 4, 4], 2, 4), ([3, 3, 3], 2, 3),
                                                 ([5, 2, 3], 2, 4), ([2, 6, 1, 3], 3, 5), ([4, 4], 2, 3),
                                                 ([8] * 8, 4, 8)])
def test_node_limited_topk_equals_reference(sizes, max_nodes, k):
    g = torch.Generator().manual_seed(sum(sizes) + k)
    E = sum(sizes)
    floats = torch.rand(40, E, generator=g, dtype=torch.float64)
    ties = torch.randint(0, 3, (40, E), generator=g).double()          # many equal scores and node sums
    for scores in (floats, ties):
        got = node_limited_topk(scores, sizes if len(set(sizes)) > 1 else sizes[0], max_nodes, k)
        assert got.shape == (40, k)
        assert got.sort(1).values.tolist() == reference_routing(scores, sizes, max_nodes, k)
        picked = scores.gather(1, got)
        assert (picked[:, :-1] >= picked[:, 1:]).all()                 # best first
        reached = nodes_per_token(got, sizes if len(set(sizes)) > 1 else sizes[0], E).sum(1)
        assert (reached <= max_nodes).all()


def test_node_limited_topk_by_hand():
    # node 0 holds experts 0-2, node 1 experts 3-4. k = 2, M = 1: node 0 is worth 0.5 + 0.4 = 0.9,
    # node 1 0.9 + 0.0: equal sums, the lower node wins; by its single best score node 1 would.
    scores = torch.tensor([[0.5, 0.4, 0.1, 0.9, 0.0]])
    assert node_limited_topk(scores, [3, 2], 1, 2).tolist() == [[0, 1]]
    assert node_limited_topk(scores, [3, 2], 2, 2).tolist() == [[3, 0]]     # M = 2 nodes: plain top-2
    # equal scores inside a node: the lower expert
    assert node_limited_topk(torch.tensor([[1.0, 2.0, 2.0, 0.0]]), 2, 1, 1).tolist() == [[1]]


def test_no_limit_is_plain_topk():
    scores = torch.rand(30, 12, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    got = node_limited_topk(scores, 4, 3, 3)
    assert torch.equal(got, scores.topk(3, dim=1).indices)


def test_bias_update_and_imbalance_by_hand():
    load = torch.tensor([6, 2, 4, 4])                       # mean 4
    assert bias_update(load, 0.01).tolist() == [-0.01, 0.01, 0.0, 0.0]
    assert imbalance(load) == 1.5 and imbalance(torch.tensor([3, 3])) == 1.0


def test_expected_nodes_equals_enumeration():
    for E, N, k in [(6, 3, 2), (8, 2, 3), (12, 4, 4)]:
        per = E // N
        counts = [len({e // per for e in c}) for c in itertools.combinations(range(E), k)]
        assert expected_nodes(E, N, k) == pytest.approx(sum(counts) / len(counts), rel=1e-12)


def test_balancing_bias_evens_the_load():
    """A skewed router left alone keeps its busiest expert; with the bias (selection only) the load evens out."""
    torch.manual_seed(0)
    layers = {gamma: DroplessMoE(8, 4, 8, 2, Cluster(2, 1), 1).double() for gamma in (0.0, 0.02)}
    layers[0.02].router.load_state_dict(layers[0.0].router.state_dict())
    mu = torch.randn(8, dtype=torch.float64)
    seen = {gamma: [] for gamma in layers}
    for step in range(40):
        x = torch.randn(64, 8, dtype=torch.float64) + 2 * mu
        for gamma, layer in layers.items():
            with torch.no_grad():
                layer(x)
            seen[gamma].append(imbalance(layer.update_bias(gamma)))
    assert layers[0.0].bias.abs().max() == 0
    late = {gamma: sum(v[-10:]) / 10 for gamma, v in seen.items()}
    assert seen[0.02][0] > 1.5 and late[0.02] < 0.7 * late[0.0]


def _ranks_job(dense, xs, ws, gamma):
    r = dist.get_rank()
    m = DroplessMoE.from_dense(dense)
    x = xs[r].clone().requires_grad_(True)
    y = m(x)
    (y * ws[r]).sum().backward()
    with pplab.trace.paused():
        load = m.update_bias(gamma)
    return {"y": y.detach(), "x.grad": x.grad, "router": m.router.weight.grad, "first": m.first,
            "experts": [[q.grad for q in e.parameters()] for e in m.experts], "pairs": m.remote_pairs,
            "bias": m.bias.clone(), "load": load, "send": m.send_counts}


@pytest.mark.parametrize("cluster, E, M", [(Cluster(2, 1), 8, 1), (Cluster(3, 1), 12, 2), (Cluster(2, 2), 16, 1),
                                           (Cluster(2, 2), 8, 2)], ids=["2x1", "3x1", "2x2-limited", "2x2-free"])
def test_layer_on_ranks_equals_one_process(cluster, E, M):
    p, k = cluster.world_size, 4
    torch.manual_seed(p + E)
    dense = DroplessMoE(H, FFN, E, k, cluster, M).double()
    g = torch.Generator().manual_seed(E)
    xs = [torch.randn(7 + 2 * r, H, generator=g, dtype=torch.float64) for r in range(p)]   # uneven batches
    ws = [torch.randn_like(x) for x in xs]
    res = pplab.launch(_ranks_job, dense, xs, ws, 0.01, world_size=p, timeout=60)
    pairs, load = 0, 0
    for r in range(p):
        x = xs[r].clone().requires_grad_(True)
        y = dense(x)
        (y * ws[r]).sum().backward()
        assert torch.allclose(res[r]["y"], y.detach(), rtol=TOL, atol=TOL), r
        assert torch.allclose(res[r]["x.grad"], x.grad, rtol=TOL, atol=TOL), r
        assert dense.load.sum() == k * len(x)                               # dropless: every choice computed
        reached = nodes_per_token(dense.chosen, dense.experts_per_node, E)
        assert (reached.sum(1) <= M).all()
        assert res[r]["send"]["across"] == reached.sum(0).tolist()        # one row per (token, node), node by node
        reached[:, cluster.node_of(r)] = False
        assert res[r]["pairs"] == reached.sum()
        pairs, load = pairs + int(reached.sum()), load + dense.load
    assert torch.allclose(sum(res[r]["router"] for r in range(p)), dense.router.weight.grad, rtol=TOL, atol=TOL)
    for r in range(p):
        assert res[r]["first"] == r * E // p and torch.equal(res[r]["load"], load)
        assert torch.equal(res[r]["bias"], bias_update(load, 0.01))        # the same bias on every rank
        for i, grads in enumerate(res[r]["experts"]):
            want = dense.experts[res[r]["first"] + i].parameters()
            assert all(torch.allclose(a, b.grad, rtol=TOL, atol=TOL) for a, b in zip(grads, want)), (r, i)
    assert cross_node_bytes(res.timeline, cluster) == cross_node_bytes_formula(pairs, cluster, H, E, 8)


@pytest.mark.parametrize("call, words", [
    (lambda: node_limited_topk(torch.rand(2, 8), 3, 1, 2), "must divide the 8 experts"),
    (lambda: node_limited_topk(torch.rand(2, 8), [4, 3], 1, 2), "adding up"),
    (lambda: node_limited_topk(torch.rand(2, 8), [4, 2, 2], 1, 3), "Raise max_nodes or lower k"),
    (lambda: node_limited_topk(torch.rand(2, 8), 4, 0, 2), "max_nodes"),
    (lambda: node_limited_topk(torch.rand(2, 8), 4, 1, 9), "k must be"),
    (lambda: node_limited_topk(torch.rand(8), 4, 1, 2), "[tokens, experts]"),
    (lambda: bias_update(torch.tensor([1, 2]), -0.1), "gamma"),
    (lambda: DroplessMoE(4, 4, 6, 2, Cluster(4, 1)), "multiple of 4"),
    (lambda: DroplessMoE(4, 4, 8, 4, Cluster(4, 1), max_nodes=1), "Raise max_nodes"),
])
def test_bad_input_says_what_to_change(call, words):
    with pytest.raises(ValueError, match=None) as err:
        call()
    assert words in str(err.value)


def test_cluster_must_match_the_launch():
    def job():
        DroplessMoE(4, 4, 8, 2, Cluster(2, 2))
    with pytest.raises(pplab.LaunchError, match="n_nodes × ranks_per_node = 2"):
        pplab.launch(job, world_size=2, timeout=30)


def test_the_checkers_problems_catch_every_slip_on_every_seed():
    """pplab.checks.ch11_frontier.node_limited_routing promises a problem that each slip gets wrong, whatever the seed;
    its plain-Python reference agrees with the library on all of them."""
    import wrong_solutions_ch11_node_limited_routing as wrong
    from pplab.checks.ch11_frontier.node_limited_routing import _node_sizes, problems, reference
    slips = {"routing": [wrong.limits_ranks_instead_of_nodes, wrong.nodes_by_their_best_score, wrong.plain_topk,
                         wrong.drops_only_the_worst_node, wrong.last_expert_left_out, wrong.nodes_as_equal_blocks,
                         wrong.first_tokens_nodes_for_every_token],
             "ties": [wrong.ties_to_the_higher_index]}
    for seed in range(5):
        caught = set()
        for p in problems(seed):
            args = (p["scores"], p["experts_per_rank"], p["ranks_per_node"], p["max_nodes"], p["k"])
            want = reference(*args)
            sizes = _node_sizes(p["experts_per_rank"], p["ranks_per_node"])
            assert node_limited_topk(p["scores"], sizes, p["max_nodes"], p["k"]).sort(1).values.tolist() == want
            for fn in slips[p["part"]]:
                try:
                    caught.add(fn.__name__) if fn(*args).sort(1).values.tolist() != want else None
                except RuntimeError:             # equal blocks that do not fit: a raise is caught too
                    caught.add(fn.__name__)
        assert caught == {fn.__name__ for fns in slips.values() for fn in fns}, seed
