"""Wrong answers to chapter 10's exercise, find_layout (memory_per_gpu), each with what its message
must say: the reference formulas with one plausible slip each."""
from pplab.checks.at_scale import reference


def memory_ignores_zero(problem):
    return sum(reference(problem, "no_zero"))


def memory_holds_every_microbatch(problem):
    return sum(reference(problem, "gpipe_memory"))


def memory_keeps_scores_when_selective(problem):
    return sum(reference(problem, "selective_keeps_scores"))


def memory_forgets_embedding(problem):
    return sum(reference(problem, "no_embedding"))


def memory_in_gigabytes(problem):
    return sum(reference(problem)) / 1e9


PROBLEM = r"^problem \d+: you said "
WRONG = {
    "find_layout": [
        (memory_ignores_zero, [PROBLEM, r"shards over the dp"], None),
        (memory_holds_every_microbatch, [PROBLEM, r"min\(pp, m\)"], None),
        (memory_keeps_scores_when_selective, [PROBLEM, r"drops the 5·a·s/h term"], None),
        (memory_forgets_embedding, [PROBLEM, r"embedding"], None),
        (memory_in_gigabytes, [PROBLEM], None),
    ],
}
