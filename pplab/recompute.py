"""Activation recomputation: keep fewer activations for backward, compute them again there.

    block = Recomputed(megatron_block, "selective")     # drop attention's s x s tensors, recompute them
    layers = recompute_layers(gpt_layers, "full", every=2)   # keep one input per 2 blocks

Backward needs what the forward computed: autograd keeps those tensors ("saved activations")
from the forward until the backward has used them. A policy decides which ones a transformer
block keeps and which it drops and computes again in backward, from a tensor it did keep:

* "none": keep everything: Korthikanti et al.'s s·b·h·(34 + 5·a·s/h) bytes per block.
* "full": keep only the block's input (2·s·b·h bytes); backward runs the whole forward again
  first, one more forward per block (a third more compute, when backward costs two forwards).
* "selective": keep all but attention's scores, softmax and dropout (the 5·a·s/h term, which
  grows with s²), recompute those from q, k, v: the most memory for the least compute
  (Korthikanti et al. 2022, section 5).
* every=k (with "full"): one checkpoint per k consecutive blocks, the input of each group
  kept. N blocks then keep N/k inputs, and backward holds one group's k blocks at once: the
  sum is least near k = √N when a block keeps as much as its input (Chen et al. 2016).

Both recomputations use torch.utils.checkpoint (non-reentrant), which saves the checkpoint's
inputs, runs the function without saving anything inside it, and in backward runs it again
with the random-number state of the forward put back: dropout draws the same masks, so the
gradients are bit for bit those of the run that kept everything. The blocks are pplab's
MegatronBlock (chapter 5: the paper's layout, dropout included; tensor parallel, with or
without sequence parallelism, or on one process) and chapter 3's dense TransformerBlock
("full" only: its attention is fused and keeps no scores).
"""
from __future__ import annotations

import math

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from torch.utils.flop_counter import FlopCounterMode

from .memory import activation_bytes_formula
from .pipeline import simulate
from . import trace
from .swimlane.style import KIND_COLORS
from .trace import Event, Timeline
from .sequence_parallel import MegatronBlock
from .tensor_parallel.transformer import TransformerBlock

__all__ = ["POLICIES", "COLORS", "Recomputed", "recompute_layers", "expected_saved_bytes", "best_every", "flops",
           "simulate_recomputed"]

POLICIES = ("none", "selective", "full")
COLORS = {"R": KIND_COLORS["F"]}     # swimlane.draw(..., colors=COLORS): a recomputation is forward work


def _check_policy(policy):
    if policy not in POLICIES:
        raise ValueError(f"recomputation policy must be one of {POLICIES}, got {policy!r}")


class Recomputed(nn.Module):
    """`blocks` (one block, or several run one after the other) under a recomputation policy.

    "full" checkpoints the whole run of blocks: only its input is kept. "selective" needs
    MegatronBlocks: their attention core (scores, softmax, dropout, product with v) becomes a
    checkpoint whose only input, qkv, the block keeps anyway. The blocks are changed in place
    for "selective" and hold the same parameters: build a fresh block to compare with.
    """

    def __init__(self, blocks, policy: str = "full"):
        super().__init__()
        _check_policy(policy)
        blocks = [blocks] if isinstance(blocks, nn.Module) else list(blocks)
        if not blocks:
            raise ValueError("Recomputed needs at least one block")
        if policy == "selective":
            for block in blocks:
                if not isinstance(block, MegatronBlock):
                    raise ValueError(f"selective recomputation needs a MegatronBlock (its attention keeps the "
                                     f"scores), got {type(block).__name__}: build the blocks with "
                                     f"pplab.models.parallel_layers, or use policy='full'")
                core = _traced_again(block.attention)        # the bound method, before we shadow it
                block.attention = lambda qkv, core=core: checkpoint(core, qkv, use_reentrant=False)
        self.blocks, self.policy = nn.ModuleList(blocks), policy

    def _run(self, x):
        for block in self.blocks:
            x = block(x)
        return x

    def forward(self, x):
        if self.policy == "full" and torch.is_grad_enabled():   # keeps x, runs _run again in backward
            return checkpoint(_traced_again(self._run), x, use_reentrant=False)
        return self._run(x)


def _traced_again(fn):
    """fn, whose calls after the first (the recomputation, inside backward) are each a trace span
    of kind "R": on a swimlane, a box of forward work inside the backward's box."""
    calls = [0]

    def run(*args):
        calls[0] += 1
        if calls[0] == 1:
            return fn(*args)
        with trace.span("R"):
            return fn(*args)
    return run


