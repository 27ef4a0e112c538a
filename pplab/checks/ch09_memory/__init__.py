"""The checkers of chapter 9's exercises (notebooks 09a_recomputation, 09b_mixed_precision and 09c_clipping_and_rng): one module per exercise,
named by its id (exercises/NNx_<id>.ipynb), and its rank-side jobs in <id>_rank.py.

Imported in the order the chapter links them: the course's order (`pplab grade`'s CSV columns)."""
from importlib import import_module

ORDER = ("checkpointed_block", "loss_scaler", "clip_sharded")

for _exercise in ORDER:
    import_module(f"{__name__}.{_exercise}")
