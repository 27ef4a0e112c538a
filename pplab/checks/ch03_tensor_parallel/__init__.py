"""The checkers of chapter 3's exercises (notebooks 03_tensor_parallel and 03b_tensor_parallel_2_5d_3d): one module per exercise,
named by its id (exercises/NNx_<id>.ipynb), and its rank-side jobs in <id>_rank.py; tp_groups_rank.py, tp_trials.py:
what several of them share.

Imported in the order the chapter links them: the course's order (`pplab grade`'s CSV columns)."""
from importlib import import_module

ORDER = ("f_g", "row_parallel_linear", "vocab_parallel_ce", "linear_traffic", "linear_3d")

for _exercise in ORDER:
    import_module(f"{__name__}.{_exercise}")
