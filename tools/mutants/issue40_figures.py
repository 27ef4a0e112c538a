# swimlane.draw(nodes=): the node boundary and the messages between nodes (issue 40, 10b's figure)
MUTANTS += [
    Mutant("pplab/swimlane/lanes.py", "between = nodes is not None and s.rank // nodes != rv.rank // nodes",
           "between = nodes is not None and s.rank % nodes != rv.rank % nodes",
           T("test_swimlane", k="nodes"), "swimlane: ranks assigned to nodes round-robin, not node by node"),
    Mutant("pplab/swimlane/lanes.py", "for k in range(nodes, n, nodes):", "for k in range(nodes, n + 1, nodes):",
           T("test_swimlane", k="nodes"), "swimlane: a boundary drawn under the last node too"),
]

# flops_per_token(causal=True): the causal half (issue 40, 10a's 128k share)
MUTANTS += [
    Mutant("pplab/flops.py", "return six_n(cfg) + (6 if causal else 12) * cfg.layers * s * cfg.hidden",
           "return six_n(cfg) + (12 if causal else 12) * cfg.layers * s * cfg.hidden",
           T("test_flops", k="six_n"), "per token: the causal flag ignored, every score counted"),
]
