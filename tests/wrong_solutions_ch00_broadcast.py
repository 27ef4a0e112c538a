"""Plausible wrong answers to the exercises, each a mistake a student could make.

WRONG[exercise_id] lists (function, regular expressions the check's message must match,
timeout for the check or None for the default). tests/test_checks.py checks that every
one of them fails with that message.
"""
import torch.distributed as dist
from torch.distributed import _functional_collectives as funcol
from torch.distributed import broadcast as imported_broadcast

from pplab import comm


def _rounds(p):
    """The masks of a binomial tree: 1, 2, 4, ... below p."""
    mask = 1
    while mask < p:
        yield mask
        mask *= 2


def broadcast_ignores_src(tensor, src):
    """A binomial tree rooted at rank 0 whatever src says: right only when src == 0."""
    rank, p = comm.rank(), comm.world_size()
    for mask in _rounds(p):
        if rank < mask and rank + mask < p:
            comm.send(tensor, rank + mask)
        elif mask <= rank < 2 * mask:
            comm.recv(tensor, rank - mask)


def broadcast_to_next_only(tensor, src):
    """src sends to its neighbour and stops: right for 2 ranks, wrong for 3 or more."""
    rank, p = comm.rank(), comm.world_size()
    if rank == src:
        comm.send(tensor, (src + 1) % p)
    elif rank == (src + 1) % p:
        comm.recv(tensor, src)


def broadcast_with_library(tensor, src):
    """Calls the collective the exercise asks to build."""
    dist.broadcast(tensor, src)


def broadcast_with_imported_library(tensor, src):
    """The same, with the collective imported by name before the check started."""
    imported_broadcast(tensor, src)


def broadcast_returns_new_tensor(tensor, src):
    """Receives into a new tensor and returns it, leaving the caller's tensor as it was."""
    rank, p = comm.rank(), comm.world_size()
    out = tensor.clone()
    if rank == src:
        for r in range(p):
            if r != src:
                comm.send(out, r)
    else:
        comm.recv(out, src)
    return out


def broadcast_receives_first(tensor, src):
    """Every rank (src included) waits for its predecessor before sending on: a deadlock."""
    rank, p = comm.rank(), comm.world_size()
    comm.recv(tensor, (rank - 1) % p)
    if (rank + 1) % p != src:
        comm.send(tensor, (rank + 1) % p)


def broadcast_forgets_wraparound(tensor, src):
    """A binomial tree rooted at src that forgets `% p` when turning a relative rank back
    into a real one: it sends past the last rank as soon as src != 0."""
    rank, p = comm.rank(), comm.world_size()
    relative = (rank - src) % p
    for mask in _rounds(p):
        if relative < mask and relative + mask < p:
            comm.send(tensor, relative + mask + src)
        elif mask <= relative < 2 * mask:
            comm.recv(tensor, (relative - mask + src) % p)


def broadcast_via_functional_collective(tensor, src):
    """A functional collective: the checker's router refuses it like any other library collective."""
    out = funcol.broadcast(tensor, src, dist.group.WORLD)
    tensor.copy_(out.wait() if hasattr(out, "wait") else out)


def broadcast_last_rank_scratch_buffer(tensor, src):
    """A right binomial tree, except that the last rank receives into a scratch buffer and
    never copies it back: right on rank 0 (and every other rank), wrong on rank p-1."""
    rank, p = comm.rank(), comm.world_size()
    me = (rank - src) % p
    target = tensor.clone() if rank == p - 1 else tensor
    for mask in _rounds(p):
        if me < mask and me + mask < p:
            comm.send(target, (me + mask + src) % p)
        elif mask <= me < 2 * mask:
            comm.recv(target, (me - mask + src) % p)


def broadcast_last_rank_spins(tensor, src):
    """The last rank loops forever (a loop condition that never changes): not a deadlock."""
    rank, p = comm.rank(), comm.world_size()
    if rank == p - 1:
        done = False
        while not done:
            pass
    elif rank == src:
        for r in range(p - 1):
            if r != src:
                comm.send(tensor, r)
    else:
        comm.recv(tensor, src)


