"""The checkers of chapter 1's exercises (notebooks 01_collectives): one module per exercise,
named by its id (exercises/NNx_<id>.ipynb), and its rank-side jobs in <id>_rank.py; ring_checks.py:
what several of them share.

Imported in the order the chapter links them: the course's order (`pplab grade`'s CSV columns)."""
from importlib import import_module

ORDER = ("reduce_scatter", "ring_all_reduce", "predict_time")

for _exercise in ORDER:
    import_module(f"{__name__}.{_exercise}")
