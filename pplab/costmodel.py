"""How long a collective should take: the α-β-γ cost model, and α, β measured here.

A message of n bytes from one rank to another takes α + nβ: α (latency) is what even an
empty message costs, β (seconds per byte) is one over the bandwidth. Combining n bytes
(adding them, say) takes nγ. A collective of N bytes on p ranks then takes

    A·α + B·β + C·γ

A counts the messages on its critical path (the longest chain of messages that must
follow one another), B the bytes along that chain and C the bytes combined along it
(Thakur, Rabenseifner & Gropp, 2005). Each rank sends one message and receives one at
a time, both at once. For the algorithms of pplab.collectives:

    collective       algorithm             A          B               C
    broadcast        tree (binomial)       ⌈log p⌉    ⌈log p⌉·N       0
    reduce           tree (binomial)       ⌈log p⌉    ⌈log p⌉·N       ⌈log p⌉·N
    scatter, gather  linear                p-1        (p-1)/p·N       0
    all_gather       ring                  p-1        (p-1)/p·N       0
    reduce_scatter   ring                  p-1        (p-1)/p·N       (p-1)/p·N
    all_to_all       pairwise              p-1        (p-1)/p·N       0
    all_reduce       naive (param server)  2(p-1)     2(p-1)·N        (p-1)·N
                     tree                  2⌈log p⌉   2⌈log p⌉·N      ⌈log p⌉·N
                     ring                  2(p-1)     2(p-1)/p·N      (p-1)/p·N
                     recursive_doubling    log p      log p·N         log p·N
                     halving_doubling      2 log p    2(p-1)/p·N      (p-1)/p·N

The last two need p = 2^k. For other p, pplab folds p - q ranks into partners first
(q = 2^⌊log p⌋): the cost on q ranks plus 2 messages, 2N bytes and N combined.

N is all the data in bytes: the tensor of broadcast, reduce and all_reduce; all p pieces
for the others (the output of all_gather and gather, the input of scatter, reduce_scatter
and all_to_all). So ring all_reduce = reduce_scatter + all_gather, term by term.

The seeds' parameter server (bandwidth 2pdβ, latency 2α) has a server apart from its p
workers and counts one round for talking to all of them at once. pplab's naive all-reduce
makes rank 0 the server of p-1 workers: the same 2·(p-1)·N bytes cross the server's link,
but the server sends (and receives) them one message at a time, so A = 2(p-1), not 2.

`cost` and `predict` are the formulas; `bytes_sent_per_rank` counts exactly what each rank
of pplab.collectives sends (chunks differ by an element when p does not divide the
tensor), to compare with a trace; and `messages_on_critical_path` reads A off a trace.
`pplab.costfit.fit()` measures α, β, γ on this machine, with what a CPU adds to them.
"""
from __future__ import annotations

from dataclasses import dataclass

from .split import ring_sends, split_sizes

COLLECTIVES = {      # collective: its algorithms in pplab.collectives (the first is the default)
    "broadcast": ("tree",), "reduce": ("tree",), "scatter": ("linear",), "gather": ("linear",),
    "all_gather": ("ring",), "reduce_scatter": ("ring",), "all_to_all": ("pairwise",),
    "all_reduce": ("ring", "naive", "tree", "recursive_doubling", "halving_doubling"),
}
_PIECES = ("scatter", "gather", "all_gather", "reduce_scatter", "all_to_all")   # p equal pieces


@dataclass(frozen=True)
class Cost:
    """A·α + B·β + C·γ: messages, bytes and bytes combined on the critical path."""

    latency_rounds: int          # A
    bytes: float                 # B (bytes, N included)
    reduce_bytes: float = 0.0    # C (bytes, N included)

    def time(self, alpha: float, beta: float, gamma: float = 0.0) -> float:
        return self.latency_rounds * alpha + self.bytes * beta + self.reduce_bytes * gamma

    def __add__(self, other: "Cost") -> "Cost":
        return Cost(self.latency_rounds + other.latency_rounds, self.bytes + other.bytes,
                    self.reduce_bytes + other.reduce_bytes)


