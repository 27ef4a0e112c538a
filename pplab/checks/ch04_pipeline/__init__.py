"""The checkers of chapter 4's exercises (notebooks 04_pipeline): one module per exercise,
named by its id (exercises/NNx_<id>.ipynb), and its rank-side jobs in <id>_rank.py; schedule_cases.py:
what several of them share.

Imported in the order the chapter links them: the course's order (`pplab grade`'s CSV columns)."""
from importlib import import_module

ORDER = ("gpipe_order", "one_f_one_b_order", "bubble_fraction", "pipeline_executor", "zero_bubble")

for _exercise in ORDER:
    import_module(f"{__name__}.{_exercise}")
