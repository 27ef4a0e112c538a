"""Chapter 6's FSDP capstone check: registered with its wrong answers, its helpers against values
worked out by hand, and another correct design passing every part. The solution passing, the
stub failing and every wrong answer of wrong_solutions_ch06_fsdp.py failing with its message
are run by tests/test_checks.py, the solution as source by tests/test_checks_sealed.py."""
import re

import pytest
import torch
from torch import nn

from pplab import checks
from pplab.checks.ch06_zero import fsdp as capstone
from pplab.checks.ch06_zero.fsdp_rank import flat_padded, reachable_tensors
from pplab.checks.ch06_zero.fsdp_reference import _expected
from wrong_solutions_ch06_fsdp import WRONG, FlatViews, OnlyRank0Steps

pytestmark = pytest.mark.usefixtures("no_leftover_processes")


def test_the_capstone_registers_one_exercise_with_its_wrong_answers():
    ids = sorted(i for i, ex in checks.EXERCISES.items() if ex.checker.__module__ == capstone.__name__)
    assert ids == ["fsdp"] == sorted(WRONG)
    ex = checks.get_exercise("fsdp")
    assert ex.notebook == "06_fsdp" and ex.points == 5 and ex.answer == "FSDP" and ex.sealed
    assert OnlyRank0Steps in [fn for fn, _, _ in WRONG["fsdp"]]           # wrong on ranks other than 0 only


def test_another_correct_design_passes_every_part():
    """Parameters as views of one flat buffer whose storage shrinks to 0 bytes between uses,
    torch.distributed's collectives, gradients divided by N before the reduce-scatter (another
    rounding than the solution's: within the tolerance for fp16 and bf16)."""
    result = checks.run_check("fsdp", FlatViews, seed=3)
    assert result, result.message
    assert "Parts: forward ✔ · backward ✔ · memory ✔ · traffic ✔ · low precision ✔ (5 of 5)" in result.message


# -- the helpers, by hand ---------------------------------------------------------------

def test_flat_padded_by_hand():
    flat = flat_padded([torch.tensor([[1, 2], [3, 4]]), torch.tensor([5])], 3)
    assert flat.dtype == torch.float32 and flat.tolist() == [1, 2, 3, 4, 5, 0]
    assert flat_padded([torch.ones(4)], 2, torch.bfloat16).tolist() == [1, 1, 1, 1]


def test_where_names_the_parameter_or_the_padding():
    ref = {"names": [[("w", torch.Size([2, 3])), ("b", torch.Size([2]))]], "kinds": ["Linear"]}
    assert capstone._where(ref, 0, 4) == "unit 0 (Linear), w[1, 1]"
    assert capstone._where(ref, 0, 6) == "unit 0 (Linear), b[0]"
    assert capstone._where(ref, 0, 8) == "unit 0 (Linear), padding element 0"


def test_reachable_tensors_follows_what_python_can_see():
    a, b, c, g, hidden = (torch.zeros(n) for n in (2, 3, 5, 7, 11))
    p = nn.Parameter(torch.zeros(7))
    p.grad = g

    class Holder:
        pass
    h = Holder()
    h.items, h.fn, h.p, h.torch = [a, {"k": (b,)}], (lambda: c), p, torch     # a module is not followed
    assert {id(t) for t in reachable_tensors([h])} == {id(a), id(b), id(c), id(p), id(g)}
    assert id(hidden) not in {id(t) for t in reachable_tensors([torch])}


def test_expected_step_sums_in_the_compute_dtype_and_allows_two_roundings():
    grads = [[torch.tensor([1.0, 3.0], dtype=torch.bfloat16)], [torch.tensor([2.0, -3.0], dtype=torch.bfloat16)]]
    want = _expected([1.0, 2.0], grads, 2, torch.bfloat16)
    assert want["grads"][0].tolist() == [1.5, 0.0] and want["grads"][0].dtype == torch.float32
    tiny = 2 * torch.finfo(torch.bfloat16).tiny * torch.finfo(torch.bfloat16).eps
    assert torch.allclose(want["slack"][0], torch.tensor([2**-6 * 1.5 + tiny, 2**-6 * 3 + tiny]))
    assert want["local"][1][0].tolist() == [2.0, -3.0]