def recompute_layers(layers, policy: str = "full", every: int = 1) -> list[nn.Module]:
    """A list of layers (pplab.models' [Embed, block, ..., block, Head], or a pipeline's) with
    its transformer blocks under `policy`; every=k groups k consecutive blocks into one
    checkpoint ("full" only). Other layers are left as they are; a list ending in a shorter
    group keeps that group too."""
    _check_policy(policy)
    if not isinstance(every, int) or every < 1:
        raise ValueError(f"every must be a whole number of blocks >= 1, got {every!r}")
    if every > 1 and policy != "full":
        raise ValueError(f"every={every} groups blocks into one checkpoint, which is full recomputation: "
                         f"use policy='full' (got {policy!r})")
    if policy == "none":
        return list(layers)
    out, group = [], []
    for layer in list(layers) + [None]:                       # None: flush the last group
        if isinstance(layer, (MegatronBlock, TransformerBlock)):
            group.append(layer)
            if len(group) < every:
                continue
        if group:
            out += [Recomputed(group, policy)] if policy == "full" else [Recomputed(b, policy) for b in group]
            group = []
        if layer is not None and not isinstance(layer, (MegatronBlock, TransformerBlock)):
            out.append(layer)
    return out


def expected_saved_bytes(s, b, h, a, t=1, sequence_parallel=True, policy="none", element_bytes=2) -> int:
    """What autograd keeps for one MegatronBlock: Korthikanti et al.'s Table 2 row
    (pplab.memory.activation_bytes_formula) plus the one thing the paper leaves out, LayerNorm's
    mean and 1/std: 2 numbers per token for each of the 2 LayerNorms, on s/t tokens with sequence
    parallelism (none with "full": the LayerNorms run again in backward)."""
    _check_policy(policy)
    formula = activation_bytes_formula(s, b, h, a, t, sequence_parallel, policy, element_bytes)
    tokens = s * b // (t if sequence_parallel and t > 1 else 1)
    stats = 0 if policy == "full" else 2 * 2 * element_bytes * tokens
    return round(formula + stats)                  # the formula is whole bytes; its float may be off by 1e-12


def best_every(n_blocks: int, kept: float = 1.0, held: float = 1.0) -> int:
    """The group size k that holds least at the peak of backward: ceil(N/k) kept inputs of
    `kept` bytes each, plus the k blocks being recomputed, `held` bytes each. With kept = held
    (Chen et al.'s assumption) it is about √N."""
    if n_blocks < 1:
        raise ValueError(f"best_every needs at least one block, got {n_blocks}")
    return min(range(1, n_blocks + 1), key=lambda k: (math.ceil(n_blocks / k) * kept + k * held, k))


def flops(fn, *args) -> int:
    """Floating-point operations of fn(*args) by torch's FlopCounterMode: matrix products only
    (what a transformer's time is made of), counted from shapes, so the same on any machine.
    Everything fn runs counts, a backward too, and a forward that backward runs again."""
    with FlopCounterMode(display=False) as counter:
        fn(*args)
    return counter.get_total_flops()


def simulate_recomputed(schedule, t_f=1.0, t_b=2.0, t_r=None, t_w=None):
    """simulate(schedule) where each backward first runs its forward again, for t_r (default t_f:
    full recomputation), and the Timeline that draws it: every B (or I) box split into an "R" box,
    R<micro-batch> (the recomputation: draw it with colors=COLORS, as forward work), and the
    backward proper. In a schedule that splits the backward, I recomputes (W reuses what I rebuilt):
    I lasts t_r + t_b - t_w, W lasts t_w (default t_b / 2, as simulate's).
    Returns (SimResult, Timeline). t_f, t_b, t_r, t_w: numbers, one rank's whole share, as simulate's."""
    t_r = t_f if t_r is None else t_r
    t_w = t_b / 2 if t_w is None else t_w
    if not all(isinstance(x, (int, float)) and x >= 0 for x in (t_f, t_b, t_r, t_w)) or t_w > t_b:
        raise ValueError(f"t_f, t_b, t_r and t_w must be numbers >= 0, t_w <= t_b (W is a part of the backward), "
                         f"got {t_f!r}, {t_b!r}, {t_r!r}, {t_w!r}")
    sim = simulate(schedule, t_f, t_b + t_r, t_w=t_w)
    events = []
    for e in sim.timeline().events:
        if e.kind in ("B", "I") and t_r > 0:
            rest = t_b if e.kind == "B" else t_b - t_w               # the backward proper, after R
            cut = e.start + (e.end - e.start) * t_r / (rest + t_r)   # the same share of every chunk's box
            events.append(Event(e.rank, "R", "compute", e.start, cut, "R" + e.label[1:], meta=dict(e.meta)))
            e = Event(**{**e.__dict__, "start": cut})
        events.append(e)
    return sim, Timeline(events, world_size=schedule.num_ranks, source="simulated", t0=0.0, unit=sim.unit,
                         memory_unit="micro-batches")
