"""Check of chapter 7's exercise (b): which of three layouts is fastest among those that fit.

    pick_layout    pick_layout(problem) -> index (0, 1, 2) of the fastest layout that fits, or None
    design_layout  design_layout(problem) -> {"dp", "tp", "pp", "m"}: a layout of the problem's world
                   size, scored 0 to 3 by how close its step time comes to the fastest that fits

No ranks: each problem is a random model, batch, α, β, per-block times and memory, and three
random dp × tp × pp (× m micro-batches, 1F1B) layouts of 4 or 8 ranks. The right answer is
pplab.planner's: `plan`'s step time and memory of each layout (chapter 4's simulator for the
pipeline, ring collectives from the α-β model, chapter 6's memory for fp32 Adam without ZeRO).
The learner's formulas leave out what is small (the embedding and the head); problems are
drawn only where that cannot change the answer: the fastest layout that fits is at least 25%
faster than the next, and no layout's memory is within 10% of the budget.
"""
from __future__ import annotations

import random

from . import sealed
from .planner_rank import _refuse_planner
from .core import Fail, Scored, exercise, require_function


def _problem(rng, choices: int | None = 3):
    """One random problem: the learner's dict, and the planner's inputs that say the same.
    choices: how many of the valid layouts the problem offers (None: every one)."""
    from .. import costfit, planner
    from ..models.gpt import GPTConfig
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


def _answer(preds, budget):
    """The planner's pick, or None; and whether the problem is clear-cut (see the module's docstring)."""
    if any(abs(p.memory["total"] - budget) < 0.1 * budget for p in preds):
        return None, False
    fits = sorted((p.time["total"], i) for i, p in enumerate(preds) if p.memory["total"] <= budget)
    if not fits:
        return None, True
    clear = len(fits) == 1 or fits[1][0] >= 1.25 * fits[0][0]
    return fits[0][1], clear


SLIPS = ("ignore_memory", "no_bubble", "tp_once", "no_dp")


def problems(seed: int, count: int = 16):
    """`count` clear-cut problems, (learner's dict, planner's predictions, budget, right answer),
    among them for each common slip (SLIPS) at least one that the slip gets wrong."""
    rng, out, caught = random.Random(seed), [], set()
    while len(out) < count or caught != set(SLIPS):
        problem, preds, budget = _problem(rng)
        best, clear = _answer(preds, budget)
        if not clear or _slipped(problem, None) != best:    # the learner's formulas must be able to get it right
            continue
        wrong = {slip for slip in SLIPS if _slipped(problem, slip) != best}
        if len(out) < count - len(set(SLIPS) - caught) or wrong - caught:   # room kept for the slips not yet caught
            out.append((problem, preds, budget, best))
            caught |= wrong
    return out


def _mb(nbytes) -> str:
    """Megabytes as a learner reads them: 4 significant digits, and no 1.033e+04."""
    mb = nbytes / 1e6
    return f"{mb:,.0f}" if mb >= 1000 else f"{mb:.4g}"


def _describe(problem, preds, budget) -> str:
    rows = []
    for i, (L, p) in enumerate(zip(problem["layouts"], preds)):
        fits = "fits" if p.memory["total"] <= budget else "does NOT fit"
        t = p.time
        rows.append(f"  {i}: dp={L['dp']} tp={L['tp']} pp={L['pp']} m={L['m']}: {t['total'] * 1e3:.3g} ms "
                    f"(compute {t['compute'] * 1e3:.3g}, tp {t['tp'] * 1e3:.3g}, bubble {t['bubble'] * 1e3:.3g}, "
                    f"sends {t['pp_send'] * 1e3:.3g}, dp {t['dp'] * 1e3:.3g}), "
                    f"{_mb(p.memory['total'])} MB per rank, {fits}")
    return "\n".join(rows)


@exercise("pick_layout", "Pick the fastest layout that fits, from α, β, layer times and memory",
          answer="pick_layout", notebook="07_pick_layout", sealed=True,
          preload=('pplab.planner',))
def check_pick_layout(fn, seed: int, timeout: float) -> str:
    """pick_layout(problem) -> the index of the fastest of problem['layouts'] that fits, or None."""
    cases = problems(seed)
    require_function(fn, "pick_layout", "problem", cases[0][0])
    outs = sealed.call_each(fn, [(dict(problem),) for problem, *_ in cases], where=lambda k: f"problem {k}: ",
                            timeout=timeout, probe=_refuse_planner)
    for k, ((problem, preds, budget, best), got) in enumerate(zip(cases, outs)):
        if got != best or isinstance(got, bool):
            said = "None (nothing fits)" if best is None else f"{best}"
            raise Fail(f"problem {k}: you picked {got!r}, the planner picks {said}. The planner's numbers, "
                       f"budget {_mb(budget)} MB per rank:\n{_describe(problem, preds, budget)}"
                       f"{_hint(problem, got, best)}")
    nothing = sum(best is None for *_, best in cases)
    return f"on {len(cases)} random problems (4 and 8 ranks; {nothing} where no layout fits)"


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


# ----------------------------------------------------------------------------------
# Exercise "design_layout": every valid layout offered, the answer scored on how fast it is

DESIGN_POINTS = 3


