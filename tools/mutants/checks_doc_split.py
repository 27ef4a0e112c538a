# The loosenings of chapter 11c's checker (doc_split): a world size dropped from the judging, rank 0's
# range read only, the exact comparison widened (integers: no tolerance, so the classic bound for the
# best, total/p + the largest token's work, stands in for "widened"), and the blind spot of the
# concept, a token's work. Each is caught by a near-miss wrong answer in
# tests/wrong_solutions_ch11_doc_split.py (named after each). Checked by hand in a copy of the tree
# (November 2026): 4 / 4 caught; the first "widened" mutant tried, 1% of slack, survived (the small
# problems still caught the near miss) and gave way to the bound, which a checker might well use.
# Run with tools/mutate.py's names in scope (see tools/mutants/README.md).

DOCSPLIT = CHK("doc_split", "cuts_rounded or skips_a_token or inclusive_stops or just_short or forgets_itself "
                            "or resets_late or balances_tokens")

MUTANTS += [
    Mutant("pplab/checks/ch11_frontier/doc_split.py", "    for k, ((docs, p), got) in enumerate(zip(cases, outs)):",
           "    for k, ((docs, p), got) in [c for c in enumerate(zip(cases, outs)) if c[1][0][1] == 2]:",
           DOCSPLIT, "doc_split check: only the p = 2 problems judged (cuts_rounded_alone)"),
    Mutant("pplab/checks/ch11_frontier/doc_split.py", "    for r, (a, b) in enumerate(ranges):",
           "    for r, (a, b) in enumerate(ranges[:1]):", DOCSPLIT,
           "doc_split check: rank 0's range read only (skips_a_token_before_the_last_rank, inclusive_stops)"),
    Mutant("pplab/checks/ch11_frontier/doc_split.py", "        if max(work) != best:", "        if max(work) > sum(c) / p + max(c):",
           DOCSPLIT, "doc_split check: a bound (total/p + the largest token's work) for the best (just_short_of_the_best)"),
    Mutant("pplab/checks/ch11_frontier/doc_split.py", "                out.append(t)  # the t-th token of its document sees t keys", "                out.append(t - 1)",
           DOCSPLIT, "doc_split check: a token's work counted without itself (forgets_itself)"),
]
