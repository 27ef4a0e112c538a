"""pplab.expert_parallel: the MoE layer with its experts split over ranks equals the same layer
on one process, token for token and gradient for gradient; a tiny MoE model trains alike;
the all-to-all moves exactly the rows the formula counts; bad setups get a clear error.

The reference is `MoE` outside a launch (every expert on one process) run on each rank's
batch in turn: capacity and the balancing loss are per rank-local batch on both sides, so
the same tokens are dropped. float64 throughout; tolerance 1e-12 (absolute and relative):
only the order of additions differs (the router's gradient is summed over ranks).
"""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import pplab
from pplab import trace
from pplab.expert_parallel import MoE, TinyMoE, all_to_all, all_to_all_bytes, steer, sync_gradients
from pplab.mesh import Mesh

pytestmark = pytest.mark.usefixtures("no_leftover_processes")

TOL = 1e-12
H, FFN = 6, 10


def _close(a, b):
    return a.shape == b.shape and torch.allclose(a, b, rtol=TOL, atol=TOL)


def _batches(p, seed, hidden=H):
    """Each rank its own number of tokens (9, 11, 13, ...): uneven splits every step."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(9 + 2 * r, hidden, generator=g, dtype=torch.float64) for r in range(p)]


def _loss(layer, x, w):
    y = layer(x)
    return y, (y * w).sum() + 0.1 * layer.aux_loss


CASES = [(1, 1.0), (2, 0.75), (2, None)]        # (k, capacity_factor): drops, drops, none


def _layers(E):
    torch.manual_seed(E)
    return [MoE(H, FFN, E, k, cf).double() for k, cf in CASES]


def _ep_layer(dense, xs, ws):
    rank = dist.get_rank()
    out = []
    for layer in dense:
        ep = MoE.from_dense(layer)
        x = xs[rank].clone().requires_grad_(True)
        y, loss = _loss(ep, x, ws[rank])
        loss.backward()
        out.append({"y": y.detach(), "x.grad": x.grad, "router": ep.router.weight.grad, "first": ep.first,
                    "experts": [[q.grad for q in e.parameters()] for e in ep.experts],
                    "load": ep.load, "dropped": ep.dropped})
    return out


@pytest.mark.parametrize("p, E", [(1, 4), (2, 4), (3, 6), (4, 4), (4, 8)])
def test_layer_equals_one_process(p, E):
    dense, xs = _layers(E), _batches(p, 10 * p + E)
    ws = [torch.randn_like(x) for x in xs]
    res = pplab.launch(_ep_layer, dense, xs, ws, world_size=p, timeout=60)
    dropped_somewhere = False
    for c, layer in enumerate(dense):
        layer.zero_grad()
        for rank in range(p):
            x = xs[rank].clone().requires_grad_(True)
            y, loss = _loss(layer, x, ws[rank])
            loss.backward()
            got = res[rank][c]
            assert _close(got["y"], y.detach()), (c, rank)
            assert _close(got["x.grad"], x.grad), (c, rank)
            assert torch.equal(got["load"], layer.load) and got["dropped"] == layer.dropped, (c, rank)
            dropped_somewhere |= layer.dropped > 0
        router = sum(res[rank][c]["router"] for rank in range(p))      # each rank's part: its tokens
        assert _close(router, layer.router.weight.grad), c
        for rank in range(p):
            first = res[rank][c]["first"]
            assert first == rank * E // p
            for i, grads in enumerate(res[rank][c]["experts"]):
                want = [q.grad for q in layer.experts[first + i].parameters()]
                assert all(_close(a, b) for a, b in zip(grads, want)), (c, rank, i)
    assert dropped_somewhere                        # capacity was binding: drops compared too


def test_all_to_all_backward_is_the_reverse_exchange():
    def f():
        rank, p = dist.get_rank(), dist.get_world_size()
        sizes = [[2, 0, 1], [1, 3, 0], [0, 2, 2]]                  # rows rank i sends rank j
        x = torch.randn(sum(sizes[rank]), 2, dtype=torch.float64, requires_grad=True)
        y = all_to_all(x, sizes[rank], [sizes[i][rank] for i in range(p)])
        w = torch.randn_like(y)
        (y * w).sum().backward()
        return x.detach(), y.detach(), w, x.grad

    res = pplab.launch(f, world_size=3, timeout=30)
    sizes = [[2, 0, 1], [1, 3, 0], [0, 2, 2]]
    for j in range(3):           # y_j = rows from rank 0, 1, 2 in order; dL/dx_i = w's rows sent back to rank i
        assert torch.equal(res[j][1], torch.cat([res[i][0].split(sizes[i])[j] for i in range(3)]))
    for i in range(3):
        back = [res[j][2].split([sizes[r][j] for r in range(3)])[i] for j in range(3)]
        assert torch.equal(res[i][3], torch.cat(back))


def test_capacity_drops_later_choices_first_in_token_order():
    torch.manual_seed(0)
    layer = MoE(4, 5, 4, k=2, capacity_factor=0.5).double()       # C = ceil(0.5 * 6 * 2 / 4) = 2
    x = steer(layer, torch.tensor([[0, 1], [0, 2], [0, 1], [1, 0], [3, 2], [1, 3]]))
    _, _, expert = layer.route(x)
    # choices numbered j·n + i; expert 0 takes tokens 0, 1 (first choices) and drops 2's, and 3's second
    assert expert.view(2, 6).tolist() == [[0, 0, -1, 1, 3, 1], [-1, 2, -1, -1, 2, 3]]
    assert layer.dropped == 4 and layer.load.tolist() == [2, 2, 2, 2]


def _train(dense, tokens, targets, steps, dp):
    """EP over every rank (dp=1), or EP x DP on a mesh: experts split over ep, copied over dp."""
    rank = dist.get_rank()
    mesh = Mesh(dp=dp, ep=dist.get_world_size() // dp)
    model = TinyMoE.from_dense(dense, group=mesh.ep_group)
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    losses = []
    for s in range(steps):
        opt.zero_grad()
        loss = model.loss(tokens[s][rank], targets[s][rank])
        loss.backward()
        sync_gradients(model, batch_group=mesh.group("dp", "ep"), expert_replica_group=mesh.dp_group)
        opt.step()
        losses.append(loss.item())
    return losses, model.dense_state_dict(), len(model.blocks[0].experts)


@pytest.mark.parametrize("p, dp", [(2, 1), (4, 1), (4, 2)], ids=["ep2", "ep4", "ep2xdp2"])
def test_tiny_moe_trains_like_one_process(p, dp):
    torch.manual_seed(1)
    V, E, steps = 11, 4, 3
    dense = TinyMoE(V, H, FFN, E, k=2, capacity_factor=1.0, layers=2).double()
    g = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, V, (steps, p, 2, 5), generator=g)         # step, rank, batch, sequence
    targets = torch.randint(0, V, (steps, p, 2, 5), generator=g)
    res = pplab.launch(_train, dense, tokens, targets, steps, dp, world_size=p, timeout=90)
    opt = torch.optim.SGD(dense.parameters(), lr=0.2)
    for s in range(steps):
        opt.zero_grad()
        losses = [dense.loss(tokens[s][r], targets[s][r]) for r in range(p)]   # per rank-local batch
        (sum(losses) / p).backward()
        opt.step()
        for rank in range(p):
            assert abs(res[rank][0][s] - losses[rank].item()) < TOL, (s, rank)
    ref = dense.state_dict()
    for rank, (_, state, local) in enumerate(res):
        assert local == E // (p // dp)                  # E/ep experts per rank
        assert set(state) <= set(ref) and len(state) == len(ref) - (E - local) * 4 * len(dense.blocks)
        for name, value in state.items():
            assert _close(value, ref[name]), (rank, name)


def _bytes_of_one_step(E, k, n, choices):
    rank, p = dist.get_rank(), dist.get_world_size()
    layer = MoE(2 * H, FFN, E, k, capacity_factor=None).double()          # experts split over the ranks
    x = steer(layer, choices[rank]).requires_grad_(True)
    with trace.span("case", label="forward"):
        y = layer(x)
    with trace.span("case", label="backward"):
        y.sum().backward()
    return layer.send_counts, layer.recv_counts


def _sent(timeline, rank, label):
    (span,) = [s for s in timeline.select(rank, "compute", "case") if s.label == label]
    return sum(e.bytes_sent for e in timeline.select(rank, "comm") if span.start <= e.start and e.end <= span.end)


@pytest.mark.parametrize("skewed", [False, True], ids=["even", "skewed"])
def test_all_to_all_bytes_per_rank_equal_the_formula(skewed):
    p, E, k, n, es, h = 4, 8, 2, 16, 8, 2 * H
    if skewed:       # every token's first choice is expert 0 or 1 (rank 0's): rank 0 receives most rows
        choices = torch.stack([torch.stack([torch.arange(n) % 2, 2 + (torch.arange(n) + r) % 6], 1) for r in range(p)])
    else:            # token i chooses experts i and i+1 (mod E): every rank sends every rank n·k/p rows
        choices = torch.stack([torch.stack([torch.arange(n) % E, (torch.arange(n) + 1) % E], 1)] * p)
    res = pplab.launch(_bytes_of_one_step, E, k, n, choices, world_size=p, timeout=60)
    tl = res.timeline
    counts_bytes = (p - 1) * (E // p) * 8
    for rank, (sends, recvs) in enumerate(res):
        off = [j for j in range(p) if j != rank]
        rows = sum(sends[j] for j in off) + sum(recvs[j] for j in off)   # dispatch out + combine back
        assert sum(sends) == n * k and sum(recvs[j] for j in range(p)) == sum(res[j][0][rank] for j in range(p))
        assert _sent(tl, rank, "forward") == counts_bytes + rows * h * es
        assert _sent(tl, rank, "backward") == rows * h * es                # the same exchanges reversed
        if not skewed:
            assert _sent(tl, rank, "forward") == all_to_all_bytes(n, k, E, p, h, es)
    if skewed:
        assert res[0][1][0] > 2 * res[1][1][1]        # rank 0 keeps far more rows than the others


def test_bad_setups_are_refused_clearly():
    with pytest.raises(pplab.LaunchError, match=r"6 experts cannot be split evenly over 4 ranks.*"
                                                r"ep group of \[1, 2, 3, 6\] ranks"):
        pplab.launch(lambda: MoE(H, FFN, 6), world_size=4, timeout=30)
    with pytest.raises(pplab.LaunchError, match=r"build different layers.*rank 1: \(6, 10, 4, 2, 1.25\)"):
        pplab.launch(lambda: MoE(H, FFN, 4, k=1 + dist.get_rank() % 2), world_size=2, timeout=30)
    with pytest.raises(ValueError, match=r"k=3 experts per token must be between 1 and num_experts=2"):
        MoE(H, FFN, 2, k=3)


# ----------------------------------------------------------------------------------
# Routing against numbers worked out by hand (not against MoE itself)
#
# Four tokens, four experts. The router is the identity and each token's features are the log of
# the probabilities below, so softmax(router(x)) is exactly this table. Every expert's fc1 is
# zero and fc2's bias is a one-hot vector: expert e outputs e_e whatever its input, so the
# layer's output row i is token i's gate weight on each expert (0 where not chosen or dropped).

PROBS = torch.tensor([[0.5, 0.3, 0.1, 0.1],        # token 0: experts 0, then 1
                      [0.1, 0.6, 0.2, 0.1],        # token 1: 1, then 2
                      [0.2, 0.1, 0.3, 0.4],        # token 2: 3, then 2
                      [0.7, 0.1, 0.15, 0.05]],     # token 3: 0, then 2
                     dtype=torch.float64)
P_MEAN = [0.375, 0.275, 0.1875, 0.1625]            # column means: each expert's mean probability P_i

# k=1 (Switch): the weight is the chosen expert's probability itself, not renormalised.
GATES_K1 = [[0.5, 0, 0, 0], [0, 0.6, 0, 0], [0, 0, 0, 0.4], [0.7, 0, 0, 0]]
# k=2 (GShard): the two chosen probabilities divided by their sum.
GATES_K2 = [[5 / 8, 3 / 8, 0, 0], [0, 3 / 4, 1 / 4, 0], [0, 0, 3 / 7, 4 / 7], [14 / 17, 0, 3 / 17, 0]]
# Balancing loss E·Σ f_i·P_i, f_i = share of the k·n choices that picked expert i (before drops):
AUX_K1 = 4 * (2 / 4 * 0.375 + 1 / 4 * 0.275 + 0 / 4 * 0.1875 + 1 / 4 * 0.1625)          # = 1.1875
AUX_K2 = 4 * (2 / 8 * 0.375 + 2 / 8 * 0.275 + 3 / 8 * 0.1875 + 1 / 8 * 0.1625)          # = 1.0125


def _hand_layer(k, capacity_factor):
    """An MoE whose router probabilities are PROBS and whose output is the gate matrix."""
    layer = MoE(4, 3, 4, k=k, capacity_factor=capacity_factor).double()
    with torch.no_grad():
        layer.router.weight.copy_(torch.eye(4))
        for e, expert in enumerate(layer.experts):
            expert.fc1.weight.zero_(), expert.fc1.bias.zero_(), expert.fc2.weight.zero_()
            expert.fc2.bias.copy_(torch.eye(4)[e])
    return layer


def _gates(rows):
    return torch.tensor(rows, dtype=torch.float64)


@pytest.mark.parametrize("k, gates, aux", [(1, GATES_K1, AUX_K1), (2, GATES_K2, AUX_K2)], ids=["k1", "k2"])
def test_gate_weights_and_balancing_loss_equal_hand_values(k, gates, aux):
    assert [round(x, 12) for x in PROBS.mean(0).tolist()] == P_MEAN
    layer = _hand_layer(k, capacity_factor=None)
    y = layer(PROBS.log())
    assert torch.allclose(y, _gates(gates), rtol=0, atol=TOL), y
    assert abs(layer.aux_loss.item() - aux) < TOL, (layer.aux_loss.item(), aux)
    assert layer.dropped == 0 and layer.load.tolist() == ([2, 1, 0, 1] if k == 1 else [2, 2, 3, 1])


def test_balancing_loss_is_one_under_uniform_probabilities():
    # P_i = 1/E for every expert, so E·Σ f_i·P_i = Σ f_i = 1 whatever the split, if f sums to 1 over
    # the k·n choices (dividing by the n tokens instead gives k)
    for k in (1, 2):
        layer = _hand_layer(k, capacity_factor=None)
        layer.route(torch.zeros(8, 4, dtype=torch.float64))
        assert abs(layer.aux_loss.item() - 1.0) < TOL, (k, layer.aux_loss.item())


# (k, capacity_factor, C, output = gates left after drops, load, dropped). Choices queue
# choice-major: every token's first choice, in token order, before any second choice.
CAPACITY_CASES = [
    (1, 1.25, 2, GATES_K1, [2, 1, 0, 1], 0),
    # C = ceil(1.25·4·1/4) = ceil(1.25) = 2: expert 0 takes both tokens that chose it
    (1, 1.0, 1, [[0.5, 0, 0, 0], [0, 0.6, 0, 0], [0, 0, 0, 0.4], [0, 0, 0, 0]], [1, 1, 0, 1], 1),
    # C = 1: token 3's first choice (expert 0) comes after token 0's: dropped, its output 0
    (2, 1.0, 2, [[5 / 8, 3 / 8, 0, 0], [0, 3 / 4, 1 / 4, 0], [0, 0, 3 / 7, 4 / 7], [14 / 17, 0, 0, 0]],
     [2, 2, 2, 1], 1),
    # C = 2: expert 2 is the second choice of tokens 1, 2, 3: token 3's is third in line, dropped.
    # The kept weight is not renormalised (14/17 stays): the residual carries the rest.
    (2, 0.5, 1, [[5 / 8, 0, 0, 0], [0, 3 / 4, 1 / 4, 0], [0, 0, 0, 4 / 7], [0, 0, 0, 0]], [1, 1, 1, 1], 4),
    # C = ceil(0.5·4·2/4) = 1: token 1's FIRST choice of expert 1 beats token 0's second choice of it
]


@pytest.mark.parametrize("k, cf, cap, gates, load, dropped", CAPACITY_CASES, ids=["k1-cf1.25", "k1-cf1", "k2-cf1", "k2-cf0.5"])
def test_capacity_and_dropped_tokens_equal_hand_values(k, cf, cap, gates, load, dropped):
    from pplab.expert_parallel import capacity
    assert capacity(4, k, 4, cf) == cap
    layer = _hand_layer(k, cf)
    y = layer(PROBS.log())
    assert torch.allclose(y, _gates(gates), rtol=0, atol=TOL), y
    assert layer.load.tolist() == load and layer.dropped == dropped
    assert abs(layer.aux_loss.item() - (AUX_K1 if k == 1 else AUX_K2)) < TOL     # f_i counts choices before drops


def _hand_ep(dense, batches):
    layer = MoE.from_dense(dense)                          # experts split over the ranks
    y = layer(batches[dist.get_rank()])
    return y, layer.aux_loss.item(), layer.load, layer.dropped


@pytest.mark.parametrize("p", [2, 4])
def test_expert_parallel_layer_gives_the_hand_values(p):
    """The same hand cases with the experts on p ranks; each rank routes its own copy of the tokens,
    rank r's in another order (rotated by r), so a token sent to the wrong expert or back to the
    wrong row shows."""
    batches = [PROBS.log().roll(r, 0) for r in range(p)]
    for k, cf, _, gates, load, dropped in [(1, None, 1, GATES_K1, None, 0), (2, None, 2, GATES_K2, None, 0)]:
        res = pplab.launch(_hand_ep, _hand_layer(k, cf), batches, world_size=p, timeout=60)
        for r, (y, aux, _, d) in enumerate(res):
            assert torch.allclose(y, _gates(gates).roll(r, 0), rtol=0, atol=TOL), (k, r, y)
            assert abs(aux - (AUX_K1 if k == 1 else AUX_K2)) < TOL and d == 0, (k, r, aux)


# -- MoE against the formula, written here with plain torch --------------------------------------------
#
# The tests above compare the split layer with MoE on one process: a routing bug in
# code both sides share (the order of the dispatch, the top-k weights) passes that comparison.
# Here the reference is the definition. Without a capacity limit every choice is kept, and
# token i's output is
#
#     y_i = Σ_j w_ij · expert_{e_ij}(x_i),   (w_i, e_i) = the top k of softmax(router · x_i),
#
# the k weights renormalised to sum to 1 when k > 1 (GShard). float64; tolerance 1e-12.


H, FFN = 6, 10


def by_hand(layer, x):
    probs = torch.softmax(x @ layer.router.weight.T, -1)
    w, e = probs.topk(layer.k, -1)
    if layer.k > 1:
        w = w / w.sum(-1, keepdim=True)
    return torch.stack([sum(w[i, j] * layer.experts[int(e[i, j])](x[i]) for j in range(layer.k))
                        for i in range(len(x))])


def dense_layer(E, k, seed):
    torch.manual_seed(seed)
    return MoE(H, FFN, E, k, capacity_factor=None).double()


@pytest.mark.parametrize("E, k", [(4, 1), (5, 2), (6, 3)])
def test_one_process_layer_is_the_formula(E, k):
    layer = dense_layer(E, k, seed=E)
    x = torch.randn(13, H, dtype=torch.float64, generator=torch.Generator().manual_seed(k))
    with torch.no_grad():
        assert torch.allclose(layer(x), by_hand(layer, x), rtol=1e-12, atol=1e-12)


def _split_forward(dense, xs):
    layer = MoE.from_dense(dense)
    with torch.no_grad():
        return layer(xs[dist.get_rank()])


def test_layer_on_three_ranks_is_the_formula():
    """3 ranks, 2 experts each, k = 2; each rank its own number of tokens (uneven all-to-alls)."""
    dense = dense_layer(6, 2, seed=1)
    g = torch.Generator().manual_seed(2)
    xs = [torch.randn(5 + 3 * r, H, dtype=torch.float64, generator=g) for r in range(3)]
    out = pplab.launch(_split_forward, dense, xs, world_size=3, timeout=60)
    for rank, x in enumerate(xs):
        with torch.no_grad():
            assert torch.allclose(out[rank], by_hand(dense, x), rtol=1e-12, atol=1e-12), rank


def test_tiny_moe_loss_adds_every_blocks_balancing_loss():
    """TinyMoE.loss = cross-entropy + aux_weight · Σ over blocks of Switch's E·Σ_i f_i·P_i, each
    block's written out here from its own router (two blocks, so a block left out shows)."""
    torch.manual_seed(0)
    model = TinyMoE(11, H, FFN, 4, k=2, capacity_factor=None, layers=2).double()
    tokens, targets = torch.randint(0, 11, (2, 5)), torch.randint(0, 11, (2, 5))
    x, auxes = model.embed(tokens).reshape(-1, H), []
    for block in model.blocks:
        probs = torch.softmax(x @ block.router.weight.T, -1)
        f = torch.bincount(probs.topk(2, -1).indices.flatten(), minlength=4).double() / (2 * len(x))
        auxes.append(4 * (f * probs.mean(0)).sum())
        x = x + by_hand(block, x)
    expected = F.cross_entropy(model.head(x), targets.flatten()) + 0.01 * sum(auxes)
    assert abs(auxes[0] - auxes[1]) > 1e-3                   # the blocks' losses differ: both count
    assert abs(model.loss(tokens, targets, aux_weight=0.01).item() - expected.item()) < 1e-12
