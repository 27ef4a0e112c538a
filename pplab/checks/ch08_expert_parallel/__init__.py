"""Chapter 8's checkers (notebooks 08_expert_parallel): <id>.py, and <id>_rank.py for its sealed ranks."""

ORDER = ("moe_dispatch", "moe_bytes")   # as the notebooks link them: the course's order
