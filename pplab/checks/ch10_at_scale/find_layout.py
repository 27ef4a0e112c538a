"""Check of chapter 10's exercise: the memory of one GPU of a big layout, worked out by hand.

    find_layout    memory_per_gpu(problem) -> bytes on the first pipeline GPU of problem's layout

No ranks. Each problem is a random GPT (hidden h, heads a, layers L, sequence s, vocabulary V) on
dp × tp × pp GPUs, with a ZeRO stage, a recomputation mode, a micro-batch size b and m
micro-batches (1F1B). The right answer is the sum of chapter 6's model state and Korthikanti et
al.'s activations (pplab.zero.model_state_bytes, pplab.memory.activation_bytes_formula):

    Ψ          = (L / pp) · 12h² / tp + V·h / tp            (its layers' share, and the embedding)
    state      = model_state_bytes(zero, Ψ, dp)              (2 + 2 + 12 bytes, ZeRO-sharded over dp)
    per layer  = s·b·h·(34 + 5·a·s/h) / tp      (sequence parallel; selective: 34·s·b·h/tp; full: 2·s·b·h/tp)
    held       = min(pp, m) micro-batches × L / pp layers    (the first rank of 1F1B)

Problems are drawn so that each common slip (ZeRO ignored, all m micro-batches held, or pp of
them when there are fewer, ZeRO-2 taken to shard the parameters, the scores' term kept under
selective recomputation or not split by tp, full recomputation's input not split by tp, the
embedding forgotten) changes the answer by more than 1%; answers are compared to 1e-6 relative.
"""
from __future__ import annotations

import random

from .. import sealed
from ..core import Fail, exercise, problems_showing, require_function


SLIPS = ("no_zero", "gpipe_memory", "pp_in_flight", "zero2_shards_parameters", "selective_keeps_scores",
         "scores_not_split", "full_input_not_split", "no_embedding")


def reference(problem, slip=None):
    """(model state, activations) in bytes, as the module's docstring says; with one slip if asked."""
    from ...memory import activation_bytes_formula
    from ...zero import model_state_bytes
    p = problem
    h, L, pp, tp = p["hidden"], p["layers"], p["pp"], p["tp"]
    psi = (L // pp) * 12 * h * h // tp + (0 if slip == "no_embedding" else p["vocab"] * h // tp)
    zero = 0 if slip == "no_zero" else 3 if slip == "zero2_shards_parameters" and p["zero"] == 2 else p["zero"]
    state = model_state_bytes(zero, psi, p["dp"])
    recompute = "none" if slip == "selective_keeps_scores" and p["recompute"] == "selective" else p["recompute"]
    s, b, a = p["seq"], p["micro_batch"], p["heads"]
    layer = activation_bytes_formula(s, b, h, a, tp, True, recompute)
    if slip == "scores_not_split" and recompute == "none":
        layer += 5 * a * s * s * b * (1 - 1 / tp)                # 5·a·s²·b whole on every rank
    if slip == "full_input_not_split" and recompute == "full":
        layer *= tp                                               # 2·s·b·h on every rank
    held = {"gpipe_memory": p["m"], "pp_in_flight": pp}.get(slip, min(pp, p["m"]))
    return state, held * (L // pp) * layer


def _problem(rng):
    h = rng.choice([1024, 2048, 4096, 6144, 8192])
    heads = rng.choice([16, 32, 64])
    pp = rng.choice([1, 2, 4, 8])
    layers = pp * rng.choice([2, 3, 4, 6])
    return {"hidden": h, "heads": heads, "layers": layers, "seq": rng.choice([1024, 2048, 4096]),
            "vocab": rng.choice([32000, 51200]), "dp": rng.choice([2, 4, 8, 16]), "tp": rng.choice([1, 2, 4, 8]),
            "pp": pp, "zero": rng.choice([0, 1, 2, 3]), "recompute": rng.choice(["none", "selective", "full"]),
            "micro_batch": rng.choice([1, 2, 4]), "m": rng.choice([2, 4, 8, 16])}


def problems(seed: int, count: int = 12):
    """`count` (problem, right answer) pairs, among them for every slip at least one it gets wrong
    by more than 1%."""
    rng = random.Random(seed)

    def draw(_):
        problem = _problem(rng)
        return problem, sum(reference(problem))

    def slips_wrong(case):
        problem, right = case
        return {s for s in SLIPS if abs(sum(reference(problem, s)) / right - 1) > 0.01}
    return problems_showing(draw, slips_wrong, SLIPS, count)


HINTS = {"no_zero": "ZeRO stage {zero} shards over the dp = {dp} ranks: the optimizer state from stage 1, "
                    "the gradients from 2, the parameters at 3.",
         "gpipe_memory": "1F1B's first rank holds min(pp, m) micro-batches at its peak, not all m (that is GPipe).",
         "pp_in_flight": "with m = {m} micro-batches and pp = {pp}, the first rank holds min(pp, m): it cannot hold "
                         "more micro-batches than the step has.",
         "zero2_shards_parameters": "ZeRO-2 shards the optimizer state and the gradients; each rank keeps all of "
                                    "its parameters (only ZeRO-3 shards them).",
         "selective_keeps_scores": "selective recomputation drops the 5·a·s/h term: the scores are computed again.",
         "scores_not_split": "tensor parallelism splits the heads, so the scores' 5·a·s/h term is divided by tp too.",
         "full_input_not_split": "with sequence parallelism each rank keeps its s/tp slice of the layer's input: "
                                 "2·s·b·h/tp.",
         "no_embedding": "the first pipeline GPU also holds its 1/tp of the embedding, V·h parameters."}


@exercise("find_layout", "The memory of one GPU of a big layout: model state and activations, by hand",
          answer="memory_per_gpu", notebook="10_find_layout", sealed=True)
def check_find_layout(fn, seed: int, timeout: float) -> str:
    """memory_per_gpu(problem) -> bytes on the first pipeline GPU."""
    cases = problems(seed)
    require_function(fn, "find_layout", "problem", cases[0][0])
    outs = sealed.call_each(fn, [(dict(problem),) for problem, _ in cases], where=lambda k: f"problem {k}: ",
                            timeout=timeout)
    for k, ((problem, right), got) in enumerate(zip(cases, outs)):
        if isinstance(got, bool) or not isinstance(got, (int, float)):
            raise Fail(f"problem {k}: memory_per_gpu must return a number of bytes, got {got!r}")
        if abs(got - right) > 1e-6 * right:
            state, acts = reference(problem)
            hints = [HINTS[s].format(**problem) for s in SLIPS if abs(sum(reference(problem, s)) - got) <= 1e-6 * right]
            if any(abs(got * unit / right - 1) <= 1e-3 for unit in (1e9, 2 ** 30, 1e6, 2 ** 20)):
                hints.append("return bytes, not GB, GiB, MB or MiB.")
            raise Fail(f"problem {k}: you said {got / 1e9:.4f} GB, the answer is {right / 1e9:.4f} GB "
                       f"({state / 1e9:.4f} GB of model state + {acts / 1e9:.4f} GB of activations) for {problem}"
                       + "".join("\n" + h for h in hints))
    return f"on {len(cases)} random layouts (every ZeRO stage and recomputation mode)"
