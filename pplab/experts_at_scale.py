"""Chapter 11d: experts at scale, as DeepSeek-V3 runs them (DeepSeek-AI, "DeepSeek-V3 Technical
Report", 2024, §2.1.2 and §3.2.2).

Chapter 8's layer holds one or two experts per rank and drops the tokens over an expert's
capacity. A frontier MoE holds many experts per rank (DeepSeek-V3: 256 routed experts on 64
GPUs of 8 nodes, 4 per GPU) and changes three things:

    dropless    no capacity: every token is computed by all its k experts, so the all-to-all's
                split sizes follow the router wherever it goes (only the load varies, not the result)
    balancing   no auxiliary loss: a bias b_e per expert is added to the scores *for the top-k
                choice only* (the gate weights use the bare scores). After each step every rank
                knows every expert's load (an all-reduce of E counts) and moves b_e by -γ if expert
                e took more than the mean load, +γ if it took less (`bias_update`)
    node limit  each token goes to experts on at most M nodes: the nodes are ranked by the sum of
                the top ceil(k/M) scores of the experts each holds, the best M kept, then the top-k
                experts chosen among theirs (`node_limited_topk`; DeepSeek-V3: k = 8, M = 4)

The node limit pays only if a token crosses to a node *once*, however many of its experts sit
there. So the dispatch here goes in two hops, as DeepSeek-V3's does (slow link first, then the
node's fast one):

    hop 1 (rail group, across nodes)   one row per (token, node it chose): to the rank of that node
                                       with my local index, carrying the token and its gate weights
                                       for that node's experts
    hop 2 (node group, inside a node)  one row per (arrived row, rank of my node holding one of its
                                       experts), with the gates of that rank's experts
    experts                            each rank runs every expert on every row with a gate for it
    combine                            hop 2 back (summed per hop-1 row), then hop 1 back (summed per token)

Bytes between nodes, forward: each rank's counts, 8 B to each other node, plus, for every
(token, other node) pair P, the token and the node's gates out (h + E/N elements) and the output
back (h). Backward sends the same rows the other way: 2·P·(2h + E/N)·element_size + p·(N-1)·8 in all.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from . import collectives
from .cluster import Cluster
from .expert_parallel import MoE, all_to_all
from .runtime import comm

__all__ = ["node_limited_topk", "bias_update", "imbalance", "nodes_per_token", "expected_nodes",
           "cross_node_bytes_formula", "DroplessMoE"]


def _node_sizes(experts_per_node, num_experts: int) -> list[int]:
    """experts_per_node as a list, one count per node (an int: every node holds that many)."""
    if isinstance(experts_per_node, int) and not isinstance(experts_per_node, bool):
        if experts_per_node < 1 or num_experts % experts_per_node:
            raise ValueError(f"experts_per_node={experts_per_node} must divide the {num_experts} experts; "
                             f"for nodes holding different numbers pass a list of counts, one per node")
        return [experts_per_node] * (num_experts // experts_per_node)
    sizes = [int(s) for s in experts_per_node]
    if any(s < 1 for s in sizes) or sum(sizes) != num_experts:
        raise ValueError(f"experts_per_node={list(experts_per_node)} must be counts >= 1, one per node, adding up "
                         f"to the scores' {num_experts} experts (node 0 holds the first ones, and so on)")
    return sizes


def _check_limit(sizes: list[int], max_nodes, k: int) -> None:
    if isinstance(max_nodes, bool) or not isinstance(max_nodes, int) or max_nodes < 1:
        raise ValueError(f"max_nodes (M) is a whole number >= 1 of nodes a token may reach, got {max_nodes!r}")
    fewest = sum(sorted(sizes)[:max_nodes])
    if fewest < k:
        raise ValueError(f"k={k} experts cannot always be found on M={max_nodes} nodes: the {max_nodes} smallest "
                         f"nodes hold {fewest} experts. Raise max_nodes or lower k.")


def _top(x: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest along the last dim; equal values: the lower index first (a stable sort).
    torch.topk leaves ties unspecified, and a tie broken differently changes which expert runs."""
    return torch.sort(x, dim=-1, descending=True, stable=True).indices[..., :k]


def node_limited_topk(scores: torch.Tensor, experts_per_node, max_nodes: int, k: int) -> torch.Tensor:
    """Each token's k experts [n, k], drawn from at most `max_nodes` nodes (DeepSeek-V3's node-limited routing).

    scores [n, E]: the selection scores (DeepSeek-V3: affinity + balancing bias). experts_per_node:
    an int (every node holds that many) or one count per node; node 0 holds experts 0.. and so on.
    A node's score is the sum of its top min(ceil(k/M), its size) scores: a node is worth the
    experts a token would use there, not its single best one. The best M nodes are kept (equal
    sums: the lower node), then the top-k scores among their experts (equal: the lower expert),
    listed best first. M >= the number of nodes is plain top-k."""
    if scores.dim() != 2:
        raise ValueError(f"scores must be [tokens, experts], got shape {tuple(scores.shape)}")
    sizes = _node_sizes(experts_per_node, scores.shape[1])
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= scores.shape[1]:
        raise ValueError(f"k must be a whole number of experts between 1 and {scores.shape[1]}, got {k!r}")
    _check_limit(sizes, max_nodes, k)
    per_node = math.ceil(k / max_nodes)
    node_score = torch.stack([part.gather(1, _top(part, min(per_node, part.shape[1]))).sum(1)
                              for part in scores.split(sizes, dim=1)], dim=1)
    keep = _top(node_score, min(max_nodes, len(sizes)))
    allowed = torch.zeros_like(node_score, dtype=torch.bool).scatter(1, keep, True)
    allowed = allowed.repeat_interleave(torch.tensor(sizes), dim=1)        # node's choice -> its experts
    return _top(scores.masked_fill(~allowed, -math.inf), k)


