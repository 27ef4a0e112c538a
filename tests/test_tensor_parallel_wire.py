"""pplab.tensor_parallel.summa.traced_collectives: the bytes each rank puts on the wire for the 1D
and 2D layers, against counts worked out by hand, with the layers still equal to the dense ones.

float64 (8 bytes a number). Hand counts: a binomial-tree broadcast or reduce on q ranks sends the
block q-1 times in all, and over SUMMA's q steps every rank takes every place in the tree once,
so each rank sends q-1 blocks per broadcast (or reduce) of a step; a ring all-reduce of n numbers
on p ranks sends 2(p-1)/p·n from each rank (here p divides n).
"""
import pytest
import torch
from torch import nn

import pplab
from pplab import comm, trace
from pplab import tensor_parallel as tp
from pplab.tensor_parallel.summa import Grid2D, Linear2D, split_2d, traced_collectives

TOL = 1e-10


def dense(i, o, seed, bias=True):
    torch.manual_seed(seed)
    return nn.Linear(i, o, bias=bias).double()


def data(*shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)


def sent_and_kinds(mark):
    events = trace.events()[mark:]
    return sum(e.bytes_sent for e in events), {e.kind for e in events if e.category == "comm"}


def summa_wire_job(B, c_in, c_out):
    grid = Grid2D()
    fc = dense(c_in, c_out, seed=0)
    layer = Linear2D.from_dense(fc, grid)
    X = data(B, c_in).requires_grad_()
    x = split_2d(X.detach(), grid).requires_grad_()
    mark = len(trace.events())
    with traced_collectives():
        y = layer(x)
        y.square().sum().backward()
    sent, kinds = sent_and_kinds(mark)
    Y = fc(X)
    Y.square().sum().backward()
    equal = ((y - split_2d(Y, grid)).abs().max() <= TOL and (x.grad - split_2d(X.grad, grid)).abs().max() <= TOL
             and (layer.weight.grad - split_2d(fc.weight.grad.T, grid)).abs().max() <= TOL)
    return sent, kinds, bool(equal)


def test_summa_on_a_3x3_grid_sends_what_the_trees_and_the_ring_send():
    # q = 3; X blocks [2, 3], W blocks [3, 6], bias blocks of 6 numbers
    # forward: 2 X blocks (12 numbers) + 2 W blocks (36) = 48; backward: 2 W broadcasts (36), 2 dX reduces
    # (12), 2 X broadcasts (12), 2 dW reduces (36) = 96; the bias gradient's ring all-reduce down a
    # column of 3: 2 * 2/3 * 6 = 8. 152 numbers.
    for sent, kinds, equal in pplab.launch(summa_wire_job, 6, 9, 18, world_size=9):
        assert equal
        assert sent == 152 * 8
        assert kinds <= {"send", "recv"}, f"a collective ran outside the traced algorithms: {kinds}"


def pair_1d_job(B, h, f):
    fc1, fc2 = dense(h, f, seed=0), dense(f, h, seed=1)
    col, row = tp.ColumnParallelLinear.from_dense(fc1), tp.RowParallelLinear.from_dense(fc2)
    X = data(B, h)
    x = X.clone().requires_grad_()
    mark = len(trace.events())
    with traced_collectives():
        y = row(col(x))
        y.square().sum().backward()
    sent, kinds = sent_and_kinds(mark)
    x_ref = X.clone().requires_grad_()
    fc2(fc1(x_ref)).square().sum().backward()
    equal = (y - fc2(fc1(X))).abs().max() <= TOL and (x.grad - x_ref.grad).abs().max() <= TOL
    return sent, kinds, bool(equal)


def test_a_column_row_pair_on_3_ranks_sends_two_ring_all_reduces():
    # B·h = 5·6 = 30 numbers, all-reduced once forward (g) and once backward (f): 2 * (2 * 2/3 * 30) = 80;
    # the width in between (7) does not divide by 3 and does not matter
    for sent, kinds, equal in pplab.launch(pair_1d_job, 5, 6, 7, world_size=3):
        assert equal
        assert sent == 80 * 8
        assert kinds <= {"send", "recv"}


def restored_job():
    t = torch.ones(3)
    with pytest.raises(ValueError, match="async_op=False"):
        with traced_collectives():
            comm.all_reduce(t, async_op=True)
    mark = len(trace.events())
    comm.broadcast(t, src=1)             # the backend's collective again: one traced payload event
    kinds = [e.kind for e in trace.events()[mark:] if e.category == "comm"]
    return kinds, t.tolist()


def test_async_calls_are_refused_and_the_backend_is_back_after_the_block():
    for kinds, values in pplab.launch(restored_job, world_size=2):
        assert kinds == ["broadcast"] and values == [1.0, 1.0, 1.0]
