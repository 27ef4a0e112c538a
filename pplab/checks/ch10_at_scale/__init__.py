"""The checkers of chapter 10's exercises (notebooks 10_at_scale, 10c_zero_plus_plus and 10d_placing_layouts): one module per exercise,
named by its id (exercises/NNx_<id>.ipynb), and its rank-side jobs in <id>_rank.py.

Imported in the order the chapter links them: the course's order (`pplab grade`'s CSV columns)."""
from importlib import import_module

ORDER = ("find_layout", "quantised_gather", "place_layout")

for _exercise in ORDER:
    import_module(f"{__name__}.{_exercise}")