def bias_update(load: torch.Tensor, gamma: float) -> torch.Tensor:
    """The change to the balancing biases after a step: -γ for an expert above the mean load, +γ below, 0 at it.

    load: tokens each expert took this step, summed over every rank (so every rank moves its
    copy of the biases alike). DeepSeek-V3 uses γ = 0.001 for most of training, then 0."""
    if not (isinstance(gamma, (int, float)) and gamma >= 0 and math.isfinite(gamma)):
        raise ValueError(f"gamma is the bias's step size, a number >= 0, got {gamma!r}")
    load = load.to(torch.float64)
    return gamma * torch.sign(load.mean() - load)


def imbalance(load: torch.Tensor) -> float:
    """max load / mean load: 1 when every expert takes as many tokens; the busiest expert's rank sets the step."""
    load = load.to(torch.float64)
    return float(load.max() / load.mean())


def nodes_per_token(chosen: torch.Tensor, experts_per_node, num_experts: int) -> torch.Tensor:
    """[n, N] bool: which nodes hold one or more of each token's chosen experts [n, k]."""
    sizes = _node_sizes(experts_per_node, num_experts)
    node = torch.arange(len(sizes)).repeat_interleave(torch.tensor(sizes))
    return torch.zeros(len(chosen), len(sizes), dtype=torch.bool).scatter(1, node[chosen], True)


