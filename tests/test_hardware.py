"""pplab.hardware: the presets against their datasheets, and this machine fitted for real."""
import math

import pytest

from pplab.hardware import A100_80GB, H100_SXM, H200, PRESETS, fit_this_machine, measure_copy_bandwidth, \
    measure_matmul_flops

# The datasheets' headline tensor-core figures are "with sparsity" (2:4): dense is half of them.
SPARSE_BF16 = {A100_80GB: 624e12, H100_SXM: 1979e12, H200: 1979e12}


@pytest.mark.parametrize("hw", [A100_80GB, H100_SXM, H200], ids=lambda hw: hw.name)
def test_presets_hold_the_dense_datasheet_figures(hw):
    assert hw.peak("bf16") == hw.peak("fp16") == pytest.approx(SPARSE_BF16[hw] / 2)
    assert hw.source.startswith("NVIDIA") and "datasheet" in hw.source
    assert PRESETS[hw.name] is hw


def test_memory_links_and_ridge_by_hand():
    assert (A100_80GB.memory, A100_80GB.memory_bandwidth) == (80e9, 2039e9)
    assert (H100_SXM.memory, H100_SXM.memory_bandwidth) == (80e9, 3.35e12)
    assert (H200.memory, H200.memory_bandwidth) == (141e9, 4.8e12)
    assert A100_80GB.nvlink == 300e9 and H100_SXM.nvlink == H200.nvlink == 450e9        # half of 600 / 900 GB/s
    assert A100_80GB.network == 25e9 and H100_SXM.network == 50e9                       # 200 / 400 Gb/s
    assert H100_SXM.ridge("bf16") == pytest.approx(295.4, abs=0.1)           # 989.5e12 / 3.35e12
    assert A100_80GB.ridge("fp32") == pytest.approx(19.5 / 2.039)
    with pytest.raises(ValueError, match="has no 'int4' figure"):
        H100_SXM.peak("int4")


def test_this_machine_is_measured():
    here = fit_this_machine(dtypes=("fp32",), matmul_n=128, copy_bytes=4 * 2 ** 20, repeats=3, seconds_each=0.05)
    assert set(here.flops) == {"fp32"} and here.name == "this machine"
    for value in (here.peak("fp32"), here.memory_bandwidth, here.memory):
        assert math.isfinite(value) and value > 0
    assert "fastest of 0.05 s of timed 128x128 matmuls and of copies of 4 MiB in 16 slices" in here.source
    assert 0 < measure_matmul_flops(64, "fp64", repeats=2, min_seconds=0.01) < math.inf
    assert 0 < measure_copy_bandwidth(2 ** 20, repeats=2, min_seconds=0.01) < math.inf
    with pytest.raises(ValueError, match="dtype must be one of"):
        measure_matmul_flops(64, "int8")


def test_a_measurement_is_its_work_over_the_fastest_try(monkeypatch):
    """The timing replaced by 0.5 s: a matmul of n = 64 is 2·64³ FLOPs, a copy of 1 MiB moves 2 MiB."""
    from pplab import hardware
    monkeypatch.setattr(hardware, "_fastest_seconds", lambda fn, repeats, min_seconds: 0.5)
    assert measure_matmul_flops(64, "fp32") == 2 * 64 ** 3 / 0.5
    assert measure_copy_bandwidth(2 ** 20) == 2 * 2 ** 20 / 0.5


def test_the_fastest_try_on_a_clock_that_moves_only_when_asked(monkeypatch):
    """A made-up clock: each call of fn takes the next of `took` seconds (the first warms up, not
    counted); tries go on until `repeats` are done and `min_seconds` have passed."""
    from pplab import hardware
    clock, took, calls = [0.0], iter([100.0, 3.0, 1.0, 2.0, 0.5]), []

    def fn():
        calls.append(1)
        clock[0] += next(took)
    monkeypatch.setattr(hardware.time, "perf_counter", lambda: clock[0])
    assert hardware._fastest_seconds(fn, repeats=3, min_seconds=0.0) == 1.0 and len(calls) == 4
    clock[0], took, calls[:] = 0.0, iter([100.0, 3.0, 1.0, 2.0, 0.5]), []
    # one try is enough by count, but 5 s must pass: 3 + 1 + 2 = 6 s, three tries
    assert hardware._fastest_seconds(fn, repeats=1, min_seconds=5.0) == 1.0 and len(calls) == 4


