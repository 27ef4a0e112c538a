"""pplab.tensor_parallel.transformer.vocab_parallel_cross_entropy where the numbers are large.

Any constant subtracted from the logits gives the same softmax, so with small logits a wrong
constant (the min instead of the max) still gives the right loss. float32 logits spread over
hundreds do not: exp(logit - min) overflows where exp(logit - max) <= 1. The reference is
torch's F.cross_entropy on the whole logits.
"""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import pplab
from pplab.tensor_parallel import transformer as tpt
from pplab.tensor_parallel import my_range

pytestmark = pytest.mark.usefixtures("no_leftover_processes")


def _loss_and_grad(logits, targets):
    start, end = my_range(logits.shape[-1])
    shard = logits[:, start:end].clone().requires_grad_()
    loss = tpt.vocab_parallel_cross_entropy(shard, targets, vocab_size=logits.shape[-1])
    loss.backward()
    return loss.detach(), shard.grad, (start, end), dist.get_rank()


def test_large_float32_logits_on_three_ranks():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 10, generator=g) * 100                   # spread of hundreds; 10 over 3 ranks: uneven
    targets = torch.tensor([0, 3, 4, 7, 9])                          # owned by ranks 0, 0, 1, 2, 2
    full = logits.clone().requires_grad_()
    want = F.cross_entropy(full, targets)
    want.backward()
    for loss, grad, (start, end), rank in pplab.launch(_loss_and_grad, logits, targets, world_size=3, timeout=60):
        assert torch.isfinite(loss) and torch.allclose(loss, want.detach(), rtol=1e-5), rank
        assert torch.allclose(grad, full.grad[:, start:end], rtol=1e-5, atol=1e-7), rank
