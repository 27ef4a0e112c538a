"""Plausible wrong answers to the capstone `pp_dp_train_step` (a pipeline × data parallel trainer),
each one mistake a student could make, one of them wrong on ranks other than 0 only.

WRONG[exercise_id] lists (function, regular expressions the check's message must match, timeout
for the check or None for the default), as in wrong_solutions_ch00_broadcast.py. Every answer here is one
implementation, `_step`, with one switch turned.
"""
import torch

from pplab import comm
from pplab.pipeline import run_pipeline
from wrong_solutions_hard import receive as _receive, send as _send   # pipeline_executor's notebook helpers




def _order(m, pp, s, schedule, dp=None):
    """[("F", i) / ("B", i)]: 1F1B (warm-up of pp - s - 1 forwards), 1F1B with one warm-up forward
    too many, with pp - 1 on every stage, with dp - s - 1 (the other group's size), or GPipe (every
    forward, then every backward)."""
    if schedule == "gpipe":
        return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
    warmup = {"warm-up + 1": pp - s, "warm-up pp - 1": pp - 1, "warm-up from dp": max(0, dp - s - 1)}.get(
        schedule, pp - s - 1)
    warmup = min(warmup, m)
    order = [("F", i) for i in range(warmup)]
    for i in range(m - warmup):
        order += [("F", warmup + i), ("B", i)]
    return order + [("B", i) for i in range(m - warmup, m)]


def _step(stage, inputs, targets, loss_fn, m, pp_group, dp_group, schedule="1f1b", micro=None, reduce_over="dp",
          divide=True, divide_on_rank_0_only=False, loss_summed=False, one_over_m=None):
    pp, s = comm.world_size(pp_group), comm.rank(pp_group)
    ranks = comm.group_ranks(pp_group)
    prev, nxt = (ranks[s - 1] if s > 0 else None), (ranks[s + 1] if s < pp - 1 else None)
    xs, ys = inputs.chunk(m), targets.chunk(m)
    held, handles, loss = {}, [], 0.0
    scale = 1 / m if one_over_m is None else one_over_m(m)
    for kind, i in _order(micro or m, pp, s, schedule, comm.world_size(dp_group)):
        if kind == "F":
            x = xs[i] if prev is None else _receive(xs[i], prev).requires_grad_()
            out = stage(x)
            if nxt is None:
                out = loss_fn(out, ys[i]) * scale
                loss += out.item() * (m if loss_summed else 1)
            else:
                handles.append(_send(out, nxt))
            held[i] = (x, out)
        else:
            x, out = held.pop(i)
            torch.autograd.backward(out, None if nxt is None else _receive(out, nxt))
            if prev is not None:
                handles.append(_send(x.grad, prev))
    for handle in handles:
        handle.wait()
    if reduce_over:
        group = dp_group if reduce_over == "dp" else pp_group
        params = list(stage.parameters())
        flat = torch.cat([q.grad.flatten() for q in params])
        comm.all_reduce(flat, group=group)
        if divide and (comm.rank() == 0 or not divide_on_rank_0_only):
            flat /= comm.world_size(dp_group)
        for q, g in zip(params, flat.split([q.numel() for q in params])):
            q.grad.copy_(g.view_as(q))
    return loss if nxt is None else None


def ppdp_gpipe_order(stage, inputs, targets, loss_fn, m, pp_group, dp_group):
    """All forwards first, then all backwards: right values, m micro-batches held."""
    return _step(stage, inputs, targets, loss_fn, m, pp_group, dp_group, schedule="gpipe")


def ppdp_warm_up_one_too_many(stage, inputs, targets, loss_fn, m, pp_group, dp_group):
    """pp - s warm-up forwards instead of pp - s - 1: one micro-batch more held than 1F1B needs."""
    return _step(stage, inputs, targets, loss_fn, m, pp_group, dp_group, schedule="warm-up + 1")


