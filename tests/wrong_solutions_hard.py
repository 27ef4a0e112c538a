"""Plausible wrong answers to the two harder exercises (4d: the 1F1B executor loop, 2c: DDP
bucketing from scratch), each a mistake a student could make.

WRONG[exercise_id] lists (function, regular expressions the check's message must match,
timeout for the check or None for the default), as in wrong_solutions_ch00_broadcast.py:
tests/test_checks.py checks that every one of them fails with that message.
"""
import torch

from pplab import comm
from wrong_solutions_chapters import _buckets

# ----------------------------------------------------------------------------------
# 4d: the executor loop. send/receive are the notebook's helpers.


def send(tensor, dst):
    return comm.isend(tensor.detach().contiguous(), dst)


def receive(like, src):
    buffer = torch.empty_like(like)
    comm.recv(buffer, src)
    return buffer


def _executor(actions, stage, microbatches, loss_fn, prev_rank, next_rank, *, scale=True, send_back="input",
              blocking=False, last_weights=True, order=None):
    """A right executor, but for the mistake each keyword turns on."""
    m = len(microbatches)
    held, sends = {}, []
    post = (lambda t, dst: comm.send(t.detach().contiguous(), dst)) if blocking else send
    for a in (order(actions) if order else actions):
        i = a.microbatch
        x0, y = microbatches[i]
        if a.kind == "F":
            x = x0 if prev_rank is None else receive(x0, prev_rank).requires_grad_()
            out = stage(x)
            if next_rank is None:
                out = loss_fn(out, y) / (m if scale else 1)
            else:
                sends.append(post(out, next_rank))
            held[i] = (x, out)
            continue
        x, out = held.pop(i)
        grad = None if next_rank is None else receive(out, next_rank)
        if next_rank is None and not last_weights:         # only what rank p-2 needs
            (gx,) = torch.autograd.grad(out, x)
            x.grad = gx
        else:
            torch.autograd.backward(out, grad)
        if prev_rank is not None:
            sends.append(post(x.grad if send_back == "input" or grad is None else grad, prev_rank))
    for h in sends:
        if h is not None:
            h.wait()


def executor_gpipe_order(actions, stage, microbatches, loss_fn, prev_rank, next_rank):
    """Ignores the schedule's order: every forward, then every backward."""
    return _executor(actions, stage, microbatches, loss_fn, prev_rank, next_rank,
                     order=lambda acts: sorted(acts, key=lambda a: (a.kind != "F", a.microbatch)))


def executor_forgets_one_over_m(actions, stage, microbatches, loss_fn, prev_rank, next_rank):
    return _executor(actions, stage, microbatches, loss_fn, prev_rank, next_rank, scale=False)


def executor_sends_the_output_gradient_back(actions, stage, microbatches, loss_fn, prev_rank, next_rank):
    """Passes on the gradient it received (of its output), not the one of its input (the
    last stage received none, so there it sends the right one: p = 2 passes)."""
    return _executor(actions, stage, microbatches, loss_fn, prev_rank, next_rank, send_back="output")


def executor_blocking_sends(actions, stage, microbatches, loss_fn, prev_rank, next_rank):
    """comm.send waits for its receiver: in 1F1B's steady state rank r sends an activation
    while rank r+1 sends it a gradient, and both wait for ever."""
    return _executor(actions, stage, microbatches, loss_fn, prev_rank, next_rank, blocking=True)


def executor_last_stage_input_grad_only(actions, stage, microbatches, loss_fn, prev_rank, next_rank):
    """Right on rank 0: the last stage computes only the gradient it sends back
    (torch.autograd.grad), so its own weights get no gradient."""
    return _executor(actions, stage, microbatches, loss_fn, prev_rank, next_rank, last_weights=False)


def executor_sends_its_input_on(actions, stage, microbatches, loss_fn, prev_rank, next_rank):
    m, held, sends = len(microbatches), {}, []
    for a in actions:
        x0, y = microbatches[a.microbatch]
        if a.kind == "F":
            x = x0 if prev_rank is None else receive(x0, prev_rank).requires_grad_()
            out = stage(x)
            if next_rank is None:
                out = loss_fn(out, y) / m
            else:
                sends.append(send(x, next_rank))            # the input, not the output
            held[a.microbatch] = (x, out)
        else:
            x, out = held.pop(a.microbatch)
            torch.autograd.backward(out, None if next_rank is None else receive(out, next_rank))
            if prev_rank is not None:
                sends.append(send(x.grad, prev_rank))
    for h in sends:
        h.wait()


def executor_from_the_library(actions, stage, microbatches, loss_fn, prev_rank, next_rank):
    from pplab import pipeline
    return pipeline.PipelineExecutor


