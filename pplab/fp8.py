"""Chapter 11b: FP8, 8-bit floating point for the matmuls of a training run, and for what it sends.

An 8-bit float has a sign, e exponent bits and m mantissa bits (Micikevicius et al., *FP8 Formats
for Deep Learning*, 2022). Two formats, both torch dtypes (torch casts to them on the CPU too):

    format  dtype                  max     smallest normal  smallest subnormal  steps per power of 2
    e4m3    torch.float8_e4m3fn    448     2^-6             2^-9                8
    e5m2    torch.float8_e5m2      57344   2^-14            2^-16               4

e4m3 has the finer steps, e5m2 the wider range. 448 is what 4 exponent bits leave: e4m3 has no
infinity, only the all-ones pattern is NaN, so the largest number is 1.75 × 2^8. With so few
bits a tensor must be *scaled* into the format's range first: q = fp8(x / scale), back as
q·scale, with scale = amax / max so that the largest |x| lands on the format's largest number.
Where the scale comes from is the whole question:

* **per tensor, current** (`quantise_tensor`): one scale from this tensor's amax. One outlier
  channel 100× larger than the rest makes the scale 100× coarser for every other number, and the
  small ones fall into the subnormals or to 0.
* **per tensor, delayed** (`DelayedScaling`, Transformer Engine's recipe): the scale comes from the
  largest amax of the last steps' tensors (an amax *history*), so that the amax is known before the
  matmul starts. A tensor larger than all of its history saturates at ±max.
* **per tile** (`quantise_tiles`, DeepSeek-V3, 2024): a scale per 1×128 tile of an activation (per
  token, per 128 channels) and per 128×128 block of a weight. An outlier spoils only its own tile.
  The scales cost 4 bytes per 128 numbers of an activation, 4 per 16,384 of a weight.

`EmulatedLinear` (and `emulate_matmuls(module, recipe)`) runs a Linear layer's three matmuls
(forward, input gradient, weight gradient) with their inputs rounded as a recipe says ("fp32",
"bf16", "fp8_tensor", "fp8_tiles") and the products computed in fp32: on a CPU without FP8 units
this shows what FP8 does to the numbers, not how fast it is. The weights stay fp32 masters.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class Fp8Format:
    """One 8-bit float format: its torch dtype and the numbers that bound it."""

    name: str
    dtype: torch.dtype
    exponent_bits: int
    mantissa_bits: int
    max: float              # largest finite number
    min_normal: float       # smallest number with a full mantissa: 2^(1 - bias)
    min_subnormal: float    # smallest number above 0: one mantissa step below min_normal


# bias = 2^(e-1) - 1. e4m3 (bias 7): the top exponent 15 is usable (only mantissa 111 is NaN), so max
# = 1.110b × 2^8 = 448. e5m2 (bias 15): the top exponent 31 holds inf and NaN as in IEEE, so max =
# 1.11b × 2^15 = 57344.
FORMATS = {
    "e4m3": Fp8Format("e4m3", torch.float8_e4m3fn, 4, 3, 1.75 * 2.0 ** 8, 2.0 ** -6, 2.0 ** -9),
    "e5m2": Fp8Format("e5m2", torch.float8_e5m2, 5, 2, 1.75 * 2.0 ** 15, 2.0 ** -14, 2.0 ** -16),
}
ACTIVATION_TILE = (1, 128)      # DeepSeek-V3: per token, per 128 channels
WEIGHT_TILE = (128, 128)        # DeepSeek-V3: per 128 × 128 block
RECIPES = ("fp32", "bf16", "fp8_tensor", "fp8_tiles")


def fp8_format(fmt) -> Fp8Format:
    """"e4m3" or "e5m2" (or an Fp8Format) -> its Fp8Format."""
    if isinstance(fmt, Fp8Format):
        return fmt
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be 'e4m3' or 'e5m2', got {fmt!r}")
    return FORMATS[fmt]


def to_fp8(x: torch.Tensor, fmt="e4m3") -> torch.Tensor:
    """x rounded to the nearest fp8 number (ties to even), as an fp8 tensor; beyond ±max: ±max.

    We clamp first: torch's casts saturate e4m3 but turn a large number into inf in e5m2, and a
    scaled tensor that outgrew its delayed scale must saturate, not overflow."""
    f = fp8_format(fmt)
    return x.float().clamp(-f.max, f.max).to(f.dtype)


def round_to_fp8(x: torch.Tensor, fmt="e4m3") -> torch.Tensor:
    """x rounded to fp8 and back to fp32: the numbers a matmul in fp8 would see (no scale)."""
    return to_fp8(x, fmt).float()


def _safe(scale: torch.Tensor) -> torch.Tensor:
    return torch.where(scale > 0, scale, torch.ones_like(scale))     # an all-zero tile: q = 0, no 0/0


# ----------------------------------------------------------------------------------
# One scale per tensor: current and delayed


def quantise_tensor(x: torch.Tensor, fmt="e4m3", amax=None):
    """x -> (q, scale): q = fp8(x / scale), scale = amax / fmt.max, one fp32 number.

    amax: None takes this tensor's own max|x| ("current" scaling); a number given (from earlier
    steps: delayed scaling) may be smaller than x's, and then the largest numbers saturate."""
    f = fp8_format(fmt)
    amax = x.detach().abs().max().float() if amax is None else torch.as_tensor(amax, dtype=torch.float32)
    scale = amax / f.max
    return to_fp8(x / _safe(scale), f), scale


