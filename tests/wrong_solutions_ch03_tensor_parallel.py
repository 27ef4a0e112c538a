"""Plausible wrong answers to chapter 3's exercises (tensor parallelism), each a mistake a
student could make, among them answers right on rank 0 and wrong on another rank only.

WRONG[exercise_id] lists (function, regular expressions the check's message must match,
timeout for the check or None for the default), as in wrong_solutions_ch00_broadcast.py.
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from pplab import comm
from pplab.tensor_parallel import RowParallelLinear, reduce_from_parallel
from pplab.tensor_parallel.transformer import vocab_parallel_cross_entropy

# ----------------------------------------------------------------------------------
# f and g


def _fg(f_fwd=False, f_bwd=True, g_fwd=True, g_bwd=False, use_group=True, scale=1.0, only_rank0=False):
    def reduce(t, group):
        t = t.clone()
        comm.all_reduce(t, group=group if use_group else None)
        return t

    class Fn(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, group):
            ctx.group = group
            return reduce(x, group) if f_fwd else x.view_as(x)

        @staticmethod
        def backward(ctx, grad):
            if not f_bwd:
                return grad, None
            out = reduce(grad, ctx.group) * scale
            return (out if not only_rank0 or dist.get_rank() == 0 else grad), None

    class Gn(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, group):
            ctx.group = group
            return reduce(x, group) if g_fwd else x.clone()

        @staticmethod
        def backward(ctx, grad):
            return (reduce(grad, ctx.group) if g_bwd else grad), None

    return Fn.apply, Gn.apply


def f_backward_is_identity():
    """f passes the gradient through: forgets that X is shared."""
    return _fg(f_bwd=False)


def f_and_g_swapped():
    """f all-reduces forward and g backward: the operators swapped."""
    return _fg(f_fwd=True, f_bwd=False, g_fwd=False, g_bwd=True)


def g_backward_all_reduces_too():
    return _fg(g_bwd=True)


def f_backward_averages():
    """Divides the summed gradient by p."""
    return _fg_mean()


def _fg_mean():
    class Fn(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, group):
            ctx.group = group
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad):
            grad = grad.clone()
            comm.all_reduce(grad, group=ctx.group)
            return grad / comm.world_size(ctx.group), None
    return Fn.apply, _fg()[1]


def f_g_ignore_the_group():
    """All-reduce over the whole world, whatever group is passed."""
    return _fg(use_group=False)


def f_backward_right_on_rank_zero_only():
    """Every rank takes part in the all-reduce, but only rank 0 returns its result."""
    return _fg(only_rank0=True)


def f_g_not_a_pair():
    return _fg()[0]


# ----------------------------------------------------------------------------------
# Row-parallel linear


def _row(dense, group, split="tensor_split", bias_where="after", backward_reduce=False, whole_weight=False,
         compute_dtype=None):
    p, r = comm.world_size(group), comm.rank(group)
    n = dense.in_features
    if split == "tensor_split":
        sizes = [n // p + (k < n % p) for k in range(p)]
        start, end = sum(sizes[:r]), sum(sizes[:r + 1])
    else:                                       # chunks of ceil(n / p): rank 0 right, the others not
        c = -(-n // p)
        start, end = min(r * c, n), min((r + 1) * c, n)

    class Reduce(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            x = x.clone()
            comm.all_reduce(x, group=group)
            return x

        @staticmethod
        def backward(ctx, grad):
            if backward_reduce:
                grad = grad.clone()
                comm.all_reduce(grad, group=group)
            return grad

    class Row(nn.Module):
        def __init__(self):
            super().__init__()
            w = dense.weight.detach()
            self.weight = nn.Parameter((w if whole_weight else w[:, start:end]).clone())
            self.bias = None if dense.bias is None else nn.Parameter(dense.bias.detach().clone())

        def forward(self, x):
            b = self.bias
            if bias_where == "before" and b is not None:
                return Reduce.apply(x @ self.weight.T + b)
            if bias_where == "rank0" and b is not None:
                return Reduce.apply(x @ self.weight.T + (b if r == 0 else 0 * b.detach()))
            local = x @ self.weight.T if compute_dtype is None else \
                (x.to(compute_dtype) @ self.weight.to(compute_dtype).T).to(x.dtype)
            y = Reduce.apply(local)
            return y if b is None else y + b

    return Row()


def row_bias_added_on_every_rank(dense, group=None):
    return _row(dense, group, bias_where="before")


def row_bias_only_on_rank_zero(dense, group=None):
    """Right output everywhere; but ranks > 0 never use their bias, so it gets no gradient."""
    return _row(dense, group, bias_where="rank0")


def row_ceil_chunks(dense, group=None):
    """ceil(n/p) columns per rank: right on rank 0, wrong on the others when p does not divide n."""
    return _row(dense, group, split="ceil")


def row_multiplies_in_float32(dense, group=None):
    """The local product x @ W_r^T computed in float32 (a GPU's fast path) and cast back to
    float64: the input rounded to 24 bits, an output error near 1e-7, not float64's 1e-16."""
    return _row(dense, group, compute_dtype=torch.float32)


def row_all_reduces_backward_too(dense, group=None):
    return _row(dense, group, backward_reduce=True)


def row_keeps_the_whole_weight(dense, group=None):
    return _row(dense, group, whole_weight=True)


def row_from_library(dense, group=None):
    return RowParallelLinear.from_dense(dense, group=group)


def row_returns_a_function(dense, group=None):
    layer = _row(dense, group)
    return lambda x: layer(x)


# ----------------------------------------------------------------------------------
# Vocabulary-parallel cross-entropy


def ce_gathers_the_logits(logits_shard, targets, vocab_start, group=None):
    """Gathers everything and calls F.cross_entropy: right values, the whole point missed."""
    p = comm.world_size(group)
    sizes = torch.zeros(p, dtype=torch.long)
    comm.all_gather_into_tensor(sizes, torch.tensor([logits_shard.shape[-1]]), group=group)
    width = int(sizes.max())
    padded = F.pad(logits_shard, (0, width - logits_shard.shape[-1]))
    out = [torch.empty_like(padded) for _ in range(p)]
    dist.all_gather(out, padded.contiguous(), group=group)
    full = torch.cat([o[:, :int(s)] for o, s in zip(out, sizes)], dim=-1)
    return F.cross_entropy(full, targets)


def ce_all_reduces_padded_logits(logits_shard, targets, vocab_start, group=None):
    """Puts its slice in a zero [tokens, vocab] tensor and all-reduces that: a gather in disguise."""
    vocab = torch.tensor([vocab_start + logits_shard.shape[-1]])
    comm.all_reduce(vocab, op="max", group=group)
    full = logits_shard.new_zeros(logits_shard.shape[0], int(vocab))
    full[:, vocab_start:vocab_start + logits_shard.shape[-1]] = logits_shard.detach()
    comm.all_reduce(full, group=group)
    return F.cross_entropy(full, targets)


def _ce(logits_shard, targets, vocab_start, group, local_max=False, no_max=False, no_mask=False):
    m = logits_shard.detach().max(dim=-1).values
    if not local_max:
        comm.all_reduce(m, op="max", group=group)
    shifted = logits_shard if no_max else logits_shard - m.unsqueeze(-1)
    sum_exp = reduce_from_parallel(shifted.exp().sum(dim=-1), group)
    mine = (targets >= vocab_start) & (targets < vocab_start + logits_shard.shape[-1])
    idx = ((targets - vocab_start).clamp(0, logits_shard.shape[-1] - 1) if no_mask
           else (targets - vocab_start) * mine).unsqueeze(-1)
    picked = shifted.gather(-1, idx).squeeze(-1)
    target = reduce_from_parallel(picked if no_mask else picked * mine, group)
    return (sum_exp.log() - target).mean()


def ce_local_max(logits_shard, targets, vocab_start, group=None):
    """Each rank subtracts its own max: the partial sums of exps are in different units."""
    return _ce(logits_shard, targets, vocab_start, group, local_max=True)


def ce_without_max(logits_shard, targets, vocab_start, group=None):
    """No max at all: exp overflows for large logits."""
    return _ce(logits_shard, targets, vocab_start, group, no_max=True)


def ce_every_rank_adds_a_target(logits_shard, targets, vocab_start, group=None):
    """Clamps the target index instead of masking it: every rank adds some logit."""
    return _ce(logits_shard, targets, vocab_start, group, no_mask=True)


class _CE(torch.autograd.Function):
    """The loss right everywhere; backward forgets vocab_start: right on rank 0 only."""

    @staticmethod
    def forward(ctx, logits, targets, start, group):
        m = logits.max(dim=-1).values
        comm.all_reduce(m, op="max", group=group)
        e = (logits - m.unsqueeze(-1)).exp()
        s = e.sum(dim=-1)
        comm.all_reduce(s, group=group)
        mine = (targets >= start) & (targets < start + logits.shape[-1])
        t = (logits - m.unsqueeze(-1)).gather(-1, ((targets - start) * mine).unsqueeze(-1)).squeeze(-1) * mine
        comm.all_reduce(t, group=group)
        ctx.save_for_backward(e / s.unsqueeze(-1), targets)
        ctx.width = logits.shape[-1]
        return (s.log() - t).mean()

    @staticmethod
    def backward(ctx, grad):
        softmax, targets = ctx.saved_tensors
        mine = targets < ctx.width                           # should be targets - start in [0, width)
        g = softmax.clone()
        g[mine.nonzero().squeeze(-1), targets[mine]] -= 1
        return g * grad / targets.numel(), None, None, None


def ce_gradient_forgets_vocab_start(logits_shard, targets, vocab_start, group=None):
    return _CE.apply(logits_shard, targets, vocab_start, group)


def ce_from_library(logits_shard, targets, vocab_start, group=None):
    return vocab_parallel_cross_entropy(logits_shard, targets, group)


# ----------------------------------------------------------------------------------
# The table of CMU 15-418's lecture 25 (model and pipeline parallelism)


def traffic_counts_tensor_sizes(strategy, B, c_in, c_out):
    """The all-reduced tensor's size, not the seed's 2N."""
    return {"data parallel": c_out * c_in, "column": B * c_in, "row": B * c_out}[strategy]


def traffic_dp_grows_with_batch(strategy, B, c_in, c_out):
    return {"data parallel": 2 * B * c_out * c_in, "column": 2 * B * c_in, "row": 2 * B * c_out}[strategy]


def traffic_column_and_row_swapped(strategy, B, c_in, c_out):
    return {"data parallel": 2 * c_out * c_in, "column": 2 * B * c_out, "row": 2 * B * c_in}[strategy]


def traffic_as_text(strategy, B, c_in, c_out):
    return "2*B*C"



# ----------------------------------------------------------------------------------
# Near misses (issue 38): right at p = 2 and wrong at p = 3, just outside the tolerance, a float32 wire


def f_g_mean_times_two():
    """f's backward averages, then doubles ("the mean, times the two ranks"): the sum at p = 2 and on
    the sub-groups of 2, two thirds of it at p = 3."""
    class Fn(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, group):
            ctx.group = group
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad):
            grad = grad.clone()
            comm.all_reduce(grad, group=ctx.group)
            return grad / comm.world_size(ctx.group) * 2, None
    return Fn.apply, _fg()[1]


