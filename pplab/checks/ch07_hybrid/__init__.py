"""The checkers of chapter 7's exercises (notebooks 07_hybrid): one module per exercise,
named by its id (exercises/NNx_<id>.ipynb), and its rank-side jobs in <id>_rank.py; layout_costs.py, refuse_planner_rank.py:
what several of them share.

Imported in the order the chapter links them: the course's order (`pplab grade`'s CSV columns)."""
from importlib import import_module

ORDER = ("mesh_groups", "pick_layout", "design_layout", "pp_dp_train_step")

for _exercise in ORDER:
    import_module(f"{__name__}.{_exercise}")
