"""Check of chapter 9's exercise: a transformer block that recomputes selectively.

    checkpointed_block   checkpointed_block(block) -> module; module(x) == block(x), bit for bit

The student gets this rank's MegatronBlock (tensor parallel over the ranks, no sequence
parallelism, dropout on, bf16) and returns a module that computes what the block computes,
with the same dropout masks, while autograd keeps at most Korthikanti et al.'s selective row,
s·b·h·(10 + 24/t) bytes plus LayerNorm's statistics (pplab.recompute.expected_saved_bytes), and
recomputes no more than attention's core. The block's attention core is `block.attention(qkv)`.

Two sealed launches, t = 2 and t = 3, each with a random shape (a multiple of t heads, head size
2 to 4, s = 14 to 20 tokens: the s x s tensors outweigh the MLP's, so dropping the MLP instead
does not fit), random weights, input, output gradient, dropout rate and seed from the checker.
In each rank, first the block as given runs forward and backward (the plain run: output, input
and parameter gradients, bytes kept, FLOPs); then a fresh block, built the same way, goes to the
answer and its module runs the same step under the same random seed. Three parts, every rank
(partial credit):

* exact: output, x.grad and every parameter's gradient torch.equal to the plain run's;
* within budget: bytes autograd kept (pplab.memory.saved_activations) <= the selective row;
* recompute cost: FLOPs of forward + backward (torch's FlopCounterMode: matrix products, from
  shapes) minus the plain run's <= attention's two s x s products, 4·b·s²·h/t.

The verdicts are reached here; the plain run's bytes are checked here against Table 2's first
TP row, so a rank that measured something else is not believed.
"""
from __future__ import annotations

import random
import torch
from torch import nn

from .. import sealed
from ..core import Fail, Parts, exercise, first_difference, require_function
from .checkpointed_block_rank import _rank_job, _refuse_library_recompute


PARTS = ("exact", "within budget", "recompute cost")


def _trials(seed):
    rng = random.Random(seed)
    out = []
    for t in (2, 3):
        a = t * rng.randint(1, 2)
        shape = {"s": rng.randint(14, 20), "b": rng.randint(1, 2), "h": a * rng.randint(2, 4), "a": a,
                 "dropout": rng.choice([0.1, 0.2, 0.3])}
        out.append((t, shape, rng.randrange(2**31)))
    return out


def _budget(shape, t, policy="selective"):
    from ...recompute import expected_saved_bytes
    return expected_saved_bytes(shape["s"], shape["b"], shape["h"], shape["a"], t, False, policy)


def _exact_problem(plain, mine):
    if mine["y"] is None:
        return f"the module returned {mine['y_shape']}, not a tensor shaped like its input [s, b, h]."
    diff = first_difference(mine["y"].float(), plain["y"].float())
    if diff is not None:
        return (f"the output differs from the block's {diff}: "
                f"recomputation must not change what the forward computes.")
    tensors = [("x.grad", mine["x_grad"], plain["x_grad"])] + \
        [(f"{n}.grad", mine["grads"].get(n), g) for n, g in plain["grads"].items()]
    for name, got, want in tensors:
        if got is None or want is None or got.shape != want.shape:
            return f"{name} is {'missing' if got is None else list(got.shape)} after backward."
        diff = first_difference(got.float(), want.float())
        if diff is not None:
            return (f"the output is exact but {name} differs {diff}: "
                    f"backward used recomputed tensors that are not the forward's. Dropout drew a new mask when "
                    f"it ran again: put the random state of the forward back before recomputing (torch's "
                    f"checkpoint does it with preserve_rng_state=True).")
    return None


def _budget_problem(plain, mine, shape, t):
    s, b, h, a = shape["s"], shape["b"], shape["h"], shape["a"]
    budget, got = _budget(shape, t), mine["bytes"]
    if got <= budget:
        return None
    head = (f"autograd kept {got:,} bytes for backward; the budget is {budget:,} (s·b·h·(10 + 24/t) = "
            f"{s * b * h * (10 + 24 / t):,.0f} with s={s}, b={b}, h={h}, t={t}, plus LayerNorm's mean and 1/std, "
            f"{budget - round(s * b * h * (10 + 24 / t)):,}): over by {got - budget:,}.")
    if got == plain["bytes"]:
        return (f"{head} That is exactly what the block keeps without recomputation: nothing was dropped. "
                f"Attention's softmax, dropout mask and dropout output (5·a·s²·b/t = {5 * a * s * s * b // t:,} "
                f"bytes) grow with s²: checkpoint block.attention.")
    if got - budget >= a * s * s * b // t:
        return (f"{head} Attention's s x s tensors are still kept, some or all of them (softmax 2 bytes a score, "
                f"dropout mask 1, dropout output 2: {5 * a * s * s * b // t:,} bytes here): recompute everything "
                f"from the scores to the product with v.")
    return head


