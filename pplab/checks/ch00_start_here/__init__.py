"""The checkers of chapter 0's exercises (notebooks 00_start_here): one module per exercise,
named by its id (exercises/NNx_<id>.ipynb), and its rank-side jobs in <id>_rank.py.

Imported in the order the chapter links them: the course's order (`pplab grade`'s CSV columns)."""
from importlib import import_module

ORDER = ("broadcast",)

for _exercise in ORDER:
    import_module(f"{__name__}.{_exercise}")
