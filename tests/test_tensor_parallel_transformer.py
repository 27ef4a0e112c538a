"""pplab.tensor_parallel.transformer: MLP, attention, block, vocabulary (and the course's tiny GPT
built from them, pplab.models) on 1-4 ranks
against the same dense modules on one process.

float64 throughout; "equal" means max |difference| <= TOL = 1e-10. Gradients are compared
shard by shard: the dense gradients are put into a copy of the dense module and split by the
same from_dense whose forward the test has just shown equal to the dense one.
"""
import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import pplab
from pplab.models import GPTConfig, gpt_layers, gpt_loss, parallel_layers
from pplab.tensor_parallel import my_range
from pplab.tensor_parallel import transformer as tpt

pytestmark = pytest.mark.usefixtures("no_leftover_processes")

TOL = 1e-10
S, B, H, HEADS, FFN, VOCAB = 6, 2, 24, 12, 10, 50        # 12 heads: TP 1, 2, 3, 4; ffn 10: uneven over 3, 4


def data(*shape, seed=1):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def dense_model(kind, seed=0):
    torch.manual_seed(seed)
    m = {"mlp": lambda: tpt.MLP(H, FFN), "attn": lambda: tpt.SelfAttention(H, HEADS),
         "block": lambda: tpt.TransformerBlock(H, HEADS, FFN)}[kind]()
    return m.double()


PARALLEL = {"mlp": tpt.ParallelMLP, "attn": tpt.ParallelSelfAttention, "block": tpt.ParallelTransformerBlock}


def grads_as_model(model):
    """A copy of the dense model whose weights are its gradients."""
    g = copy.deepcopy(model)
    with torch.no_grad():
        for p, q in zip(g.parameters(), model.parameters()):
            p.copy_(q.grad)
    return g


def comm_log(events):
    return [(e.kind, e.meta.get("payload")) for e in events if e.category == "comm"]


def modules_job(kind):
    dense = dense_model(kind)
    x, up = data(S, B, H, seed=2).requires_grad_(), data(S, B, H, seed=3)
    (dense(x) * up).sum().backward()
    par = PARALLEL[kind].from_dense(dense).double()
    xp = x.detach().clone().requires_grad_()
    n = len(pplab.trace.events())
    y = par(xp)
    n2 = len(pplab.trace.events())
    (y * up).sum().backward()
    events = pplab.trace.events()
    expect = PARALLEL[kind].from_dense(grads_as_model(dense))
    grad_diff = max((p.grad - q).abs().max().item() for p, q in zip(par.parameters(), expect.parameters()))
    return ((y - dense(x)).abs().max().item(), (xp.grad - x.grad).abs().max().item(), grad_diff,
            comm_log(events[n:n2]), comm_log(events[n2:]))


@pytest.mark.parametrize("p", [1, 2, 3, 4])
def test_mlp_attention_and_block_equal_the_dense_modules(p):
    for kind in ("mlp", "attn", "block"):
        for out_diff, x_diff, grad_diff, fwd, bwd in pplab.launch(modules_job, kind, world_size=p):
            assert out_diff < TOL and x_diff < TOL and grad_diff < TOL, (kind, out_diff, x_diff, grad_diff)
            # Megatron: one all-reduce of [s, b, h] forward and one backward per MLP or attention
            n = {"mlp": 1, "attn": 1, "block": 2}[kind] if p > 1 else 0
            assert fwd == [("all_reduce", S * B * H * 8)] * n and bwd == [("all_reduce", S * B * H * 8)] * n


def heads_job():
    try:
        tpt.ParallelSelfAttention(60, 12)
    except ValueError as e:
        return str(e)


def test_heads_that_do_not_divide_get_a_clear_error():
    assert "12 heads cannot be split over 5 ranks" in pplab.launch(heads_job, world_size=5)[0]


@pytest.mark.parametrize("bad", [-1, 7])
def test_vocab_embedding_refuses_an_id_outside_the_vocabulary(bad):
    """An id of V or more belongs to no rank: every rank would add zeros and the embedding would be
    silently 0. One process (a group of one) takes the same check as every rank of a launch."""
    emb = tpt.VocabParallelEmbedding(7, 3)
    assert emb(torch.tensor([0, 6])).shape == (2, 3)                  # 0 and V-1 are fine
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 7\)"):
        emb(torch.tensor([0, bad]))


# ----------------------------------------------------------------------------------
# The vocabulary


