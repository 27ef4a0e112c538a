"""pplab.expert_parallel.MoE against the formula, written here with plain torch.

test_expert_parallel.py compares the split layer with MoE on one process: a routing bug in
code both sides share (the order of the dispatch, the top-k weights) passes that comparison.
Here the reference is the definition. Without a capacity limit every choice is kept, and
token i's output is

    y_i = Σ_j w_ij · expert_{e_ij}(x_i),   (w_i, e_i) = the top k of softmax(router · x_i),

the k weights renormalised to sum to 1 when k > 1 (GShard). float64; tolerance 1e-12.
"""
import pytest
import torch
import torch.distributed as dist

import pplab
import torch.nn.functional as F

from pplab.expert_parallel import MoE, TinyMoE

pytestmark = pytest.mark.usefixtures("no_leftover_processes")

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
