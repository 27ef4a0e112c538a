"""The checkers of chapter 5's exercises (notebooks 05_sequence_parallel): one module per exercise,
named by its id (exercises/NNx_<id>.ipynb), and its rank-side jobs in <id>_rank.py; tolerance.py:
what several of them share.

Imported in the order the chapter links them: the course's order (`pplab grade`'s CSV columns)."""
from importlib import import_module

ORDER = ("online_softmax_merge", "ulysses_all_to_all", "ring_attention_step", "megatron_sp_block", "ring_attention")

for _exercise in ORDER:
    import_module(f"{__name__}.{_exercise}")
