"""Check of exercise reduce_scatter (exercises/01_reduce_scatter.ipynb): Ring reduce-scatter from point-to-point messages.

    reduce_scatter    my_reduce_scatter(output, input)                rank r gets the sum of chunk r
"""
from __future__ import annotations

import torch

from ..core import Fail, exercise, first_difference, require_function
from .reduce_scatter_rank import _reduce_scatter_rank
from .ring_checks import _check_ring_traffic, _inputs, _returned_new, _run, _same_kind, _tolerance


_RS_CASES = ([("float32", 7), ("int64", 5), ("float32", 250)], [("float32", 1), ("int64", 1)])  # elements per rank


def _check_reduce_scatter(name, trials, seed):
    def check(p, i, observed, traffic):
        dtype, n = trials[p][i]
        inputs = _inputs(seed, p, i, dtype, (p * n,))
        chunk_sums = torch.stack(inputs).double().sum(0).to(inputs[0].dtype).view(p, n)
        for rank, seen in sorted(observed.items()):   # every rank: each ends with its own chunk
            output, input, expected = seen["output"], seen["input"], chunk_sums[rank]
            _same_kind(rank, output, expected, "output")
            tol = _tolerance(expected.dtype)
            diff = first_difference(output, expected, **tol)
            if diff is not None:
                _returned_new(name, rank, seen["returned"], expected, "output")
                message = (f"rank {rank}'s output differs from the sum over ranks of chunk {rank} (input elements "
                           f"{rank * n}..{rank * n + n - 1}) {diff}.")
                other = [j for j in range(p) if j != rank and first_difference(output, chunk_sums[j], **tol) is None]
                alone = [k for k in range(p) if first_difference(output, inputs[k].view(p, n)[rank], **tol) is None]
                if (output == -7777).all():
                    message += " output was never written."
                elif other:
                    message += (f" It holds the sum of chunk {other[0]} instead: rank r must end with chunk r "
                                f"(check which chunk each step sends and which it adds into).")
                elif alone:
                    message += (f" It holds rank {alone[0]}'s chunk {rank} alone: add what each step receives "
                                f"to your partial sum, so that every rank's part gets in.")
                raise Fail(message)
            _same_kind(rank, input, inputs[rank], "input")
            changed = first_difference(input, inputs[rank])
            if changed is not None:
                raise Fail(f"rank {rank}'s input changed {changed}: like "
                           f"torch.distributed.reduce_scatter_tensor, leave input as it was (add up partial sums "
                           f"in a copy, input.clone()).")
            _check_ring_traffic(traffic, rank, p, input, p - 1, "a ring reduce-scatter (p-1 steps of one chunk)",
                                "sending each chunk straight to the rank that owns it is not a ring")
    return check


@exercise("reduce_scatter", "Ring reduce-scatter from point-to-point messages", answer="my_reduce_scatter",
          notebook="01_reduce_scatter", sealed=True)
def check_reduce_scatter(fn, seed: int, timeout: float) -> str:
    """my_reduce_scatter(output, input), on every rank: output <- the sum over ranks of chunk
    `rank` of input (p equal chunks), by a ring of send/recv; input unchanged."""
    require_function(fn, "reduce_scatter", "output, input", torch.zeros(1), torch.zeros(2))
    n = _run(fn, "reduce_scatter", "reduce_scatter", _reduce_scatter_rank, _check_reduce_scatter, _RS_CASES, seed,
             timeout, what="elements per rank", shape=lambda p, n: (p * n,))
    return (f"on world sizes 2, 3, 4 ({n} trials with random float32 and int64 inputs of 1 to 250 elements per "
            f"rank; sums exact for int64, to 1e-5 for float32; every rank sent only to its right neighbour, "
            f"p-1 chunks)")
