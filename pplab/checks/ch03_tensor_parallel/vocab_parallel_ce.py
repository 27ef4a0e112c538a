"""Check of exercise vocab_parallel_ce (exercises/03_vocab_parallel_ce.ipynb): Vocabulary-parallel cross-entropy that never gathers the logits.

    vocab_parallel_ce     vocab_parallel_ce(logits_shard, targets, vocab_start, group=None) -> loss
"""
from __future__ import annotations

import random
import torch
import torch.nn.functional as F

from ..core import Fail, exercise, require_function
from .tp_trials import _close, _data, _launch, _split
from .vocab_parallel_ce_rank import _ce_rank, _refuse_vocab_parallel_ce


def _ce_shapes(seed, big):
    rng = random.Random(seed)
    return rng.randint(3, 9), rng.randint(7, 40), (800.0 if big else 0.0)       # tokens, vocab, logit offset


@exercise("vocab_parallel_ce", "Vocabulary-parallel cross-entropy that never gathers the logits",
          answer="vocab_parallel_ce", notebook="03_vocab_parallel_ce", sealed=True,
          preload=('pplab.tensor_parallel.transformer',))
def check_vocab_parallel_ce(fn, seed: int, timeout: float) -> str:
    require_function(fn, "vocab_parallel_ce", "logits_shard, targets, vocab_start, group",
                     torch.zeros(1, 1), torch.zeros(1, dtype=torch.long), 0, None)
    rng = random.Random(seed)
    trials = [(p, None, rng.randrange(2**31), big) for p, big in ((2, False), (3, False), (3, True))]
    for t in trials:
        n, vocab, offset = _ce_shapes(t[2], t[3])
        logits = (_data(t[2], n, vocab) * 3 + offset).requires_grad_()
        targets = torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(t[2] + 1))
        for r in range(t[0]):                   # token r's target in rank r's slice: every rank's mask is tried
            a, e = _split(vocab, t[0], r)
            targets[r] = a + t[2] % (e - a)
        inputs = [{"shard": logits.detach()[:, a:e].clone(), "targets": targets, "start": a}
                  for a, e in (_split(vocab, t[0], r) for r in range(t[0]))]
        results = _launch(_ce_rank, fn, t, inputs, timeout, "vocab_parallel_ce", probe=_refuse_vocab_parallel_ce)
        loss = F.cross_entropy(logits, targets)
        loss.backward()
        for r, res in enumerate(results):           # every rank of the vocabulary split
            where = (f"world_size={t[0]}, {n} tokens, vocabulary {vocab}" + (f" (logits around {offset:g})"
                     if offset else "") + f", rank {r}")
            if "error" in res:
                raise Fail(f"{where}: {res['error']}.")
            for ph, name, numel in res["calls"]:
                if name in ("all_gather", "gather", "all_to_all") and numel >= res["shard"] * n:
                    raise Fail(f"{where}: you {name.replace('_', '-')}ed the logits ({numel} elements per rank, in "
                               f"{ph}): the point of this loss is never to build [tokens, vocab] anywhere. All-reduce "
                               f"a max, a sum of exps and the target's logit instead: a few numbers per token.")
                if numel > 3 * n:
                    raise Fail(f"{where}: your {name} of {numel} elements (in {ph}) moves as much as the logits "
                               f"({n} tokens x {res['shard']} on this rank); every all-reduce here should hold at "
                               f"most a few numbers per token.")
            a, e = _split(vocab, t[0], r)
            hint = ""
            if not torch.isfinite(res["loss"]):
                hint = (" It is not finite: exp() overflowed. Subtract the max over the *whole* vocabulary "
                        "(an all-reduce with op=MAX) before exp.")
            _close(res["loss"], loss.detach(), "the loss", where, hint or
                   " Check the three pieces: the global max (all-reduce MAX), the global sum of exp(logit - max), "
                   "and the target's logit, which only the rank whose slice holds it may contribute.")
            _close(res["grad"], logits.grad[:, a:e], "the gradient of logits_shard", where,
                   f" It must be (softmax - one_hot(target)) / tokens on this rank's columns {a}..{e - 1}; the "
                   f"target's column is target - vocab_start on the rank that owns it.")
    return ("on world sizes 2 and 3, uneven vocabularies, logits near 0 and near 800 (loss and gradient to "
            "1e-10; no collective larger than 3 numbers per token)")
