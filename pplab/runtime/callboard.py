"""What each rank is inside right now, on a board the caller reads while the ranks run.

A launch gives every rank one fixed-size slot of a small shared file. `pplab.comm` writes
the call a rank enters (kind, tensor, root, group, and for collectives its index among
this rank's collectives on that group) and clears it on the way out: a copy into shared
memory, cheap enough for every call. The caller (pplab.runtime.launcher) reads the board a few
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
import struct
import time

import torch.distributed as dist

SLOT = 512
RETURNED = "the end-of-launch barrier (fn had returned)"   # where a finished rank waits
_HEAD = struct.Struct("<QBd")          # version, inside (0 or 1), since (time.time())
_encode = json.JSONEncoder(separators=(",", ":")).encode     # built once: json.dumps(..., separators) is slow
_state = {"mm": None, "offset": 0, "version": 0, "index": {}, "now": "null", "last": "null"}


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
    _state.update(offset=rank * SLOT, version=0, index={}, now="null", last="null")


def _write_head(inside: int) -> int:
    mm, off = _state["mm"], _state["offset"]
    v = _state["version"] = _state["version"] + 2
    mm[off:off + _HEAD.size] = _HEAD.pack(v - 1, 0, 0.0)         # odd: being written
    return v


def _write(inside: int) -> None:
    """Write the slot: header (version, inside, since) and body {"now": ..., "last": ...}."""
    mm, off = _state["mm"], _state["offset"]
    body = f'{{"now":{_state["now"]},"last":{_state["last"]}}}'.encode()
    if len(body) > SLOT - _HEAD.size - 2:              # a huge shape: keep what fits, still valid JSON
        body = b'{"now":{"kind":"?"},"last":null}'
    v = _write_head(inside)
    mm[off + _HEAD.size:off + _HEAD.size + 2] = len(body).to_bytes(2, "little")
    mm[off + _HEAD.size + 2:off + _HEAD.size + 2 + len(body)] = body
    mm[off:off + _HEAD.size] = _HEAD.pack(v, inside, time.time())


def group_key(group) -> str:
    """A name for a process group that two different groups never share."""
    if group is None or group is dist.group.WORLD:
        return "world"
    name = getattr(group, "group_name", None)
    return "world" if name is None else str(name)


def enter(kind: str, tensor=None, group=None, ranks=(), collective=True, **extra) -> None:
    """Note that this rank is entering `kind` (a no-op outside pplab.launch)."""
    if _state["mm"] is None:
        return
    call = {"kind": kind, "group": group_key(group), "ranks": list(ranks), **extra}
    if tensor is not None:
        call["dtype"] = str(tensor.dtype)[6:]                         # "torch.float32" -> "float32"
        call["shape"] = list(tensor.shape)
    if collective:
        index = _state["index"]
        call["index"] = index.get(call["group"], 0)
        index[call["group"]] = call["index"] + 1
    _state["now"] = _encode(call)
    _write(1)
    if collective:                     # once it returns, this is the rank's last collective
        _state["last"] = _state["now"]


def leave() -> None:
    """Note that the call has returned (only the header changes: cheap)."""
    if _state["mm"] is not None:
        mm, off = _state["mm"], _state["offset"]
        v = _write_head(0)
        mm[off:off + _HEAD.size] = _HEAD.pack(v, 0, time.time())


# ----------------------------------------------------------------------------------
# In the caller


def read(path: str, world_size: int) -> list:
    """One dict per rank: inside (bool), since (time.time() it entered), call (what it is in,
    {} when in none), last (its last finished collective, {} when none)."""
    empty = {"inside": False, "since": 0.0, "call": {}, "last": {}}
    try:
        with open(path, "rb") as f:
            raw = f.read(SLOT * world_size)
    except OSError:
        return [dict(empty) for _ in range(world_size)]
    out = []
    for r in range(world_size):
        off = r * SLOT
        version, inside, since = _HEAD.unpack_from(raw, off)
        n = int.from_bytes(raw[off + _HEAD.size:off + _HEAD.size + 2], "little")
        try:
            body = json.loads(raw[off + _HEAD.size + 2:off + _HEAD.size + 2 + n]) if n and not version % 2 else {}
        except ValueError:
            body = {}
        now, last = body.get("now") or {}, body.get("last") or {}
        if not inside:                          # it returned from `now`: that is its last collective
            last, now = (now if "index" in now else last), {}
        out.append({"inside": bool(inside) and bool(now), "since": since, "call": now, "last": last})
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
    """Two ranks that disagree on the same collective call (same group, same index): both
    inside it, or one inside it while the other has already finished its own version."""
    at = {}
    for r, slot in enumerate(board):
        if slot["inside"] and "index" in slot["call"]:
            at.setdefault((slot["call"]["group"], slot["call"]["index"]), []).append((r, slot["call"], ""))
    for r, slot in enumerate(board):
        last = slot["last"]
        if last and (last["group"], last["index"]) in at:
            at[(last["group"], last["index"])].append((r, last, " (and returned from it)"))
    for (group, index), calls in sorted(at.items(), key=lambda kv: kv[1][0][0]):
        if len({_signature(c) for _, c, _ in calls}) > 1:
            calls.sort(key=lambda x: x[0])
            listing = "; ".join(f"rank {r} {'called' if done else 'is in'} {describe(c)}{done}"
                                for r, c, done in calls)
            which = "the world group" if group == "world" else f"group {calls[0][1]['ranks']}"
            return (f"mismatched collectives: at collective call #{index} on {which}, {listing}. "
                    f"Every rank of a group must make the same collective calls, in the same order, "
                    f"with the same shapes, dtypes and roots; these ranks would wait for each other forever "
                    f"(or gloo would abort)")
    return None
