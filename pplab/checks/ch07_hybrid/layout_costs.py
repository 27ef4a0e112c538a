"""What chapter 7's checkers of pick_layout, design_layout share.

No ranks: each problem is a random model, batch, α, β, per-block times and memory, and three
random dp × tp × pp (× m micro-batches, 1F1B) layouts of 4 or 8 ranks. The right answer is
pplab.planner's: `plan`'s step time and memory of each layout (chapter 4's simulator for the
pipeline, ring collectives from the α-β model, chapter 6's memory for fp32 Adam without ZeRO).
The learner's formulas leave out what is small (the embedding and the head); problems are
drawn only where that cannot change the answer: the fastest layout that fits is at least 25%
faster than the next, and no layout's memory is within 10% of the budget.

"""
from __future__ import annotations


def _problem(rng, choices: int | None = 3):
    """One random problem: the learner's dict, and the planner's inputs that say the same.
    choices: how many of the valid layouts the problem offers (None: every one)."""
    from ... import costfit, planner
    from ...models.gpt import GPTConfig
    h = rng.choice([256, 512, 1024, 2048])
    cfg = GPTConfig(vocab=8, seq=rng.choice([128, 256, 512]), hidden=h, heads=8, ffn=4 * h,
                            layers=rng.choice([4, 8, 16]))
    world = rng.choice([4, 8])
    t_f = rng.choice([1e-4, 3e-4, 1e-3, 3e-3]) * (h / 512) ** 2
    saved = rng.choice([10, 20, 34]) * cfg.seq * h          # elements a block keeps per sample, at tp = 1
    n = cfg.layers + 2
    times = planner.LayerTimes([0.0] * n, [0.0] + [t_f] * cfg.layers + [0.0], [0.0] * n,
                               [0.0] + [2 * t_f] * cfg.layers + [0.0], [0.0] + [saved] * cfg.layers + [0.0], 0.0,
                               source="exercise")
    alpha, beta = rng.choice([1e-6, 1e-5, 1e-4, 1e-3]), rng.choice([1e-11, 1e-10, 1e-9])
    fit = costfit.Fit(alpha, beta, 0.0, [1, 2], [alpha, alpha])
    batch = rng.choice([8, 16, 32, 64])
    valid, _ = planner.enumerate_layouts(cfg, batch, world, zero_stages=(0,))
    valid = [L for L in valid if L.pp == 1 or L.m >= L.pp]
    layouts = valid if choices is None else rng.sample(valid, choices)
    preds = [planner.predict(cfg, L, batch, fit, times) for L in layouts]
    budget = rng.choice([p.memory["total"] for p in preds]) * rng.choice([0.7, 1.3, 3.0])
    if choices is None:                                     # some layouts fit and some do not
        budget = sorted(p.memory["total"] for p in preds)[len(preds) // 2] * rng.choice([0.8, 1.2])
    # what tp leaves of a block's activations, as the planner counts them (chapter 5's block, unfused attention)
    ratio = {t: planner.parallel_saved(cfg, t)[1] / planner.parallel_saved(cfg, 1)[1] for t in (1, 2, 4, 8)}
    block = cfg.parameters() - (cfg.vocab * h + cfg.seq * h + 2 * h + h * cfg.vocab)
    problem = {"alpha": alpha, "beta": beta, "batch": batch, "layers": cfg.layers, "t_f": t_f, "t_b": 2 * t_f,
               "act_bytes": 4 * cfg.seq * h, "block_bytes": 4 * block // cfg.layers,
               "saved": {t: 4 * saved * r for t, r in ratio.items()}, "budget": budget,
               "layouts": [{"dp": L.dp, "tp": L.tp, "pp": L.pp, "m": L.m} for L in layouts]}
    return problem, preds, budget


SLIPS = ("ignore_memory", "no_bubble", "tp_once", "no_dp")


def _mb(nbytes) -> str:
    """Megabytes as a learner reads them: 4 significant digits, and no 1.033e+04."""
    mb = nbytes / 1e6
    return f"{mb:,.0f}" if mb >= 1000 else f"{mb:.4g}"


def _hint(problem, got, best) -> str:
    """Name the mistakes (common slips) that give exactly the learner's pick."""
    slips = {"ignore_memory": "\nThat is the fastest layout if memory did not matter: check each layout's "
                              "model state + activations against the budget first.",
             "no_bubble": "\nThat is the pick without the pipeline's bubble: with pp stages each rank "
                          "waits (pp - 1) micro-batch times while the pipeline fills and drains.",
             "tp_once": "\nThat is the pick with one all-reduce per block and direction: a block has two "
                        "(after attention, after the MLP) forward and two backward.",
             "no_dp": "\nThat is the pick without the gradient all-reduce over dp."}
    hits = [text for slip, text in slips.items() if got is not None and _slipped(problem, slip) == got != best]
    return ("\nOne of these slips gives your pick:" if len(hits) > 1 else "") + "".join(hits)


def _ring(p, n, alpha, beta):
    return 0.0 if p == 1 else 2 * (p - 1) * alpha + 2 * (p - 1) / p * n * beta


def estimate(problem, slip=None):
    """The learner's model (the reference solution's formulas), with one slip if asked:
    [(seconds, bytes per rank)] for each layout."""
    a, b, out = problem["alpha"], problem["beta"], []
    for L in problem["layouts"]:
        dp, tp, pp, m = L["dp"], L["tp"], L["pp"], L["m"]
        mb, blocks = problem["batch"] // (dp * m), problem["layers"] // pp
        per_tp = 1 if slip == "tp_once" else 2
        comm = per_tp * blocks * _ring(tp, mb * problem["act_bytes"], a, b)
        f = blocks * problem["t_f"] * mb / tp + comm
        bw = blocks * problem["t_b"] * mb / tp + comm
        fill = 0 if slip == "no_bubble" else pp - 1
        pipe = (m + fill) * (f + bw) + 2 * (pp - 1) * (a + b * mb * problem["act_bytes"])
        grads = blocks * problem["block_bytes"] / tp
        dp_time = 0.0 if slip == "no_dp" else _ring(dp, grads, a, b)
        memory = 4 * grads + min(m, pp) * mb * blocks * problem["saved"][tp]
        out.append((pipe + dp_time, memory))
    return out


def _slipped(problem, slip):
    est = estimate(problem, slip)
    fits = [(t, i) for i, (t, mem) in enumerate(est) if slip == "ignore_memory" or mem <= problem["budget"]]
    return min(fits)[1] if fits else None
