# Chapter 11c's library: packed documents (the work per rank, the best split), the document mask in ring
# attention, Llama 3's all-gather attention and the bytes formulas; each caught by tests/test_long_context.py.
# Run (November 2026): 7 / 7 caught by an assertion (the unmasked padding first survived: every case had a
# document mask, which hid the padding too; a case without documents was added).
# Run with tools/mutate.py's names in scope (see tools/mutants/README.md).

LONG = T("test_long_context")

MUTANTS += [
    Mutant("pplab/sequence_parallel/packed.py", "work += _tri(y - s) - _tri(x - s) if causal else (y - x) * n",
           "work += _tri(y - s) - _tri(x - s) if causal else (y - x) * (n - 1)", LONG,
           "range work: a bidirectional query does not see itself"),
    Mutant("pplab/sequence_parallel/packed.py", "            if work + c > bound:", "            if work + c >= bound:",
           LONG, "doc_split: a range stops short of the bound"),
    Mutant("pplab/sequence_parallel/ring_attention.py", "out.append((x, y, sum(s <= x for s in starts), offset))",
           "out.append((x, y, sum(s < x for s in starts), offset))", LONG,
           "ring attention: a piece starting a document counted in the one before"),
    Mutant("pplab/sequence_parallel/ring_attention.py", "if qdoc == kdoc and (not causal or ka < qb):",
           "if not causal or ka < qb:", LONG, "ring attention: the document mask dropped"),
    Mutant("pplab/sequence_parallel/allgather_cp.py", "visible = (key_pos >= 0)[None, :].expand(len(q_pos), -1)",
           "visible = (key_pos >= -1)[None, :].expand(len(q_pos), -1)", LONG,
           "all-gather attention: the padding rows are not masked"),
    Mutant("pplab/sequence_parallel/allgather_cp.py", "        return mine[..., :n, :], None, None",
           "        return grad[me][..., :n, :], None, None", LONG,
           "all-gather attention: the K/V gradient not summed over the ranks"),
    Mutant("pplab/sequence_parallel/allgather_cp.py", "    right = n[(rank + 1) % p]", "    right = n[(rank - 1) % p]",
           LONG, "bytes formula: the ring's last block taken from the left neighbour"),
]
