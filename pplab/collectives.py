"""The collectives of chapter 1, built from nothing but traced point-to-point messages.

Each function takes torch.distributed's arguments, works in place like it, and gives
its result (floats up to rounding: the additions happen in another order). But each is
a short loop of `comm.send` / `comm.recv` / `comm.isend` / `comm.irecv`, so every byte it
moves is in the trace, and the swimlane shows who talks to whom, step by step.

    broadcast(tensor, src)                  binomial tree
    reduce(tensor, dst, op)                 binomial tree
    scatter(tensor, scatter_list, src)      the root sends to each rank
    gather(tensor, gather_list, dst)        each rank sends to the root
    all_gather(tensor_list, tensor)         ring (also all_gather_into_tensor(output, input))
    reduce_scatter_tensor(output, input)    ring, on p equal pieces of the flattened input
    all_to_all_single(output, input)        pairwise exchange, p equal pieces, or rows split
        (..., output_split_sizes, input_split_sizes)   in sizes that differ per rank (MoE)
    all_reduce(tensor, op, algorithm)       naive | tree | ring | recursive_doubling | halving_doubling

Every one also takes group= (from dist.new_group); src and dst are global ranks, as in
torch.distributed; op is "sum", "product", "max" or "min". Like torch.distributed's, they
move data outside autograd (under torch.no_grad()), so parameters can be passed too.

Costs use the α-β(-γ) model: a message of n bytes takes α + nβ, combining n bytes takes
nγ. N is the tensor's size in bytes, p the number of ranks in the group, and "sends" is
what one rank sends. A chunk that is empty (numel < p) is not sent at all.

Before any data moves, the ranks of the group swap a few bytes describing their call
(untraced bookkeeping), so that a mismatch (shapes, dtypes, roots, algorithms) raises the
same ValueError on every rank: never a hang or a silently wrong answer. That swap costs
a round trip of its own (milliseconds on gloo), so timing code turns it off with
`with collectives.unchecked(): ...`; only calls that are known to be right belong there.
"""
from __future__ import annotations

import contextlib
import itertools

import torch
import torch.distributed as dist

from .runtime import comm

OPS = {"sum": torch.add, "product": torch.mul, "max": torch.maximum, "min": torch.minimum}
ALL_REDUCE_ALGORITHMS = ("naive", "tree", "ring", "recursive_doubling", "halving_doubling")


def combine(acc, incoming, op):
    """acc <- acc (op) incoming, in place: the one line of arithmetic in every reduction."""
    OPS[op](acc, incoming, out=acc)


def sendrecv(send, dst, recv, src, group):
    """Send to dst while receiving from src: posting both first keeps a ring from deadlocking."""
    handles = ([comm.isend(send, dst, group)] if send.numel() else []) + \
              ([comm.irecv(recv, src, group)] if recv.numel() else [])
    for h in handles:
        h.wait()


# ----------------------------------------------------------------------------------
# Rooted collectives: broadcast, reduce (binomial trees), scatter, gather (linear).


def _tree_broadcast(flat, ranks, root, me, group):
    # Binomial tree: in round k the 2^k ranks that have the data each send it to one that has not.
    #   p=8, root 0:   0→1  |  0→2 1→3  |  0→4 1→5 2→6 3→7
    # Cost: ⌈log2 p⌉ rounds of α + Nβ. Every rank receives N once; the root sends ⌈log2 p⌉·N.
    p = len(ranks)
    vr = (me - root) % p                            # my place counted from the root
    mask = 1
    while mask < p:
        if vr < mask and vr + mask < p:
            comm.send(flat, ranks[(root + vr + mask) % p], group)
        elif mask <= vr < 2 * mask:
            comm.recv(flat, ranks[(root + vr - mask) % p], group)
        mask *= 2


def _tree_reduce(acc, ranks, root, me, group, op):
    # The broadcast's tree run backwards: each round, the upper half of the ranks still
    # holding a partial result send it to the lower half, which combine it with their own.
    #   p=8, root 0:   4→0 5→1 6→2 7→3  |  2→0 3→1  |  1→0
    # Cost: ⌈log2 p⌉ rounds of α + Nβ + Nγ. Every rank but the root sends N once.
    p = len(ranks)
    vr = (me - root) % p
    incoming = torch.empty_like(acc)
    mask = 1 << (p - 1).bit_length()                # the smallest power of two >= p
    while mask > 1:
        mask //= 2
        if mask <= vr < 2 * mask:
            comm.send(acc, ranks[(root + vr - mask) % p], group)
            return                                  # my part is in; I am done
        if vr + mask < p:
            comm.recv(incoming, ranks[(root + vr + mask) % p], group)
            combine(acc, incoming, op)


