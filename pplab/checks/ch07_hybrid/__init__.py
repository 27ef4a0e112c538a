"""Chapter 7's checkers (notebooks 07_hybrid): <id>.py, and <id>_rank.py for its sealed ranks; layout_costs,
refuse_planner_rank: what they share."""

# as the notebooks link them: the course's order
ORDER = ("mesh_groups", "pick_layout", "design_layout", "pp_dp_train_step")