def f_g_backward_off_by_1e_9():
    """f's backward sum scaled by 1 + 1e-9: ten times the check's tolerance (1e-10), a hundred
    times under a tolerance of 1e-8."""
    return _fg(scale=1 + 1e-9)


def f_g_backward_all_reduces_in_float32():
    """f's backward all-reduces a float32 copy of the float64 gradient (half the bytes on the wire):
    each gradient rounded to 24 bits."""
    class Fn(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, group):
            ctx.group = group
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad):
            low = grad.float()
            comm.all_reduce(low, group=ctx.group)
            return low.to(grad.dtype), None
    return Fn.apply, _fg()[1]


def f_g_within_tolerance():
    """Right, but f's backward scaled by 1 + 1e-12: well inside the tolerance, so it must pass
    (tests/test_checks_tensor_parallel.py)."""
    return _fg(scale=1 + 1e-12)


class _Scaled(nn.Module):
    def __init__(self, inner, scale):
        super().__init__()
        self.inner, self.scale = inner, scale
        self.weight, self.bias = inner.weight, inner.bias

    def forward(self, x):
        return self.inner(x) * self.scale


def row_output_off_by_1e_9(dense, group=None):
    """The output scaled by 1 + 1e-9: ten times the tolerance."""
    return _Scaled(_row(dense, group), 1 + 1e-9)


