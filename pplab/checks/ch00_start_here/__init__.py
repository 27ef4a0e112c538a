"""Chapter 0's checkers (notebooks 00_start_here): <id>.py, and <id>_rank.py for its sealed ranks."""

ORDER = ("broadcast",)   # as the notebooks link them: the course's order
