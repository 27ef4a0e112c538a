"""Chapter 6's checkers (notebooks 06_zero): <id>.py, and <id>_rank.py for its sealed ranks; fsdp_reference,
tolerance: what they share."""

# as the notebooks link them: the course's order
ORDER = ("zero1_step", "zero_bytes", "stage3_unit", "sharded_optimizer", "fsdp")