def test_this_machines_peak_is_one_cores_times_the_cores(monkeypatch):
    import os

    import torch

    from pplab import hardware
    threads = []
    monkeypatch.setattr(hardware, "measure_matmul_flops",
                        lambda n, dtype, repeats, min_seconds: threads.append(torch.get_num_threads()) or 2e9)
    assert hardware.peak_here.__wrapped__("fp32") == len(os.sched_getaffinity(0)) * 2e9 and threads == [1]


def test_this_machine_is_one_cores_tries_times_the_cores(monkeypatch):
    """The fastest tries replaced by hand values: an fp32 matmul of n = 64 in 1 ms and fp64 in 2 ms,
    a slice of 1 MiB / 16 copied in 0.1 ms; each figure is one core's times the cores, timed on one
    thread, and the thread count is restored afterwards."""
    import os

    import torch

    from pplab import hardware
    seen = []

    def fake(fns, repeats, min_seconds):
        seen.append((len(fns), torch.get_num_threads(), min_seconds))
        for fn in fns:
            fn()                                   # each really runs (the copy sweeps its slices)
        return [1e-3, 2e-3, 1e-4]
    monkeypatch.setattr(hardware, "_fastest_interleaved", fake)
    before = torch.get_num_threads()
    here = fit_this_machine(matmul_n=64, copy_bytes=2 ** 20, seconds_each=0.25)
    cores = len(os.sched_getaffinity(0))
    assert here.peak("fp32") == pytest.approx(cores * 2 * 64 ** 3 / 1e-3)
    assert here.peak("fp64") == pytest.approx(cores * 2 * 64 ** 3 / 2e-3)
    assert here.memory_bandwidth == pytest.approx(cores * 2 * (2 ** 20 // 16) / 1e-4)
    assert seen == [(3, 1, 0.75)] and torch.get_num_threads() == before
    with pytest.raises(ValueError, match="dtype must be one of"):
        fit_this_machine(dtypes=("fp32", "int8"))


def test_interleaved_tries_on_a_clock_that_moves_only_when_asked(monkeypatch):
    """Two functions tried in turn (after one warm-up each): a takes 3, 1, 2 s, b takes 5, 4, 6 s;
    each keeps its own fastest, and rounds go on until `repeats` and `min_seconds` are both met."""
    from pplab import hardware
    clock, order = [0.0], []

    def timed(name, took):
        took = iter(took)

        def fn():
            order.append(name)
            clock[0] += next(took)
        return fn
    monkeypatch.setattr(hardware.time, "perf_counter", lambda: clock[0])
    a, b = timed("a", [100, 3, 1, 2]), timed("b", [100, 5, 4, 6])
    assert hardware._fastest_interleaved([a, b], repeats=3, min_seconds=0.0) == [1, 4]
    assert order == ["a", "b"] * 4
    clock[0], order[:] = 0.0, []
    a, b = timed("a", [100, 3, 1, 2]), timed("b", [100, 5, 4, 6])
    # one round is enough by count, but 12 s must pass: 3 + 5 = 8 s, then 1 + 4 = 13 s, two rounds
    assert hardware._fastest_interleaved([a, b], repeats=1, min_seconds=12.0) == [1, 4]
    assert order == ["a", "b"] * 3


def test_core_share_on_made_up_clocks(monkeypatch):
    """Wall-clock ticks 0.1 s per reading, CPU time 0.05 s: the process got half a core."""
    from pplab import hardware
    wall, cpu = iter(i / 10 for i in range(100)), iter(i / 20 for i in range(100))
    monkeypatch.setattr(hardware.time, "perf_counter", lambda: next(wall))
    monkeypatch.setattr(hardware.time, "process_time", lambda: next(cpu))
    # readings: wall 0 (start), 0.1 (loop test: go on), 0.2 (stop at 0.2 s), 0.3 (end); cpu 0, 0.05
    assert hardware.core_share(0.2) == pytest.approx(0.05 / 0.3)


def test_core_share_falls_beside_two_spin_loops_per_core():
    """Beside two spinners per core this process can get at most a third of a core on average
    (every core shared three ways); 0.8 leaves a wide margin for the scheduler's unfairness."""
    from busy_load import busy

    from pplab.hardware import core_share
    with busy():
        assert core_share(0.3) < 0.8