def _cost_problem(plain, mine, shape, t):
    s, b, h = shape["s"], shape["b"], shape["h"]
    extra, limit = mine["flops"] - plain["flops"], 4 * b * s * s * h // t
    if extra <= limit:
        return None
    forward = plain["flops"] // 3
    what = ("the whole block's forward ran again in backward (full recomputation): it fits, at a third more "
            "compute" if extra >= forward else "more than attention's core ran again")
    return (f"backward recomputed {extra:,} FLOPs beyond the plain run's {plain['flops']:,}; selective recomputation "
            f"needs at most attention's two s x s products, 4·b·s²·h/t = {limit:,}: {what}. Keep everything but "
            f"the scores, softmax and dropout, and recompute only those.")


def _describe(t, shape):
    return (f"t={t}, s={shape['s']}, b={shape['b']}, h={shape['h']}, {shape['a']} heads, "
            f"dropout {shape['dropout']}")


@exercise("checkpointed_block", "A transformer block that recomputes attention's scores only",
          answer="checkpointed_block", notebook="09a_checkpointed_block", sealed=True, points=len(PARTS),
          preload=("pplab.recompute", "torch.utils.checkpoint", "torch.utils.flop_counter"))
def check_checkpointed_block(fn, seed: int, timeout: float) -> str:
    require_function(fn, "checkpointed_block", "block", nn.Linear(1, 1))
    parts = Parts(PARTS)
    for t, shape, trial_seed in _trials(seed):
        from ...tensor_parallel.transformer import TransformerBlock
        g = torch.Generator().manual_seed(trial_seed)
        dense = TransformerBlock(shape["h"], shape["a"], 4 * shape["h"])
        state = {n: torch.randn(p.shape, generator=g) * (0.3 if p.dim() == 1 else p.shape[-1] ** -0.5) +
                 (1.0 if n.startswith("ln") and n.endswith("weight") else 0.0) for n, p in dense.named_parameters()}
        x = torch.randn(shape["s"], shape["b"], shape["h"], generator=g).to(torch.bfloat16)
        dy = torch.randn(shape["s"], shape["b"], shape["h"], generator=g)
        inputs = [{"shape": shape, "state": state, "x": x, "dy": dy, "seed": trial_seed % 10_000} for _ in range(t)]
        found = dict.fromkeys(PARTS)

        def judge(p, i, observed, traffic):
            if len(observed) != p:
                return
            for rank in range(p):
                res = observed[rank]
                if not res["is_module"]:
                    raise Fail(f"rank {rank}: checkpointed_block must return an nn.Module (the block's parameters "
                               f"inside it).", seed_matters=False)
                plain, mine = res["plain"], res["mine"]
                if plain["bytes"] != _budget(shape, t, "none"):
                    raise Fail(f"rank {rank}: the block as given kept {plain['bytes']:,} bytes, not Table 2's "
                               f"{_budget(shape, t, 'none'):,}: was MegatronBlock changed before the check ran?")
                problems = {"exact": _exact_problem(plain, mine), "within budget": None, "recompute cost": None}
                if mine["y"] is not None:
                    problems["within budget"] = _budget_problem(plain, mine, shape, t)
                    problems["recompute cost"] = _cost_problem(plain, mine, shape, t)
                for part, problem in problems.items():
                    if problem and not found[part]:
                        found[part] = f"rank {rank}: {problem}"
        sealed.run_sealed(_rank_job, fn, [inputs], world_size=t, timeout=timeout,
                          exercise=("checkpointed_block", ""), forbidden=(), probe=_refuse_library_recompute,
                          describe=lambda p, i: _describe(t, shape), check=judge)
        for part in PARTS:
            parts.note(part, found[part], where=_describe(t, shape))
    return parts.finish("on t = 2 and t = 3 (bf16, dropout on: output and every gradient bit-equal to the block "
                        "that keeps everything, saved bytes within s·b·h·(10 + 24/t) + LayerNorm statistics, "
                        "recomputing at most attention's two s x s products)")
