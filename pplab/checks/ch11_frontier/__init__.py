"""Chapter 11's checkers (notebooks 11a_overlap_measured, 11b_fp8, 11c_long_context and
11d_experts_at_scale): <id>.py, and <id>_rank.py for its sealed ranks."""

ORDER = ("overlapped_step", "fp8_blocks", "doc_split", "node_limited_routing")   # as the notebooks link them: the course's order