def expected_nodes(num_experts: int, n_nodes: int, k: int) -> float:
    """Mean number of nodes a token reaches with k experts drawn uniformly (distinct) from E on N equal
    nodes: N·(1 - C(E - E/N, k) / C(E, k)), each node missed only if all k land elsewhere."""
    return n_nodes * (1 - math.comb(num_experts - num_experts // n_nodes, k) / math.comb(num_experts, k))


def cross_node_bytes_formula(pairs: int, cluster: Cluster, hidden: int, num_experts: int, element_size: int,
                             backward: bool = True) -> int:
    """Bytes all ranks send between nodes in one DroplessMoE forward (and backward) of the two-hop dispatch.

    pairs: (token, node other than its own) pairs over all ranks, i.e. rows on the slow link.
    Each carries the token and that node's E/N gates out, its output back (h); the counts are one
    int64 per rank for each other node. Backward returns the same rows' gradients."""
    rows = pairs * (2 * hidden + num_experts // cluster.n_nodes) * element_size
    return (2 if backward else 1) * rows + cluster.world_size * (cluster.n_nodes - 1) * 8


def _counts(send: torch.Tensor, group) -> list[int]:
    """The split sizes I will receive: an all-to-all of one int64 per rank of the group."""
    recv = torch.empty_like(send)
    collectives.all_to_all_single(recv, send, group=group)
    return recv.tolist()


def _run_experts(rows: torch.Tensor, gates: torch.Tensor, experts) -> torch.Tensor:
    """Σ_e gate_e · expert_e(row) for every row, expert e run only on the rows with a gate for it (dropless)."""
    out = rows.new_zeros(rows.shape)
    for e, expert in enumerate(experts):
        idx = (gates[:, e].detach() > 0).nonzero().flatten()
        out = out.index_add(0, idx, gates[idx, e:e + 1] * expert(rows[idx]))
    return out


class DroplessMoE(MoE):
    """A dropless MoE layer with sigmoid scores, a balancing bias, node-limited routing and a two-hop dispatch.

    x [..., hidden] -> [..., hidden]. `cluster` lays the ranks onto nodes (rank r on node
    r // ranks_per_node) and with them the experts: rank r holds experts r·E/p .. (r+1)·E/p - 1.
    Outside a launch it holds every expert and routes alike (the single-process reference).
    After each forward: `load` (tokens per expert, this rank's batch), `chosen` [n, k], `remote_pairs`
    (token, other node) rows this rank sent over the slow link, `send_counts` {"across": rows to each
    node's rank of my rail, "inside": rows to each rank of my node}: split sizes that change every step.
    `update_bias(gamma)` after a step.
    """

    def __init__(self, hidden, ffn, num_experts, k=2, cluster: Cluster | None = None, max_nodes: int | None = None):
        super().__init__(hidden, ffn, num_experts, k, capacity_factor=None)
        p = len(comm.group_ranks(None))
        self.cluster = cluster or Cluster(1, p)
        if p > 1 and self.cluster.world_size != p:
            raise ValueError(f"DroplessMoE: the cluster has {self.cluster.world_size} ranks but the launch has {p}: "
                             f"pass Cluster(n_nodes, ranks_per_node) with n_nodes × ranks_per_node = {p}")
        if num_experts % self.cluster.world_size:
            raise ValueError(f"DroplessMoE: {num_experts} experts cannot be split evenly over the cluster's "
                             f"{self.cluster.world_size} ranks; use a multiple of {self.cluster.world_size}")
        self.experts_per_node = num_experts // self.cluster.n_nodes
        self.max_nodes = self.cluster.n_nodes if max_nodes is None else max_nodes
        _check_limit([self.experts_per_node] * self.cluster.n_nodes, self.max_nodes, k)
        self.register_buffer("bias", torch.zeros(num_experts, dtype=torch.float64))   # selection only: no gradient

    @classmethod
    def from_dense(cls, moe: "DroplessMoE") -> "DroplessMoE":
        """This rank's part of a single-process DroplessMoE: its router, bias and block of experts."""
        fc1 = moe.experts[0].fc1
        m = cls(fc1.in_features, fc1.out_features, moe.num_experts, moe.k, moe.cluster, moe.max_nodes)
        m = m.to(fc1.weight.dtype)
        m.router.load_state_dict(moe.router.state_dict())
        m.bias.copy_(moe.bias)
        for i, expert in enumerate(m.experts):
            expert.load_state_dict(moe.experts[m.first + i].state_dict())
        return m

    def route(self, x):
        """(dense gates [n, E], chosen [n, k]): sigmoid scores; the top-k chosen on score + bias,
        node-limited; gates = the chosen experts' bare scores, normalised to sum to 1 (DeepSeek-V3)."""
        s = torch.sigmoid(self.router(x))
        chosen = node_limited_topk(s.detach() + self.bias.to(s.dtype), self.experts_per_node, self.max_nodes, self.k)
        g = s.gather(1, chosen)
        gates = torch.zeros_like(s).scatter(1, chosen, g / g.sum(-1, keepdim=True))
        self.chosen, self.load = chosen, torch.bincount(chosen.flatten(), minlength=self.num_experts)
        self.aux_loss = s.new_zeros(())          # no balancing loss: the bias balances
        return gates, chosen

    def forward(self, x):
        shape, x = x.shape, x.reshape(-1, x.shape[-1])
        gates, _ = self.route(x)
        if len(comm.group_ranks(None)) == 1:
            self.remote_pairs = 0
            return _run_experts(x, gates, self.experts).view(shape)
        return self._two_hops(x, gates).view(shape)

    def _two_hops(self, x, gates):
        c, h, n = self.cluster, x.shape[1], x.shape[0]
        node_group, rail_group = c.groups()
        # hop 1: one row per (token, node), sorted by node: the rail group's j-th rank is on node j
        by_node = gates.view(n, c.n_nodes, self.experts_per_node)
        t, d = (by_node.detach() > 0).any(-1).nonzero(as_tuple=True)
        order = torch.argsort(d, stable=True)
        t, d = t[order], d[order]
        send1 = torch.bincount(d, minlength=c.n_nodes)
        self.remote_pairs = int((d != c.node_of(comm.rank())).sum())
        recv1 = _counts(send1, rail_group)
        rows1 = all_to_all(torch.cat([x[t], by_node[t, d]], 1), send1.tolist(), recv1, rail_group)
        # hop 2: inside my node, one row per (arrived row, local rank holding one of its experts)
        x1, g1 = rows1[:, :h], rows1[:, h:].view(len(rows1), c.ranks_per_node, len(self.experts))
        i, j = (g1.detach() > 0).any(-1).nonzero(as_tuple=True)
        order = torch.argsort(j, stable=True)
        i, j = i[order], j[order]
        send2 = torch.bincount(j, minlength=c.ranks_per_node)
        recv2 = _counts(send2, node_group)
        rows2 = all_to_all(torch.cat([x1[i], g1[i, j]], 1), send2.tolist(), recv2, node_group)
        self.send_counts = {"across": send1.tolist(), "inside": send2.tolist()}
        out = _run_experts(rows2[:, :h], rows2[:, h:], self.experts)
        # combine: back inside the node, summed per hop-1 row; back across nodes, summed per token
        back2 = all_to_all(out, recv2, send2.tolist(), node_group)
        y1 = x1.new_zeros(len(rows1), h).index_add(0, i, back2)
        back1 = all_to_all(y1, recv1, send1.tolist(), rail_group)
        return x.new_zeros(n, h).index_add(0, t, back1)

    @torch.no_grad()
    def update_bias(self, gamma: float) -> torch.Tensor:
        """After a step: the load of every rank's batch (all-reduced), the biases moved by ±γ; returns that load."""
        load = self.load.clone()
        if len(comm.group_ranks(None)) > 1:
            comm.all_reduce(load)
        self.bias += bias_update(load, gamma)
        return load
