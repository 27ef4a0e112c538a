"""Check of exercise ring_all_reduce (exercises/01_ring_all_reduce.ipynb): Ring all-reduce from point-to-point messages.

    ring_all_reduce   my_ring_all_reduce(tensor)                      in place, the sum over ranks
"""
from __future__ import annotations

import torch

from ..core import Fail, exercise, first_difference, require_function
from .ring_all_reduce_rank import _all_reduce_rank
from .ring_checks import _check_ring_traffic, _inputs, _returned_new, _run, _same_kind, _tolerance


# (dtype, shape): p does not divide 13, 2-D, larger, then the edge cases numel < p.
_CASES = ([("float32", (13,)), ("int64", (3, 5)), ("float32", (1001,)), ("int64", (12,))],
          [("float32", (1,)), ("int64", (2,))])


def _check_all_reduce(name, trials, seed):
    def check(p, i, observed, traffic):
        dtype, shape = trials[p][i]
        inputs = _inputs(seed, p, i, dtype, shape)
        expected = torch.stack(inputs).sum(0) if dtype == "int64" else torch.stack(inputs).double().sum(0).float()
        for rank, seen in sorted(observed.items()):   # every rank: a slip may show on one only
            tensor = seen["tensor"]
            _same_kind(rank, tensor, expected)
            diff = first_difference(tensor, expected, **_tolerance(expected.dtype))
            if diff is not None:
                _returned_new(name, rank, seen["returned"], expected)
                message = (f"rank {rank}'s result differs from the sum over all ranks {diff}.")
                pieces = list(zip(tensor.view(-1).tensor_split(p), expected.view(-1).tensor_split(p)))
                right = [j for j, (a, b) in enumerate(pieces)
                         if a.numel() and first_difference(a, b, **_tolerance(b.dtype)) is None]
                if torch.equal(tensor, inputs[rank]):
                    message += " Its tensor is unchanged: nothing was added to it."
                elif len(right) == 1 and sum(a.numel() > 0 for a, _ in pieces) > 1:
                    message += (f" Only chunk {right[0]} of tensor.tensor_split({p}) is right: that is what a "
                                f"reduce-scatter leaves. The all-gather must then pass each complete chunk "
                                f"round the ring ({p - 1} more step{'s' if p > 2 else ''}) so that every rank gets "
                                f"all of them.")
                elif right and len(right) < sum(a.numel() > 0 for a, _ in pieces):
                    wrong = [j for j, (a, _) in enumerate(pieces) if a.numel() and j not in right]
                    message += (f" Chunk{'s' if len(wrong) > 1 else ''} {', '.join(map(str, wrong))} of "
                                f"tensor.tensor_split({p}) {'are' if len(wrong) > 1 else 'is'} wrong on this rank: "
                                f"every rank must take part in all {p - 1} steps of the all-gather.")
                raise Fail(message)
            _check_ring_traffic(traffic, rank, p, tensor, 2 * (p - 1),
                                "a ring all-reduce (2(p-1) steps of one chunk of at most ceil(numel/p) elements)",
                                "sending everything to one rank and back is a parameter server, not a ring")
    return check


@exercise("ring_all_reduce", "Ring all-reduce from point-to-point messages", answer="my_ring_all_reduce",
          notebook="01_ring_all_reduce", sealed=True)
def check_ring_all_reduce(fn, seed: int, timeout: float) -> str:
    """my_ring_all_reduce(tensor), on every rank: tensor <- the sum of every rank's tensor, in
    place, by a reduce-scatter then an all-gather round a ring of send/recv."""
    require_function(fn, "ring_all_reduce", "tensor", torch.zeros(1))
    n = _run(fn, "ring_all_reduce", "all_reduce", _all_reduce_rank, _check_all_reduce, _CASES, seed, timeout)
    return (f"on world sizes 2, 3, 4 ({n} trials with random float32 and int64 tensors of 1 to 1001 elements; "
            f"sums exact for int64, to 1e-5 for float32; every rank sent only to its right neighbour, "
            f"at most 2(p-1) chunks)")
