"""How n things are shared by p ranks, everywhere in pplab: as torch.tensor_split cuts a tensor,
the first n % p ranks get one more. Rows of a tensor-parallel weight, chunks of a ring
collective, tokens of a sequence shard, and the cost model's bytes all use this one rule.

    split_sizes(10, 4) == [3, 3, 2, 2]
"""


def split_sizes(n: int, p: int) -> list[int]:
    """How many of n things each of p ranks gets: n // p, and one more for the first n % p."""
    return [n // p + (r < n % p) for r in range(p)]
