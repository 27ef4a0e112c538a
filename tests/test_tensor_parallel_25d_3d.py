"""pplab.tensor_parallel.tp25d and tp3d: Linear2p5D and Linear3D against the dense layer on one process,
and the bytes each rank puts on the wire against numbers worked out by hand.

float64; "equal" means max |difference| <= TOL = 1e-10. 3D on 8 ranks (2x2x2); 2.5D with q=2, d=2
(8 ranks), q=2, d=1 (4 ranks, where it must be SUMMA: same outputs, same messages as Linear2D)
and q=1, d=3 (3 ranks, an odd world: only the depth's all-reduce moves data).
"""
import pytest
import torch
import torch.distributed as dist
from torch import nn

import pplab
from pplab.memory import saved_activations, state_bytes
from pplab.tensor_parallel.summa import Grid2D, Linear2D, split_2d
from pplab.tensor_parallel import tp3d, tp25d
from pplab.tensor_parallel.tp25d import Grid2p5D, Linear2p5D, split_2p5d
from pplab.tensor_parallel.tp3d import (Grid3D, Linear3D, crossovers, split_3d_input, split_3d_output,
                                        split_3d_weight, total_bytes_per_rank, traced_collectives)

TOL = 1e-10


def data(*shape, seed=1):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def dense(i, o, seed=0):
    torch.manual_seed(seed)
    return nn.Linear(i, o, bias=False).double()


def reference(B, c_in, c_out):
    lin, x = dense(c_in, c_out), data(B, c_in, seed=2).requires_grad_()
    y = lin(x)
    (y * data(B, c_out, seed=3)).sum().backward()
    return y.detach(), x.grad, lin.weight.grad.T          # W = weight^T, [in, out]


def run(layer, x, upstream):
    """Forward and backward under traced collectives: outputs, grads, bytes sent, memory."""
    x = x.requires_grad_()
    with traced_collectives():
        n0 = len(pplab.trace.events())
        with saved_activations(layer.parameters()) as saved:
            y = layer(x)
        n1 = len(pplab.trace.events())
        (y * upstream).sum().backward()
    ev = pplab.trace.events()
    sent = lambda es: sum(e.bytes_sent for e in es if e.category == "comm")
    return {"y": y.detach(), "dx": x.grad, "dw": layer.weight.grad, "fwd": sent(ev[n0:n1]), "bwd": sent(ev[n1:]),
            "weight_bytes": state_bytes(layer).parameters, "saved": saved.bytes}


def job_3d(B, c_in, c_out):
    cube = Grid3D()
    layer = Linear3D.from_dense(dense(c_in, c_out), cube)
    out = run(layer, split_3d_input(data(B, c_in, seed=2), cube), split_3d_output(data(B, c_out, seed=3), cube))
    return {**out, "where": (cube.i, cube.j, cube.l)}


def test_linear3d_on_a_2x2x2_cube_equals_the_dense_layer_and_sends_what_the_formula_says():
    B, c_in, c_out = 8, 4, 6
    results = pplab.launch(job_3d, B, c_in, c_out, world_size=8)
    y, dx, dw = reference(B, c_in, c_out)
    assert sorted(r["where"] for r in results) == [(i, j, l) for i in range(2) for j in range(2) for l in range(2)]
    for rank, r in enumerate(results):
        i, j, l = r["where"]
        assert rank == 4 * i + 2 * j + l
        # Y's rows i·q + l (of q² = 4 pieces of 2 rows), columns j (of 2 pieces of 3): by hand
        assert (r["y"] - y[2 * (2 * i + l):2 * (2 * i + l) + 2, 3 * j:3 * j + 3]).abs().max() < TOL
        assert (r["dx"] - dx[2 * (2 * i + j):2 * (2 * i + j) + 2, 2 * l:2 * l + 2]).abs().max() < TOL
        assert (r["dw"] - dw[2 * l + i:2 * l + i + 1, 3 * j:3 * j + 3]).abs().max() < TOL
        # each ring step of q=2 sends one piece: X piece 2x2, W piece 1x3, Y piece 2x3 (forward);
        # dY piece 2x3, dX piece 2x2, dW piece 1x3 (backward); 8 bytes each: (4 + 3 + 6)·8 = 104
        assert r["fwd"] == r["bwd"] == 104, (rank, r["fwd"], r["bwd"])
        # weight piece 1x3; saved: gathered X_il 4x2 and W_lj 2x3
        assert r["weight_bytes"] == 3 * 8 and r["saved"] == (8 + 6) * 8, (rank, r["weight_bytes"], r["saved"])
    # the formulas the notebook plots give the same hand-counted numbers
    assert tp3d.bytes_per_rank(B, c_in, c_out, 2) == {"forward": 104, "backward": 104}
    assert tp3d.memory_per_rank(B, c_in, c_out, 2) == {"weight": 3 * 8, "saved": (8 + 6) * 8}


def job_25d(B, c_in, c_out, depth):
    grid = Grid2p5D(depth)
    layer = Linear2p5D.from_dense(dense(c_in, c_out), grid)
    out = run(layer, split_2p5d(data(B, c_in, seed=2), grid), split_2p5d(data(B, c_out, seed=3), grid))
    out["where"] = (grid.k, grid.i, grid.j)
    if depth == 1:                                  # the same layer as SUMMA's Linear2D, without bias
        g2 = Grid2D()
        layer2 = Linear2D(c_in, c_out, g2, bias=False).double()
        with torch.no_grad():
            layer2.weight.copy_(layer.weight)
        two = run(layer2, split_2d(data(B, c_in, seed=2), g2), split_2d(data(B, c_out, seed=3), g2))
        out["same_as_summa"] = all(torch.equal(out[k], two[k]) for k in ("y", "dx", "dw")) and \
            (out["fwd"], out["bwd"]) == (two["fwd"], two["bwd"])
    return out


