"""Near-miss wrong answers to chapter 2's DDP and top-k exercises (issue 38): right at p = 2 and
wrong at p = 3, or just outside the checker's tolerance. Each is a correct answer with one thing
changed; tools/mutants/checks_collectives_dp_clip.py loosens the checker the matching way, and
only these answers catch it. As in wrong_solutions_ch00_broadcast.py: WRONG[exercise_id] lists (answer, regular
expressions the check's message must match, timeout or None).

CLOSE_BUT_RIGHT lists answers that differ from the reference by far less than the tolerance: they
must pass (tests/test_checks_near_miss.py).
"""
import torch

import wrong_solutions_hard as hard
from pplab import comm
from wrong_solutions_chapters import DDP_TRIAL, TOPK, _buckets, _ddp

# ----------------------------------------------------------------------------------
# ddp_buckets (float32, gradients to 1e-5 absolute and 1e-4 relative)


def ddp_divides_by_p_plus_epsilon(model, cap_bytes):
    """Divides by p + 1e-3, an epsilon "against a division by zero": every gradient 0.03% to 0.05% small."""
    return _ddp(model, _buckets(model.parameters(), cap_bytes), divide=comm.world_size() + 1e-3)


# ----------------------------------------------------------------------------------
# topk_error_feedback (values to 1e-6, what was sent + new_memory to 1e-5)


def topk_sends_half_precision_values(grad, memory, k):
    """Sends the values as float16 to halve the bytes again: each rounded to 11 bits."""
    a = grad + memory
    indices = a.abs().topk(k).indices
    new_memory = a.clone()
    new_memory[indices] = 0
    return a[indices].half().float(), indices, new_memory


def topk_keeps_half_precision_memory(grad, memory, k):
    """Keeps the memory (d numbers per rank, as many as the model) in float16 to save memory: what
    was not sent comes back rounded, so what is sent drifts from the gradients' sum."""
    a = grad + memory
    indices = a.abs().topk(k).indices
    new_memory = a.clone()
    new_memory[indices] = 0
    return a[indices], indices, new_memory.half().float()


def topk_memory_decays(grad, memory, k):
    """Keeps the memory with a decay of 0.9999, like a momentum: what was not sent shrinks by 0.01% a
    step, so what is sent falls short of the gradients' sum by ~1e-4 of the memory, in 1e-5."""
    a = grad + memory
    indices = a.abs().topk(k).indices
    new_memory = a.clone()
    new_memory[indices] = 0
    return a[indices], indices, new_memory * 0.9999


def topk_in_float64(grad, memory, k):
    """Right, adding grad and memory in float64: the values differ from float32's by ~1e-8."""
    a = grad.double() + memory.double()
    indices = a.abs().topk(k).indices
    new_memory = a.clone()
    new_memory[indices] = 0
    return a[indices].float(), indices, new_memory.float()


# ----------------------------------------------------------------------------------
# ddp_from_scratch (float64, gradients to 1e-9 relative)


def bucketed_ddp_float32_factor(model, group, cap_bytes):
    """Averages by multiplying with torch.tensor(1 / n), a float32 tensor (torch's default dtype): exact
    for n = 2 and 4, but 1/3 rounded to float32 is off by 3e-8, which a float64 gradient keeps."""
    finish = hard._ddp(model, group, hard._reverse(model, cap_bytes), average=False)

    def averaged():
        finish()
        factor = torch.tensor(1 / comm.world_size(group))
        for q in model.parameters():
            q.grad.mul_(factor)
    return averaged


CLOSE_BUT_RIGHT = {"topk_error_feedback": [topk_in_float64]}

WRONG = {
    "ddp_buckets": [
        (ddp_divides_by_p_plus_epsilon,
         [DDP_TRIAL, r"step 0: rank \d's [\d.]+(weight|bias)\.grad differs from the single-process gradient of the "
          r"whole global batch"], None),
    ],
    "topk_error_feedback": [
        (topk_sends_half_precision_values,
         [TOPK, r"values\[\d+\] is [-\d.e+]+ but the entry at indices\[\d+\] = \d+ of grad \+ memory is [-\d.e+]+\.( Re-run|$)"],
         None),
        (topk_keeps_half_precision_memory,
         [TOPK, r"what was sent so far \+ new_memory should equal the sum of the gradients so far"], None),
        (topk_memory_decays,
         [TOPK, r"what was sent so far \+ new_memory should equal the sum of the gradients so far"], None),
    ],
    "ddp_from_scratch": [
        (bucketed_ddp_float32_factor,
         [r"^world_size=3, MLP widths \[[\d, ]+\], cap_bytes=\d+: step 1: rank \d's [\d.]+(weight|bias)\.grad at .* "
          r"is .*, but the single-process gradient of the group's whole batch is"], None),
    ],
}
