"""What each rank is inside right now, on a board the caller reads while the ranks run.

A launch gives every rank one fixed-size slot of a small shared file. `pplab.comm` writes
the call a rank enters (kind, tensor, root, group, and for collectives its index among
this rank's collectives on that group) and clears it on the way out: a copy into shared
memory, cheap enough for every call. The caller (pplab.launcher) reads the board a few
times a second, which gives it two things:

* a mismatch, found at once: two ranks inside *different* collectives (or the same one
  with different sizes) at the same index of the same group can never finish, since each
  waits for the other to join its own call. The launch is ended within a second with a
  message naming both calls, instead of hanging until the timeout;
* at a timeout, or when a rank dies, what each rank was inside and for how long.

A slot is written like a seqlock: its version is odd while the rank writes it, so the
caller never reads half an update.
"""
from __future__ import annotations

import json
import mmap
import os
import struct
import time

SLOT = 512
RETURNED = "nothing: fn had returned"   # what a rank waiting in the end-of-launch barrier is in
_HEAD = struct.Struct("<QBd")          # version, inside (0 or 1), since (time.time())
_state = {"mm": None, "offset": 0, "version": 0, "index": {}}


# ----------------------------------------------------------------------------------
# In a rank


def create(path: str, world_size: int) -> str:
    with open(path, "wb") as f:
        f.truncate(SLOT * world_size)
    return path


def attach(path: str, rank: int) -> None:
    """Called once in each rank, before fn runs."""
    with open(path, "r+b") as f:
        _state["mm"] = mmap.mmap(f.fileno(), 0)
    _state.update(offset=rank * SLOT, version=0, index={})


def _write(inside: int, call: dict) -> None:
    mm, off = _state["mm"], _state["offset"]
    body = json.dumps(call, separators=(",", ":")).encode()[: SLOT - _HEAD.size - 2]
    v = _state["version"] + 1                           # odd: being written
    mm[off:off + _HEAD.size] = _HEAD.pack(v, 0, 0.0)
    mm[off + _HEAD.size:off + _HEAD.size + 2] = len(body).to_bytes(2, "little")
    mm[off + _HEAD.size + 2:off + _HEAD.size + 2 + len(body)] = body
    _state["version"] = v + 1                            # even: whole again
    mm[off:off + _HEAD.size] = _HEAD.pack(v + 1, inside, time.time())


def group_key(group) -> str:
    """A name for a process group that two different groups never share."""
    if group is None:
        return "world"
    name = getattr(group, "group_name", None)
    import torch.distributed as dist
    return "world" if group is dist.group.WORLD or name is None else str(name)


def enter(kind: str, tensor=None, group=None, ranks=(), collective=True, **extra) -> None:
    """Note that this rank is entering `kind` (a no-op outside pplab.launch)."""
    if _state["mm"] is None:
        return
    call = {"kind": kind, "group": group_key(group), "ranks": list(ranks), **extra}
    if tensor is not None:
        call["dtype"] = str(tensor.dtype).replace("torch.", "")
        call["shape"] = list(tensor.shape)
    if collective:
        index = _state["index"]
        call["index"] = index.get(call["group"], 0)
        index[call["group"]] = call["index"] + 1
    _write(1, call)


def leave() -> None:
    if _state["mm"] is not None:
        _write(0, {})


# ----------------------------------------------------------------------------------
# In the caller


def read(path: str, world_size: int) -> list:
    """[(version, inside, since, call) per rank]; call is {} when the rank is in no call."""
    try:
        with open(path, "rb") as f:
            raw = f.read(SLOT * world_size)
    except OSError:
        return [(0, 0, 0.0, {})] * world_size
    out = []
    for r in range(world_size):
        off = r * SLOT
        version, inside, since = _HEAD.unpack_from(raw, off)
        if version % 2 or not inside:
            out.append((version, 0, since, {}))
            continue
        n = int.from_bytes(raw[off + _HEAD.size:off + _HEAD.size + 2], "little")
        try:
            call = json.loads(raw[off + _HEAD.size + 2:off + _HEAD.size + 2 + n])
        except ValueError:
            call = {}
        out.append((version, inside, since, call))
    return out


def describe(call: dict) -> str:
    """all_reduce(float32[1000]), broadcast(float32[4], src=0), send(float32[2], dst=1)."""
    if not call:
        return "no communication call"
    if call["kind"] == RETURNED:
        return RETURNED
    args = []
    if "shape" in call:
        args.append(f"{call['dtype']}[{', '.join(map(str, call['shape']))}]")
    args += [f"{k}={call[k]}" for k in ("src", "dst", "op") if k in call]
    where = ""
    if call.get("group") not in (None, "world"):
        where = f" on group {call['ranks']}"
    return f"{call['kind']}({', '.join(args)}){where}"


def _signature(call: dict):
    return tuple(str(call.get(k)) for k in ("kind", "dtype", "shape", "src", "dst", "op"))


def find_mismatch(board: list) -> str | None:
    """Ranks inside different collectives at the same index of the same group, or None."""
    at = {}
    for r, (_, inside, _, call) in enumerate(board):
        if inside and "index" in call:
            at.setdefault((call["group"], call["index"]), []).append((r, call))
    for (group, index), calls in sorted(at.items(), key=lambda kv: kv[1][0][0]):
        if len({_signature(c) for _, c in calls}) > 1:
            listing = "; ".join(f"rank {r} is in {describe(c)}" for r, c in calls)
            which = "the world group" if group == "world" else f"group {calls[0][1]['ranks']}"
            return (f"mismatched collectives: at collective call #{index} on {which}, {listing}. "
                    f"Every rank of a group must make the same collective calls, in the same order, "
                    f"with the same shapes, dtypes and roots; these ranks would wait for each other forever")
    return None