def dequantise_tensor(q: torch.Tensor, scale) -> torch.Tensor:
    """q·scale in fp32."""
    return q.float() * torch.as_tensor(scale, dtype=torch.float32)


class DelayedScaling:
    """Per-tensor scaling from an amax history, as Transformer Engine's DelayedScaling recipe.

    Each call to quantise(x) scales x by the largest amax of the last `history` tensors seen
    (the first call, with no history, uses x's own), then records x's amax. The scale is known
    before x is: on a GPU the cast fuses into the kernel that makes x. The price: a tensor whose
    amax jumps above its history saturates; `saturated` counts the numbers clamped so far."""

    def __init__(self, history: int = 16, fmt="e4m3"):
        if isinstance(history, bool) or not isinstance(history, int) or history < 1:
            raise ValueError(f"history must be a whole number of steps >= 1, got {history!r}")
        self.fmt, self.history = fp8_format(fmt), history
        self.amaxes: list[float] = []
        self.saturated = 0

    def quantise(self, x: torch.Tensor):
        """x -> (q, scale) with the scale from the history; then x's amax joins the history."""
        amax_now = float(x.detach().abs().max())
        amax = max(self.amaxes) if self.amaxes else amax_now
        q, scale = quantise_tensor(x, self.fmt, amax)
        self.saturated += int((x.detach().abs() > amax).sum())
        self.amaxes = (self.amaxes + [amax_now])[-self.history:]
        return q, scale


# ----------------------------------------------------------------------------------
# One scale per tile


def _check_tile(x, tile):
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or not x.is_floating_point():
        raise ValueError(f"x must be a 2-D floating-point tensor (rows × columns), got "
                         f"{type(x).__name__ if not isinstance(x, torch.Tensor) else f'{x.dtype} of shape {tuple(x.shape)}'}")
    if not (isinstance(tile, (tuple, list)) and len(tile) == 2
            and all(isinstance(t, int) and not isinstance(t, bool) and t >= 1 for t in tile)):
        raise ValueError(f"tile must be (rows, columns), two whole numbers >= 1, e.g. (1, 128) or (128, 128); "
                         f"got {tile!r}")
    return tuple(tile)


def tile_grid(shape, tile) -> tuple[int, int]:
    """How many tiles cover a (rows, columns) matrix: ⌈rows/tr⌉ × ⌈columns/tc⌉ (the last ones ragged)."""
    return math.ceil(shape[0] / tile[0]), math.ceil(shape[1] / tile[1])


def tile_amax(x: torch.Tensor, tile=ACTIVATION_TILE) -> torch.Tensor:
    """max|x| of each tile, shape tile_grid(x.shape, tile). A ragged tile counts only its own
    numbers: padding with zeros cannot raise a max of absolute values."""
    tile = _check_tile(x, tile)
    (nr, nc), (tr, tc) = tile_grid(x.shape, tile), tile
    padded = torch.zeros(nr * tr, nc * tc)
    padded[:x.shape[0], :x.shape[1]] = x.detach().abs()
    return padded.view(nr, tr, nc, tc).amax(dim=(1, 3))