def row_within_tolerance(dense, group=None):
    """Right, the output scaled by 1 + 1e-12: inside the tolerance, must pass."""
    return _Scaled(_row(dense, group), 1 + 1e-12)


def _ce_two_ranks(logits_shard, targets, vocab_start, group=None, eps=0.0):
    """The target's owner found as "the first rank owns the targets below its end, the other one
    those from its start": right on two ranks; on three, rank 1 also claims rank 2's targets."""
    m = logits_shard.detach().max(dim=-1).values
    comm.all_reduce(m, op="max", group=group)
    shifted = logits_shard - m.unsqueeze(-1)
    sum_exp = reduce_from_parallel(shifted.exp().sum(dim=-1), group)
    width = logits_shard.shape[-1]
    mine = (targets < vocab_start + width) if vocab_start == 0 else (targets >= vocab_start)
    if eps:                                                        # the right mask: only the epsilon is wrong
        mine = (targets >= vocab_start) & (targets < vocab_start + width)
    idx = ((targets - vocab_start).clamp(0, width - 1) * mine).unsqueeze(-1)
    target = reduce_from_parallel(shifted.gather(-1, idx).squeeze(-1) * mine, group)
    return ((sum_exp + eps).log() - target).mean()


def ce_target_owner_for_two_ranks(logits_shard, targets, vocab_start, group=None):
    return _ce_two_ranks(logits_shard, targets, vocab_start, group)


