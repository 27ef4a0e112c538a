"""Chapter 1's checkers (notebooks 01_collectives): <id>.py, and <id>_rank.py for its sealed ranks;
ring_checks: what they share."""

ORDER = ("reduce_scatter", "ring_all_reduce", "predict_time")   # as the notebooks link them: the course's order