def broadcast_sends_before_receiving(tensor, src):
    """Passes the tensor round the ring with every rank sending before it receives: each
    blocking send waits for a receiver that is itself sending."""
    rank, p = comm.rank(), comm.world_size()
    for _ in range(p - 1):
        comm.send(tensor, (rank + 1) % p)
        comm.recv(tensor, (rank - 1) % p)


_listened = []


def broadcast_rank_2_listens_to_the_wrong_rank_once(tensor, src):
    """Right everywhere but on rank 2, and there in one trial only: it waits for src's
    neighbour instead of src, so it never finishes (never records) that trial while the
    other ranks finish it and go on. The message must still name rank 2 as stuck."""
    rank, p = comm.rank(), comm.world_size()
    if rank == src:
        for r in range(p):
            if r != src:
                comm.send(tensor, r)
    elif rank == 2 and not _listened:
        _listened.append(src)
        comm.recv(tensor, next(r for r in range(src + 1, src + p) if r % p != 2) % p)
    else:
        comm.recv(tensor, src)


# Failures are reported for the first trial that went wrong, lowest rank first.
TRIAL = r"^world_size=\d, src=\d, dtype=(float32|int64), shape=\([\d, ]*\): "
WRONG = {
    "broadcast": [
        (broadcast_ignores_src,
         [TRIAL, r"src=[1-9]",
          r"(result differs from the reference|is the src, so its tensor must stay as it was, but it changed)"],
         None),
        (broadcast_rank_2_listens_to_the_wrong_rank_once,      # the router sees every rank wait: named at once
         [r"^world_size=3, .*: a deadlock: .*rank 2 waits to receive from rank \d"], 10.0),
        (broadcast_to_next_only,
         [r"^world_size=[34], .*: rank \d's result differs from the reference \(rank \d's tensor, the src\) "
          r"at index [\d(]"], None),
        (broadcast_with_library,
         [r"^exercise 'broadcast' asks you to build broadcast from point-to-point sends and receives",
          r"you called torch\.distributed\.broadcast, the library collective it replaces\.$"], None),
        (broadcast_with_imported_library,
         [r"you use torch\.distributed\.broadcast, the library collective it replaces\.$"], None),
        (broadcast_returns_new_tensor,
         [TRIAL, r"returned the result as a new tensor on rank \d but left `tensor` unchanged", r"in place"],
         None),
        (broadcast_receives_first,
         [r"^world_size=2\b.*: a deadlock: rank 0 waits to receive from rank 1, rank 1 waits to receive from "
          r"rank 0\. No rank could go on, so the check stopped them at once\."], 3.0),
        (broadcast_forgets_wraparound,
         [TRIAL, r"rank \d raised ValueError: dst=\d is not a rank",
          r"\(in broadcast_forgets_wraparound, line \d+: `comm\.send\(tensor, relative \+ mask \+ src\)`\)"],
         None),
        (broadcast_last_rank_scratch_buffer,
         [TRIAL, r"rank [1-3]'s result differs from the reference \(rank [0-2]'s tensor, the src\)"], None),
        (broadcast_last_rank_spins,
         [r"^world_size=2\b.*: rank 1 was still running after 3 s, busy on the CPU all along: a loop that never "
          r"ends\? Check what ends each loop in broadcast_last_rank_spins"], 3.0),
        (broadcast_sends_before_receiving,
         [r"^world_size=2\b.*: a deadlock: rank 0 waits for rank 1 to receive what it sends, rank 1 waits for "
          r"rank 0 to receive what it sends\."], None),
        (broadcast_via_functional_collective,
         [r"^exercise 'broadcast' asks you to build broadcast from point-to-point sends and receives",
          r"you called torch\.distributed\._functional_collectives\.broadcast, the library collective it "
          r"replaces\.$"], None),
    ],
}