@pytest.mark.parametrize("depth, p, B, c_in, c_out, fwd, bwd", [
    # q=2, d=2: X block 2x2 = 4, W block 2x3 = 6; forward (q-1)(4+6) = 10 elements; backward
    # 2·10 + ring all-reduce of W's 6 over 2 ranks: 2·(1/2)·6 = 6, so 26
    (2, 8, 8, 4, 6, 10 * 8, 26 * 8),
    # q=2, d=1 (SUMMA): X block 3x2 = 6, W block 2x3 = 6: forward 12, backward 24
    (1, 4, 6, 4, 6, 12 * 8, 24 * 8),
    # q=1, d=3: no grid inside a layer; W whole (3x4 = 12) all-reduced over 3: 2·(2/3)·12 = 16
    (3, 3, 6, 3, 4, 0, 16 * 8),
])
def test_linear2p5d_equals_the_dense_layer_and_sends_what_the_formula_says(depth, p, B, c_in, c_out, fwd, bwd):
    results = pplab.launch(job_25d, B, c_in, c_out, depth, world_size=p)
    y, dx, dw = reference(B, c_in, c_out)
    q = {8: 2, 4: 2, 3: 1}[p]
    r_, i_, o_ = B // (depth * q), c_in // q, c_out // q
    for rank, r in enumerate(results):
        k, i, j = r["where"]
        assert rank == k * q * q + i * q + j
        row = k * q + i
        assert (r["y"] - y[row * r_:(row + 1) * r_, j * o_:(j + 1) * o_]).abs().max() < TOL
        assert (r["dx"] - dx[row * r_:(row + 1) * r_, j * i_:(j + 1) * i_]).abs().max() < TOL
        assert (r["dw"] - dw[i * i_:(i + 1) * i_, j * o_:(j + 1) * o_]).abs().max() < TOL
        assert (r["fwd"], r["bwd"]) == (fwd, bwd), (rank, r["fwd"], r["bwd"])
        assert r["weight_bytes"] == i_ * o_ * 8 and r["saved"] == r_ * i_ * 8
        if depth == 1:
            assert r["same_as_summa"]
    # the formulas the notebook plots give the same hand-counted numbers
    assert tp25d.bytes_per_rank(B, c_in, c_out, q, depth) == pytest.approx({"forward": fwd, "backward": bwd})
    assert tp25d.memory_per_rank(B, c_in, c_out, q, depth) == {"weight": i_ * o_ * 8, "saved": r_ * i_ * 8}


def bad_job(kind):
    try:
        if kind == "cube":
            Grid3D()
        elif kind == "3d in":
            Linear3D(6, 4, Grid3D())
        elif kind == "3d batch":
            split_3d_input(torch.zeros(6, 4), Grid3D())
        elif kind == "2.5d grid":
            Grid2p5D(2)
        elif kind == "2.5d batch":
            split_2p5d(torch.zeros(6, 4), Grid2p5D(2))
    except ValueError as e:
        return str(e)


def test_sizes_the_grid_does_not_divide_get_a_clear_error():
    assert "a 3D grid needs a cube number of ranks, and 4 is not one: use 1 or 8" in \
        pplab.launch(bad_job, "cube", world_size=4)[0]
    got = pplab.launch(bad_job, "3d in", world_size=8)
    assert all("in_features 6 does not split into 4 equal pieces on a 2x2x2 cube" in g for g in got)
    assert "a batch of 6 does not split into 4 equal pieces on a 2x2x2 cube: use a multiple of 4" in \
        pplab.launch(bad_job, "3d batch", world_size=8)[0]
    assert "a 2.5D grid needs depth·q² ranks; 4 ranks with depth=2" in pplab.launch(bad_job, "2.5d grid", world_size=4)[0]
    assert "a batch of 6 does not split into 4 equal blocks on a 2.5D grid of depth 2 over 2x2" in \
        pplab.launch(bad_job, "2.5d batch", world_size=8)[0]


def test_bytes_per_rank_curves_and_their_crossovers():
    # a square layer, B = in = out = h: 1D sends 2(p-1)/p·h², 2D 6(q-1)/q²·h² (q = sqrt p): equal at p = 4
    h = 64
    assert total_bytes_per_rank("1D", 4, h, h, h) == total_bytes_per_rank("2D", 4, h, h, h) == 1.5 * h * h * 8
    assert [round(p, 9) for p in crossovers("1D", "2D", h, h, h, 2, 100)] == [4]
    # 1D - 3D = 2(q-1)²(q+2)/q³·h² > 0 for every q > 1: no crossing
    assert crossovers("1D", "3D", h, h, h, 2, 4096) == []
    # 3D: 2(q-1)·3h²/q³ at q = 2: 0.75 h²
    assert total_bytes_per_rank("3D", 8, h, h, h) == 0.75 * h * h * 8
    # 2.5D on p = 8, depth 2 (q = 2): X block h²/8, W block h²/4; forward 3h²/8, backward
    # 2·3h²/8 + 2·(1/2)·h²/4 = h²: 11h²/8 elements
    assert total_bytes_per_rank("2.5D", 8, h, h, h, depth=2) == pytest.approx(11 / 8 * h * h * 8)
    # 1D all-reduces dX [B, in], not dY [B, out]: B=8, in=4, out=6 on 4 ranks: 2·(3/4)·32 = 48 elements
    assert total_bytes_per_rank("1D", 4, 8, 4, 6) == 48 * 8
    with pytest.raises(ValueError, match="method must be"):
        total_bytes_per_rank("4D", 8, h, h, h)
