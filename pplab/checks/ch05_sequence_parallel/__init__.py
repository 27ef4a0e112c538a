"""Chapter 5's checkers (notebooks 05_sequence_parallel): <id>.py, and <id>_rank.py for its sealed ranks;
tolerance: what they share."""

# as the notebooks link them: the course's order
ORDER = ("online_softmax_merge", "ulysses_all_to_all", "ring_attention_step", "megatron_sp_block", "ring_attention")
