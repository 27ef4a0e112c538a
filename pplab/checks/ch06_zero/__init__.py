"""The checkers of chapter 6's exercises (notebooks 06_zero): one module per exercise,
named by its id (exercises/NNx_<id>.ipynb), and its rank-side jobs in <id>_rank.py; fsdp_reference.py, tolerance.py:
what several of them share.

Imported in the order the chapter links them: the course's order (`pplab grade`'s CSV columns)."""
from importlib import import_module

ORDER = ("zero1_step", "zero_bytes", "stage3_unit", "sharded_optimizer", "fsdp")

for _exercise in ORDER:
    import_module(f"{__name__}.{_exercise}")
