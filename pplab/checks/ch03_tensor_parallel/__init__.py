"""Chapter 3's checkers (notebooks 03_tensor_parallel and 03b_tensor_parallel_2_5d_3d): <id>.py, and
<id>_rank.py for its sealed ranks; tp_groups_rank, tp_trials: what they share."""

# as the notebooks link them: the course's order
ORDER = ("f_g", "row_parallel_linear", "vocab_parallel_ce", "linear_traffic", "linear_3d")
