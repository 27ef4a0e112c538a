# The loosenings of chapter 11a's checker (overlapped_step): rank 0 only (gradients, and the overlap's
# best trial), the tolerance widened 100 times, and the blind spots: a send waited for at once (the
# threshold dropped), F1 run before B0. The world size cannot be dropped: the exercise runs on 2 ranks
# only. Each is caught by a wrong answer in tests/wrong_solutions_ch11_overlapped_step.py (named after each).
# Run with tools/mutate.py's names in scope (see tools/mutants/README.md).

OVERLAP = CHK("overlapped_step", "sequential or waits_early or swaps or activations_in or activation_under "
                                 "or blocking_gradient")

MUTANTS += [
    Mutant("pplab/checks/ch11_frontier/overlapped_step.py", "for rank in (0, 1):                                  # every rank, both chunks",
           "for rank in (0,):                                  # every rank, both chunks", OVERLAP,
           "overlapped step check: rank 0's gradients only (swaps_on_rank_1)"),
    Mutant("pplab/checks/ch11_frontier/overlapped_step.py", "for rank in (0, 1):                                  # every rank's best trial",
           "for rank in (0,):                                  # every rank's best trial", OVERLAP,
           "overlapped step check: rank 0's overlap only (waits_early_on_rank_1)"),
    Mutant("pplab/checks/ch11_frontier/overlapped_step.py", "torch.allclose(g, w, rtol=1e-4, atol=1e-6)",
           "torch.allclose(g, w, rtol=1e-2, atol=1e-4)", OVERLAP,
           "overlapped step check: tolerance 1e-4 widened 100 times (activations_in_float16)"),
    Mutant("pplab/checks/ch11_frontier/overlapped_step.py", "THRESHOLD = 0.3", "THRESHOLD = 0.0", OVERLAP,
           "overlapped step check: any fraction hidden passes, none included (sequential, blocking_gradient_send)"),
    Mutant("pplab/checks/ch11_frontier/overlapped_step.py", "if end < start:", "if False:", OVERLAP,
           "overlapped step check: F1 before B0 not named (activation_under_backward)"),
]
