"""The exercises of chapter 8 (expert parallelism): registered with their wrong answers, and other
correct answers pass too (the checks ask for a result, not one way to write it). Every solution
passing, every stub failing and every wrong answer of wrong_solutions_ch08_expert_parallel.py failing with its
message: tests/test_checks.py runs those."""
import math

import pytest
import torch

from pplab import checks
from wrong_solutions_ch08_expert_parallel import WRONG

pytestmark = pytest.mark.usefixtures("no_leftover_processes")

IDS = sorted(i for i, ex in checks.EXERCISES.items() if ex.checker.__module__.startswith("pplab.checks.ch08_expert_parallel."))


def test_chapter_8_registers_its_exercises():
    assert IDS == ["moe_bytes", "moe_dispatch"]
    assert set(WRONG) == set(IDS)
    assert checks.get_exercise("moe_bytes").points == 3


def moe_bytes_by_counting_per_expert(choices, num_experts, capacity_factor, hidden, element_size):
    """Capacity caps each expert's demand (min(C, choices for it)): which choices are dropped does
    not matter for the bytes, only how many per expert. Rows per rank pair from a matrix."""
    p, per = len(choices), num_experts // len(choices)
    kept = torch.zeros(p, p, dtype=torch.long)                  # kept[r, j]: rank r's rows for rank j's experts
    for r, c in enumerate(choices):
        demand = torch.bincount(c.flatten(), minlength=num_experts)
        if capacity_factor is not None:
            demand = demand.clamp(max=math.ceil(capacity_factor * c.numel() / num_experts))
        kept[r] = demand.view(p, per).sum(1)
    off = kept - torch.diag(torch.diag(kept))
    row = hidden * element_size
    return [((p - 1) * per * 8, int(off[r].sum()) * row, int(off[:, r].sum()) * row) for r in range(p)]


def test_other_correct_answers_pass():
    result = checks.run_check("moe_bytes", moe_bytes_by_counting_per_expert)
    assert result, result.message