def per_element(scales: torch.Tensor, tile, shape) -> torch.Tensor:
    """Each number's tile scale, as a matrix of `shape`."""
    return scales.repeat_interleave(tile[0], 0)[:shape[0]].repeat_interleave(tile[1], 1)[:, :shape[1]]


def quantise_tiles(x: torch.Tensor, tile=ACTIVATION_TILE, fmt="e4m3"):
    """x (rows × columns) -> (q, scales): one fp32 scale per tile = its amax / fmt.max, and
    q = fp8(x / its tile's scale), x's shape. tile (1, 128): DeepSeek-V3's activations; (128, 128):
    its weights. Shapes the tile does not divide end in smaller tiles. A tile of zeros: scale 0, q 0."""
    f = fp8_format(fmt)
    scales = tile_amax(x, tile) / f.max
    return to_fp8(x / per_element(_safe(scales), tile, x.shape), f), scales


def dequantise_tiles(q: torch.Tensor, scales: torch.Tensor, tile=ACTIVATION_TILE) -> torch.Tensor:
    """q·(its tile's scale) in fp32."""
    if scales.shape != tile_grid(q.shape, tile):
        raise ValueError(f"a {tuple(q.shape)} matrix in tiles of {tuple(tile)} has {tile_grid(q.shape, tile)} "
                         f"scales, got {tuple(scales.shape)}")
    return q.float() * per_element(scales.float(), tile, q.shape)


def fake_quantise(x: torch.Tensor, recipe: str, tile=ACTIVATION_TILE) -> torch.Tensor:
    """x as a matmul under `recipe` sees it, back in fp32 (quantise, then dequantise)."""
    if recipe == "fp32":
        return x.float()
    if recipe == "bf16":
        return x.to(torch.bfloat16).float()
    if recipe == "fp8_tensor":
        return dequantise_tensor(*quantise_tensor(x))
    if recipe == "fp8_tiles":
        return dequantise_tiles(*quantise_tiles(x, tile), tile)
    raise ValueError(f"recipe must be one of {RECIPES}, got {recipe!r}")


# ----------------------------------------------------------------------------------
# A Linear layer whose matmuls see fp8 inputs


class _EmulatedMatmul(torch.autograd.Function):
    """y = x̂ ŵᵀ, and in backward dx = ĝ ŵ, dw = ĝᵀ x̂, where ^ is the recipe's rounding (tiles:
    x and g in 1×block tiles along their rows, w in block×block). As DeepSeek-V3 does, the output
    gradient g is e4m3 too (finer tiles let it drop e5m2's range); every product sums in fp32."""

    @staticmethod
    def forward(ctx, x, w, recipe, block):
        xq = fake_quantise(x, recipe, (1, block))
        wq = fake_quantise(w, recipe, (block, block))
        ctx.save_for_backward(xq, wq)
        ctx.recipe, ctx.block = recipe, block
        return xq @ wq.t()

    @staticmethod
    def backward(ctx, g):
        xq, wq = ctx.saved_tensors
        gq = fake_quantise(g, ctx.recipe, (1, ctx.block))
        return gq @ wq, gq.t() @ xq, None, None


class EmulatedLinear(nn.Linear):
    """nn.Linear whose three matmuls round their inputs as `recipe` says and compute in fp32.
    The bias is added in fp32 (recipes keep it out of the matmul). block: the tile side (128)."""

    def __init__(self, in_features, out_features, bias=True, recipe="fp8_tiles", block=128):
        super().__init__(in_features, out_features, bias)
        if recipe not in RECIPES:
            raise ValueError(f"recipe must be one of {RECIPES}, got {recipe!r}")
        self.recipe, self.block = recipe, block

    def forward(self, x):
        y = _EmulatedMatmul.apply(x.reshape(-1, x.shape[-1]).float(), self.weight, self.recipe, self.block)
        y = y.reshape(*x.shape[:-1], self.out_features)
        return y + self.bias if self.bias is not None else y


def emulate_matmuls(module: nn.Module, recipe: str, block: int = 128) -> nn.Module:
    """Turn every nn.Linear inside `module` into an EmulatedLinear (the same parameters), in place."""
    if recipe not in RECIPES:
        raise ValueError(f"recipe must be one of {RECIPES}, got {recipe!r}")
    for m in module.modules():
        for name, child in m.named_children():
            if type(child) is nn.Linear:
                child.__class__ = EmulatedLinear       # keeps its weight and bias objects
                child.recipe, child.block = recipe, block
    return module
