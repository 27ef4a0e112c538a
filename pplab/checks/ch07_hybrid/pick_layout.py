"""Check of exercise pick_layout (exercises/07_pick_layout.ipynb): Pick the fastest layout that fits, from α, β, layer times and memory.

    pick_layout    pick_layout(problem) -> index (0, 1, 2) of the fastest layout that fits, or None
"""
from __future__ import annotations

import random

from .. import sealed
from ..core import Fail, exercise, problems_showing, require_function
from .layout_costs import SLIPS, _hint, _mb, _problem, _slipped
from .refuse_planner_rank import _refuse_planner


def _answer(preds, budget):
    """The planner's pick, or None; and whether the problem is clear-cut (see the module's docstring)."""
    if any(abs(p.memory["total"] - budget) < 0.1 * budget for p in preds):
        return None, False
    fits = sorted((p.time["total"], i) for i, p in enumerate(preds) if p.memory["total"] <= budget)
    if not fits:
        return None, True
    clear = len(fits) == 1 or fits[1][0] >= 1.25 * fits[0][0]
    return fits[0][1], clear


def problems(seed: int, count: int = 16):
    """`count` clear-cut problems, (learner's dict, planner's predictions, budget, right answer),
    among them for each common slip (SLIPS) at least one that the slip gets wrong."""
    rng = random.Random(seed)

    def draw(_):
        problem, preds, budget = _problem(rng)
        best, clear = _answer(preds, budget)
        if not clear or _slipped(problem, None) != best:    # the learner's formulas must be able to get it right
            return None
        return problem, preds, budget, best

    def slips_wrong(case):
        problem, _, _, best = case
        return {slip for slip in SLIPS if _slipped(problem, slip) != best}
    return problems_showing(draw, slips_wrong, SLIPS, count)


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
