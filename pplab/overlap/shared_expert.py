"""An expert all-to-all hidden under the shared expert's computation, as in DeepSeek-V3.

DeepSeek-V3's MoE layers (DeepSeek-AI, "DeepSeek-V3 Technical Report", 2024, section 2.1.2) have
routed experts, spread over the ranks, and *shared* experts that every token goes through on its
own rank. The shared expert needs no communication, so it can run while the tokens for the routed
experts are on their way (the report's overlap of "dispatch" with computation):

    counts  <- all_to_all(how many of my tokens go to each rank)     tiny, blocking
    post isend/irecv of the tokens themselves                          the dispatch, in flight ...
    s = shared(x)                                                      ... while this computes
    wait; y = my_expert(what arrived); send results back (combine)
    out = s + p(expert | token) * routed output

Routing is top-1 (one expert per token, expert e on rank e, one expert per rank) by a softmax over
`gate(x)`; the token's output is the shared expert's plus the routed expert's scaled by its
probability. With `overlap=False` the dispatch is waited for before the shared expert starts:
the same numbers, nothing hidden. `shared_time`/`expert_time` pad the two computations to a
stand-in accelerator's time (seconds per token, see hidden.py).
"""
from __future__ import annotations

import torch

from ..runtime import comm
from .hidden import stand_in_span


def _exchange(pieces, sizes_in, width, dtype):
    """Send pieces[r] to rank r and receive sizes_in[r] rows from it: the handles, and where they land."""
    me = comm.rank()
    incoming = [torch.empty(int(n), width, dtype=dtype) for n in sizes_in]
    incoming[me] = pieces[me]
    handles = []
    for peer in range(comm.world_size()):
        if peer == me:
            continue
        if pieces[peer].numel():
            handles.append(comm.isend(pieces[peer].contiguous(), peer))
        if incoming[peer].numel():
            handles.append(comm.irecv(incoming[peer], peer))
    return handles, incoming


def moe_with_shared_expert(x, gate, expert, shared, overlap: bool = True, shared_time: float = 0.0,
                           expert_time: float = 0.0) -> torch.Tensor:
    """One MoE layer's forward on this rank's tokens x [n, hidden], on every rank of the launch.

    gate: a callable giving [n, world_size] scores (the same on every rank); expert: this rank's
    routed expert; shared: the shared expert (the same on every rank). Returns [n, hidden].
    """
    p = comm.world_size()
    if x.dim() != 2:
        raise ValueError(f"x is {list(x.shape)}: pass this rank's tokens as [tokens, hidden]")
    scores = gate(x)
    if scores.shape != (x.shape[0], p):
        raise ValueError(f"gate(x) is {list(scores.shape)}: it must score each of the {x.shape[0]} tokens for each "
                         f"of the {p} experts (one per rank), [{x.shape[0]}, {p}]")
    prob, dest = torch.softmax(scores, dim=-1).max(dim=-1)
    order = torch.argsort(dest, stable=True)                    # tokens grouped by their expert's rank
    send_counts = torch.bincount(dest, minlength=p)
    recv_counts = torch.empty_like(send_counts)
    comm.all_to_all_single(recv_counts, send_counts)            # who sends me how many tokens
    handles, arrived = _exchange(list(x[order].split(send_counts.tolist())), recv_counts.tolist(),
                                 x.shape[1], x.dtype)
    if not overlap:
        for h in handles:
            h.wait()
        handles = []                                            # waited: gloo hangs on a second wait
    with stand_in_span("shared", shared_time * x.shape[0], label="shared"):
        s = shared(x)                                           # runs while the dispatch is in flight
    for h in handles:
        h.wait()
    with stand_in_span("expert", expert_time * int(recv_counts.sum()), label="expert"):
        done = [expert(piece) for piece in arrived]
    handles, back = _exchange(done, send_counts.tolist(), s.shape[1], s.dtype)   # combine: results go home
    for h in handles:
        h.wait()
    routed = torch.empty_like(s)
    routed[order] = torch.cat(back)
    return s + prob[:, None] * routed
