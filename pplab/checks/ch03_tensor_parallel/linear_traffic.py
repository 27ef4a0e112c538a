"""Check of exercise linear_traffic (exercises/03_linear_traffic.ipynb): The lecture's table: what each strategy sends for one Linear layer.

    linear_traffic        linear_traffic(strategy, B, c_in, c_out) -> numbers sent per step
"""
from __future__ import annotations

import random

from .. import sealed
from ..core import Fail, check_number, exercise, require_function


_STRATEGIES = ("data parallel", "column", "row")


def _traffic(strategy, B, c_in, c_out):
    """The table of CMU 15-418's lecture 25 (model and pipeline parallelism), in numbers per step; an all-reduce of N counts 2N."""
    return {"data parallel": 2 * c_out * c_in, "column": 2 * B * c_in, "row": 2 * B * c_out}[strategy]


_TRAFFIC_MISTAKES = [      # (what a wrong answer computes, the hint)
    (lambda s, B, i, o: _traffic(s, B, i, o) // 2,
     "That is the size of the tensor that is all-reduced; the table counts an all-reduce of N numbers as 2N (a "
     "reduce and a broadcast), and the column split moves B·C_in forward and again backward."),
    (lambda s, B, i, o: {"data parallel": 2 * B * i * o, "column": 2 * B * i, "row": 2 * B * o}[s],
     "Data parallelism synchronises the weight gradient, C_out x C_in numbers, whatever the batch."),
    (lambda s, B, i, o: {"data parallel": 2 * o * i, "column": 2 * B * o, "row": 2 * B * i}[s],
     "Column and row are swapped: the column split (each rank computes some outputs) needs all of X, B x C_in, "
     "and its gradient; the row split (each rank a partial sum of the output) all-reduces B x C_out."),
]


def _hints_apart(strategy, B, c_in, c_out) -> bool:
    """The mistakes that give a wrong number here give different wrong numbers."""
    want = _traffic(strategy, B, c_in, c_out)
    wrong = [w(strategy, B, c_in, c_out) for w, _ in _TRAFFIC_MISTAKES]
    wrong = [v for v in wrong if v != want]
    return len(set(wrong)) == len(wrong)


@exercise("linear_traffic", "The lecture's table: what each strategy sends for one Linear layer",
          answer="linear_traffic", notebook="03_linear_traffic", sealed=True)
def check_linear_traffic(fn, seed: int, timeout: float) -> str:
    require_function(fn, "linear_traffic", "strategy, B, c_in, c_out", "row", 1, 1, 1)
    rng = random.Random(seed)
    shapes = []
    while len(shapes) < 3:                                    # shapes on which every mistake has its own number,
        shape = (rng.randint(1, 64), rng.randint(1, 64) * 16, rng.randint(1, 64) * 8)    # so its hint is the right one
        if all(_hints_apart(st, *shape) for st in _STRATEGIES):
            shapes.append(shape)
    shapes.append((4096, 64, 48))                             # a big batch: data parallelism wins
    cases = [(strategy, B, c_in, c_out) for B, c_in, c_out in shapes for strategy in _STRATEGIES]

    def where_of(strategy, B, c_in, c_out):
        return f"B={B}, C_in={c_in}, C_out={c_out}, strategy {strategy!r}: "
    outs = sealed.call_each(fn, cases, where=lambda i: where_of(*cases[i]), timeout=timeout)
    for (strategy, B, c_in, c_out), got in zip(cases, outs):
        where = where_of(strategy, B, c_in, c_out)
        want = _traffic(strategy, B, c_in, c_out)
        try:
            check_number(got, want, what=f"{where}linear_traffic", rel_tol=1e-9, abs_tol=0.5)
        except Fail as failure:
            hint = next((h for wrong, h in _TRAFFIC_MISTAKES
                         if isinstance(got, (int, float)) and got == wrong(strategy, B, c_in, c_out) != want), "")
            raise Fail(f"{failure} {hint}".rstrip(), seed_matters=failure.seed_matters) from None
    return f"({len(shapes)} shapes x 3 strategies, each equal to the lecture's table (CMU 15-418, lecture 25: model and pipeline parallelism))"