@torch.no_grad()
def broadcast(tensor, src, group=None):
    """Copy rank `src`'s tensor into `tensor` on every rank of the group."""
    ranks, me = _setup("broadcast", group, tensor, src=src)
    if tensor.numel():
        _tree_broadcast(tensor.view(-1), ranks, ranks.index(src), me, group)


@torch.no_grad()
def reduce(tensor, dst, op="sum", group=None):
    """Combine all ranks' tensors with `op` into `tensor` on rank `dst`; the others keep theirs."""
    ranks, me = _setup("reduce", group, tensor, op=op, dst=dst)
    root = ranks.index(dst)
    acc = tensor.view(-1) if me == root else tensor.view(-1).clone()   # leave non-roots' data alone
    if tensor.numel():
        _tree_reduce(acc, ranks, root, me, group, op)


@torch.no_grad()
def scatter(tensor, scatter_list=None, src=0, group=None):
    """Rank `src` sends scatter_list[i] to the i-th rank of the group (into its `tensor`).

    Linear: the root posts p-1 sends at once, one piece of n bytes per rank.
    Cost: (p-1)·n bytes leave the root: up to (p-1)(α + nβ) if its link sends one at a time.
    (scatter_list is only looked at on the root.)"""
    root = comm.rank() == src
    problems = _list_problems("scatter_list", scatter_list, tensor, len(list(comm.group_ranks(group)))) if root else []
    ranks, me = _setup("scatter", group, tensor, problems, src=src)
    if root:
        handles = [comm.isend(piece, r, group) for r, piece in zip(ranks, scatter_list)
                   if r != src and piece.numel()]
        tensor.copy_(scatter_list[me])
        for h in handles:
            h.wait()
    elif tensor.numel():
        comm.recv(tensor, src, group)


@torch.no_grad()
def gather(tensor, gather_list=None, dst=0, group=None):
    """Every rank sends `tensor` to rank `dst`, which puts the i-th rank's into gather_list[i].

    Linear, the mirror of scatter: (p-1)·n bytes arrive at the root, p-1 messages."""
    root = comm.rank() == dst
    problems = _list_problems("gather_list", gather_list, tensor, len(list(comm.group_ranks(group)))) if root else []
    ranks, me = _setup("gather", group, tensor, problems, dst=dst)
    if root:
        handles = [comm.irecv(out, r, group) for r, out in zip(ranks, gather_list)
                   if r != dst and out.numel()]
        gather_list[me].copy_(tensor)
        for h in handles:
            h.wait()
    elif tensor.numel():
        comm.send(tensor, dst, group)


# ----------------------------------------------------------------------------------
# Rings: all-gather and reduce-scatter, on a list of p chunks (chunk i belongs to rank i).


def _ring_all_gather(chunks, ranks, me, group):
    # p-1 steps; in each, every rank passes the chunk it got last step (its own at first)
    # to its right neighbour and takes a new one from its left.
    #   p=4, rank r sends chunk r, then r-1, then r-2 (mod 4)
    # Cost: (p-1)(α + nβ), n = one chunk: every rank sends and receives (p-1)·n bytes.
    p = len(ranks)
    right, left = ranks[(me + 1) % p], ranks[(me - 1) % p]
    for s in range(p - 1):
        sendrecv(chunks[(me - s) % p], right, chunks[(me - s - 1) % p], left, group)


