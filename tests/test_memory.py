"""pplab.memory against bytes worked out by hand: what known ops save for backward, the state of a
model and its optimizer, and the live and peak bytes of a sequence of allocations and frees."""
import pytest
import torch
from torch import nn

from pplab.memory import PeakMemory, activation_bytes_formula, saved_activations, state_bytes

F32, F64 = 4, 8                                   # bytes per element


# ----------------------------------------------------------------------------------
# saved_activations


def test_a_linear_saves_its_input_and_the_weight_is_left_out():
    lin = nn.Linear(4, 3)
    x = torch.randn(5, 4, requires_grad=True)
    with saved_activations(lin.parameters()) as saved:
        lin(x)
    assert saved.bytes == 5 * 4 * F32             # x, for the weight's gradient
    with saved_activations() as everything:
        lin(x)
    assert everything.bytes == 5 * 4 * F32 + 3 * 4 * F32     # and the weight, for x's gradient


def test_a_product_saves_both_factors_and_a_sum_saves_nothing():
    x = torch.randn(3, dtype=torch.float64, requires_grad=True)
    y = torch.randn(7, 3, dtype=torch.float64, requires_grad=True)
    with saved_activations() as saved:
        (x * y).sum()
    assert saved.bytes == 3 * F64 + 7 * 3 * F64
    with saved_activations() as saved:
        (x + x).sum()
    assert saved.bytes == 0


def test_two_saved_views_of_one_storage_count_it_once_and_whole():
    w = torch.randn(10, requires_grad=True)
    with saved_activations() as saved:
        z = w * 3                                 # saves nothing (a constant factor)
        z[:4].sin(), z[4:].sin()                  # each saves its slice: both look into z's storage
    assert saved.bytes == 10 * F32                # z's 10 floats once, not 4 + 6 apart, not twice


def test_activation_formula_by_hand_for_a_gpt3_layer():
    """Korthikanti et al.'s s·b·h·(34 + 5as/h), GPT-3 175B's layer: s = 2048, h = 12288, a = 96:
    5as/h = 80, so 114·s·h bytes per sample; tensor parallel over 8: 10 + 24/8 + 80/8 = 23; with
    sequence parallelism 114/8."""
    s, h, a = 2048, 12288, 96
    assert activation_bytes_formula(s, 1, h, a) == 114 * s * h == 2_868_903_936
    assert activation_bytes_formula(s, 2, h, a, t=8, sequence_parallel=False) == 23 * s * 2 * h
    assert activation_bytes_formula(s, 2, h, a, t=8) == 114 * s * 2 * h / 8
    with pytest.raises(ValueError, match="t >= 1"):
        activation_bytes_formula(s, 1, h, a, t=0)


# ----------------------------------------------------------------------------------
# state_bytes


def test_adam_holds_two_moments_per_parameter_and_a_step_counter():
    lin = nn.Linear(4, 3)                         # 12 + 3 parameters
    opt = torch.optim.Adam(lin.parameters())
    assert state_bytes(lin, opt).total == 15 * F32          # no gradients, no state yet
    lin(torch.randn(2, 4)).sum().backward()
    opt.step()
    got = state_bytes(lin, opt)
    assert (got.parameters, got.gradients) == (15 * F32, 15 * F32)
    assert got.optimizer == 2 * 15 * F32 + 2 * F32          # exp_avg, exp_avg_sq; a float32 step per tensor
    assert got.total == 15 * F32 * 4 + 2 * F32


def test_sgd_with_momentum_holds_one_buffer_without_none():
    model = nn.Linear(3, 2).double()              # 6 + 2 parameters
    for momentum, want in ((0.9, 8 * F64), (0.0, 0)):
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum)
        model(torch.randn(1, 3, dtype=torch.float64)).sum().backward()
        opt.step()
        assert state_bytes(model.parameters(), opt).optimizer == want


