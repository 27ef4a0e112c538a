"""Check of exercise design_layout (exercises/07_design_layout.ipynb): Design the fastest layout that fits, among every valid one (scored).

    design_layout  design_layout(problem) -> {"dp", "tp", "pp", "m"}: a layout of the problem's world
"""
from __future__ import annotations

import random

from .. import sealed
from ..core import Fail, Scored, exercise, require_function
from .layout_costs import SLIPS, _hint, _mb, _problem, _slipped
from .refuse_planner_rank import _refuse_planner


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