def _record(p, sizes, b, prefetch=True, reduce="reduce_scatter_tensor"):
    """A right FSDP's record for every step (or one mistake), and the phases in order."""
    n, calls, order = len(sizes), [], []
    for step in range(capstone.STEPS):
        names = ["forward"] + [x for k in range(n) for x in (f"F{k}", f"F{k}/")] + ["backward"]
        names += [x for k in reversed(range(n)) for x in ([f"B{k}", f"B{k}/"] if k else ["B0"])] + ["step"]
        order += [f"{step}:{x}" for x in names]

        def call(kind, size, phase):
            calls.append({"kind": kind, "bytes": size * b, "phase": f"{step}:{phase}", "async": kind[:3] == "all",
                          "group": list(range(p)), "waited": None})
        for k, size in enumerate(sizes):                # prefetched: unit k's gather before unit k-1 computes
            call("all_gather_into_tensor", size, ("forward" if k < 2 else f"F{k - 2}/") if prefetch else
                 ("forward" if k == 0 else f"F{k - 1}/"))
        for k in reversed(range(n)):
            call("all_gather_into_tensor", sizes[k], "backward" if k >= n - 2 else f"B{k + 2}/")
            call(reduce, p * sizes[k], f"B{k}")
    return {r: {"collectives": calls} for r in range(p)}, order


@pytest.mark.parametrize("mistake, words", [
    ({}, None),
    ({"prefetch": False}, r"^step 1, rank 0 did not prefetch unit 1 in forward: its all-gather started after unit 0 "
                          r"computed"),
    ({"reduce": "all_reduce"}, r"^step 1, rank 0 called all_reduce on the gradients: an all-reduce sends twice"),
    ({"b": 4}, r"^step 1, rank 0's all-gather in forward of a unit of 3 elements per shard put in 12 bytes, 4 per "
               r"element, expected 2: all-gather the shard cast to compute_dtype"),
])
def test_traffic_mistakes_are_named_from_a_record_made_by_hand(mistake, words):
    b = mistake.pop("b", 2)
    traffic, order = _record(2, [3, 5, 4], b, **mistake)
    problem = capstone._traffic_problem(traffic, order, 2, [3, 5, 4], 2)
    assert (problem is None) if words is None else re.search(words, problem or ""), problem


def test_a_step_without_backward_all_gathers_is_named():
    traffic, order = _record(2, [3, 5], 4)
    traffic[0]["collectives"] = [c for c in traffic[0]["collectives"]
                                 if not (c["kind"] == "all_gather_into_tensor" and ":B" in c["phase"] or
                                         c["phase"].endswith(":backward"))]
    assert re.search(r"^step 1, rank 0 made no all-gather in backward: the full parameters were kept from forward",
                     capstone._traffic_problem(traffic, order, 2, [3, 5], 4))


def test_memory_bounds_by_hand():
    sizes, b = [3, 5], 4                                  # p = 2: full units of 24 and 40 bytes; 16 × 8 = 128 held
    held = {"shards": 32, "their gradients": 32, "AdamW state": 64, "units' parameters and gradients": 0, "other": 0}

    def obs(gathered, kept):
        return {r: {"steps": [{"gathered": gathered, "held": kept}] * capstone.STEPS} for r in range(2)}
    assert capstone._memory_problem(obs([("F0", [24, 0], 40), ("B1", [0, 40], 24)], held), 2, sizes, b) is None
    too_much = capstone._memory_problem(obs([("F0", [24, 40], 40)], held), 2, sizes, b)
    assert re.search(r"^step 1, rank 0: while unit 0 computed its forward, it held 104 bytes of full parameters "
                     r"\(the parameters of units 0, 1, and 40 bytes .*more than the 64 of unit 0 and the prefetched "
                     r"unit 1", too_much)
    kept = capstone._memory_problem(obs([], {**held, "units' parameters and gradients": 40}), 2, sizes, b)
    assert re.search(r"^after step 1, rank 0 held 168 bytes .* 16 × 8 = 128\. The units' full parameters or "
                     r"gradients are still held", kept)


class ReturnsSequenceFirst(FlatViews):
    """Returns the logits as the blocks hold them, [s, b, vocab], not batch first."""

    def __call__(self, ids):
        return super().__call__(ids).transpose(0, 1)


def test_logits_of_the_wrong_shape_are_named():
    result = checks.run_check("fsdp", ReturnsSequenceFirst)
    assert re.search(r"^world_size=2, compute_dtype=fp32, .*: fsdp\(ids\) returned \[\d, [12], \d+\]; expected the "
                     r"logits, a tensor of shape \[[12], \d, \d+\]\.", result.message), result.message
    assert result.score == 0
