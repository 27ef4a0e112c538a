"""Expert parallelism: a mixture-of-experts layer whose tokens travel to their experts by all-to-all.

A mixture-of-experts (MoE) layer holds E small MLPs, the experts, and a router: a linear
layer scoring every token against every expert. Each token goes to its top-k experts only
(k = 1 Switch, k = 2 GShard), so the parameters grow with E while the compute per token
stays that of k experts. With expert parallelism the E experts are split over the p ranks
of a group, E/p each (rank r holds experts r·E/p .. (r+1)·E/p - 1), and every rank routes
its own tokens:

    route      probabilities = softmax(router(x)); each token's top-k experts and weights
    capacity   each expert takes at most C = ceil(capacity_factor · n · k / E) of this rank's
               n tokens; the rest are dropped (their output is 0: the residual carries them)
    counts     an all-to-all of E integers: how many tokens each rank sends each expert
    dispatch   an all-to-all whose split sizes vary per step: tokens to their experts' ranks
    experts    each rank runs its experts on the tokens that arrived
    combine    the reverse all-to-all; each token's output = Σ weight · expert output

Backward runs the two all-to-alls the other way (`all_to_all`, an autograd Function).

**Which tokens are dropped.** Capacity is per rank-local batch (GShard's "groups"): each
rank counts its own n tokens, and an expert takes first choices before second choices and,
within a choice, tokens in order of their index. So a single process running the same layer
on each rank's batch in turn drops exactly the same tokens: that is the reference the tests
compare with (`MoE(..., group=None)` outside a launch holds every expert).

**Load balancing.** A router left alone sends most tokens to a few experts (which then drop
tokens and make the other ranks wait). `aux_loss` is Switch's E·Σ_i f_i·P_i, with f_i the
fraction of this batch's k·n choices that picked expert i and P_i its mean probability; it
is 1 when the load is even, larger otherwise. Add a small multiple of it to the loss.

**Bytes.** Per forward, rank r sends (p-1)·E/p·8 bytes of counts, then the rows of its
tokens bound for other ranks (dispatch) and the rows of other ranks' tokens it computed
(combine): with an even router and no drops, 2·n·k·(p-1)/p rows of h elements.

**Gradients.** Dense parameters (router, embeddings) are replicated: every rank of the
batch's ranks computes them on its own tokens, so their gradients are averaged over those
ranks. Each expert lives on one rank of the ep group, and backward's all-to-all already
brought it every rank's gradient contribution; with copies of the experts on several
data-parallel ranks (EP × DP), those copies are summed too. `sync_gradients` does both.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from . import collectives, trace
from .runtime import comm
from .tensor_parallel.transformer import MLP

__all__ = ["MoE", "TinyMoE", "all_to_all", "dispatch_plan", "capacity", "sync_gradients", "my_experts", "steer",
           "all_to_all_bytes"]


def _ranks(group) -> list[int]:
    return list(comm.group_ranks(group))


def my_experts(num_experts: int, group=None) -> tuple[int, int]:
    """(first, count): the experts this rank holds, E/p of them, in a contiguous block."""
    p = len(_ranks(group))
    if num_experts % p:
        divisors = [d for d in range(1, num_experts + 1) if num_experts % d == 0]
        raise ValueError(f"expert parallelism: {num_experts} experts cannot be split evenly over {p} ranks "
                         f"(every rank holds E/p whole experts). Use an ep group of {divisors} ranks, or a "
                         f"number of experts divisible by {p}.")
    count = num_experts // p
    return comm.rank(group) * count, count


def capacity(tokens: int, k: int, num_experts: int, capacity_factor: float | None) -> int:
    """Tokens one expert takes from one rank-local batch: ceil(capacity_factor · tokens · k / E).
    capacity_factor=None: no limit (every choice kept)."""
    if capacity_factor is None:
        return tokens
    return math.ceil(capacity_factor * tokens * k / num_experts)


def dispatch_plan(expert: torch.Tensor, num_experts: int, world_size: int):
    """The dispatch's bookkeeping: (send_counts, order) for one rank's choices.

    expert[s] is the expert of choice s, or -1 if it was dropped. order lists the kept
    choices sorted by expert (stable: ties keep their order), so that x[order] holds, one
    block per rank, the rows bound for rank 0's experts, then rank 1's, ...; send_counts[j]
    is the size of rank j's block."""
    kept = (expert >= 0).nonzero().flatten()
    order = kept[torch.argsort(expert[kept], stable=True)]
    per_rank = num_experts // world_size
    send_counts = torch.bincount(expert[kept] // per_rank, minlength=world_size)
    return send_counts.tolist(), order


def all_to_all_bytes(tokens, k, num_experts, ranks, hidden, element_size) -> float:
    """Bytes one rank sends in one forward, router even and nothing dropped: the int64 counts
    of the other ranks' experts, then tokens·k·(ranks-1)/ranks rows out (dispatch) and as many
    back (combine). Backward sends the two row exchanges again, without the counts."""
    counts = (ranks - 1) * (num_experts // ranks) * 8
    return counts + 2 * tokens * k * (ranks - 1) / ranks * hidden * element_size


class _AllToAll(torch.autograd.Function):
    """Rows out in send_counts, rows in by recv_counts; backward: the same exchange reversed."""

    @staticmethod
    def forward(ctx, x, send_counts, recv_counts, group):
        ctx.args = (send_counts, recv_counts, group)
        out = x.new_empty((sum(recv_counts),) + x.shape[1:])
        collectives.all_to_all_single(out, x.contiguous(), recv_counts, send_counts, group=group)
        return out

    @staticmethod
    def backward(ctx, g):
        send_counts, recv_counts, group = ctx.args
        return all_to_all(g, recv_counts, send_counts, group), None, None, None


def all_to_all(x, send_counts, recv_counts, group=None):
    """Differentiable all-to-all of rows: send_counts[j] rows of x to the j-th rank of the group,
    recv_counts[i] rows back from the i-th (pplab.collectives, traced point-to-point sends)."""
    return _AllToAll.apply(x, list(send_counts), list(recv_counts), group)


class MoE(nn.Module):
    """A mixture-of-experts layer: x [..., hidden] -> [..., hidden], experts split over `group`.

    After each forward: `aux_loss` (the balancing loss of this rank's batch, in the graph),
    `load` (choices kept per expert, all E, this rank's batch), `dropped` (choices over
    capacity), and `send_counts`/`recv_counts` (rows to and from each rank in the dispatch).
    Outside a launch, or with a group of one rank, it holds every expert.
    """

    def __init__(self, hidden, ffn, num_experts, k=1, capacity_factor: float | None = 1.25, group=None):
        super().__init__()
        if not 1 <= k <= num_experts:
            raise ValueError(f"MoE: k={k} experts per token must be between 1 and num_experts={num_experts}")
        self.group, self.num_experts, self.k, self.capacity_factor = group, num_experts, k, capacity_factor
        self.first, count = my_experts(num_experts, group)
        self.router = nn.Linear(hidden, num_experts, bias=False)
        self.experts = nn.ModuleList(MLP(hidden, ffn) for _ in range(count))
        self._agree(hidden, ffn)

    @classmethod
    def from_dense(cls, moe: "MoE", group=None) -> "MoE":
        """This rank's part of a single-process MoE: the same router, its block of experts."""
        if len(moe.experts) != moe.num_experts:
            raise ValueError(f"MoE.from_dense needs a layer holding all {moe.num_experts} experts; this one holds "
                             f"{len(moe.experts)}. Build the dense layer outside the launch (or with a group of "
                             f"one rank) and pass it in.")
        fc1 = moe.experts[0].fc1
        m = cls(fc1.in_features, fc1.out_features, moe.num_experts, moe.k, moe.capacity_factor, group)
        m = m.to(fc1.weight.dtype)
        m.router.load_state_dict(moe.router.state_dict())
        for i, expert in enumerate(m.experts):
            expert.load_state_dict(moe.experts[m.first + i].state_dict())
        return m

    def _agree(self, hidden, ffn):
        """Every rank of the group must build the same layer (untraced bookkeeping)."""
        ranks = _ranks(self.group)
        if len(ranks) == 1:
            return
        mine = (hidden, ffn, self.num_experts, self.k, self.capacity_factor)
        everyone = [None] * len(ranks)
        with trace.paused():
            dist.all_gather_object(everyone, mine, group=self.group)
        if len(set(everyone)) > 1:
            listing = "; ".join(f"rank {r}: {d}" for r, d in zip(ranks, everyone))
            raise ValueError(f"MoE: the ranks of the group build different layers (hidden, ffn, experts, k, "
                             f"capacity_factor): {listing}; every rank must pass the same")

    def route(self, x):
        """(probs [n, E], weights [n, k], expert of each choice [k·n] with -1 where dropped).

        Choices are numbered choice-major: s = j·n + i is token i's j-th choice, so capacity is
        given to every token's first choice before any second choice, tokens in index order."""
        n, E = x.shape[0], self.num_experts
        probs = torch.softmax(self.router(x), -1)
        weights, chosen = probs.topk(self.k, -1)
        if self.k > 1:                                        # GShard: the k weights sum to 1
            weights = weights / weights.sum(-1, keepdim=True)
        choice = chosen.T.reshape(-1)
        place = F.one_hot(choice, E).cumsum(0).gather(1, choice[:, None]).squeeze(1) - 1   # my place in the queue
        keep = place < capacity(n, self.k, E, self.capacity_factor)
        self.load = torch.bincount(choice[keep], minlength=E)
        self.dropped = int((~keep).sum())
        fraction = torch.bincount(choice, minlength=E).to(probs.dtype) / choice.numel()   # f_i, before drops
        self.aux_loss = E * (fraction * probs.mean(0)).sum()                            # Switch: E·Σ f_i·P_i
        return probs, weights, torch.where(keep, choice, -1)

    def forward(self, x):
        shape, x = x.shape, x.reshape(-1, x.shape[-1])
        n, p = x.shape[0], len(_ranks(self.group))
        _, weights, expert = self.route(x)
        send_counts, order = dispatch_plan(expert, self.num_experts, p)
        # counts first: how many rows each of my experts gets from each rank
        per_expert = torch.bincount(expert[order], minlength=self.num_experts)
        counts = torch.empty_like(per_expert)
        collectives.all_to_all_single(counts, per_expert, group=self.group)
        counts = counts.view(p, len(self.experts))                     # [source rank, my expert]
        self.send_counts, self.recv_counts = send_counts, counts.sum(1).tolist()
        arrived = all_to_all(x[order % n], self.send_counts, self.recv_counts, self.group)
        out = self._run_experts(arrived, counts)
        back = all_to_all(out, self.recv_counts, self.send_counts, self.group)
        y = x.new_zeros(self.k * n, x.shape[1]).index_copy(0, order, back)   # dropped choices stay 0
        y = (y * weights.T.reshape(-1, 1)).view(self.k, n, -1).sum(0)
        return y.view(shape)

    def _run_experts(self, rows, counts):
        """Rows arrive grouped by source rank, then by expert: regroup by expert, run, put back."""
        which = torch.arange(len(self.experts)).repeat(counts.shape[0]).repeat_interleave(counts.flatten())
        by_expert = torch.argsort(which, stable=True)
        with trace.span("F", label="experts", tokens=len(rows)):
            parts = rows[by_expert].split(counts.sum(0).tolist())
            out = torch.cat([e(part) for e, part in zip(self.experts, parts)])
        return out[torch.argsort(by_expert)]


def steer(moe: MoE, choices: torch.Tensor) -> torch.Tensor:
    """Tokens that `moe`'s router sends where you say (for demonstrations of load and bytes).

    Sets the router's weight to the identity (expert e scores feature e) and returns tokens
    [n, hidden] whose j-th choice is choices[i, j] (choices [n, k], distinct per row)."""
    E, hidden = moe.num_experts, moe.router.in_features
    if hidden < E:
        raise ValueError(f"steer needs hidden >= num_experts (one feature per expert): got {hidden} < {E}")
    with torch.no_grad():
        moe.router.weight.copy_(torch.eye(E, hidden))
    x = torch.zeros(len(choices), hidden, dtype=moe.router.weight.dtype)
    for j in range(choices.shape[1]):
        x.scatter_(1, choices[:, j:j + 1], 8.0 / 2 ** j)       # the first choice scores highest
    return x


class TinyMoE(nn.Module):
    """embedding -> blocks of x + MoE(x) -> head: the smallest language model with experts."""

    def __init__(self, vocab, hidden, ffn, num_experts, k=1, capacity_factor: float | None = 1.25, layers=1,
                 group=None):
        super().__init__()
        self.embed, self.head = nn.Embedding(vocab, hidden), nn.Linear(hidden, vocab)
        self.blocks = nn.ModuleList(MoE(hidden, ffn, num_experts, k, capacity_factor, group) for _ in range(layers))

    @classmethod
    def from_dense(cls, model: "TinyMoE", group=None) -> "TinyMoE":
        m0 = model.blocks[0]
        m = cls(model.embed.num_embeddings, model.embed.embedding_dim, m0.experts[0].fc1.out_features,
                m0.num_experts, m0.k, m0.capacity_factor, len(model.blocks), group).to(model.head.weight.dtype)
        m.embed.load_state_dict(model.embed.state_dict())
        m.head.load_state_dict(model.head.state_dict())
        m.blocks = nn.ModuleList(MoE.from_dense(b, group) for b in model.blocks)
        return m

    def dense_state_dict(self) -> dict:
        """This rank's state under the single-process model's names (local expert i = expert first + i)."""
        out = {}
        for name, value in self.state_dict().items():
            if ".experts." in name:                   # blocks.b.experts.i.rest
                head, rest = name.split(".experts.")
                i, tail = rest.split(".", 1)
                name = f"{head}.experts.{self.blocks[int(head.split('.')[1])].first + int(i)}.{tail}"
            out[name] = value
        return out

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)

    def loss(self, tokens, targets, aux_weight=0.01):
        """Cross-entropy of this rank's batch + aux_weight · the blocks' balancing losses."""
        ce = F.cross_entropy(self(tokens).flatten(0, -2), targets.flatten())
        return ce + aux_weight * sum(b.aux_loss for b in self.blocks)


def expert_parameters(model: nn.Module) -> set:
    return {id(q) for m in model.modules() if isinstance(m, MoE) for q in m.experts.parameters()}


def _all_reduce_flat(grads, group) -> None:
    """One all-reduce (sum) for a list of gradients: flattened into one buffer, copied back."""
    if grads:
        flat = torch.cat([g.flatten() for g in grads])
        comm.all_reduce(flat, group=group)
        for g, part in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(part.view_as(g))


def sync_gradients(model: nn.Module, batch_group=None, expert_replica_group=None) -> None:
    """After backward: .grad = the gradient of the mean of the losses of `batch_group`'s ranks.

    batch_group: every rank holding a different part of the batch (the ep group; dp × ep on a
    mesh). Dense gradients are summed over it; expert gradients are summed over
    `expert_replica_group` (the ranks holding copies of the same experts: dp; None = no
    copies), having already received every ep rank's part through the all-to-all. Both are
    then divided by the number of batch ranks. One all-reduce per group, of all its gradients."""
    experts = expert_parameters(model)
    with_grad = [q for q in model.parameters() if q.grad is not None]
    _all_reduce_flat([q.grad for q in with_grad if id(q) not in experts], batch_group)
    if expert_replica_group is not None:
        _all_reduce_flat([q.grad for q in with_grad if id(q) in experts], expert_replica_group)
    for q in with_grad:
        q.grad /= len(_ranks(batch_group))
