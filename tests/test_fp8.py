"""pplab.fp8 and pplab.zero.fp8_gather against independent references: the formats' numbers decoded
from their bit fields by hand, tile scales by a loop over the tiles, the emulated matmul against
torch's matmul on pre-rounded inputs, and FSDP's fp8 gathers against one process and the formula."""
import math

import pytest
import torch
from torch import nn

import pplab
from pplab import fp8
from pplab.zero.fp8_gather import Fp8GatherFSDP, gather_bytes


def _decode(code, e, m):
    """An 8-bit pattern's value by the formula: normal (1 + M/2^m)·2^(E-b), subnormal (M/2^m)·2^(1-b)."""
    sign = -1.0 if code >> 7 else 1.0
    E, M, bias = (code >> m) & (2 ** e - 1), code & (2 ** m - 1), 2 ** (e - 1) - 1
    return sign * (M / 2 ** m * 2.0 ** (1 - bias) if E == 0 else (1 + M / 2 ** m) * 2.0 ** (E - bias))


def _table(fmt):
    f = fp8.FORMATS[fmt]
    values = torch.tensor([_decode(c, f.exponent_bits, f.mantissa_bits) for c in range(128)], dtype=torch.float64)
    finite = torch.isfinite(torch.arange(128, dtype=torch.uint8).view(f.dtype).float())
    return values[finite]                               # every finite number >= 0, ascending


def _nearest(x, fmt):
    """Round to the nearest finite fp8 number by searching the table (ties: the even code), saturating."""
    table = _table(fmt)
    a = x.double().abs().clamp(max=float(table[-1]))
    hi = torch.searchsorted(table, a).clamp(1, len(table) - 1)
    d_lo, d_hi = a - table[hi - 1], table[hi] - a
    up = (d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0))
    return (x.sign() * torch.where(up, table[hi], table[hi - 1])).float()


@pytest.mark.parametrize("fmt, top, normal, subnormal", [("e4m3", 448.0, 2.0 ** -6, 2.0 ** -9),
                                                         ("e5m2", 57344.0, 2.0 ** -14, 2.0 ** -16)])
def test_formats_are_the_published_numbers_and_torchs(fmt, top, normal, subnormal):
    f = fp8.fp8_format(fmt)
    table = _table(fmt)
    assert (f.max, f.min_normal, f.min_subnormal) == (top, normal, subnormal)     # Micikevicius et al. 2022
    assert float(table[-1]) == top and float(table[1]) == subnormal
    assert torch.finfo(f.dtype).max == top and torch.finfo(f.dtype).tiny == normal


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_rounding_is_nearest_even_by_table_and_saturates(fmt):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(20000, generator=g) * 10.0 ** (torch.rand(20000, generator=g) * 12 - 7)
    f = fp8.FORMATS[fmt]
    x = torch.cat([x, torch.tensor([f.max * 1.5, -f.max * 4, 1e30, f.min_subnormal / 2, 1.0625])])
    assert torch.equal(fp8.round_to_fp8(x, fmt), _nearest(x, fmt))
    assert fp8.round_to_fp8(torch.tensor([1e30]), fmt).item() == f.max          # saturates, never inf
    assert fp8.round_to_fp8(torch.tensor([1.0625]), "e4m3").item() == 1.0       # a tie, to the even mantissa


def _loop_reference(x, tile, top=448.0):
    rows, cols = x.shape
    scales = torch.zeros(math.ceil(rows / tile[0]), math.ceil(cols / tile[1]))
    out = torch.zeros_like(x)
    for i, r in enumerate(range(0, rows, tile[0])):
        for j, c in enumerate(range(0, cols, tile[1])):
            block = x[r:r + tile[0], c:c + tile[1]]
            s = float(block.abs().max()) / top
            scales[i, j] = s
            if s > 0:
                out[r:r + tile[0], c:c + tile[1]] = _nearest(block / s, "e4m3") * s
    return out, scales


@pytest.mark.parametrize("shape, tile", [((5, 300), (1, 128)), ((4, 256), (1, 128)), ((150, 200), (128, 128)),
                                         ((7, 33), (3, 5)), ((1, 1), (1, 128))])
def test_tiles_against_a_loop_over_tiles(shape, tile):
    g = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(*shape, generator=g) * 10.0 ** (torch.rand(shape[0], 1, generator=g) * 4 - 3)
    x[0, :min(tile[1], shape[1])] = 0.0 if shape[0] > tile[0] else x[0, :min(tile[1], shape[1])]
    q, scales = fp8.quantise_tiles(x, tile)
    want, want_scales = _loop_reference(x, tile)
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape
    torch.testing.assert_close(scales, want_scales, rtol=1e-6, atol=0)
    deq = fp8.dequantise_tiles(q, scales, tile)
    assert not torch.isnan(deq).any()
    torch.testing.assert_close(deq, want, rtol=2e-6, atol=0)
    assert tuple(scales.shape) == fp8.tile_grid(shape, tile)


def test_per_tensor_is_one_tile_and_delayed_scaling_saturates():
    x = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    q, scale = fp8.quantise_tensor(x, "e5m2")
    assert math.isclose(float(scale), float(x.abs().max()) / 57344, rel_tol=1e-6)
    assert torch.equal(q.float(), _nearest(x / scale, "e5m2"))
    q4, scale4 = fp8.quantise_tensor(x)
    tiles_q, tiles_s = fp8.quantise_tiles(x, tuple(x.shape))
    assert torch.equal(q4.float(), tiles_q.float()) and float(tiles_s) == float(scale4)

    delayed = fp8.DelayedScaling(history=2)
    sizes = [1.0, 2.0, 1.0, 0.5, 0.5]
    for k, amax in enumerate(sizes):
        y = torch.tensor([amax, -amax / 2, amax / 8])
        q, scale = delayed.quantise(y)
        history = sizes[max(0, k - 2):k] or [amax]          # the scale: max of the last 2 amaxes
        assert math.isclose(float(scale), max(history) / 448, rel_tol=1e-6), k
    assert delayed.saturated == 1                          # only step 1's 2.0 beyond its history's 1.0
    with pytest.raises(ValueError, match="history must be a whole number"):
        fp8.DelayedScaling(history=0)


