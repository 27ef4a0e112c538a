"""Check of exercise ulysses_all_to_all (exercises/05_ulysses_all_to_all.ipynb): Ulysses' all-to-all: sequence-sharded to head-sharded and back.

    ulysses_all_to_all    ulysses_all_to_all(x, scatter_dim, gather_dim) -> tensor

ulysses_all_to_all runs on 2, 3 and 4 sealed ranks (sealed.py), both ways (sequence-sharded -> head-
sharded and back), on tensors whose entries name their head and token, so a misplaced
piece is named exactly. It must use point-to-point messages only, and send each other
rank exactly the piece it needs: (p-1)/p of the tensor.
"""
from __future__ import annotations

import random
import torch

from .. import sealed
from ..core import Fail, exercise, first_difference, require_function
from .ulysses_all_to_all_rank import _ulysses_rank


def _ulysses_trials(seed, p):
    rng = random.Random(seed * 31 + p)
    return [(rng.randint(1, 2), p * rng.randint(1, 3), rng.randint(1, 4), rng.randint(1, 3)) for _ in range(3)]


def _labelled(b, heads, seq, d):
    """Entry (batch i, head h, token t, j) = 10⁶·i + 1000·h + t + j/10: a misplaced piece names itself."""
    i, h, t, j = torch.meshgrid(*(torch.arange(n, dtype=torch.float64) for n in (b, heads, seq, d)), indexing="ij")
    return 1e6 * i + 1000 * h + t + j / 10


def _check_ulysses(trials):
    def check(p, i, observed, traffic):
        b, hp, n, d = trials[i]
        X, h = _labelled(b, hp, n * p, d), hp // p
        for rank, got in sorted(observed.items()):
            where = f"rank {rank}'s "
            for key, want, what, rule in (
                    ("to_heads", X[:, rank * h:(rank + 1) * h], "result of ulysses_all_to_all(x, 1, 2)",
                     f"heads {rank * h}..{(rank + 1) * h - 1} (its share) for all {n * p} tokens, tokens in "
                     f"order: the piece from rank i holds tokens i·{n}..(i+1)·{n}-1 and goes at place i"),
                    ("back", X[:, :, rank * n:(rank + 1) * n], "result of ulysses_all_to_all(y, 2, 1)",
                     f"all {hp} heads of its own tokens {rank * n}..{(rank + 1) * n - 1}: the piece from "
                     f"rank i holds heads i·{h}..(i+1)·{h}-1 and goes at place i")):
                value = got[key]
                if not isinstance(value, torch.Tensor) or value.shape != want.shape:
                    shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
                    raise Fail(f"{where}{what} is {shape}, expected shape {tuple(want.shape)}: {rule}.")
                diff = first_difference(value, want)
                if diff is not None:
                    index, g, w = diff
                    raise Fail(f"{where}{what} differs at index {index}: got head {int(g // 1000 % 1000)}, token "
                               f"{int(g % 1000)}, expected head {int(w // 1000 % 1000)}, token {int(w % 1000)}. "
                               f"It must hold {rule}.")
            for direction, phase in (("ulysses_all_to_all(x, 1, 2)", "to_heads"),
                                     ("ulysses_all_to_all(y, 2, 1)", "back")):
                piece = b * hp * n * d * 8 // p
                per_peer = {}
                for dst, nbytes in traffic[rank]["sends_in"].get(phase, []):
                    per_peer[dst] = per_peer.get(dst, 0) + nbytes
                want_sends = {j: piece for j in range(p) if j != rank}
                if per_peer != want_sends:
                    raise Fail(f"{where}{direction} sent {per_peer or 'nothing'} (bytes per destination rank); "
                               f"an all-to-all sends every other rank exactly the one piece it needs, "
                               f"{piece:,} bytes each ({want_sends}), and keeps its own piece: (p-1)/p of "
                               f"the tensor in all, never the whole tensor.")
            if p > 1 and not traffic[rank]["received"]:
                raise Fail(f"rank {rank} received no point-to-point message.")
    return check


@exercise("ulysses_all_to_all", "Ulysses' all-to-all: sequence-sharded to head-sharded and back",
          answer="ulysses_all_to_all", notebook="05_ulysses_all_to_all", sealed=True)
def check_ulysses_all_to_all(fn, seed: int, timeout: float) -> str:
    """ulysses_all_to_all(x, scatter_dim, gather_dim): cut x into p pieces along scatter_dim, piece j to
    rank j; concatenate the pieces received, in rank order, along gather_dim. Point-to-point only."""
    require_function(fn, "ulysses_all_to_all", "x, scatter_dim, gather_dim", torch.zeros(1, 1, 1, 1), 1, 2)
    count = 0
    for p in (2, 3, 4):                             # Ulysses: 3 heads' pieces do not halve
        trials = _ulysses_trials(seed, p)

        def describe(world_size, i, trials=trials):
            b, hp, n, d = trials[i]
            return f"world_size={world_size}, x of {b} x {hp} heads x {n} tokens per rank x {d}"
        inputs = []
        for b, hp, n, d in trials:
            X = _labelled(b, hp, n * p, d)
            inputs.append([{"mine": X[:, :, r * n:(r + 1) * n].contiguous(),
                            "heads": X[:, r * hp // p:(r + 1) * hp // p].contiguous()} for r in range(p)])
        sealed.run_sealed(_ulysses_rank, fn, inputs, world_size=p, timeout=timeout,
                          exercise=("ulysses_all_to_all", "all_to_all"), describe=describe,
                          check=_check_ulysses(trials))
        count += len(trials)
    return (f"on world sizes 2, 3, 4 ({count} trials, both directions: every entry in its place, every rank "
            f"sent each other rank exactly its piece with point-to-point messages)")