EXECUTOR = r"^p=[234] ranks, (1f1b|gpipe) with m=\d micro-batches of \dx\d: "
WRONG = {
    "pipeline_executor": [
        (executor_from_the_library, [r"^exercise 'pipeline_executor' asks you to work out the executor loop yourself; "
                                     r"you use pplab\.pipeline's executor"], None),
        (executor_gpipe_order,
         [EXECUTOR, r"rank \d ran F0 F1 .*, but its actions are F0 .*: at step \d it ran F\d where the schedule "
                    r"says B0"], None),
        (executor_forgets_one_over_m,
         [EXECUTOR, r"rank 0's stage 0\.weight\.grad at .* is .*, but the single-process gradient of the whole "
                    r"batch is",
          r"It is \d times that: .* divide each micro-batch's loss by m"], None),
        (executor_sends_the_output_gradient_back,
         [EXECUTOR, r"rank \d's stage output for micro-batch 0 differs",
          r"It is the gradient of rank \d's \*output\*"], None),
        (executor_blocking_sends,
         [r"^p=2 ranks, 1f1b .*(ranks 0, 1 were still (waiting|running) after \d+ s|a deadlock: rank 0 waits for "
          r"rank 1 to receive what it sends, rank 1 waits for rank 0 to receive what it sends)",
          r"Where the ranks stopped: rank 0 had run F0 F1, next B0; rank 1 had run F0 B0, next F1\.",
          r"post sends with send\(\.\.\.\) \(comm\.isend\)"], 4.0),
        (executor_last_stage_input_grad_only,
         [EXECUTOR, r"rank 1's stage 0\.weight\.grad is None", r"torch\.autograd\.grad does not fill \.grad"], None),
        (executor_sends_its_input_on,
         [EXECUTOR, r"forward 0 of rank 1's stage got an input that is not the activation of any micro-batch at "
                    r"stage 1", r"It is the input of rank 0's stage: send on its output"], None),
    ],
}


# ----------------------------------------------------------------------------------
# 2c: DDP bucketing from scratch


def _ddp(model, group, buckets, *, average=True, wait=True, reset=True, in_hooks=True, all_at_once=False,
         over_world=False, copy_back=lambda rank: True):
    """A right bucketed DDP over the given buckets, but for the mistake each keyword turns on."""
    bucket_of = {p: b for b, bucket in enumerate(buckets) for p in bucket}
    missing, in_flight = [len(b) for b in buckets], []
    where = None if over_world else group

    def launch(upto):
        while len(in_flight) < upto and missing[len(in_flight)] == 0:
            bucket = buckets[len(in_flight)]
            flat = torch.cat([q.grad.reshape(-1) for q in bucket])
            in_flight.append((bucket, flat, comm.all_reduce(flat, group=where, async_op=True)))

    def hook(p):
        missing[bucket_of[p]] -= 1
        if in_hooks and (not all_at_once or not any(missing)):
            launch(len(buckets))

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(hook)

    def finish():
        if not in_hooks:
            launch(len(buckets))
        n = comm.world_size(where)
        for bucket, flat, handle in in_flight:
            if wait:
                handle.wait()
            if average:
                flat /= n
            if copy_back(comm.rank()):
                for q, piece in zip(bucket, flat.split([q.numel() for q in bucket])):
                    q.grad.copy_(piece.view_as(q))
        in_flight.clear()
        if reset:
            missing[:] = [len(b) for b in buckets]
    return finish


def _reverse(model, cap_bytes):
    return _buckets(model.parameters(), cap_bytes)


def ddp_sums_without_averaging(model, group, cap_bytes):
    return _ddp(model, group, _reverse(model, cap_bytes), average=False)


def ddp_one_all_reduce_per_parameter(model, group, cap_bytes):
    return _ddp(model, group, [[p] for p in reversed(list(model.parameters()))])


def ddp_one_bucket_for_everything(model, group, cap_bytes):
    return _ddp(model, group, [list(reversed(list(model.parameters())))])


def ddp_buckets_in_forward_order(model, group, cap_bytes):
    """Forward order: bucket 0 (the first layer) is complete last, so nothing overlaps."""
    return _ddp(model, group, _buckets(model.parameters(), cap_bytes, reverse=False))


def ddp_forgets_to_wait(model, group, cap_bytes):
    return _ddp(model, group, _reverse(model, cap_bytes), wait=False)


def ddp_counts_never_reset(model, group, cap_bytes):
    """What the hooks count carries over into the second step, where no bucket ever looks complete."""
    return _ddp(model, group, _reverse(model, cap_bytes), reset=False)


