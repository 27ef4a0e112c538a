"""Check of chapter 11b's exercise: FP8 (e4m3) quantisation with one scale per tile.

    fp8_blocks    quantise_blocks(x, tile) -> (dequantised, scales)

x is a 2-D fp32 matrix, tile = (rows, columns): (1, 128) for DeepSeek-V3's activations, (128, 128)
for its weights, and one small tile. Each tile's scale is its amax / 448 (e4m3's largest number);
each number is rounded to the nearest e4m3 number after dividing by its tile's scale, and
multiplied back. The answer is called in one sealed rank (no ranks talk: it is a pure function),
on shapes the tile divides and shapes it does not (the last tiles ragged), with outlier channels
100× the rest, rows and blocks of magnitudes five orders apart, and a tile of zeros. Two parts:

    scales    ⌈rows/tr⌉ × ⌈columns/tc⌉ of them, each amax / 448 to 1e-5
    values    every number against a reference worked out here differently from pplab.fp8: a loop
              over the tiles, and rounding by searching the table of all 255 e4m3 numbers built
              from their bit fields (ties to the even code), never torch's cast. Where x/scale
              sits within 1e-5 of a midpoint between two e4m3 numbers, either one is right.
"""
from __future__ import annotations

import math
import random

import torch

from .. import sealed
from ..core import Fail, Parts, exercise, require_function
from .fp8_blocks_rank import _refuse_fp8

PARTS = ("scales", "values")
E4M3_MAX, E5M2_MAX = 448.0, 57344.0
TOLERANCE = 1e-5


def _e4m3_table() -> torch.Tensor:
    """Every finite e4m3 number >= 0, in the order of its code (0..126): subnormals k·2^-9, then
    (1 + m/8)·2^(e-7) for exponent fields 1..15; field 15 with mantissa 7 is NaN, left out."""
    values = [k * 2.0 ** -9 for k in range(8)]
    values += [(1 + m / 8) * 2.0 ** (e - 7) for e in range(1, 16) for m in range(8) if (e, m) != (15, 7)]
    return torch.tensor(values, dtype=torch.float64)


TABLE = _e4m3_table()


def _round(ratio: torch.Tensor):
    """ratio (float64) -> (nearest e4m3 number, the other neighbour, near a midpoint?), clamped to ±448."""
    a = ratio.abs().clamp(max=E4M3_MAX)
    hi = torch.searchsorted(TABLE, a).clamp(1, len(TABLE) - 1)
    lo = hi - 1
    d_lo, d_hi = a - TABLE[lo], TABLE[hi] - a
    up = (d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0))          # a tie goes to the even code
    near, other = torch.where(up, TABLE[hi], TABLE[lo]), torch.where(up, TABLE[lo], TABLE[hi])
    tie = (d_hi - d_lo).abs() <= TOLERANCE * a
    return ratio.sign() * near, ratio.sign() * other, tie


def _reference(x: torch.Tensor, tile):
    """(dequantised, the other neighbour's value, near a tie, scales), tile by tile, in float64."""
    (rows, cols), (tr, tc) = x.shape, tile
    scales = torch.zeros(math.ceil(rows / tr), math.ceil(cols / tc), dtype=torch.float64)
    want, other = torch.zeros(rows, cols, dtype=torch.float64), torch.zeros(rows, cols, dtype=torch.float64)
    tie = torch.zeros(rows, cols, dtype=torch.bool)
    for i, r in enumerate(range(0, rows, tr)):
        for j, c in enumerate(range(0, cols, tc)):
            block = x[r:r + tr, c:c + tc].double()
            scale = float(block.abs().max()) / E4M3_MAX
            scales[i, j] = scale
            if scale == 0:
                continue                                           # a tile of zeros stays zeros
            near, far, close = _round(block / scale)
            want[r:r + tr, c:c + tc], other[r:r + tr, c:c + tc] = near * scale, far * scale
            tie[r:r + tr, c:c + tc] = close
    return want, other, tie, scales