def _ring_reduce_scatter(chunks, ranks, me, group, op):
    # p-1 steps; in each, every rank sends its partial result for one chunk to the right
    # and combines the partial result coming from the left into another. Each chunk goes
    # once round the ring, picking up every rank's part, and ends complete on its owner.
    #   p=4, rank r sends chunk r-1, then r-2, then r-3 (mod 4); it is left with chunk r.
    # Cost: (p-1)(α + nβ + nγ): every rank sends and receives (p-1)·n bytes.
    p = len(ranks)
    right, left = ranks[(me + 1) % p], ranks[(me - 1) % p]
    landing = torch.empty_like(chunks[0])       # one receive buffer for all steps (chunk 0 is the largest)
    for s in range(p - 1):
        out, into = chunks[(me - s - 1) % p], chunks[(me - s - 2) % p]
        incoming = landing[:into.numel()]
        sendrecv(out, right, incoming, left, group)
        combine(into, incoming, op)


@torch.no_grad()
def all_gather_into_tensor(output, input, group=None):
    """output = every rank's `input`, concatenated in group-rank order (p × input.numel())."""
    p = len(list(comm.group_ranks(group)))
    problems = _output_problem(output, input.dtype, p * input.numel(), f"{p} x input.numel()")
    ranks, me = _setup("all_gather", group, input, problems)
    if input.numel():
        chunks = output.view(-1).split(input.numel())
        chunks[me].copy_(input.view(-1))
        _ring_all_gather(chunks, ranks, me, group)


@torch.no_grad()
def all_gather(tensor_list, tensor, group=None):
    """tensor_list[i] = the i-th rank's `tensor`, on every rank (ring)."""
    problems = _list_problems("tensor_list", tensor_list, tensor, len(list(comm.group_ranks(group))))
    ranks, me = _setup("all_gather", group, tensor, problems)
    tensor_list[me].copy_(tensor)
    _ring_all_gather(tensor_list, ranks, me, group)


@torch.no_grad()
def reduce_scatter_tensor(output, input, op="sum", group=None):
    """output = the i-th of p equal pieces of the ranks' `input`s, combined with `op` (ring).
    `input` is left as it was."""
    p = len(list(comm.group_ranks(group)))
    problems = _output_problem(output, input.dtype, input.numel() / p, f"input.numel() / {p}")
    ranks, me = _setup("reduce_scatter", group, input, problems, op=op)
    if output.numel():
        chunks = input.view(-1).clone().split(output.numel())   # partial results go in a copy
        _ring_reduce_scatter(chunks, ranks, me, group, op)
        output.view(-1).copy_(chunks[me])


# ----------------------------------------------------------------------------------
# All-to-all: every rank has a different piece for every other rank.


def pairwise_all_to_all(outs, ins, ranks, me, group):
    # p-1 steps; in step s every rank sends the piece meant for the rank s places to its
    # right and receives its own piece from the rank s places to its left.
    #   p=4:  r→r+1  |  r→r+2  |  r→r+3   (mod 4)
    # Cost: (p-1)(α + nβ), n = N/p: each rank sends (p-1)/p·N bytes, all of them different.
    p = len(ranks)
    outs[me].copy_(ins[me])
    for s in range(1, p):
        to, frm = (me + s) % p, (me - s) % p
        sendrecv(ins[to], ranks[to], outs[frm], ranks[frm], group)


@torch.no_grad()
def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None):
    """Split `input` into p pieces; piece j goes to the j-th rank of the group, which puts
    the piece from the i-th rank at the i-th place of its `output`.

    Without split sizes: p equal pieces of the flattened tensor. With them (torch's
    signature): pieces of rows (dim 0), input_split_sizes[j] rows for rank j, and
    output_split_sizes[i] rows expected from rank i; they may differ per rank and per
    call, and be 0. Rank i's input_split_sizes[j] must equal rank j's output_split_sizes[i]:
    a receiver learns its sizes beforehand, usually by an all-to-all of the counts.
    Cost: each rank sends the rows it does not keep, Σ_{j≠me} input_split_sizes[j] rows.
    """
    if output_split_sizes is None and input_split_sizes is None:
        _equal_all_to_all(output, input, group)
    else:
        _uneven_all_to_all(output, input, output_split_sizes, input_split_sizes, group)


def _equal_all_to_all(output, input, group):
    p = len(list(comm.group_ranks(group)))
    problems = _output_problem(output, input.dtype, input.numel(), "input.numel()")
    if input.numel() % p:
        problems.append(f"input has {input.numel()} elements: it must split into {p} equal pieces")
    ranks, me = _setup("all_to_all", group, input, problems)
    if input.numel():
        n = input.numel() // p
        pairwise_all_to_all(output.view(-1).split(n), input.view(-1).split(n), ranks, me, group)


