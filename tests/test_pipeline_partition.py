"""pplab.pipeline.layer_times and partition(balance="time") against layers whose cost is known by
construction: a layer that spins for a given CPU time, one that sleeps (wall-clock time, no CPU),
and one that is slow on its first call only."""
import time

import torch
from torch import nn

from pplab.pipeline import layer_times, partition


class Spin(nn.Module):
    """Costs `ms` milliseconds of CPU per forward; its backward (a multiplication) costs next to nothing."""

    def __init__(self, ms, first_call_ms=None):
        super().__init__()
        self.ms, self.first_call_ms, self.calls = ms, first_call_ms, 0

    def forward(self, x):
        ms = self.first_call_ms if self.first_call_ms is not None and self.calls == 0 else self.ms
        self.calls += 1
        end = time.process_time() + ms / 1e3
        while time.process_time() < end:
            pass
        return x * 1.0


class Sleep(nn.Module):
    """Takes `ms` milliseconds of wall-clock time and no CPU: waiting, not work."""

    def __init__(self, ms):
        super().__init__()
        self.ms = ms

    def forward(self, x):
        time.sleep(self.ms / 1e3)
        return x * 1.0


SAMPLE = torch.randn(4, 3)
SLACK = 3e-3          # a layer's own overhead (autograd, a multiplication) on a loaded machine, generously


def test_layer_times_are_the_cpu_each_layer_costs():
    times = layer_times([Spin(2), Spin(6), Sleep(30)], SAMPLE)
    assert 2e-3 <= times[0] < 2e-3 + SLACK and 6e-3 <= times[1] < 6e-3 + SLACK
    assert times[2] < SLACK                          # sleeping costs no CPU: no reason to give it a stage


def test_layer_times_leave_out_the_first_call():
    slow_start = Spin(1, first_call_ms=50)
    times = layer_times([slow_start], SAMPLE, repeats=2)
    assert slow_start.calls == 3                     # one warm-up call, then the 2 repeats
    assert 1e-3 <= times[0] < 1e-3 + SLACK


def test_partition_by_time_minimises_the_slowest_stage_of_known_costs():
    layers = [Sleep(20), Spin(1), Spin(1), Spin(1), Spin(1), Spin(4)]      # CPU costs 0, 1, 1, 1, 1, 4 ms
    assert partition(layers, 2, "time", sample=SAMPLE) == [(0, 5), (5, 6)]     # 4 | 4: nothing beats it
    assert partition(layers, 3, "time", sample=SAMPLE) == [(0, 3), (3, 5), (5, 6)]   # 2 | 2 | 4
