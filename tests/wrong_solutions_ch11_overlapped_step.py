"""Plausible wrong answers to chapter 11a's overlapped step, as in wrong_solutions.py:
WRONG[exercise_id] lists (answer, regular expressions the check's message must match, timeout or None);
tests/test_checks.py checks that each fails with its message, tests/test_checks_near_miss.py that
each CLOSE_BUT_RIGHT answer passes.

`overlapped_step` is a correct answer written apart from the solution notebook's: it posts all four
receives at the start. Each wrong one changes one step of it. The exercise runs on 2 ranks only (the
pair needs both ends of DualPipe's two-way pipeline), so there is no answer "right at p = 2 and wrong
at p = 3" to register.
"""
import torch

from pplab import comm


def overlapped_step(first, last, inputs, wait_early_on=(), swap_on=(), wire=None, send_first=False):
    me = comm.rank()
    peer = 1 - me
    ACT, GRAD = 0, 1                                 # tags: activations and gradients never take each other's receive

    def send(t, tag):
        return comm.isend(t.to(wire) if wire else t, peer, tag=tag)
    a0 = first.forward(0, inputs[0])
    x0, my_g0, x1, my_g1 = (torch.empty_like(a0, dtype=wire or a0.dtype) for _ in range(4))
    posted = [comm.irecv(x0, peer, tag=ACT), comm.irecv(my_g0, peer, tag=GRAD), comm.irecv(x1, peer, tag=ACT),
              comm.irecv(my_g1, peer, tag=GRAD)]
    sends = [send(a0, ACT)]
    posted[0].wait()
    last.forward(0, x0.float())
    if send_first:                                   # F1 first, then B0: the activation under B0, not the gradient under F1
        sends.append(send(first.forward(1, inputs[1]), ACT))
        sends.append(send(last.backward(0), GRAD))
    else:
        grad_send = send(last.backward(0), GRAD)
        if me in wait_early_on:
            grad_send.wait()
        a1 = first.forward(1, inputs[1])
        if me not in wait_early_on:
            grad_send.wait()
        sends.append(send(a1, ACT))
    posted[1].wait()
    posted[2].wait()
    first.backward(*((1, my_g0.float()) if me in swap_on else (0, my_g0.float())))
    last.forward(1, x1.float())
    sends.append(send(last.backward(1), GRAD))
    posted[3].wait()
    first.backward(*((0, my_g1.float()) if me in swap_on else (1, my_g1.float())))
    for h in sends:
        h.wait()


def sequential(first, last, inputs):
    """Right gradients, nothing hidden: the gradient's send is waited for before F1, on both ranks."""
    overlapped_step(first, last, inputs, wait_early_on=(0, 1))


def waits_early_on_rank_1(first, last, inputs):
    """Overlapped on rank 0 only: rank 1 waits for its gradient's send before F1."""
    overlapped_step(first, last, inputs, wait_early_on=(1,))


def swaps_micro_batches(first, last, inputs):
    """Overlapped, but each gradient that comes back is used for the other micro-batch (wrong on both ranks)."""
    peer = 1 - comm.rank()
    a0 = first.forward(0, inputs[0])
    s0 = comm.isend(a0, peer)
    x0 = torch.empty_like(a0)
    comm.recv(x0, peer)
    last.forward(0, x0)
    my_g0, x1 = torch.empty_like(a0), torch.empty_like(a0)
    hs = [comm.irecv(my_g0, peer), comm.irecv(x1, peer)]
    g = comm.isend(last.backward(0), peer)
    a1 = first.forward(1, inputs[1])
    g.wait()
    s1 = comm.isend(a1, peer)
    for h in hs:
        h.wait()
    last.forward(1, x1)
    s2 = comm.isend(last.backward(1), peer)
    my_g1 = torch.empty_like(a0)
    comm.recv(my_g1, peer)
    first.backward(0, my_g1)                         # micro-batch 0 given micro-batch 1's gradient
    first.backward(1, my_g0)
    for h in (s0, s1, s2):
        h.wait()