def _uneven_all_to_all(output, input, output_split_sizes, input_split_sizes, group):
    p = len(list(comm.group_ranks(group)))
    sizes = {"output": (output, output_split_sizes), "input": (input, input_split_sizes)}
    problems = []
    for name, (t, split) in sizes.items():
        if t.dim() == 0 or not t.is_contiguous():
            problems.append(f"{name} must be a contiguous tensor of rows (at least 1-d), got {_describe(t)}")
        elif split is None or len(split) != p or any(int(n) < 0 for n in split) or sum(split) != len(t):
            problems.append(f"{name}_split_sizes={None if split is None else list(split)} must be {p} "
                            f"numbers >= 0 (one per rank of the group) adding up to {name}'s {len(t)} rows")
    if output.dtype != input.dtype or output.shape[1:] != input.shape[1:]:
        problems.append(f"output is {_describe(output)} and input {_describe(input)}: "
                        f"their dtypes and all dimensions but the first must agree")
    row = input[:0] if input.dim() else input                 # every rank must agree on dtype and row shape
    splits = [list(map(int, output_split_sizes or [])), list(map(int, input_split_sizes or []))]
    ranks, me = _setup("all_to_all", group, row.contiguous(), problems, across=(splits, _splits_agree))
    pairwise_all_to_all(output.split(splits[0]), input.split(splits[1]), ranks, me, group)


def _splits_agree(everyone) -> list[str]:
    """Rank i sends input_split_sizes[j] rows to rank j, which must expect output_split_sizes[i] of them."""
    return [f"rank {i} sends {sends[j]} rows to rank {j}, which expects {everyone[j][0][i]} "
            f"(its output_split_sizes[{i}]): exchange the counts first"
            for i, (_, sends) in enumerate(everyone) for j in range(len(everyone))
            if sends[j] != everyone[j][0][i]]


# ----------------------------------------------------------------------------------
# All-reduce, five ways. Each works on the flattened tensor, in place.


def _naive_all_reduce(flat, ranks, me, group, op):
    # Parameter server: every worker sends its tensor to one rank (the group's first), which
    # combines them all and sends the result back to each.
    #   p=4:   1→0 2→0 3→0  |  0→1 0→2 0→3
    # Cost: 2 rounds, but all 2(p-1)·N bytes cross the server's link, 2(α + (p-1)Nβ) when
    # it is the bottleneck. Each worker sends N; the server sends (p-1)·N.
    server, workers = ranks[0], ranks[1:]
    if me != 0:
        comm.send(flat, server, group)
        comm.recv(flat, server, group)
        return
    parts = [torch.empty_like(flat) for _ in workers]
    for h in [comm.irecv(t, w, group) for t, w in zip(parts, workers)]:
        h.wait()
    for t in parts:
        combine(flat, t, op)
    for h in [comm.isend(flat, w, group) for w in workers]:
        h.wait()


def _tree_all_reduce(flat, ranks, me, group, op):
    # Reduce to the group's first rank along a binomial tree, then broadcast back down it.
    # Cost: 2⌈log2 p⌉ rounds of α + Nβ; no link carries more than ⌈log2 p⌉·N each way.
    _tree_reduce(flat, ranks, 0, me, group, op)
    _tree_broadcast(flat, ranks, 0, me, group)


def _ring_all_reduce(flat, ranks, me, group, op):
    # Ring (Baidu, NCCL): cut the tensor into p chunks, reduce-scatter them round the ring
    # so each rank ends with one chunk complete, then all-gather the complete chunks.
    # Cost: 2(p-1) rounds: 2(p-1)α + 2(p-1)/p·Nβ + (p-1)/p·Nγ. Each rank sends 2(p-1)/p·N
    # bytes, nearly 2N however large p grows. Chunks differ by one element if p ∤ numel.
    chunks = flat.tensor_split(len(ranks))
    _ring_reduce_scatter(chunks, ranks, me, group, op)
    _ring_all_gather(chunks, ranks, me, group)