def design_problems(seed: int, count: int = 8):
    """`count` problems offering every valid layout of 4 or 8 ranks, each with (learner's dict,
    planner's predictions, budget), drawn where the learner's formulas (`estimate`, which leave
    out the embedding and the head) can reach the planner's fastest fitting layout within 5%,
    and where each common slip (SLIPS) costs points in at least one problem."""
    rng, out, caught = random.Random(seed), [], set()
    while len(out) < count or caught != set(SLIPS):
        problem, preds, budget = _problem(rng, choices=None)
        fits = [p.time["total"] for p in preds if p.memory["total"] <= budget]
        mine = _slipped(problem, None)
        if not fits or mine is None or preds[mine].memory["total"] > 0.9 * budget \
                or preds[mine].time["total"] > 1.05 * min(fits):
            continue
        costly = {slip for slip in SLIPS if _design_points(preds, budget, _slipped(problem, slip))[0] < 3}
        if len(out) < count - len(set(SLIPS) - caught) or costly - caught:   # each slip costs points somewhere
            out.append((problem, preds, budget))
            caught |= costly
    return out


def _design_points(preds, budget, got) -> tuple[int, str]:
    """Points for picking layout `got` (an index), and why."""
    fits = [p.time["total"] for p in preds if p.memory["total"] <= budget]
    best = min(fits)
    if isinstance(got, bool) or not isinstance(got, int) or not 0 <= got < len(preds):
        return 0, "not a layout"
    p = preds[got]
    if p.memory["total"] > budget:
        return 0, (f"dp={p.layout.dp}, tp={p.layout.tp}, pp={p.layout.pp}, m={p.layout.m} needs "
                   f"{_mb(p.memory['total'])} MB per rank, over the budget of {_mb(budget)} MB")
    ratio = p.time["total"] / best
    points = 3 if ratio <= 1.05 else 2 if ratio <= 1.25 else 1
    L = preds[got].layout
    return points, f"dp={L.dp}, tp={L.tp}, pp={L.pp}, m={L.m} fits and takes {ratio:.2f}× the fastest that fits"


def _learner_view(problem) -> dict:
    """What design_layout gets: the problem without the list of layouts, with what makes one valid."""
    view = {k: v for k, v in problem.items() if k != "layouts"}
    first = problem["layouts"][0]
    view.update(world=first["dp"] * first["tp"] * first["pp"], heads=8)
    return view


def _which(problem, got):
    """(index of the layout the answer names, or None; why it is not a valid layout, or None)."""
    if not isinstance(got, dict) or not all(isinstance(got.get(k), int) and not isinstance(got.get(k), bool)
                                            for k in ("dp", "tp", "pp", "m")):
        return None, f"{got!r} is not a layout: return a dict with whole numbers dp, tp, pp and m"
    key = (got["dp"], got["tp"], got["pp"], got["m"])
    for i, L in enumerate(problem["layouts"]):
        if (L["dp"], L["tp"], L["pp"], L["m"]) == key:
            return i, None
    view, (dp, tp, pp, m) = _learner_view(problem), key
    why = (f"dp·tp·pp = {dp * tp * pp}, not the {view['world']} ranks" if dp * tp * pp != view["world"] else
           f"tp={tp} does not divide the 8 heads" if tp < 1 or 8 % tp else
           "without a pipeline (pp = 1) m is 1" if pp == 1 and m != 1 else
           f"1F1B needs at least as many micro-batches as stages: m={m}, pp={pp}" if pp > 1 and m < pp else
           f"the batch of {view['batch']} does not split into dp·m = {dp * m} equal micro-batches"
           if view["batch"] % (dp * m) else f"pp={pp} stages for {view['layers'] + 2} pipeline layers")
    return None, f"dp={dp}, tp={tp}, pp={pp}, m={m} is not a valid layout: {why}"


@exercise("design_layout", "Design the fastest layout that fits, among every valid one (scored)",
          answer="design_layout", notebook="07_design_layout", sealed=True, points=DESIGN_POINTS,
          preload=('pplab.planner',))
def check_design_layout(fn, seed: int, timeout: float):
    """design_layout(problem) -> a layout {"dp", "tp", "pp", "m"}: 3 points within 5% of
    the planner's fastest layout that fits, 2 within 25%, 1 for any that fits, 0 for one that does
    not; the score is the mean over the problems."""
    cases = design_problems(seed)
    require_function(fn, "design_layout", "problem", _learner_view(cases[0][0]))
    outs = sealed.call_each(fn, [(_learner_view(problem),) for problem, *_ in cases], where=lambda k: f"problem {k}: ",
                            timeout=timeout, probe=_refuse_planner)
    picks = [_which(problem, got) for (problem, *_), got in zip(cases, outs)]
    scored = [(0, why, k) if why else _design_points(preds, budget, i) + (k,)
              for k, ((_, preds, budget), (i, why)) in enumerate(zip(cases, picks))]
    earned = round(sum(points for points, _, _ in scored) / len(scored), 2)
    worst = min(scored)
    sizes = sorted({len(problem["layouts"]) for problem, *_ in cases})
    summary = (f"on {len(cases)} random problems of 4 and 8 ranks ({sizes[0]} to {sizes[-1]} valid layouts each): "
               f"{sum(p == 3 for p, _, _ in scored)} within 5% of the fastest layout that fits, "
               f"{sum(p == 2 for p, _, _ in scored)} within 25%, {sum(p == 1 for p, _, _ in scored)} slower, "
               f"{sum(p == 0 for p, _, _ in scored)} not fitting or not a layout; mean {earned:g} points")
    if worst[0] < 3:
        points, why, k = worst
        problem, preds, budget = cases[k]
        summary += f". Your weakest: problem {k}, {why}.{_hint(problem, picks[k][0], _slipped(problem, None))}"
    if worst[0] == 0:
        raise Fail(summary, earned=earned)
    return Scored(summary, earned)