def ddp_buffers_never_emptied(model, group, cap_bytes):
    """A flat buffer per bucket, made once, each gradient *added* into its slot and never
    emptied: the second step's buckets hold both steps' gradients."""
    buckets = _reverse(model, cap_bytes)
    sums = [torch.zeros(sum(p.numel() for p in b), dtype=b[0].dtype) for b in buckets]
    slot = {p: (b, sum(q.numel() for q in bucket[:k]))
            for b, bucket in enumerate(buckets) for k, p in enumerate(bucket)}
    missing, in_flight = [len(b) for b in buckets], []

    def hook(p):
        b, offset = slot[p]
        sums[b][offset:offset + p.numel()] += p.grad.reshape(-1)
        missing[b] -= 1
        while len(in_flight) < len(buckets) and missing[len(in_flight)] == 0:
            buffer = sums[len(in_flight)].clone()
            in_flight.append((buffer, comm.all_reduce(buffer, group=group, async_op=True)))

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(hook)

    def finish():
        for buffer, handle in in_flight:
            handle.wait()
        for p, (b, offset) in slot.items():
            p.grad.copy_(in_flight[b][0][offset:offset + p.numel()].view_as(p) / comm.world_size(group))
        in_flight.clear()
        missing[:] = [len(b) for b in buckets]
    return finish


def ddp_all_reduces_in_finish(model, group, cap_bytes):
    return _ddp(model, group, _reverse(model, cap_bytes), in_hooks=False)


def ddp_launches_when_all_are_ready(model, group, cap_bytes):
    """Every bucket launched from the last hook of backward: right sizes, no overlap."""
    return _ddp(model, group, _reverse(model, cap_bytes), all_at_once=True)


def ddp_ignores_the_group(model, group, cap_bytes):
    """All-reduces over every rank: right while the group is every rank (2 and 3 ranks)."""
    return _ddp(model, group, _reverse(model, cap_bytes), over_world=True)


def ddp_only_rank0_copies_back(model, group, cap_bytes):
    """Right on rank 0; the other ranks keep their own gradients."""
    return _ddp(model, group, _reverse(model, cap_bytes), copy_back=lambda rank: rank == 0)


def ddp_from_the_library(model, group, cap_bytes):
    from pplab import data_parallel
    ddp = data_parallel.DDP(model, bucket_cap_mb=cap_bytes / 2**20)
    return lambda: ddp


DDP = r"^world_size=[234](, groups \[\[0, 2\], \[1, 3\]\])?, MLP widths \[[\d, ]+\], cap_bytes=\d+: "
WRONG["ddp_from_scratch"] = [
    (ddp_from_the_library, [r"^exercise 'ddp_from_scratch' asks you to work out the buckets and their all-reduces "
                            r"yourself; you use a library DDP"], None),
    (ddp_sums_without_averaging,
     [DDP, r"step 1: rank 0's [\d.]+(weight|bias)\.grad at .* is",
      r"It is [234] times that: the all-reduce sums"], None),
    (ddp_one_all_reduce_per_parameter,
     [DDP, r"step 1: bucket \d \(\['[\d.]+(weight|bias)'\], \d+ bytes\) had room for [\d.]+(weight|bias) \(\d+ bytes\) "
           r"under cap_bytes=\d+"], None),
    (ddp_one_bucket_for_everything, [DDP, r"step 1: bucket 0 holds \[.*\], \d+ bytes, more than cap_bytes=\d+"], None),
    (ddp_buckets_in_forward_order, [DDP, r"step 1: the all-reduces, of \[[\d, ]+\] elements", r"\*forward\* order"],
     None),
    (ddp_forgets_to_wait, [DDP, r"step 1: bucket 0's all-reduce was never waited for"], None),
    (ddp_counts_never_reset,
     [DDP, r"step 2 started no all-reduce", r"The first step did: reset what your hooks count"], None),
    (ddp_buffers_never_emptied,
     [DDP, r"step 2: rank 0's [\d.]+(weight|bias)\.grad at",
      r"It is this step's gradient plus the step before's"], None),
    (ddp_all_reduces_in_finish, [DDP, r"step 1: bucket 0's all-reduce started only after loss\.backward\(\) returned"],
     None),
    (ddp_launches_when_all_are_ready,
     [DDP, r"step 1: bucket 0's all-reduce started only once the gradient of [\d.]+(weight|bias) was in"], None),
    (ddp_ignores_the_group,
     [r"^world_size=4, groups \[\[0, 2\], \[1, 3\]\], .*step 1: bucket 0's all-reduce went over ranks \[0, 1, 2, 3\], "
      r"but this rank's data-parallel group is \[0, 2\]"], None),
    (ddp_only_rank0_copies_back,
     [DDP, r"step 1: rank [123]'s [\d.]+(weight|bias)\.grad at", r"It is this rank's own gradient"], None),
]