def _recursive_doubling(flat, ranks, me, group, op):
    # p a power of two. Step k: swap the whole tensor with the rank whose index differs in
    # bit k, and combine. After log2 p steps every rank has combined all p tensors.
    #   p=8:   r↔r^1  |  r↔r^2  |  r↔r^4
    # Cost: log2 p rounds of α + Nβ + Nγ: each rank sends log2(p)·N bytes.
    incoming = torch.empty_like(flat)
    mask = 1
    while mask < len(ranks):
        partner = ranks[me ^ mask]
        sendrecv(flat, partner, incoming, partner, group)
        combine(flat, incoming, op)
        mask *= 2


def _halving_doubling(flat, ranks, me, group, op):
    # Rabenseifner, p a power of two: reduce-scatter by recursive halving (each step swap
    # half of what is left with a partner, keep and combine the other half), then
    # all-gather by recursive doubling (swap everything complete so far).
    #   p=4:   r↔r^2 (N/2)  |  r↔r^1 (N/4)  ||  r↔r^1 (N/4)  |  r↔r^2 (N/2)
    # Cost: 2·log2 p rounds; each rank sends 2(p-1)/p·N bytes: the ring's bytes, fewer α.
    p = len(ranks)
    bounds = [0, *itertools.accumulate(c.numel() for c in flat.tensor_split(p))]

    def part(a, b):                                 # chunks a..b-1, one contiguous slice
        return flat[bounds[a]:bounds[b]]

    lo, hi, mask = 0, p, p // 2                     # chunks lo..hi-1 are still mine to reduce
    while mask >= 1:
        partner, mid = ranks[me ^ mask], (lo + hi) // 2
        keep, give = ((lo, mid), (mid, hi)) if me & mask == 0 else ((mid, hi), (lo, mid))
        incoming = torch.empty_like(part(*keep))
        sendrecv(part(*give), partner, incoming, partner, group)
        combine(part(*keep), incoming, op)
        (lo, hi), mask = keep, mask // 2
    mask = 1                                        # now chunk `me` is complete; gather the rest
    while mask < p:
        partner, other = ranks[me ^ mask], lo ^ mask
        sendrecv(part(lo, hi), partner, part(other, other + mask), partner, group)
        lo, hi, mask = min(lo, other), max(hi, other + mask), mask * 2


def _fold_to_power_of_two(algorithm, flat, ranks, me, group, op):
    # p = 2^k + r ranks: the first 2r pair up; each even one hands its tensor to the odd one
    # after it and sits out, the 2^k ranks left run `algorithm`, and the odd ones hand the
    # result back. Cost: two extra rounds of α + Nβ for the paired ranks.
    rem = len(ranks) - (1 << (len(ranks).bit_length() - 1))
    if me < 2 * rem and me % 2 == 0:
        comm.send(flat, ranks[me + 1], group)
        comm.recv(flat, ranks[me + 1], group)
        return
    if me < 2 * rem:
        incoming = torch.empty_like(flat)
        comm.recv(incoming, ranks[me - 1], group)
        combine(flat, incoming, op)
    stay = ranks[1:2 * rem:2] + ranks[2 * rem:]
    algorithm(flat, stay, stay.index(ranks[me]), group, op)
    if me < 2 * rem:
        comm.send(flat, ranks[me - 1], group)


@torch.no_grad()
def all_reduce(tensor, op="sum", algorithm="ring", group=None):
    """Combine every rank's `tensor` with `op` ("sum", "product", "max", "min"); all get the result.

    algorithm: "naive" (parameter server), "tree" (binomial reduce + broadcast), "ring",
    "recursive_doubling" or "halving_doubling" (Rabenseifner). The last two need a power
    of two ranks; on other group sizes they first fold the extra ranks in (see
    _fold_to_power_of_two). Every algorithm leaves bitwise the same result on every rank.
    """
    problems = [] if algorithm in ALL_REDUCE_ALGORITHMS else \
        [f"unknown algorithm {algorithm!r}: use one of {', '.join(map(repr, ALL_REDUCE_ALGORITHMS))}"]
    ranks, me = _setup("all_reduce", group, tensor, problems, op=op, algorithm=algorithm)
    if len(ranks) == 1 or tensor.numel() == 0:
        return
    run = {"naive": _naive_all_reduce, "tree": _tree_all_reduce, "ring": _ring_all_reduce,
           "recursive_doubling": _recursive_doubling, "halving_doubling": _halving_doubling}[algorithm]
    if algorithm in ("recursive_doubling", "halving_doubling"):
        _fold_to_power_of_two(run, tensor.view(-1), ranks, me, group, op)
    else:
        run(tensor.view(-1), ranks, me, group, op)


