"""pplab.tensor_parallel: the conjugate operators and the 1D linear layers against one process.

Every comparison is float64 against the very same dense nn.Linear run on one process (built
from torch.manual_seed, so every rank holds the same one): "equal" means max |difference|
<= TOL = 1e-10 (only the order of the additions changes). TP sizes 1, 2, 3 and 4, with
feature sizes that do not divide by the TP size (7 over 2, 3, 4) where a layer supports them,
and on the sub-groups {0, 1} and {2, 3} of a 4-rank world.
"""
import pytest
import torch
import torch.distributed as dist
from torch import nn

import pplab
from pplab import comm
from pplab import tensor_parallel as tp

TOL = 1e-10


def dense(i, o, seed, bias=True):
    torch.manual_seed(seed)
    return nn.Linear(i, o, bias=bias).double()


def data(*shape, seed=1):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def comm_since(n):
    """(kind, payload bytes) of this rank's collectives recorded after the first n events."""
    return [(e.kind, e.meta.get("payload", 0)) for e in pplab.trace.events()[n:] if e.category == "comm"]


def mark():
    return len(pplab.trace.events())


def ranges(n, p):
    sizes = [n // p + (r < n % p) for r in range(p)]
    return [(sum(sizes[:r]), sum(sizes[:r + 1])) for r in range(p)]


# ----------------------------------------------------------------------------------
# The conjugate operators: forward, backward, and the communication of each


def ops_job():
    r, p = dist.get_rank(), dist.get_world_size()
    out = {}
    x = data(4, 6, seed=3)                                   # the same on every rank
    w = data(4, 6, seed=10 + r)                              # a different upstream gradient per rank
    for name, fn in [("f", lambda t: tp.copy_to_parallel(t)), ("g", lambda t: tp.reduce_from_parallel(t)),
                     ("split", lambda t: tp.split_to_parallel(t, dim=1)),
                     ("gather", lambda t: tp.gather_from_parallel(t, dim=1, full=6)),
                     ("sp_gather", lambda t: tp.gather_from_sequence_parallel(t, dim=0)),
                     ("sp_rs", lambda t: tp.reduce_scatter_to_sequence_parallel(t, dim=0))]:
        if name.startswith("sp_") and 4 % p:
            continue
        xi = x.clone().requires_grad_()
        inp = xi
        if name == "gather":
            a, b = ranges(6, p)[r]
            inp = xi[:, a:b]
        if name == "sp_gather":
            inp = xi[r * 4 // p:(r + 1) * 4 // p]
        m = mark()
        y = fn(inp)
        fwd = comm_since(m)
        m = mark()
        (y * data(*y.shape, seed=10 + r)).sum().backward()
        out[name] = (y.detach(), xi.grad.clone(), fwd, comm_since(m))
    return out


@pytest.mark.parametrize("p", [1, 2, 3, 4])
def test_conjugate_operators_forward_backward_and_their_communication(p):
    res = pplab.launch(ops_job, world_size=p)
    x = data(4, 6, seed=3)
    up = [data(4, 6, seed=10 + r) for r in range(p)]             # each rank's upstream gradient (full shape)
    B = 4 * 6 * 8
    sum_up = sum(up)
    for r, out in enumerate(res):
        a, b = ranges(6, p)[r]
        # f: identity forward, all-reduce backward
        y, gx, fwd, bwd = out["f"]
        assert torch.equal(y, x) and fwd == []
        assert (gx - sum_up).abs().max() < TOL
        assert bwd == ([("all_reduce", B)] if p > 1 else [])
        # g: all-reduce forward, identity backward
        y, gx, fwd, bwd = out["g"]
        assert (y - p * x).abs().max() < TOL and fwd == ([("all_reduce", B)] if p > 1 else [])
        assert torch.equal(gx, up[r]) and bwd == []
        # split forward (no comm), all-gather backward: the gradient of every slice, each from its owner
        y, gx, fwd, bwd = out["split"]
        assert torch.equal(y, x[:, a:b]) and fwd == []
        expect = torch.cat([data(4, e - s0, seed=10 + s) for s, (s0, e) in enumerate(ranges(6, p))], dim=1)
        assert torch.equal(gx, expect)
        assert [k for k, _ in bwd] == (["all_gather"] if p > 1 else [])
        # gather forward (uneven 6 over 4 works), split backward
        y, gx, fwd, bwd = out["gather"]
        assert torch.equal(y, x) and [k for k, _ in fwd] == (["all_gather"] if p > 1 else []) and bwd == []
        assert torch.equal(gx[:, a:b], up[r][:, a:b]) and gx[:, :a].abs().sum() == 0
        if 4 % p == 0:
            k = 4 // p
            # SP gather: all-gather forward, reduce-scatter backward
            y, gx, fwd, bwd = out["sp_gather"]
            assert torch.equal(y, x) and fwd == ([("all_gather", B // p)] if p > 1 else [])
            assert (gx[r * k:(r + 1) * k] - sum_up[r * k:(r + 1) * k]).abs().max() < TOL
            assert bwd == ([("reduce_scatter", B)] if p > 1 else [])
            # SP reduce-scatter: the sum, sliced, forward; all-gather backward
            y, gx, fwd, bwd = out["sp_rs"]
            assert (y - p * x[r * k:(r + 1) * k]).abs().max() < TOL
            assert fwd == ([("reduce_scatter", B)] if p > 1 else [])
            upk = [data(k, 6, seed=10 + s) for s in range(p)]
            assert (gx - torch.cat(upk)).abs().max() < TOL
            assert bwd == ([("all_gather", B // p)] if p > 1 else [])


def sp_uneven_job():
    try:
        tp.reduce_scatter_to_sequence_parallel(torch.zeros(10, 2, 3), dim=0)
    except ValueError as e:
        return str(e)


def test_sequence_parallel_refuses_a_length_that_does_not_divide():
    for msg in pplab.launch(sp_uneven_job, world_size=4):
        assert "length 10 cannot be split over 4 ranks" in msg and "multiple of 4" in msg


# ----------------------------------------------------------------------------------
# The layers equal the dense layer: output, input gradient, every parameter's gradient


def layers_job(i, o, group_of=None):
    group = None
    if group_of is not None:                                     # sub-groups: every rank creates all
        groups = [dist.new_group(g) for g in group_of]
        group = next(g for g, members in zip(groups, group_of) if dist.get_rank() in members)
    r, p = comm.rank(group), comm.world_size(group)
    x = data(5, i, seed=2)
    up = data(5, o, seed=3)
    out = {}
    for gather in (False, True):
        col = tp.ColumnParallelLinear.from_dense(dense(i, o, 0), gather_output=gather, group=group)
        xi = x.clone().requires_grad_()
        y = col(xi)
        a, b = ranges(o, p)[r]
        (y * (up if gather else up[:, a:b])).sum().backward()
        out["col", gather] = (y.detach(), xi.grad, col.weight.grad, col.bias.grad)
    for parallel in (True, False):
        row = tp.RowParallelLinear.from_dense(dense(o, i, 1), input_is_parallel=parallel, group=group)
        h = data(5, o, seed=4)
        a, b = ranges(o, p)[r]
        hi = (h[:, a:b] if parallel else h).clone().requires_grad_()
        y = row(hi)
        (y * x).sum().backward()
        out["row", parallel] = (y.detach(), hi.grad, row.weight.grad, row.bias.grad)
    return r, p, out


def check_layers(results, i, o):
    x, up, h = data(5, i, seed=2), data(5, o, seed=3), data(5, o, seed=4)
    col, row = dense(i, o, 0), dense(o, i, 1)
    xi = x.clone().requires_grad_()
    y_col = col(xi)
    (y_col * up).sum().backward()
    hi = h.clone().requires_grad_()
    y_row = row(hi)
    (y_row * x).sum().backward()
    for r, p, out in results:
        a, b = ranges(o, p)[r]
        for gather in (False, True):
            y, gx, gw, gb = out["col", gather]
            assert (y - (y_col if gather else y_col[:, a:b])).abs().max() < TOL
            assert (gx - xi.grad).abs().max() < TOL            # f summed every rank's share of dX
            assert (gw - col.weight.grad[a:b]).abs().max() < TOL and (gb - col.bias.grad[a:b]).abs().max() < TOL
        for parallel in (True, False):
            y, gx, gw, gb = out["row", parallel]
            assert (y - y_row).abs().max() < TOL
            assert (gx - (hi.grad[:, a:b] if parallel else hi.grad)).abs().max() < TOL
            assert (gw - row.weight.grad[:, a:b]).abs().max() < TOL and (gb - row.bias.grad).abs().max() < TOL


@pytest.mark.parametrize("p", [1, 2, 3, 4])
@pytest.mark.parametrize("i,o", [(6, 12), (5, 7)])               # 7 does not divide by 2, 3 or 4
def test_column_and_row_layers_equal_the_dense_layer(p, i, o):
    check_layers(pplab.launch(layers_job, i, o, world_size=p), i, o)


def test_layers_on_sub_groups_of_a_larger_world():
    results = pplab.launch(layers_job, 5, 7, [[0, 1], [2, 3]], world_size=4)
    assert [(r, p) for r, p, _ in results] == [(0, 2), (1, 2), (0, 2), (1, 2)]
    check_layers(results, 5, 7)


def mlp_sp_job(s, b, h, ffn, sequence_parallel):
    r, p = dist.get_rank(), dist.get_world_size()
    fc1 = tp.ColumnParallelLinear.from_dense(dense(h, ffn, 0), sequence_parallel=sequence_parallel)
    fc2 = tp.RowParallelLinear.from_dense(dense(ffn, h, 1), sequence_parallel=sequence_parallel)
    x, up = data(s, b, h, seed=2), data(s, b, h, seed=3)
    k = s // p
    if sequence_parallel:
        x, up = x[r * k:(r + 1) * k], up[r * k:(r + 1) * k]
    x = x.clone().requires_grad_()
    m = mark()
    y = fc2(torch.nn.functional.gelu(fc1(x)))
    fwd = comm_since(m)
    m = mark()
    (y * up).sum().backward()
    return (y.detach(), x.grad, [fc1.weight.grad, fc1.bias.grad, fc2.weight.grad, fc2.bias.grad],
            fwd, comm_since(m))


@pytest.mark.parametrize("p", [1, 2, 4])
@pytest.mark.parametrize("sp", [False, True])
def test_column_then_row_needs_one_collective_each_way_with_or_without_sequence_parallel(p, sp):
    s, b, h, ffn = 8, 2, 6, 10                                   # ffn 10 over 4 ranks: uneven
    fc1, fc2 = dense(h, ffn, 0), dense(ffn, h, 1)
    x, up = data(s, b, h, seed=2).requires_grad_(), data(s, b, h, seed=3)
    y = fc2(torch.nn.functional.gelu(fc1(x)))
    (y * up).sum().backward()
    nbytes = s * b * h * 8
    for r, (y_r, gx, grads, fwd, bwd) in enumerate(pplab.launch(mlp_sp_job, s, b, h, ffn, sp, world_size=p)):
        k, (a, e) = s // p, ranges(ffn, p)[r]
        sl = slice(r * k, (r + 1) * k) if sp else slice(None)
        assert (y_r - y[sl]).abs().max() < TOL and (gx - x.grad[sl]).abs().max() < TOL
        ref = [fc1.weight.grad[a:e], fc1.bias.grad[a:e], fc2.weight.grad[:, a:e], fc2.bias.grad]
        assert max((u - v).abs().max().item() for u, v in zip(grads, ref)) < TOL
        if p == 1:
            assert fwd == [] and bwd == []
        elif not sp:      # Megatron: one all-reduce of the [s, b, h] activations forward, one backward
            assert fwd == [("all_reduce", nbytes)] and bwd == [("all_reduce", nbytes)]
        else:             # SP: the all-reduce becomes all-gather + reduce-scatter; + the row bias's gradient
            assert fwd == [("all_gather", nbytes // p), ("reduce_scatter", nbytes)]
            assert sorted(bwd) == sorted([("all_gather", nbytes // p), ("reduce_scatter", nbytes),
                                          ("all_reduce", h * 8)])


def bad_layer_job(kind):
    try:
        if kind == "col":
            tp.ColumnParallelLinear(4, 3)
        elif kind == "row":
            tp.RowParallelLinear(3, 4)
        else:
            tp.ColumnParallelLinear(4, 8, gather_output=True, sequence_parallel=True)
    except ValueError as e:
        return str(e)


def test_layers_say_what_is_wrong_with_their_sizes():
    assert "3 output features cannot be split over 4 ranks" in pplab.launch(bad_layer_job, "col", world_size=4)[0]
    assert "3 input features cannot be split over 4 ranks" in pplab.launch(bad_layer_job, "row", world_size=4)[0]
    assert "do not go together" in pplab.launch(bad_layer_job, "sp", world_size=2)[0]



def init_job():
    torch.manual_seed(0)
    col, row = tp.ColumnParallelLinear(64, 9), tp.RowParallelLinear(64, 9)
    return [(m.weight.abs().max().item(), m.bias.abs().max().item()) for m in (col, row)]


def test_layers_built_split_keep_nn_linear_initialisation():
    """A layer built split draws each shard from nn.Linear's U(-1/sqrt(in), 1/sqrt(in)) with the
    WHOLE layer's fan-in (64 here, 64/3 inputs per row shard): bound 1/8, not 1/sqrt(22)."""
    bound = 1 / 8
    for r, layers in enumerate(pplab.launch(init_job, world_size=3)):
        for name, (w, b) in zip(("column", "row"), layers):
            # each shard holds >= 9*21 draws: all of them under 0.8*bound has probability 0.8**189
            assert 0.8 * bound < w <= bound and b <= bound, (r, name, w, b, bound)

# ----------------------------------------------------------------------------------
# Seed 002's table (CMU 15-418, lecture 25): elements communicated per step by one Linear layer
# y = xW (batch B, C_in -> C_out), by strategy. The seed counts an all-reduce of N elements as
# 2N (a reduce and a broadcast); its column split receives x (B*C_in) forward and returns dx
# (B*C_in) backward, where Megatron's f keeps x everywhere and all-reduces dx: the same 2*B*C_in.


def seed_table(B, c_in, c_out):
    return {"data parallel": 2 * c_out * c_in, "column": 2 * B * c_in, "row": 2 * B * c_out}


def table_job(B, c_in, c_out):
    from pplab.data_parallel import DDP, shard
    r, p = dist.get_rank(), dist.get_world_size()
    x = data(B, c_in, seed=2).requires_grad_()     # a layer inside a network: dx is needed
    out = {}
    ddp = DDP(dense(c_in, c_out, 0, bias=False), bucket_cap_mb=100)
    col = tp.ColumnParallelLinear.from_dense(dense(c_in, c_out, 0, bias=False))
    row = tp.RowParallelLinear.from_dense(dense(c_in, c_out, 0, bias=False))
    a, b = ranges(c_in, p)[r]
    for name, layer, inp in [("data parallel", ddp, shard(x)), ("column", col, x), ("row", row, x[:, a:b])]:
        m = mark()
        layer(inp).square().sum().backward()
        # counted the seed's way: an all-reduce of N elements = 2N, anything else = N (DDP's
        # tiny all-gather of batch sizes, 8 bytes per rank, is not part of the gradient sync)
        out[name] = sum((2 if kind == "all_reduce" else 1) * nbytes // 8
                        for kind, nbytes in comm_since(m) if kind != "all_gather")
    return out


@pytest.mark.parametrize("B,c_in,c_out,best", [(4, 64, 16, "row"), (256, 8, 4, "data parallel")])
def test_seed_table_of_one_linear_layer_matches_the_trace(B, c_in, c_out, best):
    for measured in pplab.launch(table_job, B, c_in, c_out, world_size=2):
        assert measured == seed_table(B, c_in, c_out)
        assert min(measured, key=measured.get) == best       # "the best strategy depends on the model"