def vocab_job(vocab, n_tok, with_size):
    torch.manual_seed(0)
    emb = torch.nn.Embedding(vocab, 4).double()
    ids = torch.randint(0, vocab, (n_tok,), generator=torch.Generator().manual_seed(5))
    pemb = tpt.VocabParallelEmbedding.from_dense(emb)
    (pemb(ids) * data(n_tok, 4, seed=6)).sum().backward()
    (emb(ids) * data(n_tok, 4, seed=6)).sum().backward()
    emb_diff = (pemb.weight.grad - emb.weight.grad[pemb.start:pemb.end]).abs().max().item()
    out_diff = (pemb(ids) - emb(ids)).abs().max().item()

    logits = data(n_tok, vocab, seed=7).requires_grad_()
    F.cross_entropy(logits, ids).backward()
    shard = logits.detach()[:, pemb.start:pemb.end].clone().requires_grad_()   # the same split as the embedding
    n = len(pplab.trace.events())
    loss = tpt.vocab_parallel_cross_entropy(shard, ids, vocab_size=vocab if with_size else None)
    fwd = comm_log(pplab.trace.events()[n:])
    n = len(pplab.trace.events())
    loss.backward()
    return (out_diff, emb_diff, (loss - F.cross_entropy(logits, ids)).abs().item(),
            (shard.grad - logits.grad[:, pemb.start:pemb.end]).abs().max().item(),
            fwd, comm_log(pplab.trace.events()[n:]))


@pytest.mark.parametrize("p", [1, 2, 3, 4])
def test_vocab_parallel_embedding_and_cross_entropy_never_gather_the_logits(p):
    n_tok = 6
    for with_size in (True, False):
        for out_diff, emb_diff, loss_diff, grad_diff, fwd, bwd in \
                pplab.launch(vocab_job, 1000, n_tok, with_size, world_size=p):      # 1000 over 3: uneven
            assert max(out_diff, emb_diff, loss_diff, grad_diff) < TOL
            assert bwd == []                                 # the gradient softmax - onehot is local
            if p == 1:
                assert fwd == []
                continue
            # a max and the two sums, one number per token each: never [tokens, vocab]
            expect = [("all_reduce", n_tok * 8), ("all_reduce", 2 * n_tok * 8)]
            assert fwd == (expect if with_size else [("all_gather", 8)] + expect)


# ----------------------------------------------------------------------------------
# Training: the course's tiny GPT (pplab.models), tensor parallel, step by step

CFG = GPTConfig(vocab=VOCAB, seq=S, hidden=H, heads=HEADS, ffn=FFN, layers=2)


def train(layers, steps, ids, targets, group=None):
    model = nn.Sequential(*layers)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    losses = []
    for _ in range(steps):
        loss = gpt_loss(model(ids), targets, group=group, vocab=CFG.vocab)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def tokens():
    g = torch.Generator().manual_seed(9)
    return torch.randint(0, VOCAB, (B, S), generator=g), torch.randint(0, VOCAB, (B, S), generator=g)


def train_job(steps, trained_dense):
    world = torch.distributed.group.WORLD
    mine = parallel_layers(gpt_layers(CFG), group=world)
    losses = train(mine, steps, *tokens(), group=world)
    expect = parallel_layers(trained_dense, group=world)   # one process's trained weights, split as ours
    got = [p for layer in mine for p in layer.parameters()]
    want = [p for layer in expect for p in layer.parameters()]
    return losses, max((a - b).abs().max().item() for a, b in zip(got, want))


@pytest.mark.parametrize("p", [1, 2, 3, 4])
def test_training_a_tiny_gpt_matches_one_process_step_by_step(p):
    """Adam, 4 steps: losses within 1e-10, every parameter shard within 1e-8 (Adam's division by
    sqrt(v) amplifies the summation-order differences of small gradients)."""
    steps = 4
    dense = gpt_layers(CFG)
    ref_losses = train(dense, steps, *tokens())
    assert ref_losses[-1] < ref_losses[0]                   # it does learn
    for losses, param_diff in pplab.launch(train_job, steps, dense, world_size=p):
        assert max(abs(a - b) for a, b in zip(losses, ref_losses)) < TOL
        assert param_diff < 1e-8


# -- vocab_parallel_cross_entropy where the numbers are large -----------------------------------------
#
# Any constant subtracted from the logits gives the same softmax, so with small logits a wrong
# constant (the min instead of the max) still gives the right loss. float32 logits spread over
# hundreds do not: exp(logit - min) overflows where exp(logit - max) <= 1. The reference is
# torch's F.cross_entropy on the whole logits.


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