def _cases(seed: int):
    """(x, tile, what) for each case: activations with outlier channels, weights with blocks of
    very different sizes, shapes that the tile divides and shapes that it does not."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(rng.randrange(2 ** 31))
    cases = []
    for rows, cols, tile in ((rng.randint(3, 6), rng.randint(2, 3) * 128 + rng.randint(5, 120), (1, 128)),
                             (rng.randint(3, 5), 256, (1, 128)),
                             (rng.randint(129, 180), 128 + rng.randint(10, 100), (128, 128)),
                             (256, 128, (128, 128)),
                             (rng.randint(5, 9), rng.randint(20, 40), (2, 16))):
        x = torch.randn(rows, cols, generator=g)
        if tile[0] == 1:                                           # tokens: each its own size
            x *= 10.0 ** (torch.rand(rows, 1, generator=g) * 4 - 3)
            for c in rng.sample(range(cols), 3):
                x[:, c] *= 100.0                                   # outlier channels
        else:                                                      # blocks five orders apart
            sizes = 10.0 ** (torch.rand(*[math.ceil(n / t) for n, t in zip(x.shape, tile)], generator=g) * 5 - 4)
            x *= sizes.repeat_interleave(tile[0], 0)[:rows].repeat_interleave(tile[1], 1)[:, :cols]
        if len(cases) == 0:
            x[0, :tile[1]] = 0.0                                   # a tile of zeros
        cases.append((x, tile, f"x {rows}×{cols}, tile {tile}"))
    return cases


def _two_tensors(got, shape, tile, grid):
    if not (isinstance(got, (tuple, list)) and len(got) == 2 and all(isinstance(t, torch.Tensor) for t in got)):
        return None, None, (f"quantise_blocks must return (dequantised, scales), two tensors; got "
                            f"{type(got).__name__}{f' of {len(got)}' if isinstance(got, (tuple, list)) else ''}.")
    deq, scales = got
    if tuple(scales.shape) != grid:
        turned = (math.ceil(shape[0] / tile[1]), math.ceil(shape[1] / tile[0]))
        swapped = (f" That is tiles of {tile[1]}×{tile[0]}, turned round: tile is (rows, columns), and (1, 128) "
                   f"runs along a row (one token, 128 channels).") if tuple(scales.shape) == turned else ""
        return None, None, f"scales has shape {tuple(scales.shape)}, expected {grid}, one per tile.{swapped}"
    if tuple(deq.shape) != tuple(shape):
        return None, None, f"dequantised has shape {tuple(deq.shape)}, expected x's {tuple(shape)}."
    if not deq.is_floating_point() or deq.element_size() < 4:
        return None, None, (f"dequantised is {deq.dtype}: return q·scale in float32, the numbers the matmul "
                            f"would use, not the fp8 codes.")
    return deq.double(), scales.double(), None


def _judge_scales(x, tile, scales, want):
    bad = ~((scales - want).abs() <= TOLERANCE * want + 1e-30)
    if not bool(bad.any()):
        return None
    i, j = (int(v) for v in bad.nonzero()[0])
    block = x[i * tile[0]:(i + 1) * tile[0], j * tile[1]:(j + 1) * tile[1]].double()
    got, amax = float(scales[i, j]), float(block.abs().max())
    said = f"the scale of tile ({i}, {j}) is {got:.6g}, expected its amax / 448 = {amax:.6g} / 448 = {float(want[i, j]):.6g}"
    guesses = [
        (float(x.abs().max()) / E4M3_MAX, "one scale for the whole tensor: each tile needs its own amax"),
        (float(block.abs().mean()) / E4M3_MAX, "the tile's mean |x| / 448: the scale comes from its amax, so that "
                                               "its largest number lands on 448 and none saturates"),
        (amax / E5M2_MAX, "amax / 57344, e5m2's largest number: this exercise is e4m3, whose largest is 448"),
        (max(amax, 1.0) / E4M3_MAX, "max(amax, 1) / 448: the ragged last tile was padded with ones, and the padding "
                                    "took part in the amax. Pad with zeros, or take the amax of the real numbers only"),
    ]
    right = float(want[i, j])
    hint = next((why for value, why in guesses          # a slip whose value is not the right one here
                 if math.isclose(got, value, rel_tol=1e-6) and not math.isclose(value, right, rel_tol=1e-6)), None)
    if hint is None and want[i, j] > 0:
        hint = f"{got / float(want[i, j]):.6f} times the right one (tolerance {TOLERANCE:g})"
    return f"{said}: that is {hint}." if hint else f"{said}."


def _judge_values(x, deq, want, other, tie):
    ok = ((deq - want).abs() <= TOLERANCE * want.abs() + 1e-30) | (tie & ((deq - other).abs() <= TOLERANCE * other.abs() + 1e-30))
    if bool(ok.all()):
        return None
    r, c = (int(v) for v in (~ok).nonzero()[0])
    got, expected = float(deq[r, c]), float(want[r, c])
    said = f"x[{r}, {c}] = {float(x[r, c]):.6g} dequantises to {got:.6g}, expected {expected:.6g}"
    if math.isnan(got):
        hint = (" A NaN: a tile of zeros has scale 0, and 0/0 is NaN. Divide by 1 where the scale is 0."
                if expected == 0 else " A NaN: nothing was written there?")
    elif math.isclose(got, float(x[r, c]), rel_tol=1e-7):
        hint = " That is x itself, not rounded: divide by the scale, round to e4m3, multiply back."
    elif expected != 0 and abs(got) > abs(expected) * 1.01 and abs(expected / float(want.abs().max())) > 0.99:
        hint = " Past 448 × scale: clamp to ±448 before casting."
    else:
        hint = " Round x / scale to the nearest e4m3 number (torch.float8_e4m3fn), then multiply by the scale."
    return said + "." + hint


@exercise("fp8_blocks", "FP8 with a scale per tile: DeepSeek-V3's 1×128 and 128×128 quantisation",
          answer="quantise_blocks", notebook="11b_fp8_blocks", sealed=True, points=len(PARTS))
def check_fp8_blocks(fn, seed: int, timeout: float) -> str:
    """quantise_blocks(x, tile) -> (dequantised, scales): e4m3 with one scale (amax / 448) per tile."""
    require_function(fn, "fp8_blocks", "x, tile", torch.zeros(1, 1), (1, 128))
    cases = _cases(seed)
    parts = Parts(PARTS)
    outs = sealed.call_each(fn, [(x.clone(), tile) for x, tile, _ in cases], where=lambda i: f"{cases[i][2]}: ",
                            timeout=timeout, probe=_refuse_fp8)
    try:
        for (x, tile, what), got in zip(cases, outs):
            grid = (math.ceil(x.shape[0] / tile[0]), math.ceil(x.shape[1] / tile[1]))
            deq, scales, problem = _two_tensors(got, x.shape, tile, grid)
            if problem:
                raise Fail(f"{what}: {problem}")
            want, other, tie, want_scales = _reference(x, tile)
            parts.note("scales", _judge_scales(x, tile, scales, want_scales), what)
            parts.note("values", _judge_values(x, deq, want, other, tie), what)
    except Fail as failure:
        raise parts.aborted(failure) from None
    return parts.finish(f"on {len(cases)} matrices (tiles 1×128, 128×128 and 2×16, shapes they divide and shapes "
                        f"with ragged last tiles, outlier channels, blocks five orders of magnitude apart, a tile of "
                        f"zeros): scales to {TOLERANCE:g}, every number against e4m3's table")
