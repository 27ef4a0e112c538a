"""The two harder exercises (pipeline_executor: the executor loop on real ranks, ddp_from_scratch: DDP from
scratch): other correct answers pass too (the checks ask for a result, not one way of
writing it), and the bucket reading the DDP check relies on. Every solution passing, every
stub failing and every wrong answer in wrong_solutions_hard.py failing with its message
are run by tests/test_checks.py, for all exercises."""
import pytest
import torch
import torch.distributed as dist

from pplab import checks
from wrong_solutions_hard import WRONG

pytestmark = pytest.mark.usefixtures("no_leftover_processes")


def test_the_hard_exercises_are_registered_with_their_wrong_answers():
    assert {checks.get_exercise(i).notebook for i in WRONG} == {"04_pipeline_executor", "02_ddp_from_scratch"}
    for cases in WRONG.values():
        assert len(cases) >= 6


# -- other correct executors -------------------------------------------------------------

def executor_torch_distributed_prefetch(actions, stage, microbatches, loss_fn, prev_rank, next_rank):
    """torch.distributed directly; each receive posted (irecv) one action ahead; the loss
    divided by m through the gradients at the end instead of the loss."""
    m, held, sends = len(microbatches), {}, []

    def post_recv(a):
        src = prev_rank if a.kind == "F" else next_rank
        if src is None:
            return None
        buffer = torch.empty_like(microbatches[a.microbatch][0])
        return buffer, dist.irecv(buffer, src)

    pending = post_recv(actions[0]) if actions else None
    for k, a in enumerate(actions):
        mine, pending = pending, post_recv(actions[k + 1]) if k + 1 < len(actions) else None
        if mine is not None:
            mine[1].wait()
        x, y = microbatches[a.microbatch]
        if a.kind == "F":
            x = x if mine is None else mine[0].requires_grad_()
            out = stage(x)
            held[a.microbatch] = (x, loss_fn(out, y) if next_rank is None else out)
            if next_rank is not None:
                t = out.detach().clone()
                sends.append((t, dist.isend(t, next_rank)))
        else:
            x, out = held.pop(a.microbatch)
            out.backward(None if mine is None else mine[0])
            if prev_rank is not None:
                sends.append((x.grad, dist.isend(x.grad, prev_rank)))
    for q in stage.parameters():
        q.grad /= m
    for _, work in sends:
        work.wait()


def executor_class_with_dispatch(actions, stage, microbatches, loss_fn, prev_rank, next_rank):
    """A small class, one method per action kind, the last stage's loss kept as a list."""
    from pplab import comm

    class Rank:
        def __init__(self):
            self.saved, self.handles = {}, []

        def F(self, i):
            x, y = microbatches[i]
            if prev_rank is not None:
                x = torch.empty_like(x)
                comm.recv(x, prev_rank)
                x.requires_grad_(True)
            out = stage(x)
            if next_rank is None:
                out = loss_fn(out, y) * (1.0 / len(microbatches))
            else:
                self.handles.append(comm.isend(out.detach(), next_rank))
            self.saved[i] = [x, out]

        def B(self, i):
            x, out = self.saved.pop(i)
            grad = None
            if next_rank is not None:
                grad = torch.empty_like(out)
                comm.recv(grad, next_rank)
            torch.autograd.backward([out], [grad] if grad is not None else None)
            if prev_rank is not None:
                self.handles.append(comm.isend(x.grad, prev_rank))

    me = Rank()
    for a in actions:
        getattr(me, a.kind)(a.microbatch)
    for h in me.handles:
        h.wait()


@pytest.mark.parametrize("fn", [executor_torch_distributed_prefetch, executor_class_with_dispatch])
def test_other_correct_executors_pass(fn):
    result = checks.run_check("pipeline_executor", fn)
    assert result, result.message


# -- other correct DDPs ---------------------------------------------------------------------

