# Chapter 11a's library (pplab/overlap): the ring's chunk owner, the intersection of two unions, the
# routed output's weight, the pair's gradient. Each is caught by tests/test_overlap_measured.py.
# Run with tools/mutate.py's names in scope (see tools/mutants/README.md).

OVERLAP_TESTS = ("tests/test_overlap_measured.py",)

MUTANTS += [
    Mutant("pplab/overlap/async_tp.py", "owner = (me - k) % p", "owner = (me + k) % p", OVERLAP_TESTS,
           "collective matmul: the chunk held at step k taken as the next rank's, not the previous one's"),
    Mutant("pplab/overlap/hidden.py", "if a[i][1] < b[j][1]:", "if a[i][0] < b[j][0]:", OVERLAP_TESTS,
           "hidden time: the two unions walked by their starts, not their ends"),
    Mutant("pplab/overlap/hidden.py", "compute = [e for e in timeline.select(rank, \"compute\")]",
           "compute = [e for e in timeline.select(None, \"compute\")]", OVERLAP_TESTS,
           "hidden time: any rank's compute counted, not the rank's own"),
    Mutant("pplab/overlap/shared_expert.py", "return s + prob[:, None] * routed", "return s + routed", OVERLAP_TESTS,
           "MoE with a shared expert: the routed output not weighted by its probability"),
    Mutant("pplab/overlap/dualpipe_pair.py", "first.backward(0, my_g0)", "first.backward(0, my_g0 * 2)", OVERLAP_TESTS,
           "DualPipe's pair: micro-batch 0's gradient doubled on the first chunk"),
]