def ce_log_with_an_epsilon(logits_shard, targets, vocab_start, group=None):
    """log(sum of exps + 1e-8), an epsilon "for safety": the sum is at least 1 (the max's own exp),
    so the loss is off by up to 1e-8, a hundred times the tolerance."""
    return _ce_two_ranks(logits_shard, targets, vocab_start, group, eps=1e-8)


WHERE_FG = r"^world_size=[234](, sub-groups \[\[0, 2\], \[1, 3\]\])?, rank \d: "
WHERE_ROW = r"^world_size=[234](, sub-groups \[\[0, 2\], \[1, 3\]\])?, in_features=\d+, out_features=\d, rank \d: "
WHERE_CE = r"^world_size=[23], \d tokens, vocabulary \d+( \(logits around 800\))?, rank \d: "

WRONG = {
    "f_g": [
        (f_backward_is_identity, [WHERE_FG, r"x\.grad after f's backward differs", r"It is this rank's own "
                                  r"gradient: X is used by every rank"], None),
        (f_and_g_swapped, [WHERE_FG, r"f's forward communicated \(\[\('all_reduce', \d+\)\]\): every rank "
                           r"already holds the same X"], None),
        (g_backward_all_reduces_too, [WHERE_FG, r"g's backward communicated", r"g's backward is the identity"],
         None),
        (f_backward_averages, [WHERE_FG, r"It is the mean over the ranks: f's backward sums"], None),
        (f_g_ignore_the_group, [r"^world_size=4, sub-groups \[\[0, 2\], \[1, 3\]\], rank \d: ",
                                r"sum over all ranks of the world: all-reduce over `group` only"], None),
        (f_backward_right_on_rank_zero_only, [r"^world_size=2, rank 1: x\.grad after f's backward differs",
                                              r"It is this rank's own gradient"], None),
        (f_g_not_a_pair, [r"f_and_g\(\) must return \(f, g\)"], None),
        (f_g_mean_times_two, [r"^world_size=3, rank \d: x\.grad after f's backward differs"], None),
        (f_g_backward_off_by_1e_9, [WHERE_FG, r"x\.grad after f's backward differs"], None),
        (f_g_backward_all_reduces_in_float32, [WHERE_FG, r"x\.grad after f's backward differs"], None),
    ],
    "row_parallel_linear": [
        (row_bias_added_on_every_rank, [WHERE_ROW, r"the output differs", r"every rank added the bias before "
                                        r"the sum; add it once, after the all-reduce"], None),
        (row_bias_only_on_rank_zero, [r"rank [123]: \.bias\.grad (is None|differs)", r"Every rank keeps the whole "
                                      r"bias and must get its whole gradient"], None),
        (row_ceil_chunks, [r"rank [12]: the module has a \.weight of shape \[\d, \d\]; rank [12] of [34] should "
                           r"hold columns \d+\.\.\d+ of dense\.weight", r"the first in_features % p ranks get one "
                           r"more"], None),
        (row_multiplies_in_float32, [WHERE_ROW, r"the output differs from the single-process value"], None),
        (row_all_reduces_backward_too, [WHERE_ROW, r"backward communicated \(\[\('all_reduce', \d+\)\]\)",
                                        r"The all-reduce's backward is the identity \(g\)"], None),
        (row_keeps_the_whole_weight, [WHERE_ROW, r"the module has a \.weight of shape \[\d, \d+\]; rank \d of \d "
                                      r"should hold columns"], None),
        (row_from_library, [r"^exercise 'row_parallel_linear' asks you to work out the row-parallel layer "
                            r"yourself; you use pplab\.tensor_parallel\.RowParallelLinear"], None),
        (row_returns_a_function, [WHERE_ROW, r"must return an nn\.Module"], None),
        (row_output_off_by_1e_9, [WHERE_ROW, r"the output differs from the single-process value"], None),
    ],
    "linear_traffic": [
        (traffic_counts_tensor_sizes, [r"^B=\d+, C_in=\d+, C_out=\d+, strategy 'data parallel': linear_traffic is \d+, "
                                       r"expected \d+", r"counts an all-reduce of N numbers as 2N"], None),
        (traffic_dp_grows_with_batch, [r"strategy 'data parallel'", r"C_out x C_in numbers, whatever the batch"],
         None),
        (traffic_column_and_row_swapped, [r"strategy 'column'", r"Column and row are swapped"], None),
        (traffic_as_text, [r"linear_traffic should be a number, got str"], None),
    ],
    "vocab_parallel_ce": [
        (ce_gathers_the_logits, [WHERE_CE, r"you all-gathered the logits \(\d+ elements per rank, in forward\)",
                                 r"never to build \[tokens, vocab\]"], None),
        (ce_all_reduces_padded_logits, [WHERE_CE, r"your all_reduce of \d+ elements \(in forward\) moves as much as "
                                        r"the logits"], None),
        (ce_local_max, [WHERE_CE, r"the loss differs from the single-process value", r"the global max "
                        r"\(all-reduce MAX\)"], None),
        (ce_without_max, [r"^world_size=3, \d tokens, vocabulary \d+ \(logits around 800\), rank \d: the loss",
                          r"It is not finite: exp\(\) overflowed"], None),
        (ce_every_rank_adds_a_target, [WHERE_CE, r"the loss differs", r"only the rank whose slice holds it may "
                                       r"contribute"], None),
        (ce_gradient_forgets_vocab_start, [r"^world_size=2, \d tokens, vocabulary \d+, rank 1: the gradient of "
                                           r"logits_shard differs", r"target - vocab_start on the rank that owns"],
         None),
        # the loss catches it unless the doubly-counted target happens to be its row's maximum (its
        # shifted logit is 0, so the loss is unchanged): then the gradient does (seed=1869083643)
        (ce_target_owner_for_two_ranks, [r"^world_size=3, \d tokens, vocabulary \d+( \(logits around 800\))?, "
                                         r"rank \d: the (loss|gradient of logits_shard) differs",
                                         r"only the rank whose slice holds it|on the rank that owns it"], None),
        (ce_log_with_an_epsilon, [WHERE_CE, r"the loss differs from the single-process value"], None),
        (ce_from_library, [r"^exercise 'vocab_parallel_ce' asks you to work out the vocabulary-parallel loss "
                           r"yourself; you use pplab\.tensor_parallel\.transformer\.vocab_parallel_cross_entropy"],
         None),
    ],
}
