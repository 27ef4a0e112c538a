"""Chapter 2's checkers (notebooks 02_data_parallel): <id>.py, and <id>_rank.py for its sealed ranks."""

ORDER = ("ddp_buckets", "topk_error_feedback", "ddp_from_scratch")   # as the notebooks link them: the course's order
