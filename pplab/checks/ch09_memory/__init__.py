"""Chapter 9's checkers (notebooks 09a_recomputation, 09b_mixed_precision and 09c_clipping_and_rng): <id>.py,
and <id>_rank.py for its sealed ranks."""

ORDER = ("checkpointed_block", "loss_scaler", "clip_sharded")   # as the notebooks link them: the course's order
