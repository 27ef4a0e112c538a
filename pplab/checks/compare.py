"""How a checker compares a tensor an answer produced with the reference, and says where they
differ: one wording for every chapter.

    diff = first_difference(got, expected, atol=1e-6)   # None, or the first element that differs
    raise Fail(f"rank 2's result differs from the sum over all ranks {diff}.")
    # rank 2's result differs from the sum over all ranks at index (1, 3) (got 0.5, expected 0.25).

A Difference is also a tuple (index, got, expected), for a checker that words its own hint.
known_mistake names the near miss a wrong result matches, for that hint:

    hint = known_mistake(got, [(p * expected, f"It is {p} times that: divide the sum by p.")], atol=1e-6)
"""
from __future__ import annotations

from typing import NamedTuple

import torch


def _fmt(value) -> str:
    """A value as a message shows it: floats to 4 significant digits."""
    return f"{value:.4g}" if isinstance(value, float) else str(value)


class Difference(NamedTuple):
    index: int | tuple                   # an int for a 1-D tensor, a tuple otherwise
    got: float | int
    expected: float | int

    def __str__(self) -> str:
        return f"at index {self.index} (got {_fmt(self.got)}, expected {_fmt(self.expected)})"


def first_difference(got: torch.Tensor, expected: torch.Tensor, *, atol=0.0, rtol=0.0) -> Difference | None:
    """The first element of `got` that differs from `expected`'s (beyond atol + rtol·|expected|;
    atol = rtol = 0: exact), or None where none does."""
    if got.shape != expected.shape:
        raise ValueError(f"shapes differ: {tuple(got.shape)} vs {tuple(expected.shape)}")
    if atol or rtol:
        bad = ~torch.isclose(got, expected, atol=atol, rtol=rtol)
    else:
        bad = got != expected
    flat = bad.flatten().nonzero()
    if flat.numel() == 0:
        return None
    i = int(flat[0])
    index = tuple(int(k) for k in torch.unravel_index(torch.tensor(i), got.shape)) if got.dim() != 1 else i
    return Difference(index, got.flatten()[i].item(), expected.flatten()[i].item())


def known_mistake(got: torch.Tensor, mistakes, *, atol=0.0, rtol=0.0) -> str:
    """The hint of the first of `mistakes` ((what that mistake would give, or None; its hint) pairs)
    whose result `got` equals within atol + rtol·|that|, with a leading space; "" if none matches."""
    for wrong, hint in mistakes:
        if wrong is not None and wrong.shape == got.shape and torch.allclose(got, wrong, atol=atol, rtol=rtol):
            return f" {hint}"
    return ""