def test_emulated_linear_against_torch_on_rounded_inputs():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 5, 200, generator=g, requires_grad=True)
    layer = nn.Linear(200, 70)
    dense = nn.Linear(200, 70)
    dense.load_state_dict(layer.state_dict())
    fp8.emulate_matmuls(nn.Sequential(layer), "fp8_tiles")
    assert isinstance(layer, fp8.EmulatedLinear)
    y = layer(x)
    rows = x.detach().reshape(-1, 200)
    xq = _loop_reference(rows, (1, 128))[0]
    wq = _loop_reference(dense.weight.detach(), (128, 128))[0]
    torch.testing.assert_close(y.reshape(-1, 70), xq @ wq.t() + dense.bias, rtol=1e-5, atol=1e-5)
    gy = torch.randn(3, 5, 70, generator=g)
    y.backward(gy)
    gq = _loop_reference(gy.reshape(-1, 70), (1, 128))[0]
    torch.testing.assert_close(x.grad.reshape(-1, 200), gq @ wq, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(layer.weight.grad, gq.t() @ xq, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(layer.bias.grad, gy.reshape(-1, 70).sum(0), rtol=1e-5, atol=1e-5)
    for recipe, cast in (("fp32", lambda t: t), ("bf16", lambda t: t.bfloat16().float())):
        layer.recipe = recipe
        torch.testing.assert_close(layer(rows), cast(rows) @ cast(dense.weight).t() + dense.bias, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("call, match", [
    (lambda: fp8.fp8_format("e3m4"), "fmt must be 'e4m3' or 'e5m2'"),
    (lambda: fp8.quantise_tiles(torch.zeros(4), (1, 128)), "x must be a 2-D floating-point tensor"),
    (lambda: fp8.quantise_tiles(torch.zeros(2, 2), (0, 128)), r"tile must be \(rows, columns\)"),
    (lambda: fp8.quantise_tiles(torch.zeros(2, 2), 128), r"tile must be \(rows, columns\)"),
    (lambda: fp8.dequantise_tiles(torch.zeros(2, 300).to(torch.float8_e4m3fn), torch.zeros(2, 2)), "has \\(2, 3\\) scales"),
    (lambda: fp8.emulate_matmuls(nn.Linear(2, 2), "fp4"), "recipe must be one of"),
    (lambda: fp8.fake_quantise(torch.zeros(2, 2), "int8"), "recipe must be one of"),
])
def test_bad_input_says_what_to_change(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def _fsdp_step(fp8_gather, block):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(20, 90), nn.GELU(), nn.Linear(90, 7))
    fsdp = Fp8GatherFSDP(model, fp8=fp8_gather, block=block, compute_dtype=torch.float32)
    x = torch.randn(4, 20, generator=torch.Generator().manual_seed(1 + torch.distributed.get_rank()))
    out = fsdp(x)
    out.pow(2).mean().backward()
    return {"out": out.detach(), "shards": [u.shard.numel() for u in fsdp.units]}


@pytest.mark.parametrize("p", [2, 3])
def test_fsdp_fp8_gathers_the_rounded_weights_and_the_formulas_bytes(p):
    """Every rank computes with the weights rounded in 1×block tiles of each shard (the forward of
    a dense copy with those weights is the reference), and hands the gathers s + 4⌈s/block⌉ bytes."""
    block = 16
    runs = {on: pplab.launch(_fsdp_step, on, block, world_size=p) for on in (True, False)}
    torch.manual_seed(0)
    dense = nn.Sequential(nn.Linear(20, 90), nn.GELU(), nn.Linear(90, 7))
    with torch.no_grad():
        for layer in (dense[0], dense[2]):
            flat = torch.cat([layer.weight.reshape(-1), layer.bias])
            s = math.ceil(flat.numel() / p)
            padded = torch.cat([flat, torch.zeros(s * p - flat.numel())]).view(p, s)
            rounded = torch.cat([_loop_reference(row.view(1, -1), (1, block))[0].view(-1) for row in padded])
            layer.weight.copy_(rounded[:layer.weight.numel()].view_as(layer.weight))
            layer.bias.copy_(rounded[layer.weight.numel():flat.numel()])
    for rank in range(p):
        x = torch.randn(4, 20, generator=torch.Generator().manual_seed(1 + rank))
        torch.testing.assert_close(runs[True][rank]["out"], dense(x), rtol=1e-5, atol=1e-6)
    for on, result in runs.items():
        shards = result[0]["shards"]
        for rank in range(p):
            paid = sum(e.meta["payload"] for e in result.timeline.select(rank, "comm", "all_gather"))
            assert paid == 2 * sum(gather_bytes(s, fp8=on, element_size=4, block=block) for s in shards)
    assert gather_bytes(1000, block=128) == 1000 + 4 * 8 and gather_bytes(1000, fp8=False) == 2000


def test_fsdp_fp8_refuses_a_bad_block():
    with pytest.raises(ValueError, match="block must be a whole number"):
        Fp8GatherFSDP(nn.Linear(2, 2), block=0)
