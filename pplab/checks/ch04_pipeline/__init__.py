"""Chapter 4's checkers (notebooks 04_pipeline): <id>.py, and <id>_rank.py for its sealed ranks;
schedule_cases, schedules_refused_rank: what they share."""

# as the notebooks link them: the course's order
ORDER = ("gpipe_order", "one_f_one_b_order", "bubble_fraction", "pipeline_executor", "zero_bubble")
