"""Plausible wrong answers to chapter 3b's linear_3d, each a mistake a student could make, as in
wrong_solutions_ch00_broadcast.py: WRONG[exercise_id] lists (answer, regular expressions the check's message must
match, timeout or None). tests/test_checks.py checks that each fails with its message.

Each is `right` (a correct answer written apart from the solution notebook's) with one thing changed.
"""
import torch

from pplab import comm


def _gather(piece, group, q):
    out = piece.new_empty(q * piece.shape[0], *piece.shape[1:])
    comm.all_gather_into_tensor(out, piece.contiguous(), group=group)
    return out


def _scatter(whole, group, q, reduce=True):
    """The line's sum cut by rows, my piece; reduce=False: my own term's piece, never summed."""
    if not reduce:
        return whole.chunk(q)[comm.rank(group)].clone()
    out = whole.new_empty(whole.shape[0] // q, *whole.shape[1:])
    comm.reduce_scatter_tensor(out, whole.contiguous(), group=group)
    return out


def _all_reduce_piece(whole, group, q):
    """The line's sum by an all-reduce, then my piece: right values, twice a reduce-scatter's bytes."""
    whole = whole.contiguous().clone()
    comm.all_reduce(whole, group=group)
    return whole.chunk(q)[comm.rank(group)].clone()


def _make(sum_y=True, sum_dw=True, y_group="l", bump_rank=None, scale=1.0, all_reduce_on=()):
    class Matmul3D(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w, c):
            x_il, w_lj = _gather(x, c.group_j, c.q), _gather(w, c.group_i, c.q)
            ctx.save_for_backward(x_il, w_lj)
            ctx.c = c
            if (c.i, c.j) in all_reduce_on:
                y = _all_reduce_piece(x_il @ w_lj, c.group_l, c.q)
            else:
                y = _scatter(x_il @ w_lj, c.group_l if y_group == "l" else c.group_j, c.q, sum_y)
            y = y * scale
            if bump_rank is not None and torch.distributed.get_rank() == bump_rank:
                y = y + 1e-3
            return y

        @staticmethod
        def backward(ctx, dy):
            x_il, w_lj = ctx.saved_tensors
            c = ctx.c
            dy_ij = _gather(dy, c.group_l, c.q)
            return _scatter(dy_ij @ w_lj.T, c.group_j, c.q), _scatter(x_il.T @ dy_ij, c.group_i, c.q, sum_dw), None
    return Matmul3D


def right(x, w, cube):
    return _make().apply(x, w, cube)


def forward_not_summed_over_l(x, w, cube):
    """Each rank keeps the l-th piece of its own term X_il W_lj: forward wrong, backward right."""
    return _make(sum_y=False).apply(x, w, cube)


def weight_grad_not_summed_over_i(x, w, cube):
    """dW_lj's piece taken from this rank's own term, never summed over i: backward wrong."""
    return _make(sum_dw=False).apply(x, w, cube)


def reduce_scatter_along_j(x, w, cube):
    """The terms summed along the wrong line (j instead of l)."""
    return _make(y_group="j").apply(x, w, cube)


def off_on_rank_5(x, w, cube):
    """Right everywhere but on rank 5 (i=1, j=0, l=1), whose output is shifted."""
    return _make(bump_rank=5).apply(x, w, cube)


def gathers_everything(x, w, cube):
    """Right values, but X and W gathered whole on every rank (plain autograd through the gathers):
    far more traffic than 3D's."""
    q = cube.q
    world = None
    p = comm.world_size(world)
    xs = [torch.empty_like(x) for _ in range(p)]
    ws = [torch.empty_like(w) for _ in range(p)]
    comm.all_gather(xs, x.detach().contiguous(), group=world)
    comm.all_gather(ws, w.detach().contiguous(), group=world)
    at = lambda a, b, c: (a * q + b) * q + c
    X = torch.cat([torch.cat([xs[at(a, b, l_)] for l_ in range(q)], dim=1) for a in range(q) for b in range(q)])
    W = torch.cat([torch.cat([ws[at(i_, j_, l_)] for j_ in range(q)], dim=1) for l_ in range(q) for i_ in range(q)])
    mine = comm.rank()
    i, j, l = mine // (q * q), (mine // q) % q, mine % q
    Y = X @ W
    ry, cy = Y.shape[0] // (q * q), Y.shape[1] // q
    y = Y[(i * q + l) * ry:(i * q + l + 1) * ry, j * cy:(j + 1) * cy]
    return _SumGrads.apply(y, X, W, x, w, cube)


def l3d_last_line_all_reduces(x, w, cube):
    """Right values everywhere; but the line through the cube's last corner (i = j = 1: ranks 6
    and 7) sums Y's terms by an all-reduce and slices its piece: the all-reduce sends twice a
    reduce-scatter's bytes, on ranks 6 and 7 only."""
    return _make(all_reduce_on={(1, 1)}).apply(x, w, cube)


def l3d_off_by_5e_10(x, w, cube):
    """y (and so both gradients) scaled by 1 + 5e-10: five times the tolerance on a y of 1, and
    inside a tolerance of 1e-8 for every |y| < 20."""
    return _make(scale=1 + 5e-10).apply(x, w, cube)


def l3d_within_tolerance(x, w, cube):
    """Right, y scaled by 1 + 1e-13: inside the tolerance, must pass (test_checks_tensor_parallel.py)."""
    return _make(scale=1 + 1e-13).apply(x, w, cube)


class _SumGrads(torch.autograd.Function):
    """Backward of the gather-everything answer: the whole dY gathered, dX and dW summed everywhere."""

    @staticmethod
    def forward(ctx, y, X, W, x, w, cube):
        ctx.save_for_backward(X.detach(), W.detach())
        ctx.cube, ctx.shapes = cube, (x.shape, w.shape)
        return y.detach().clone()

    @staticmethod
    def backward(ctx, dy):
        X, W = ctx.saved_tensors
        q, (xs, ws) = ctx.cube.q, ctx.shapes
        p = comm.world_size()
        dys = [torch.empty_like(dy) for _ in range(p)]
        comm.all_gather(dys, dy.contiguous())
        at = lambda a, b, c: (a * q + b) * q + c
        dY = torch.cat([torch.cat([dys[at(a, j_, l_)] for j_ in range(q)], dim=1) for a in range(q) for l_ in range(q)])
        dX, dW = dY @ W.T, X.T @ dY
        mine = comm.rank()
        i, j, l = mine // (q * q), (mine // q) % q, mine % q
        dx = dX[(i * q + j) * xs[0]:(i * q + j + 1) * xs[0], l * xs[1]:(l + 1) * xs[1]].clone()
        dw = dW[(l * q + i) * ws[0]:(l * q + i + 1) * ws[0], j * ws[1]:(j + 1) * ws[1]].clone()
        return None, None, None, dx, dw, None


WRONG = {
    "linear_3d": [
        (forward_not_summed_over_l, [r"rank 0 \(i=0, j=0, l=0\): y differs", r"sum of the q terms over l",
                                     r"forward ✘ · backward ✔ · traffic ✔", r"\[2 of 3 points\]"], None),
        (weight_grad_not_summed_over_i, [r"w\.grad differs", r"sums those over i",
                                         r"forward ✔ · backward ✘ · traffic ✔"], None),
        (reduce_scatter_along_j, [r"y differs", r"forward ✘"], None),
        (off_on_rank_5, [r"rank 5 \(i=1, j=0, l=1\): y differs", r"forward ✘ · backward ✔"], None),
        (l3d_last_line_all_reduces, [r"rank [67] put \d+ bytes on the wire in the forward \(all_gather_into_tensor, all_reduce\)",
                                     r"an all-reduce sends twice a reduce-scatter's bytes",
                                     r"forward ✔ · backward ✔ · traffic ✘"], None),
        (l3d_off_by_5e_10, [r"y differs from the single-process value", r"forward ✘"], None),
        (gathers_everything, [r"bytes on the wire in the forward", r"forward ✔ · backward ✔ · traffic ✘",
                              r"\[2 of 3 points\]"], None),
    ],
}
