"""Wrong answers to chapter 10's exercise, find_layout (memory_per_gpu), each with what its message
must say: the reference formulas with one plausible slip each."""
from pplab.checks.ch10_at_scale.find_layout import reference


def memory_ignores_zero(problem):
    return sum(reference(problem, "no_zero"))


def memory_holds_every_microbatch(problem):
    return sum(reference(problem, "gpipe_memory"))


def memory_keeps_scores_when_selective(problem):
    return sum(reference(problem, "selective_keeps_scores"))


def memory_forgets_embedding(problem):
    return sum(reference(problem, "no_embedding"))


def memory_holds_pp_microbatches(problem):
    return sum(reference(problem, "pp_in_flight"))


def memory_zero2_shards_parameters(problem):
    return sum(reference(problem, "zero2_shards_parameters"))


def memory_scores_not_split_by_tp(problem):
    return sum(reference(problem, "scores_not_split"))


def memory_full_input_not_split_by_tp(problem):
    return sum(reference(problem, "full_input_not_split"))


def memory_in_gigabytes(problem):
    return sum(reference(problem)) / 1e9


def memory_off_by_a_tenth_of_a_percent(problem):
    return sum(reference(problem)) * 1.001


def memory_says_yes(problem):
    return True


PROBLEM = r"^problem \d+: you said "
WRONG = {
    "find_layout": [
        (memory_ignores_zero, [PROBLEM, r"shards over the dp"], None),
        (memory_holds_every_microbatch, [PROBLEM, r"min\(pp, m\)"], None),
        (memory_keeps_scores_when_selective, [PROBLEM, r"drops the 5·a·s/h term"], None),
        (memory_forgets_embedding, [PROBLEM, r"embedding"], None),
        (memory_holds_pp_microbatches, [PROBLEM, r"cannot hold more micro-batches"], None),
        (memory_zero2_shards_parameters, [PROBLEM, r"only ZeRO-3 shards them"], None),
        (memory_scores_not_split_by_tp, [PROBLEM, r"divided by tp too"], None),
        (memory_full_input_not_split_by_tp, [PROBLEM, r"s/tp slice of the layer's input"], None),
        (memory_in_gigabytes, [PROBLEM, r"return bytes, not GB"], None),
        (memory_off_by_a_tenth_of_a_percent, [PROBLEM], None),
        (memory_says_yes, [r"must return a number of bytes, got True"], None),
    ],
}