def _check(collective, algorithm, p, n_bytes) -> str:
    """The algorithm to use (None: the default one), or a ValueError saying what to change."""
    if collective not in COLLECTIVES:
        raise ValueError(f"unknown collective {collective!r}: use one of {', '.join(COLLECTIVES)}")
    algorithm = COLLECTIVES[collective][0] if algorithm is None else algorithm
    if algorithm not in COLLECTIVES[collective]:
        raise ValueError(f"{collective} has no algorithm {algorithm!r} in pplab: use one of "
                         f"{', '.join(map(repr, COLLECTIVES[collective]))}")
    if isinstance(p, bool) or not isinstance(p, int) or p < 1:
        raise ValueError(f"p is a number of ranks, a whole number >= 1: got {p!r}")
    if isinstance(n_bytes, bool) or not isinstance(n_bytes, (int, float)) or not n_bytes >= 0:
        raise ValueError(f"n_bytes is a size in bytes, >= 0: got {n_bytes!r}")
    return algorithm


def cost(collective: str, algorithm: str | None, p: int, n_bytes: float) -> Cost:
    """The α-β-γ terms of `collective` by `algorithm` on p ranks, N = n_bytes (see the table)."""
    algorithm = _check(collective, algorithm, p, n_bytes)
    N = float(n_bytes)
    if p == 1:
        return Cost(0, 0.0, 0.0)
    if algorithm in ("recursive_doubling", "halving_doubling"):
        q = 1 << (p.bit_length() - 1)                      # the largest power of two <= p
        k = q.bit_length() - 1                             # log2 q
        body = Cost(k, k * N, k * N) if algorithm == "recursive_doubling" else \
            Cost(2 * k, 2 * (q - 1) / q * N, (q - 1) / q * N)
        return body if q == p else body + Cost(2, 2 * N, N)
    log = (p - 1).bit_length()                             # ⌈log2 p⌉
    share = (p - 1) / p * N                                # all the pieces but one
    return {
        ("broadcast", "tree"): Cost(log, log * N),
        ("reduce", "tree"): Cost(log, log * N, log * N),
        ("scatter", "linear"): Cost(p - 1, share),
        ("gather", "linear"): Cost(p - 1, share),
        ("all_gather", "ring"): Cost(p - 1, share),
        ("reduce_scatter", "ring"): Cost(p - 1, share, share),
        ("all_to_all", "pairwise"): Cost(p - 1, share),
        ("all_reduce", "naive"): Cost(2 * (p - 1), 2 * (p - 1) * N, (p - 1) * N),
        ("all_reduce", "tree"): Cost(2 * log, 2 * log * N, log * N),
        ("all_reduce", "ring"): Cost(2 * (p - 1), 2 * share, share),
    }[collective, algorithm]


