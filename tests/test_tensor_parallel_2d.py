"""pplab.tensor_parallel.summa: Linear2D (SUMMA on a q x q grid) against the dense layer on one process.

float64; "equal" means max |difference| <= TOL = 1e-10. Grids 1x1 and 2x2 (and 3x3 once, 9
ranks, since that is the next square), and a 2x2 grid on a sub-group of a 5-rank world.
"""
import pytest
import torch
import torch.distributed as dist
from torch import nn

import pplab
from pplab.tensor_parallel.summa import Grid2D, Linear2D, split_2d

TOL = 1e-10


def data(*shape, seed=1):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def dense(i, o, seed=0):
    torch.manual_seed(seed)
    return nn.Linear(i, o).double()


def block(t, grid_q, i, j):
    r, c = t.shape[0] // grid_q, t.shape[1] // grid_q
    return t[i * r:(i + 1) * r, j * c:(j + 1) * c]


def summa_job(B, c_in, c_out, members=None):
    group = dist.new_group(members) if members is not None else None
    if members is not None and dist.get_rank() not in members:
        return None
    grid = Grid2D(group)
    layer = Linear2D.from_dense(dense(c_in, c_out), grid)
    x = split_2d(data(B, c_in, seed=2), grid).requires_grad_()
    n = len(pplab.trace.events())
    y = layer(x)
    n2 = len(pplab.trace.events())
    (y * split_2d(data(B, c_out, seed=3), grid)).sum().backward()
    ev = pplab.trace.events()
    log = lambda es: [(e.kind, e.meta["payload"]) for e in es if e.category == "comm"]
    return grid.i, grid.j, grid.q, y.detach(), x.grad, layer.weight.grad, layer.bias.grad, log(ev[n:n2]), log(ev[n2:])


def check(results, B, c_in, c_out):
    lin, x = dense(c_in, c_out), data(B, c_in, seed=2).requires_grad_()
    y = lin(x)
    (y * data(B, c_out, seed=3)).sum().backward()
    for res in results:
        if res is None:
            continue
        i, j, q, y_ij, gx, gw, gb, fwd, bwd = res
        assert (y_ij - block(y.detach(), q, i, j)).abs().max() < TOL
        assert (gx - block(x.grad, q, i, j)).abs().max() < TOL
        assert (gw - block(lin.weight.grad.T, q, i, j)).abs().max() < TOL
        assert (gb - lin.bias.grad[j * c_out // q:(j + 1) * c_out // q]).abs().max() < TOL
        # each rank's payloads: q broadcasts of an X block and of a W block forward; backward,
        # q of each again plus q reduces of a dX and a dW block, and the bias gradient's all-reduce
        xb, wb = B * c_in // q ** 2 * 8, c_in * c_out // q ** 2 * 8
        if q > 1:
            assert sorted(fwd) == sorted([("broadcast", xb), ("broadcast", wb)] * q)
            assert sorted(bwd) == sorted([("broadcast", xb), ("broadcast", wb), ("reduce", xb), ("reduce", wb)] * q
                                         + [("all_reduce", c_out // q * 8)])
            assert sum(b for _, b in fwd) == (B * c_in + c_in * c_out) // q * 8      # shrinks like 1/sqrt(p)


@pytest.mark.parametrize("p", [1, 4])
def test_linear2d_equals_the_dense_layer(p):
    check(pplab.launch(summa_job, 6, 4, 8, world_size=p), 6, 4, 8)


def test_linear2d_on_a_3x3_grid():
    check(pplab.launch(summa_job, 6, 9, 3, world_size=9), 6, 9, 3)


def test_linear2d_on_a_sub_group():
    results = pplab.launch(summa_job, 4, 6, 2, [1, 2, 3, 4], world_size=5)
    assert results[0] is None and [r[:2] for r in results[1:]] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    check(results, 4, 6, 2)


def bad_job(kind):
    try:
        if kind == "grid":
            Grid2D()
        else:
            Linear2D(5, 4, Grid2D())
    except ValueError as e:
        return str(e)


def test_bad_sizes_get_a_clear_error():
    assert "a 2D grid needs a square number of ranks, and 3 is not one" in pplab.launch(bad_job, "grid", world_size=3)[0]
    assert "in_features 5 does not split into 2 equal blocks" in pplab.launch(bad_job, "lin", world_size=4)[0]
