"""pplab.tensor_parallel.cnn: a conv split by filters, and the DP-conv / TP-FC hybrid CNN, against
the same dense modules on one process.

float64; "equal" means max |difference| <= TOL = 1e-10 (1e-8 for parameters after several
SGD steps). TP sizes 1-4; 6 filters over 4 ranks is uneven.
"""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import pplab
from pplab.tensor_parallel.cnn import ColumnParallelConv2d, HybridParallelCNN, SmallCNN

TOL = 1e-10


def data(*shape, seed=1):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def conv(seed=0):
    torch.manual_seed(seed)
    return nn.Conv2d(3, 6, 3, padding=1).double()


def conv_job():
    c = conv()
    x, up = data(2, 3, 5, 5, seed=2), data(2, 6, 5, 5, seed=3)
    xr = x.clone().requires_grad_()
    (c(xr) * up).sum().backward()
    pc = ColumnParallelConv2d.from_dense(conv())
    xp = x.clone().requires_grad_()
    y = pc(xp)
    (y * up).sum().backward()
    return ((y - c(x)).abs().max().item(), (xp.grad - xr.grad).abs().max().item(),
            (pc.weight.grad - c.weight.grad[pc_range(pc)]).abs().max().item(),
            (pc.bias.grad - c.bias.grad[pc_range(pc)]).abs().max().item(), pc.weight.shape[0])


def pc_range(pc):
    from pplab.tensor_parallel import my_range
    a, b = my_range(6)
    return slice(a, b)


@pytest.mark.parametrize("p", [1, 2, 3, 4])
def test_conv_split_by_filters_equals_the_dense_conv(p):
    res = pplab.launch(conv_job, world_size=p)
    assert sum(r[-1] for r in res) == 6                       # every filter on exactly one rank
    for *diffs, _ in res:
        assert max(diffs) < TOL


def cnn(seed=0):
    torch.manual_seed(seed)
    return SmallCNN(channels=3, size=8, classes=5, width=4, hidden=12).double()


def batch():
    g = torch.Generator().manual_seed(7)
    return torch.randn(8, 3, 8, 8, generator=g, dtype=torch.float64), torch.randint(0, 5, (8,), generator=g)


def sgd_steps(model, steps, forward, after_backward=lambda: None):
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for _ in range(steps):
        loss = F.cross_entropy(forward(), batch()[1])
        loss.backward()
        after_backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def hybrid_job(steps, trained):
    model = HybridParallelCNN.from_dense(cnn())
    x = model.shard(batch()[0])
    n = len(pplab.trace.events())
    losses = sgd_steps(model, steps, lambda: model(x), model.sync_conv_grads)
    kinds = [(e.kind, e.meta["payload"]) for e in pplab.trace.events()[n:] if e.category == "comm"]
    expect = HybridParallelCNN.from_dense(trained)
    diff = max((a - b).abs().max().item() for a, b in zip(model.parameters(), expect.parameters()))
    return losses, diff, kinds, x.shape[0]


@pytest.mark.parametrize("p", [1, 2, 4])
def test_hybrid_cnn_trains_like_one_process_on_the_whole_batch(p):
    steps, dense = 3, cnn()
    ref = sgd_steps(dense, steps, lambda: dense(batch()[0]))
    assert ref[-1] < ref[0]
    n_conv = sum(q.numel() for q in dense.features.parameters())
    for losses, diff, kinds, local_batch in pplab.launch(hybrid_job, steps, dense, world_size=p):
        assert local_batch == 8 // p
        assert max(abs(a - b) for a, b in zip(losses, ref)) < TOL and diff < 1e-8
        if p > 1:     # per step: features all-gathered, logits all-reduced, their gradients
            feat = 8 * dense.fc1.in_features * 8                  # reduce-scattered, conv grads summed
            assert kinds == [("all_gather", feat // p), ("all_reduce", 8 * 5 * 8),
                             ("reduce_scatter", feat), ("all_reduce", n_conv * 8)] * steps


def odd_batch_job():
    try:
        HybridParallelCNN.from_dense(cnn()).shard(torch.zeros(6, 3, 8, 8))
    except ValueError as e:
        return str(e)


def test_a_batch_that_does_not_divide_is_refused():
    assert "6 samples does not split evenly over 4 ranks" in pplab.launch(odd_batch_job, world_size=4)[0]