def ppdp_all_reduce_over_pp(stage, inputs, targets, loss_fn, m, pp_group, dp_group):
    """Averages the gradients over the replica's pipeline instead of over the copies of the stage."""
    return _step(stage, inputs, targets, loss_fn, m, pp_group, dp_group, reduce_over="pp")


def ppdp_sum_over_dp(stage, inputs, targets, loss_fn, m, pp_group, dp_group):
    """All-reduces the gradients over dp and forgets to divide by dp."""
    return _step(stage, inputs, targets, loss_fn, m, pp_group, dp_group, divide=False)


def ppdp_one_micro_batch_short(stage, inputs, targets, loss_fn, m, pp_group, dp_group):
    """Runs micro-batches 0..m-2: the last one never goes through the pipeline."""
    return _step(stage, inputs, targets, loss_fn, m, pp_group, dp_group, micro=m - 1)


def ppdp_no_dp_all_reduce(stage, inputs, targets, loss_fn, m, pp_group, dp_group):
    """Leaves each replica with the gradient of its own share of the batch."""
    return _step(stage, inputs, targets, loss_fn, m, pp_group, dp_group, reduce_over=None)


def ppdp_divides_on_rank_0_only(stage, inputs, targets, loss_fn, m, pp_group, dp_group):
    """Right on rank 0 only: the other ranks keep the sum over the replicas."""
    return _step(stage, inputs, targets, loss_fn, m, pp_group, dp_group, divide_on_rank_0_only=True)


def ppdp_loss_summed(stage, inputs, targets, loss_fn, m, pp_group, dp_group):
    """Reports the sum of the micro-batch losses (the gradients are right)."""
    return _step(stage, inputs, targets, loss_fn, m, pp_group, dp_group, loss_summed=True)


def ppdp_warm_up_pp_minus_one_everywhere(stage, inputs, targets, loss_fn, m, pp_group, dp_group):
    """pp - 1 warm-up forwards on every stage, as stage 0 needs: right on stage 0, one micro-batch too
    many held on stage 1, two on stage 2 (wrong on later stages only)."""
    return _step(stage, inputs, targets, loss_fn, m, pp_group, dp_group, schedule="warm-up pp - 1")


def ppdp_warm_up_from_dp_size(stage, inputs, targets, loss_fn, m, pp_group, dp_group):
    """The warm-up counted from comm.world_size(dp_group), not pp_group's: right when pp = dp = 2,
    too short with 3 stages (the pipeline idles, fewer micro-batches held than 1F1B's)."""
    return _step(stage, inputs, targets, loss_fn, m, pp_group, dp_group, schedule="warm-up from dp")


def ppdp_one_over_m_in_float32(stage, inputs, targets, loss_fn, m, pp_group, dp_group):
    """Each micro-batch's loss times torch.tensor(1 / m), a float32 number: off by ~3e-8 relative
    when m is not a power of two (float64's check is 1e-9)."""
    return _step(stage, inputs, targets, loss_fn, m, pp_group, dp_group, one_over_m=lambda m: torch.tensor(1 / m))


def ppdp_from_library(stage, inputs, targets, loss_fn, m, pp_group, dp_group):
    return run_pipeline(None, [stage], inputs, targets, loss_fn)


WHERE = (r"^pp=[23] stages × dp=2 replicas, m=\d+ micro-batches of \d×\d, [12] layer\(s\) a stage, "
         r"rank \d \(stage \d of replica \d\)")

