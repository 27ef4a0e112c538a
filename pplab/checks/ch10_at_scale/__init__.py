"""Chapter 10's checkers (notebooks 10_at_scale, 10c_zero_plus_plus and 10d_placing_layouts): <id>.py, and
<id>_rank.py for its sealed ranks."""

ORDER = ("find_layout", "quantised_gather", "place_layout")   # as the notebooks link them: the course's order
