"""The exercises of chapter 3 (tensor parallelism): registered, their solution notebooks check
themselves, and other correct answers pass too (the checks ask for a result and Megatron's
communication, not for one way of writing it). Every solution passing, every stub failing and
every wrong answer of tests/wrong_solutions_ch03_tensor_parallel.py failing with its message are
run from tests/test_checks.py."""

import pytest
import torch
import torch.distributed as dist

from pplab import checks, comm
from wrong_solutions_ch03_tensor_parallel import WRONG, f_g_within_tolerance, row_within_tolerance
from wrong_solutions_ch03_linear_3d import l3d_within_tolerance

pytestmark = pytest.mark.usefixtures("no_leftover_processes")

IDS = ["f_g", "linear_traffic", "row_parallel_linear", "vocab_parallel_ce"]


def test_the_chapter_registers_its_exercises():
    assert IDS == sorted(["f_g", "row_parallel_linear", "vocab_parallel_ce", "linear_traffic"])
    assert set(WRONG) == set(IDS)
    for exercise_id in ("f_g", "row_parallel_linear", "vocab_parallel_ce"):    # the ones run on ranks:
        cases = WRONG[exercise_id]                # one answer right on rank 0, wrong on another rank only
        assert any("rank_zero" in fn.__name__ or "ceil" in fn.__name__ or "vocab_start" in fn.__name__
                   for fn, _, _ in cases), exercise_id



# -- other correct answers pass -------------------------------------------------------

def f_and_g_with_torch_distributed():
    """torch.distributed directly, and g's forward reducing into a fresh tensor made with torch.add."""
    class F(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, group):
            ctx.group = group
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            out = torch.add(grad, 0)
            dist.all_reduce(out, group=ctx.group)
            return out, None

    class G(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, group):
            out = torch.add(x, 0)
            dist.all_reduce(out, group=group)
            return out

        @staticmethod
        def backward(ctx, grad):
            return grad, None

    return (lambda x, group: F.apply(x, group)), (lambda x, group: G.apply(x, group))


def row_parallel_with_tensor_split_and_nn_linear(dense, group=None):
    """Keeps the slice as an nn.Linear without bias and reuses the library's g."""
    from pplab.tensor_parallel import reduce_from_parallel
    p, r = comm.world_size(group), comm.rank(group)
    cols = torch.arange(dense.in_features).tensor_split(p)[r]

    class Row(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(dense.weight.detach()[:, cols].clone())
            self.bias = None if dense.bias is None else torch.nn.Parameter(dense.bias.detach().clone())

        def forward(self, x):
            y = reduce_from_parallel(torch.nn.functional.linear(x, self.weight), group)
            return y if self.bias is None else y + self.bias
    return Row()


class _CE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, start, group):
        m = logits.max(dim=-1).values
        comm.all_reduce(m, op="max", group=group)
        z = logits - m.unsqueeze(-1)
        mine = (targets >= start) & (targets < start + logits.shape[-1])
        idx = ((targets - start) * mine).unsqueeze(-1)
        both = torch.stack([z.exp().sum(-1), z.gather(-1, idx).squeeze(-1) * mine])
        comm.all_reduce(both, group=group)                    # the two sums in one all-reduce
        ctx.save_for_backward(z.exp() / both[0].unsqueeze(-1), idx, mine)
        return (both[0].log() - both[1]).mean()

    @staticmethod
    def backward(ctx, grad):
        softmax, idx, mine = ctx.saved_tensors
        g = softmax.scatter_add(-1, idx, -mine.unsqueeze(-1).to(softmax.dtype))
        return g * grad / idx.shape[0], None, None, None


def vocab_ce_as_one_autograd_function(logits_shard, targets, vocab_start, group=None):
    return _CE.apply(logits_shard, targets, vocab_start, group)


@pytest.mark.parametrize("exercise_id, fn", [("f_g", f_and_g_with_torch_distributed),
                                             ("row_parallel_linear", row_parallel_with_tensor_split_and_nn_linear),
                                             ("vocab_parallel_ce", vocab_ce_as_one_autograd_function),
                                             # off by 1e-12, inside the tolerance 1e-10: a near miss must not be
                                             ("f_g", f_g_within_tolerance),              # caught by a check
                                             ("row_parallel_linear", row_within_tolerance),     # too strict
                                             ("linear_3d", l3d_within_tolerance)])
def test_other_correct_answers_pass(exercise_id, fn):
    result = checks.run_check(exercise_id, fn)
    assert result, result.message
