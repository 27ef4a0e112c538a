"""Wrong answers to chapter 7's exercise (b), pick_layout, each with what its message must say.

Each is the reference formulas (pplab.checks.ch07_hybrid.layout_costs.estimate) with one plausible slip; the
checker's problems include, for every seed, one that each slip gets wrong.
"""
from pplab.checks.ch07_hybrid.layout_costs import estimate


def _pick(problem, slip=None, check_memory=True):
    est = estimate(problem, slip)
    fits = [(t, i) for i, (t, mem) in enumerate(est) if not check_memory or mem <= problem["budget"]]
    return min(fits)[1] if fits else None


def pick_ignores_memory(problem):
    return _pick(problem, check_memory=False)


def pick_ignores_bubble(problem):
    return _pick(problem, "no_bubble")


def pick_counts_tp_all_reduces_once(problem):
    return _pick(problem, "tp_once")


def pick_ignores_dp_sync(problem):
    return _pick(problem, "no_dp")


def pick_fewest_ranks_talking(problem):
    """A rule of thumb instead of a model: the layout with the most data parallelism."""
    return max(range(3), key=lambda i: problem["layouts"][i]["dp"])


def pick_returns_the_layout(problem):
    i = _pick(problem)
    return None if i is None else problem["layouts"][i]


def pick_with_the_planner(problem):
    import pplab
    return pplab.planner.predict


PROBLEM = r"^problem \d+: you picked "
WRONG = {
    "pick_layout": [
        (pick_ignores_memory, [PROBLEM, r"does NOT fit", r"check each layout's model state \+ activations"], None),
        (pick_ignores_bubble, [PROBLEM, r"the pick without the pipeline's bubble"], None),
        (pick_counts_tp_all_reduces_once, [PROBLEM, r"one all-reduce per block and direction"], None),
        (pick_ignores_dp_sync, [PROBLEM, r"the pick without the gradient all-reduce over dp"], None),
        (pick_fewest_ranks_talking, [PROBLEM], None),
        (pick_returns_the_layout, [PROBLEM + r"\{'dp'"], None),
        (pick_with_the_planner, [r"pplab\.planner"], None),
    ],
}