def swaps_on_rank_1(first, last, inputs):
    """Wrong on rank 1 only: its first chunk's backward takes the two gradients in the wrong order."""
    overlapped_step(first, last, inputs, swap_on=(1,))


def activations_in_float16(first, last, inputs):
    """Activations and gradients travel as float16 (half the bytes): gradients off by about 1e-3 relative,
    ten times the check's 1e-4."""
    overlapped_step(first, last, inputs, wire=torch.float16)


def activation_under_backward(first, last, inputs):
    """The other half of DualPipe's pair only: F1 first, its activation in flight while B0 computes; the
    gradient's send then comes after F1, under nothing."""
    overlapped_step(first, last, inputs, send_first=True)


def blocking_gradient_send(first, last, inputs):
    """comm.send for the gradient: it returns once the other rank has posted its receive; nothing under it."""
    peer = 1 - comm.rank()
    a0 = first.forward(0, inputs[0])
    buffers = [torch.empty_like(a0) for _ in range(4)]
    posted = [comm.irecv(b, peer) for b in buffers]
    sends = [comm.isend(a0, peer)]
    posted[0].wait()
    last.forward(0, buffers[0])
    comm.send(last.backward(0), peer)
    sends.append(comm.isend(first.forward(1, inputs[1]), peer))
    posted[1].wait()
    posted[2].wait()
    first.backward(0, buffers[1])
    last.forward(1, buffers[2])
    sends.append(comm.isend(last.backward(1), peer))
    posted[3].wait()
    first.backward(1, buffers[3])
    for h in sends:
        h.wait()


GRADS = r"rank (\d)'s (first|last) chunk's (weight|bias) gradient differs from one process's"
WRONG = {"overlapped_step": [
    (sequential, [r"on rank 0 at most 0% of the gradient's send lay under compute",
                  r"gradients ✔ · overlap ✘ \(1 of 2\)"], None),
    (waits_early_on_rank_1, [r"on rank 1 at most 0% of the gradient's send lay under compute",
                             r"gradients ✔ · overlap ✘ \(1 of 2\)"], None),
    (swaps_micro_batches, [r"rank 0's first chunk's weight gradient differs", r"micro-batches 0 and 1 swapped",
                           r"gradients ✘ · overlap ✔ \(1 of 2\)"], None),
    (swaps_on_rank_1, [r"rank 1's first chunk's weight gradient differs", r"micro-batches 0 and 1 swapped",
                       r"gradients ✘ · overlap ✔ \(1 of 2\)"], None),
    (activations_in_float16, [GRADS, r"gradients ✘ · overlap ✔ \(1 of 2\)"], None),
    (activation_under_backward, [r"rank 0 ran F1 on its first chunk before B0 on its last: the pair is B0",
                                 r"gradients ✔ · overlap ✘ \(1 of 2\)"], None),
    (blocking_gradient_send, [r"on rank 0 at most 0% of the gradient's send lay under compute",
                              r"gradients ✔ · overlap ✘ \(1 of 2\)"], None),
]}


def waits_at_the_very_end(first, last, inputs):
    """Right: posts every receive up front (overlapped_step above) and waits for the gradient's send only
    with the other sends, at the end: still in flight during F1."""
    peer = 1 - comm.rank()
    a0 = first.forward(0, inputs[0])
    buffers = [torch.empty_like(a0) for _ in range(4)]
    posted = [comm.irecv(b, peer) for b in buffers]
    sends = [comm.isend(a0, peer)]
    posted[0].wait()
    last.forward(0, buffers[0])
    sends.append(comm.isend(last.backward(0), peer))
    sends.append(comm.isend(first.forward(1, inputs[1]), peer))
    posted[1].wait()
    posted[2].wait()
    first.backward(0, buffers[1])
    last.forward(1, buffers[2])
    sends.append(comm.isend(last.backward(1), peer))
    posted[3].wait()
    first.backward(1, buffers[3])
    for h in sends:
        h.wait()


CLOSE_BUT_RIGHT = {"overlapped_step": [overlapped_step, waits_at_the_very_end]}
