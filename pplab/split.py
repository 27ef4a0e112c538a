"""How n things are shared by p ranks, everywhere in pplab: as torch.tensor_split cuts a tensor,
the first n % p ranks get one more. Rows of a tensor-parallel weight, chunks of a ring
collective, tokens of a sequence shard, and the cost model's bytes all use this one rule.

    split_sizes(10, 4) == [3, 3, 2, 2]
    ring_sends("all_reduce", 10, 4, me=0) == 14     # what a ring all-reduce's rank 0 sends of 10

ring_sends is the one home of what a ring sends: pplab.costmodel (chapter 1's bytes per rank) and
pplab.flops.sent_per_rank (a chapter's run, for the collectives the backend ran) both use it.
"""


def split_sizes(n: int, p: int) -> list[int]:
    """How many of n things each of p ranks gets: n // p, and one more for the first n % p."""
    return [n // p + (r < n % p) for r in range(p)]


# The collectives a ring runs on p pieces of a tensor (the ring all-reduce is a reduce-scatter, then an all-gather).
RING = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")


def ring_sends(collective: str, n: int, p: int, me: int) -> int:
    """How many of n things (elements, or bytes) rank `me` of p sends in a ring `collective` of n in all,
    cut into p chunks by split_sizes (chapter 1's rings; NCCL's inside a node):

      all_reduce                     every chunk but its own (reduce-scatter), then every chunk but its
                                     right neighbour's (all-gather): 2n - c[me] - c[me+1], about 2(p-1)/p·n
      all_gather, reduce_scatter,    p-1 of the p pieces: (p-1)·n/p, n being all p pieces (an all-gather's
      all_to_all                     output, a reduce-scatter's or an all-to-all's input), cut equally
    """
    if collective not in RING:
        raise ValueError(f"ring_sends knows {', '.join(RING)}, got {collective!r}")
    if p == 1 or n == 0:
        return 0
    if collective == "all_reduce":
        c = split_sizes(n, p)
        return 2 * n - c[me] - c[(me + 1) % p]
    return (p - 1) * (n // p)