def ddp_tensor_hooks_and_torch_distributed(model, group, cap_bytes):
    """Tensor hooks (the gradient as an argument, before it reaches .grad), a preallocated
    flat buffer per bucket, torch.distributed directly, the mean taken before the sum."""
    params = list(model.parameters())[::-1]
    buckets, size = [[]], 0
    for p in params:
        n = p.numel() * p.element_size()
        if buckets[-1] and size + n > cap_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(p)
        size += n
    flats = [torch.zeros(sum(p.numel() for p in b), dtype=b[0].dtype) for b in buckets]
    state = {"seen": set(), "next": 0, "works": []}
    n_ranks = dist.get_world_size(group)

    def on_grad(p, b, offset):
        def hook(grad):
            flats[b][offset:offset + p.numel()].copy_(grad.reshape(-1) / n_ranks)
            state["seen"].add(p)
            while state["next"] < len(buckets) and all(q in state["seen"] for q in buckets[state["next"]]):
                state["works"].append(dist.all_reduce(flats[state["next"]], group=group, async_op=True))
                state["next"] += 1
            return grad
        return hook

    for b, bucket in enumerate(buckets):
        offset = 0
        for p in bucket:
            p.register_hook(on_grad(p, b, offset))
            offset += p.numel()

    def finish():
        for work in state["works"]:
            work.wait()
        for b, bucket in enumerate(buckets):
            offset = 0
            for p in bucket:
                p.grad = flats[b][offset:offset + p.numel()].view_as(p).clone()
                offset += p.numel()
        state.update(seen=set(), next=0, works=[])
    return finish


def ddp_as_a_class(model, group, cap_bytes):
    """A class with its state in attributes; finish is a bound method."""
    from pplab import comm

    class BucketedDDP:
        def __init__(self):
            self.buckets = []
            for p in reversed(list(model.parameters())):
                nbytes = p.numel() * p.element_size()
                if self.buckets and sum(q.numel() * q.element_size() for q in self.buckets[-1]) + nbytes <= cap_bytes:
                    self.buckets[-1].append(p)
                else:
                    self.buckets.append([p])
            self.index = {p: b for b, bucket in enumerate(self.buckets) for p in bucket}
            self.reset()
            for p in model.parameters():
                p.register_post_accumulate_grad_hook(self.ready)

        def reset(self):
            self.done = [0] * len(self.buckets)
            self.launched = []

        def ready(self, p):
            self.done[self.index[p]] += 1
            b = len(self.launched)
            while b < len(self.buckets) and self.done[b] == len(self.buckets[b]):
                flat = torch.cat([q.grad.flatten() for q in self.buckets[b]])
                self.launched.append((flat, comm.all_reduce(flat, group=group, async_op=True)))
                b += 1

        def finish(self):
            for (flat, handle), bucket in zip(self.launched, self.buckets):
                handle.wait()
                offset = 0
                for q in bucket:
                    q.grad.copy_(flat[offset:offset + q.numel()].view_as(q) / comm.world_size(group))
                    offset += q.numel()
            self.reset()

    return BucketedDDP().finish


@pytest.mark.parametrize("fn", [ddp_tensor_hooks_and_torch_distributed, ddp_as_a_class])
def test_other_correct_ddps_pass(fn):
    result = checks.run_check("ddp_from_scratch", fn)
    assert result, result.message


def test_the_all_reduces_are_read_as_buckets_of_whole_parameters():
    from pplab.checks.ch02_data_parallel.ddp_from_scratch import _buckets_of
    params = [("a", 4, 16), ("b", 2, 8), ("c", 6, 24)]
    assert [[n for n, _, _ in b] for b in _buckets_of([6, 6], params)] == [["a", "b"], ["c"]]
    assert _buckets_of([4, 3, 5], params) is None          # cuts a parameter in two
    assert _buckets_of([4, 2], params) is None             # leaves one out
    assert _buckets_of([4, 2, 6, 1], params) is None       # more than there is