WRONG = {
    "pp_dp_train_step": [
        (ppdp_gpipe_order,
         [WHERE + r": it held up to \d+ micro-batches' activations at once", r"1F1B holds at most pp - s = \d",
          r"All \d+ forwards ran before the first backward: that is GPipe's order",
          r"Parts: gradients ✔ · loss ✔ · pipeline traffic ✔ · dp all-reduce ✔ · 1F1B memory ✘ \(4 of 5\)\. "
          r".*\[4 of 5 points\]$"], None),
        (ppdp_warm_up_one_too_many,
         [WHERE + r": it held up to \d micro-batches' activations at once", r"^(?!.*GPipe)",
          r"Run pp - s - 1 = \d warm-up forwards",
          r"1F1B memory ✘ \(4 of 5\)"], None),
        (ppdp_all_reduce_over_pp,
         [WHERE + r": \S+\.grad at .* but the single-process gradient of the whole batch is",
          r"Its gradient all-reduce is wrong: it all-reduced over ranks \[\d, \d(, \d)?\], its replica's pipeline "
          r"\(pp_group\), whose ranks hold different stages; the copies of stage \d are dp_group",
          r"Parts: gradients ✘ · loss ✔ · pipeline traffic ✔ · dp all-reduce ✘ · 1F1B memory ✔ \(3 of 5\)"], None),
        (ppdp_sum_over_dp,
         [WHERE + r": \S+\.grad at .* It is 2 times that: the sum over the dp = 2 replicas",
          r"divide the all-reduced gradients by dp",
          r"Parts: gradients ✘ · loss ✔ · pipeline traffic ✔ · dp all-reduce ✔ · 1F1B memory ✔ \(4 of 5\)"], None),
        (ppdp_one_micro_batch_short,
         [WHERE + r": \S+\.grad at .* This rank ran \d+ forwards of its stage, for m = \d+ micro-batches",
          r"Parts: gradients ✘ · loss ✘ · pipeline traffic ✘ · dp all-reduce ✔ · 1F1B memory ✘ \(1 of 5\)"], None),
        (ppdp_no_dp_all_reduce,
         [WHERE + r": \S+\.grad at .* It is replica \d's own gradient", r"average the gradients over dp_group",
          r"Parts: gradients ✘ · loss ✔ · pipeline traffic ✔ · dp all-reduce ✘ · 1F1B memory ✔ \(3 of 5\)"], None),
        (ppdp_divides_on_rank_0_only,
         [r"^pp=2 stages × dp=2 replicas, .*, rank 1 \(stage 0 of replica 1\): \S+\.grad at .* It is 2 times that",
          r"Parts: gradients ✘ · loss ✔"], None),
        (ppdp_loss_summed,
         [WHERE + r": the last stage returned loss .* It is \d+ times that: the sum of the micro-batch losses",
          r"Parts: gradients ✔ · loss ✘ · pipeline traffic ✔ · dp all-reduce ✔ · 1F1B memory ✔ \(4 of 5\)"], None),
        (ppdp_warm_up_pp_minus_one_everywhere,
         [r"^pp=[23] stages × dp=2 replicas, .*, rank [2-5] \(stage [12] of replica \d\): it held up to \d "
          r"micro-batches' activations at once", r"1F1B holds at most pp - s = [12] at stage [12]",
          r"1F1B memory ✘ \(4 of 5\)"], None),
        (ppdp_warm_up_from_dp_size,
         [r"^pp=3 stages × dp=2 replicas, .*, rank [0-3] \(stage [01] of replica \d\): it held at most \d "
          r"micro-batches' activations at once", r"1F1B holds pp - s = [23] at stage [01]: its warm-up is too short",
          r"1F1B memory ✘ \(4 of 5\)"], None),
        (ppdp_one_over_m_in_float32,
         [r"^pp=[23] stages × dp=2 replicas, .*\.grad at .* but the single-process gradient of the whole batch is",
          r"Parts: gradients ✘ · loss ✘ · pipeline traffic ✔ · dp all-reduce ✔ · 1F1B memory ✔ \(3 of 5\)"], None),
        (ppdp_from_library,
         [r"^exercise 'pp_dp_train_step' asks you to work out the 1F1B loop and the data-parallel gradient average "
          r"yourself; you use pplab.pipeline's executor or pplab.hybrid's trainer"], None),
    ],
}