# ----------------------------------------------------------------------------------
# Checking the call: every rank of the group must agree, or every rank raises (the same error).

_checking = {"on": True}


@contextlib.contextmanager
def unchecked():
    """Inside this block the ranks do not compare their calls before moving data.

    For measuring time only (benchmarks, pplab.costmodel): the check is a round trip of
    its own, which would swamp small messages. Each rank still checks what it can see
    alone, but a mismatch between ranks may now hang or give a wrong answer.
    """
    before, _checking["on"] = _checking["on"], False
    try:
        yield
    finally:
        _checking["on"] = before


def _describe(t) -> str:
    return f"{str(t.dtype).replace('torch.', '')}{list(t.shape)}"


def _list_problems(name, tensors, like, p) -> list[str]:
    """What is wrong with a list that must hold p tensors shaped like `like`, if anything."""
    if tensors is None or len(tensors) != p:
        return [f"{name} must hold one tensor per rank of the group ({p}), "
                f"got {0 if tensors is None else len(tensors)}"]
    return [f"{name}[{i}] is {_describe(t)}{'' if t.is_contiguous() else ' (not contiguous)'}, "
            f"it must be a contiguous {_describe(like)} like the tensor"
            for i, t in enumerate(tensors) if _describe(t) != _describe(like) or not t.is_contiguous()]


def _output_problem(output, dtype, numel, formula) -> list[str]:
    if output.dtype == dtype and output.numel() == numel and output.is_contiguous():
        return []
    return [f"output is {_describe(output)}: it must be a contiguous {str(dtype)[6:]} tensor of "
            f"{formula} = {numel:g} elements"]


def _setup(kind, group, tensor, problems=(), across=None, **call):
    """Check the call on every rank of the group; return (ranks, me): its global ranks, my index.

    `tensor` must have the same shape and dtype on every rank, and `call` (root, op,
    algorithm) the same values. Every rank hands the others a description of its call
    (dist.all_gather_object, not traced: it is bookkeeping, not the algorithm), so all
    see the same facts and raise the same error: no rank is left waiting for a message.
    across=(facts, agree): my facts that may differ between ranks, and a function of every
    rank's facts returning problems (the uneven all-to-all's split sizes must match).
    Inside `unchecked()` that exchange is skipped.
    """
    ranks = list(comm.group_ranks(group))
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank not in ranks:
        raise ValueError(f"{kind}: rank {rank} is not in the group {ranks}; only its ranks may call it")
    problems = list(problems)
    if not tensor.is_contiguous():
        problems.append("the tensor is not contiguous: pass tensor.contiguous()")
    if call.get("op", "sum") not in OPS:
        problems.append(f"unknown op {call['op']!r}: use one of {', '.join(OPS)}")
    mine = {"problems": problems, "call": {"collective": kind, **call}, "tensor": _describe(tensor),
            "facts": across[0] if across else None}
    everyone = [mine]
    if len(ranks) > 1 and _checking["on"]:
        everyone = [None] * len(ranks)
        dist.all_gather_object(everyone, mine, group=group)
    found = [f"rank {r}: {msg}" for r, d in zip(ranks, everyone) for msg in d["problems"]]
    if across and not found and (len(ranks) == 1 or _checking["on"]):
        found = across[1]([d["facts"] for d in everyone])
    if found:
        raise ValueError(f"{kind}: " + "; ".join(found))
    for key, what in (("call", "the call"), ("tensor", "the tensor's dtype and shape")):
        if any(d[key] != everyone[0][key] for d in everyone):
            listing = ", ".join(f"rank {r}: {d[key]}" for r, d in zip(ranks, everyone))
            raise ValueError(f"{kind}: the ranks of the group disagree on {what} ({listing}); "
                             f"every rank must pass the same")
    for name in ("src", "dst"):
        if name in call and call[name] not in ranks:
            raise ValueError(f"{kind}: {name}={call[name]!r} is not a rank of the group: use one of "
                             f"{ranks} ({name} is a global rank, as in torch.distributed)")
    return ranks, ranks.index(rank)
