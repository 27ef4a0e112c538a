# Chapter 11d: pplab/experts_at_scale.py's routing, balancing, two-hop dispatch and byte formula, and the
# node_limited_routing checker's loosenings. The checker's answers are sets of whole numbers (no tolerance
# to widen) and it runs in one sealed rank (no world size, no rank 0): its analogues are a part's problems
# never tried (the ties) and only the first token of each problem judged.

EXPERTS = T("test_experts_at_scale")
ROUTING = CHK("node_limited_routing", "limits_ranks or nodes_by_their or equal_blocks or worst_node or higher_index "
                                      "or last_expert or plain_topk or first_tokens")

MUTANTS += [
    Mutant("pplab/experts_at_scale.py", "    per_node = math.ceil(k / max_nodes)", "    per_node = 1", EXPERTS,
           "node-limited routing: nodes ranked by their best score, not the sum of the top ceil(k/M)"),
    Mutant("pplab/experts_at_scale.py", "    return torch.sort(x, dim=-1, descending=True, stable=True).indices[..., :k]",
           "    return x.shape[-1] - 1 - torch.sort(x.flip(-1), dim=-1, descending=True, stable=True).indices[..., :k]",
           EXPERTS, "node-limited routing: ties to the higher index"),
    Mutant("pplab/experts_at_scale.py", "    return gamma * torch.sign(load.mean() - load)",
           "    return gamma * torch.sign(load - load.mean())", EXPERTS,
           "balancing bias: an overloaded expert's bias raised"),
    Mutant("pplab/experts_at_scale.py", "        self.remote_pairs = int((d != c.node_of(comm.rank())).sum())",
           "        self.remote_pairs = int((d != 0).sum())", EXPERTS, "two hops: the rows across counted from node 0"),
    Mutant("pplab/experts_at_scale.py", "    rows = pairs * (2 * hidden + num_experts // cluster.n_nodes) * element_size",
           "    rows = pairs * (2 * hidden + num_experts // cluster.world_size) * element_size", EXPERTS,
           "byte formula: the gates of a rank's experts, not the node's"),
    Mutant("pplab/experts_at_scale.py", "        order = torch.argsort(j, stable=True)",
           "        order = torch.arange(len(j))", EXPERTS, "hop 2: rows not grouped by their destination rank"),
    Mutant("pplab/checks/ch11_frontier/node_limited_routing.py", "    for part in PARTS:", "    for part in PARTS[:1]:", ROUTING,
           "node_limited_routing check: the ties part never tried"),
    Mutant("pplab/checks/ch11_frontier/node_limited_routing.py",
           "            bad = next((t for t in range(len(want)) if rows[t] != want[t]), None)",
           "            bad = next((t for t in range(1) if rows[t] != want[t]), None)", ROUTING,
           "node_limited_routing check: the first token of each problem only"),
]