def test_parameters_and_gradients_in_one_flat_buffer_count_it_once():
    flat, grads = torch.zeros(10), torch.zeros(10)
    a, b = nn.Parameter(flat[:4]), nn.Parameter(flat[4:])   # views, as a ZeRO flat buffer
    a.grad, b.grad = grads[:4], grads[4:]
    tied = nn.Linear(2, 2, bias=False)
    got = state_bytes([a, b, a])                  # the same parameter twice, too
    assert (got.parameters, got.gradients, got.optimizer) == (10 * F32, 10 * F32, 0)
    assert state_bytes(nn.Sequential(tied, tied)).parameters == 4 * F32      # tied weights


def test_state_bytes_says_what_it_takes():
    with pytest.raises(TypeError, match="nn.Module or an iterable"):
        state_bytes(42)
    with pytest.raises(TypeError, match="must hold tensors"):
        state_bytes([1, 2])
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        state_bytes(nn.Linear(2, 2), optimizer={"lr": 0.1})


# ----------------------------------------------------------------------------------
# PeakMemory


def test_peak_of_allocations_and_frees_by_hand():
    before = torch.randn(100)                     # made before the block: never counted
    with PeakMemory() as mem:
        a = torch.empty(10)                       # 40
        b = a * 2                                 # 80
        del a                                     # 40
        c = torch.zeros(25, dtype=torch.float64)  # 240
        view = c[3:].view(-1)                     # a view: 240 still
        d = before + 1                            # 640: the peak
        before.add_(1)                            # in place on an outside tensor: nothing new
        del d, b                                  # 200
        e = torch.ones(5)                         # 220
    assert (mem.peak, mem.live) == (640, 220)
    del c
    assert mem.live == 220                        # the view keeps c's storage
    del view
    assert mem.live == 20                         # e only
    f = torch.ones(1000)                          # after the block: not counted
    assert (mem.peak, mem.live) == (640, 20)
    del e, f


def test_count_follows_only_the_tensors_it_picks():
    with PeakMemory(count=lambda t: t.dtype == torch.bfloat16) as half, PeakMemory() as every:
        x = torch.ones(8, dtype=torch.bfloat16)   # 16 B, both
        y = x.float()                             # 32 B, every only
        z = y.to(torch.bfloat16)                  # 16 B, both
    assert (half.peak, every.peak) == (32, 64)
    del x, y, z
    assert half.live == every.live == 0
    with pytest.raises(TypeError, match="function of a tensor"):
        PeakMemory(count=True)


def test_backward_inside_the_block_is_counted():
    """(w·x).sum() with x made inside, then backward: the product (12 B) is freed once summed (mul
    saves w and x, not its output); backward adds the upstream ones (4 B) and w.grad (12 B), then
    frees the ones. Peak: x + loss + ones + w.grad."""
    w = torch.randn(3, requires_grad=True)
    with PeakMemory() as mem:
        x = torch.ones(3)
        loss = (w * x).sum()
        loss.backward()
    assert mem.peak == 3 * F32 + F32 + F32 + 3 * F32
    assert mem.live == 3 * F32 + F32 + 3 * F32            # x, loss, w.grad
    del x, loss
    assert mem.live == 3 * F32
    w.grad = None
    assert mem.live == 0


def test_saved_slices_count_their_own_bytes_when_asked():
    """A micro-batch is a slice of the batch: by storage, each counts the whole batch; with
    slices=True each counts its 2 rows (2 x 4 float32 = 32 B per tensor)."""
    batch = torch.randn(8, 4)
    w = torch.randn(4, 4, requires_grad=True)
    for slices, expected in ((False, 8 * 4 * 4), (True, 2 * 4 * 4)):
        with saved_activations([w], slices=slices) as saved:
            batch[2:4] @ w                       # matmul saves its input (the slice) for w's gradient
        assert saved.bytes == expected, (slices, saved.bytes)


def test_weights_gathered_inside_the_block_are_not_activations_when_moving():
    w = torch.nn.Parameter(torch.randn(4, 4))
    x = torch.randn(2, 4, requires_grad=True)
    for moving, expected in ((False, 4 * 4 * 4 + 2 * 4 * 4), (True, 2 * 4 * 4)):
        with saved_activations([w], moving=moving) as saved:
            w.data = torch.randn(4, 4)           # as ZeRO-3 does: a fresh storage, gathered now
            x @ w                                # saves x (for w's grad) and w (for x's grad)
        assert saved.bytes == expected, (moving, saved.bytes)
