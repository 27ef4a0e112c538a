"""The checkers of chapter 8's exercises (notebooks 08_expert_parallel): one module per exercise,
named by its id (exercises/NNx_<id>.ipynb), and its rank-side jobs in <id>_rank.py.

Imported in the order the chapter links them: the course's order (`pplab grade`'s CSV columns)."""
from importlib import import_module

ORDER = ("moe_dispatch", "moe_bytes")

for _exercise in ORDER:
    import_module(f"{__name__}.{_exercise}")
