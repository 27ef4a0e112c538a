"""Near misses of chapter 4's exercises (issue 38): wrong answers that are right at p = 2, wrong on
one rank other than 0 only, or off by a little more than the check's tolerance, each a plausible
student slip. WRONG[exercise_id] lists (function, regexes the message must match, timeout or None),
as in wrong_solutions_ch00_broadcast.py; tests/test_checks.py collects this file with the others.
"""
import torch

from wrong_solutions_chapters import LOOPED, _bubble_report, _bubble_spans
from wrong_solutions_hard import receive, send
from wrong_solutions_scored import _deferring


# ----------------------------------------------------------------------------------
# gpipe_order, 1f1b_order: a step a little longer than the reference's (< 25%)


def gpipe_looped_in_groups_of_p(num_ranks, num_microbatches, chunks):
    """Megatron's interleaving for the forwards: micro-batches in groups of p, each group through
    every chunk before the next group starts; the backwards breadth first. The same as looped GPipe
    when m <= p; otherwise chunk 1 waits for the last group: a step 3-11% longer."""
    p, m, v = num_ranks, num_microbatches, chunks
    groups = [range(g, min(g + p, m)) for g in range(0, m, p)]
    forwards = [("F", i, c) for group in groups for c in range(v) for i in group]
    backwards = [("B", i, c) for c in reversed(range(v)) for i in range(m)]
    return [forwards + backwards for _ in range(p)]


def one_f_one_b_drain_newest_first(num_stages, num_microbatches):
    """1F1B, but the cool-down pops the held micro-batches off a stack: newest backward first. Right
    at p = 2 (one micro-batch left to drain); with 3 or more stages rank r waits for rank r + 1's
    last backward: the same peaks, a step up to ~20% longer."""
    p, m, order = num_stages, num_microbatches, []
    for r in range(p):
        warmup = min(p - 1 - r, m)
        acts = [("F", i) for i in range(warmup)]
        for i in range(m - warmup):
            acts += [("F", warmup + i), ("B", i)]
        order.append(acts + [("B", i) for i in reversed(range(m - warmup, m))])
    return order


def zb_defers_one_weight_too_many(num_stages, num_microbatches):
    """ZB-H1 with rank r putting off r + 1 weight gradients, not r: one micro-batch more held than
    1F1B's busiest rank, p + 1 (a step no shorter: the bound is reached with r)."""
    return _deferring(num_stages, num_microbatches, lambda r: r + 1)


# ----------------------------------------------------------------------------------
# bubble_fraction: off by a little more than 1e-6, or wrong off rank 0 only


def bubble_rounded_for_display(timeline):
    """The right numbers rounded to 5 decimals "to print them nicely": off by up to 5e-6 relative."""
    right = _bubble_report(*_bubble_spans(timeline))
    return {"per_rank": [round(x, 5) for x in right["per_rank"]], "overall": round(right["overall"], 5),
            "idle": right["idle"]}


def bubble_busy_of_rank_0_everywhere(timeline):
    """Every rank's idle time over rank 0's busy time ("every stage does the same work"): right on
    rank 0, and on every rank when the stages are even; wrong on the others of an uneven trace."""
    p, begin, end, busy, first, last = _bubble_spans(timeline)
    right = _bubble_report(p, begin, end, busy, first, last)
    return {**right, "per_rank": [(end - begin - busy[r]) / busy[0] for r in range(p)]}


def bubble_last_rank_never_drains(timeline):
    """"The last stage finishes the step": its drain (idle after its last action) taken as 0, the time
    counted as between its actions instead. In 1F1B rank 0 finishes last."""
    right = _bubble_report(*_bubble_spans(timeline))
    before, between, after = right["idle"][-1]
    right["idle"][-1] = (before, between + after, 0.0)
    return right


# ----------------------------------------------------------------------------------
# pipeline_executor: a float32 number in a float64 check


def executor_scaled(actions, stage, microbatches, loss_fn, prev_rank, next_rank, one_over_m=lambda m: 1 / m):
    """A right executor whose last stage multiplies each micro-batch's loss by one_over_m(m)."""
    m = len(microbatches)
    held, sends = {}, []
    for a in actions:
        x0, y = microbatches[a.microbatch]
        if a.kind == "F":
            x = x0 if prev_rank is None else receive(x0, prev_rank).requires_grad_()
            out = stage(x)
            if next_rank is None:
                out = loss_fn(out, y) * one_over_m(m)
            else:
                sends.append(send(out, next_rank))
            held[a.microbatch] = (x, out)
            continue
        x, out = held.pop(a.microbatch)
        torch.autograd.backward(out, None if next_rank is None else receive(out, next_rank))
        if prev_rank is not None:
            sends.append(send(x.grad, prev_rank))
    for h in sends:
        h.wait()


def executor_one_over_m_in_float32(actions, stage, microbatches, loss_fn, prev_rank, next_rank):
    """Each micro-batch's loss times torch.tensor(1 / m): a float32 number, 1/3 off by 3e-8 relative
    (the check is float64, to 1e-9). Right when m is a power of two."""
    executor_scaled(actions, stage, microbatches, loss_fn, prev_rank, next_rank, lambda m: torch.tensor(1 / m))


WRONG = {
    "gpipe_order": [
        (gpipe_looped_in_groups_of_p,
         [LOOPED, r"your schedule takes [\d.]+ time units",
          r"Parts: GPipe ✔ · looped GPipe ✘ \(1 of 2\)"], None),
    ],
    "one_f_one_b_order": [
        (one_f_one_b_drain_newest_first,
         [r"^p=[3-5] stages, m=\d+ micro-batch(es)?: your schedule takes \d+ time units \(t_f = 1, t_b = 2\), 1F1B "
          r"takes \(m \+ p - 1\)\(t_f \+ t_b\) = \d+\. Rank \d sits idle"], None),
    ],
    "zero_bubble": [
        (zb_defers_one_weight_too_many,
         [r"^p=4 stages, m=8 micro-batches: rank 0 holds 5 micro-batches' activations at its peak, more than "
          r"the p = 4 that 1F1B's busiest rank holds"], None),
    ],
    "bubble_fraction": [
        (bubble_rounded_for_display,
         [r"bubble fraction is [\d.]+, the trace says [\d.]+", r"Parts: per rank ✘ · overall ✘ · fill and drain ✔"],
         None),
        (bubble_busy_of_rank_0_everywhere,
         [r"^(1f1b|interleaved-1f1b|zb-h1) trace, p=\d, m=\d+(, v=2)?, rank [1-5]'s bubble fraction is",
          r"Parts: per rank ✘ · overall ✔ · fill and drain ✔ \(2 of 3\)"], None),
        (bubble_last_rank_never_drains,
         [r"rank [1-5] idles [\d.]+ s between its actions, the trace says",
          r"Parts: per rank ✔ · overall ✔ · fill and drain ✘ \(2 of 3\)"], None),
    ],
    "pipeline_executor": [
        (executor_one_over_m_in_float32,
         [r"^p=2 ranks, 1f1b with m=3 micro-batches of \d+x\d+: the gradient that reached rank 1's stage output for "
          r"micro-batch 0 is not d\(loss\)/d\(output\) of loss_fn\(output, target\) / m"], None),
    ],
}
