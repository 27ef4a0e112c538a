"""DualPipe's overlapped pair on two ranks: one micro-batch's forward computing while another
micro-batch's backward communicates.

DeepSeek-V3's DualPipe (DeepSeek-AI, "DeepSeek-V3 Technical Report", 2024, section 3.2.1) feeds
micro-batches from both ends of the pipeline. With two ranks, each holds two chunks: the first
stage of the model for the micro-batches that start on it, and the last stage for those that start
on the other rank (rank 0 holds stage 0 of the "down" direction and stage 1 of "up", rank 1 the
reverse). Both ranks then run the same code, with `peer` = the other rank:

    F0 first  -> send a0                   my micro-batch 0 starts
    recv      -> F0 last (loss)            the other end's micro-batch 0 finishes its forward
    B0 last   -> isend g  ┐ the overlapped pair: the gradient of the other end's micro-batch 0
    F1 first  -> send a1  ┘ travels while my micro-batch 1 computes its forward; wait after
    B0 first, F1 last, B1 last -> send, B1 first

The chapter-4 simulator draws DualPipe's pair as one shorter "F&B" box (t_fb < t_f + t_b), an
assumption about the hardware. Here the pair is run: the gradient's isend is posted before the
forward and waited for after it, and the trace says how much of its time lay under the forward
(`pair_hidden_fraction`). With `overlap=False` the same step waits right after posting:
the same gradients, nothing hidden.

Each chunk's gradients are those of its own micro-batches: rank r's first chunk those of the
micro-batches that started on rank r, its last chunk those that started on the other rank.
DualPipe keeps the two copies of each stage apart and adds their gradients before the update.
"""
from __future__ import annotations

import torch

from ..runtime import comm
from .hidden import hidden_fraction
from .stage import Chunk


def dualpipe_step(first: Chunk, last: Chunk, inputs, overlap: bool = True) -> None:
    """One step of four micro-batches on 2 ranks (two start on each), DualPipe's order; on every rank.

    inputs: this rank's two micro-batches (tensors of one shape; the activations must have one shape
    on both ranks). Leaves the gradients in first.module's and last.module's parameters.
    """
    if comm.world_size() != 2:
        raise ValueError(f"dualpipe_step runs on 2 ranks (each the first stage of one direction and the last of "
                         f"the other), not {comm.world_size()}: launch it with world_size=2")
    if first.role != "first" or last.role != "last":
        raise ValueError("dualpipe_step(first, last, ...): pass the first-stage chunk, then the last-stage chunk")
    if len(inputs) != 2:
        raise ValueError(f"inputs: this rank's 2 micro-batches, got {len(inputs)}")
    peer = 1 - comm.rank()
    a0 = first.forward(0, inputs[0])
    sends = [comm.isend(a0, peer)]
    x0 = torch.empty_like(a0)
    comm.recv(x0, peer)
    last.forward(0, x0)
    my_g0, x1 = torch.empty_like(a0), torch.empty_like(a0)
    early = [comm.irecv(my_g0, peer), comm.irecv(x1, peer)]   # posted before the pair: they land during it
    g = last.backward(0)
    grad_send = comm.isend(g, peer)                          # the pair: this travels ...
    if not overlap:
        grad_send.wait()                                     # (or not: the step without overlap)
    a1 = first.forward(1, inputs[1])                         # ... while this computes
    if overlap:
        grad_send.wait()                                     # once only: gloo hangs on a second wait
    sends.append(comm.isend(a1, peer))
    for h in early:
        h.wait()
    first.backward(0, my_g0)
    last.forward(1, x1)
    g1 = last.backward(1)
    sends.append(comm.isend(g1, peer))
    my_g1 = torch.empty_like(a0)
    comm.recv(my_g1, peer)
    first.backward(1, my_g1)
    for h in sends:
        h.wait()


def _span(timeline, rank, label):
    found = [e for e in timeline.select(rank, "compute") if e.label == label]
    if len(found) != 1:
        raise ValueError(f"rank {rank} has {len(found)} compute spans labelled {label!r}, not 1: pass the "
                         f"timeline of one dualpipe_step (Chunk labels its spans F0f, B0l, ...)")
    return found[0]


def pair_hidden_fraction(timeline, rank: int) -> float:
    """The fraction of the pair's gradient send (posted between B0 of the last chunk and F1 of the
    first) that lay under the rank's own compute, read from a dualpipe_step's trace."""
    after_b = _span(timeline, rank, "B0l").end
    f1 = _span(timeline, rank, "F1f").start
    return hidden_fraction(timeline, rank, kinds=("send",), start=after_b, end=f1 + 1e-9)
