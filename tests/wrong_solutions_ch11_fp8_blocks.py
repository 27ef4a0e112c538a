"""Plausible wrong answers to chapter 11b's FP8 quantisation in tiles, as in wrong_solutions.py:
WRONG[exercise_id] lists (answer, regular expressions the check's message must match, timeout or None);
tests/test_checks.py checks that each fails with its message, tests/test_checks_near_miss.py that each
of CLOSE_BUT_RIGHT passes.

`quantise_blocks` is a correct answer written apart from the solution notebook's (a loop over the
tiles, not a reshape); each wrong one changes one step of it. The near misses: right for 1×128
tiles and wrong for 128×128 ones (the tile's first row only), right when the tile divides the
shape and wrong otherwise (a ragged tile padded with ones), a scale just outside the tolerance.
"""
import math

import torch


def quantise_blocks(x, tile, amax_of=lambda b: b.abs().max(), top=448.0, dtype=torch.float8_e4m3fn,
                    turned=False, pad=0.0, margin=1.0, safe=True):
    if turned:
        tile = (tile[1], tile[0])
    rows, cols = x.shape
    tr, tc = tile
    scales = torch.zeros(math.ceil(rows / tr), math.ceil(cols / tc))
    out = torch.zeros_like(x)
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            block = torch.full((tr, tc), pad)                       # the ragged last tiles, padded
            real = x[i * tr:(i + 1) * tr, j * tc:(j + 1) * tc]
            block[:real.shape[0], :real.shape[1]] = real
            scale = amax_of(block) / top * margin
            scales[i, j] = scale
            divisor = scale if (scale > 0 or not safe) else 1.0
            q = (real / divisor).clamp(-top, top).to(dtype)
            out[i * tr:(i + 1) * tr, j * tc:(j + 1) * tc] = q.float() * scale
    return out, scales


def one_scale_per_tensor(x, tile):
    return quantise_blocks(x, tile, amax_of=lambda b: x.abs().max())


def scale_from_the_mean(x, tile):
    return quantise_blocks(x, tile, amax_of=lambda b: b.abs().mean())


def tiles_turned_round(x, tile):
    """(1, 128) read as 128 rows × 1 column: right for square tiles, wrong for activations'."""
    return quantise_blocks(x, tile, turned=True)


def ragged_tile_padded_with_ones(x, tile):
    """"Pad with ones, so that no tile is all zeros": right where the tile divides the shape."""
    return quantise_blocks(x, tile, pad=1.0)


def e5m2_instead_of_e4m3(x, tile):
    return quantise_blocks(x, tile, top=57344.0, dtype=torch.float8_e5m2)


def scale_with_a_margin(x, tile):
    """A "safety margin" of 5e-5 on every scale: 5 times the tolerance (1e-5)."""
    return quantise_blocks(x, tile, margin=1 + 5e-5)


def divides_by_a_zero_scale(x, tile):
    return quantise_blocks(x, tile, safe=False)


def first_row_of_each_tile(x, tile):
    """The amax of a tile's first row only: right for 1×128 tiles, wrong for 128×128 and 2×16."""
    return quantise_blocks(x, tile, amax_of=lambda b: b[0].abs().max())


def returns_the_fp8_codes(x, tile):
    out, scales = quantise_blocks(x, tile)
    return (out / torch.where(scales > 0, scales, 1.0).repeat_interleave(tile[0], 0)[:x.shape[0]]
            .repeat_interleave(tile[1], 1)[:, :x.shape[1]]).to(torch.float8_e4m3fn), scales


SCALES = r"the scale of tile \(\d+, \d+\) is .*, expected its amax / 448"
WRONG = {"fp8_blocks": [
    (one_scale_per_tensor, [SCALES, r"one scale for the whole tensor", r"scales ✘ · values ✘ \(0 of 2\)"], None),
    (scale_from_the_mean, [SCALES, r"the tile's mean \|x\| / 448", r"scales ✘ · values ✘"], None),
    (tiles_turned_round, [r"^x \d×\d+, tile \(1, 128\): scales has shape \(\d+, \d+\), expected \(\d, \d\)",
                          r"tiles of 128×1, turned round"], None),
    (ragged_tile_padded_with_ones, [SCALES, r"max\(amax, 1\) / 448: the ragged "
                                    r"last tile was padded with ones", r"scales ✘ · values ✘"], None),
    (e5m2_instead_of_e4m3, [SCALES, r"amax / 57344, e5m2's largest number", r"scales ✘ · values ✘"], None),
    (scale_with_a_margin, [r"^x \d×\d+, tile \(1, 128\), " + SCALES, r"1\.0000[45]\d* times the right one "
                           r"\(tolerance 1e-05\)", r"scales ✘ · values ✘"], None),
    (divides_by_a_zero_scale, [r"x\[0, \d+\] = 0 dequantises to nan, expected 0. A NaN: a tile of zeros has scale 0",
                               r"scales ✔ · values ✘ \(1 of 2\)"], None),
    (first_row_of_each_tile, [r"^x \d+×\d+, tile \(128, 128\), " + SCALES, r"scales ✘ · values ✘"], None),
    (returns_the_fp8_codes, [r"dequantised is torch.float8_e4m3fn: return q·scale in float32"], None),
]}


def quantise_in_float64(x, tile):
    """Correct: the same rounding from float64 ratios, the scale as amax · (1/448); within the tolerance."""
    rows, cols = x.shape
    out, scales = torch.zeros_like(x), torch.zeros(math.ceil(rows / tile[0]), math.ceil(cols / tile[1]))
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            real = x[i * tile[0]:(i + 1) * tile[0], j * tile[1]:(j + 1) * tile[1]].double()
            scale = real.abs().max() * (1 / 448)
            scales[i, j] = scale
            q = (real / (scale if scale > 0 else 1.0)).clamp(-448, 448).to(torch.float8_e4m3fn)
            out[i * tile[0]:(i + 1) * tile[0], j * tile[1]:(j + 1) * tile[1]] = (q.double() * scale).float()
    return out, scales


CLOSE_BUT_RIGHT = {"fp8_blocks": [quantise_blocks, quantise_in_float64]}