def predict(collective: str, algorithm: str | None, p: int, n_bytes: float,
            alpha: float, beta: float, gamma: float = 0.0) -> float:
    """Seconds `collective` should take: A·α + B·β + C·γ."""
    for name, value in (("alpha", alpha), ("beta", beta), ("gamma", gamma)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
            raise ValueError(f"{name} must be a number of seconds (per byte for beta, gamma) >= 0: got {value!r}")
    return cost(collective, algorithm, p, n_bytes).time(alpha, beta, gamma)


# ----------------------------------------------------------------------------------
# Exactly what each rank of pplab.collectives sends


def _tree_sends(vr: int, p: int) -> int:
    """Messages rank vr (counted from the root) sends in a binomial-tree broadcast."""
    return sum(1 for k in range((p - 1).bit_length()) if vr < 2 ** k and vr + 2 ** k < p)


def _doubling_sends(algorithm: str, n: int, p: int, me: int) -> int:
    q = 1 << (p.bit_length() - 1)
    r = p - q
    if me < 2 * r and me % 2 == 0:                 # folded in: hands over n, gets the result back
        return n
    v = me // 2 if me < 2 * r else me - r          # my index among the q ranks that stay
    give_back = n if me < 2 * r else 0             # the result, to the partner folded into me
    masks = [2 ** k for k in range(q.bit_length() - 1)]
    if algorithm == "recursive_doubling":          # the whole tensor each step
        return len(masks) * n + give_back
    c = split_sizes(n, q)

    def block(i, m):                               # the m chunks of the block of size m holding chunk i
        return sum(c[i // m * m:(i // m + 1) * m])
    # halving: give away the half I do not keep; doubling: send all I have so far
    return sum(block(v ^ m, m) + block(v, m) for m in masks) + give_back


def bytes_sent_per_rank(collective: str, algorithm: str | None, p: int, n_bytes: int,
                        element_size: int = 4, root: int = 0) -> list[int]:
    """Bytes each rank (index = rank in the group) sends in pplab.collectives' implementation.

    n_bytes is N as in `cost`; element_size the tensor's (4 for float32), since chunks are cut
    between elements; root (a group rank) for broadcast, reduce, scatter and gather.
    """
    algorithm = _check(collective, algorithm, p, n_bytes)
    if not isinstance(n_bytes, int) or n_bytes % element_size:
        raise ValueError(f"n_bytes={n_bytes!r} is not a whole number of {element_size}-byte elements")
    if collective in _PIECES and n_bytes % (p * element_size):
        raise ValueError(f"{collective} moves p equal pieces: n_bytes={n_bytes} must be a multiple of "
                         f"p x element_size = {p * element_size}")
    if not (isinstance(root, int) and 0 <= root < p):
        raise ValueError(f"root={root!r} is not a rank of the group: use 0..{p - 1}")
    n = n_bytes // element_size                   # elements
    piece = n // p

    def sends(me):                                # elements rank `me` sends
        if p == 1 or n == 0:
            return 0
        if collective == "broadcast":
            return _tree_sends((me - root) % p, p) * n
        if collective == "reduce":
            return n if me != root else 0
        if collective == "scatter":
            return (p - 1) * piece if me == root else 0
        if collective == "gather":
            return piece if me != root else 0
        if collective in _PIECES:                 # all_gather, reduce_scatter, all_to_all
            return ring_sends(collective, n, p, me)
        if algorithm == "naive":                  # workers send n; the server sends n to each
            return (p - 1) * n if me == 0 else n
        if algorithm == "tree":                   # reduce to rank 0, then broadcast from it
            return (me != 0) * n + _tree_sends(me, p) * n
        if algorithm == "ring":                   # all chunks but mine, then all but my right's
            return ring_sends("all_reduce", n, p, me)
        return _doubling_sends(algorithm, n, p, me)

    return [element_size * sends(me) for me in range(p)]


def messages_on_critical_path(messages) -> int:
    """A read off a trace: the longest chain of messages that had to follow one another.

    `messages` is a Timeline or a list of its (send, recv) pairs (Timeline.messages()).
    A message waits for every message its sender had received before sending it, for its
    sender's previous message (one send at a time) and for its receiver's previous one
    (one receive at a time, in the order the receives were posted).
    """
    pairs = messages.messages() if hasattr(messages, "messages") else list(messages)
    before = []                                    # before[i]: the messages message i waits for
    for s, r in pairs:
        got = {j for j, (_, r2) in enumerate(pairs) if r2.rank == s.rank and r2.end <= s.start}
        sent = [j for j, (s2, _) in enumerate(pairs) if s2.rank == s.rank and s2.start < s.start]
        into = [j for j, (_, r2) in enumerate(pairs) if r2.rank == r.rank and r2.start < r.start]
        last_sent = {max(sent, key=lambda j: pairs[j][0].start)} if sent else set()
        last_into = {max(into, key=lambda j: pairs[j][1].start)} if into else set()
        before.append(got | last_sent | last_into)
    depth = [1] * len(pairs)                       # messages in the longest chain ending at i
    for _ in range(len(pairs) + 1):
        longer = [1 + max((depth[j] for j in b), default=0) for b in before]
        if longer == depth:
            return max(depth, default=0)
        depth = longer
    raise ValueError("these messages wait for each other in a circle: not one run's trace?")
