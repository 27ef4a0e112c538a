"""The router of a sealed launch: every message between its ranks passes through here.

A sealed rank (rank.py, launched by launch.py) has no process group. Its sends, receives and collectives
become requests over its channel to the checker's process, where one `Router` serves
them all:

* point-to-point: a send is matched with the receive that names the same (src, dst,
  tag), first posted first matched. A blocking send returns once its receive is posted
  (as with gloo: every rank sending first is a deadlock); `isend`/`irecv` get no reply
  (the rank numbers its handles itself: one round trip fewer) and `wait` blocks until
  the match, or raises what went wrong with the post;
* collectives the exercise allows are computed here (the router has every rank's part);
  those it forbids are refused *and recorded*, so a forbidden call counts even if the
  student's code catches the error;
* every call is recorded (`Record`): every request (calls), and who sent how many bytes
  to whom in which trial (sends, received). The checker trusts this record, never what
  a rank says about itself;
* a deadlock is exact: when every rank still running is blocked here, none can ever go
  on, and `deadlock()` says what each one waits for.

Requests and replies are a JSON header plus raw tensor bytes (`pack`/`Reader`): nothing
a rank sends is unpickled, and a malformed message is an error, never a pass.
"""
from __future__ import annotations

import json
import struct
from collections import defaultdict, deque
from dataclasses import dataclass, field

import torch

# ----------------------------------------------------------------------------------
# The wire: [4-byte header length][JSON header][raw bytes of each blob]

MAX_HEADER, MAX_BLOBS = 1 << 20, 1 << 28
_DTYPES = {str(d).replace("torch.", ""): d for d in (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
    torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128)}


class WireError(Exception):
    """A message that is not what the protocol allows (a rank wrote to its channel itself?)."""


def pack(header: dict, blobs=()) -> bytes:
    blobs = [bytes(b) for b in blobs]
    head = json.dumps({**header, "blobs": [len(b) for b in blobs]}).encode()
    return struct.pack(">I", len(head)) + head + b"".join(blobs)


class Reader:
    """Cuts a byte stream into (header, blobs) messages, refusing oversized or malformed ones."""

    def __init__(self):
        self.buffer = bytearray()

    def feed(self, data: bytes) -> list:
        self.buffer += data
        messages = []
        while len(self.buffer) >= 4:
            size = struct.unpack(">I", self.buffer[:4])[0]
            if size > MAX_HEADER:
                raise WireError(f"a message header of {size:,} bytes")
            if len(self.buffer) < 4 + size:
                break
            try:
                header = json.loads(bytes(self.buffer[4:4 + size]))
                lengths = [int(n) for n in header["blobs"]]
            except (ValueError, KeyError, TypeError) as exc:
                raise WireError(f"a message that is not valid ({type(exc).__name__})") from None
            if not isinstance(header, dict) or any(n < 0 for n in lengths) or sum(lengths) > MAX_BLOBS:
                raise WireError("a message with impossible sizes")
            end = 4 + size + sum(lengths)
            if len(self.buffer) < end:
                break
            blobs, at = [], 4 + size
            for n in lengths:
                blobs.append(bytes(self.buffer[at:at + n]))
                at += n
            del self.buffer[:end]
            messages.append((header, blobs))
        return messages


def tensor_meta(t: torch.Tensor) -> dict:
    return {"dtype": str(t.dtype).replace("torch.", ""), "shape": list(t.shape)}


def tensor_bytes(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def to_tensor(meta: dict, blob: bytes) -> torch.Tensor:
    """A tensor from its (dtype, shape) and bytes; WireError if they do not agree."""
    try:
        dtype, shape = _DTYPES[meta["dtype"]], [int(n) for n in meta["shape"]]
    except (KeyError, TypeError, ValueError):
        raise WireError("a tensor of unknown dtype or shape") from None
    numel = 1
    for n in shape:
        numel *= n
    if numel * dtype.itemsize != len(blob) or any(n < 0 for n in shape):
        raise WireError("a tensor whose bytes do not match its shape")
    if not blob:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(blob), dtype=dtype).view(shape).clone()


# ----------------------------------------------------------------------------------
# What the router records


@dataclass
class Record:
    """Every call of every rank, as the router saw it (the only record a checker trusts)."""

    calls: list = field(default_factory=list)       # every request: {rank, trial, op, peer (or kind), bytes,
    #                                                 phase, handle, group}
    sends: list = field(default_factory=list)       # (rank, trial, dst, bytes, phase), when posted
    received: list = field(default_factory=list)    # (rank, trial, src, bytes), when delivered
    forbidden: list = field(default_factory=list)   # (rank, trial, message)
    waited: dict = field(default_factory=dict)      # (rank, handle) -> the phase of the first wait() on it

    def traffic(self, trial: int) -> dict:
        """What each rank did in one trial: {rank: {"sends": [(dst, bytes)], "received": [(src, bytes)],
        "sends_in": {phase: [(dst, bytes)]}, "collectives": [{"kind", "bytes", "phase", "async",
        "group", "waited"}]}}. A collective's bytes are those of the tensor the rank put in; phase
        is what the job named with sealed.phase ("forward"); waited: the phase in which the rank
        first waited for an async one (wait(), or is_completed() once it was), None if never."""
        out = defaultdict(lambda: {"sends": [], "received": [], "collectives": [], "sends_in": {}})
        for call in self.calls:
            if call["trial"] == trial and call["op"] == "collective":
                out[call["rank"]]["collectives"].append({
                    "kind": call["peer"], "bytes": call["bytes"] or 0, "phase": call["phase"],
                    "async": call["handle"] is not None, "group": call["group"],
                    "waited": self.waited.get((call["rank"], call["handle"]))})
        for rank, t, peer, n, phase in self.sends:
            if t == trial:
                out[rank]["sends"].append((peer, n))
                out[rank]["sends_in"].setdefault(phase, []).append((peer, n))
        for rank, t, peer, n in self.received:
            if t == trial:
                out[rank]["received"].append((peer, n))
        return out


@dataclass
class _Post:
    rank: int
    trial: int
    meta: dict
    blob: bytes = b""
    handle: int | None = None            # None: a blocking call, the rank waits for the reply


_REDUCE = {"sum": lambda ts: torch.stack(ts).sum(0), "max": lambda ts: torch.stack(ts).amax(0),
           "min": lambda ts: torch.stack(ts).amin(0), "product": lambda ts: torch.stack(ts).prod(0)}


class Router:
    """Serves the requests of one launch's ranks. `handle(rank, header, blobs)` returns the
    replies to send now, as [(rank, header, blobs)]; a blocked rank gets its reply later."""

    def __init__(self, world_size: int, forbidden_message):
        self.p, self.record = world_size, Record()
        self.forbidden_message = forbidden_message      # (kind, shown) -> message, or None if allowed
        self.trial = [None] * world_size
        self.phase = [""] * world_size                   # what the job says the rank is doing (sealed.phase)
        self.finished = [False] * world_size
        self.blocked: dict[int, str] = {}               # rank -> what it waits for
        self.sends, self.recvs = defaultdict(deque), defaultdict(deque)   # (src, dst, tag) -> posts
        self.handles: dict[tuple, dict] = {}            # (rank, id) -> {"done", "reply", "waiting"}
        self.joined: dict[tuple, dict] = {}             # (group, index) -> {rank: (header, blobs)}
        self.calls = defaultdict(int)                   # (rank, group) -> collectives entered
        self.waiting_in: dict[tuple, str] = {}          # (rank, handle) -> what its collective waits for

    # -- point-to-point ---------------------------------------------------------

    def _peer(self, rank, header, name):
        peer = header.get(name)
        if isinstance(peer, bool) or not isinstance(peer, int) or not 0 <= peer < self.p or peer == rank:
            raise ValueError(f"{name}={peer!r} is not another rank: ranks are 0..{self.p - 1}")
        return peer

    def _post(self, rank, header, blobs, out, sending: bool, blocking: bool):
        peer = self._peer(rank, header, "dst" if sending else "src")
        tag = int(header.get("tag", 0))
        meta = {k: header["tensor"][k] for k in ("dtype", "shape")}
        nbytes = len(blobs[0]) if sending else int(header["nbytes"])
        handle = None if blocking else header["handle"]
        if not blocking:
            self.handles[(rank, handle)] = {"done": False, "reply": None, "waiting": False}
        post = _Post(rank, self.trial[rank], {**meta, "nbytes": nbytes}, blobs[0] if sending else b"", handle)
        key = (rank, peer, tag) if sending else (peer, rank, tag)
        if sending:
            self.record.sends.append((rank, self.trial[rank], peer, nbytes, self.phase[rank]))
        mine, theirs = (self.sends, self.recvs) if sending else (self.recvs, self.sends)
        if theirs[key]:
            send, recv = (post, theirs[key].popleft()) if sending else (theirs[key].popleft(), post)
            self._match(send, recv, out)
        else:
            mine[key].append(post)
            if blocking:
                self.blocked[rank] = (f"waits for rank {peer} to receive what it sends" if sending else
                                      f"waits to receive from rank {peer}") + (f" (tag {tag})" if tag else "")

    def _match(self, send: _Post, recv: _Post, out):
        if send.meta["nbytes"] != recv.meta["nbytes"]:
            got = f"{send.meta['dtype']}{send.meta['shape']}"
            reply = ({"error": "RuntimeError", "message":
                      f"rank {recv.rank} received {send.meta['nbytes']:,} bytes ({got}) from rank {send.rank} into a "
                      f"tensor of {recv.meta['nbytes']:,} bytes ({recv.meta['dtype']}{recv.meta['shape']}): a send "
                      f"and its recv must use tensors of the same size"}, [])
        else:
            self.record.received.append((recv.rank, recv.trial, send.rank, send.meta["nbytes"]))
            reply = ({"data": True}, [send.blob])
        self._complete(recv, reply, out)
        self._complete(send, ({"ok": True}, []), out)

    def _complete(self, post: _Post, reply, out):
        if post.handle is None:
            self.blocked.pop(post.rank, None)
            out.append((post.rank, *reply))
            return
        h = self.handles[(post.rank, post.handle)]
        h["done"], h["reply"] = True, reply
        if h["waiting"]:
            self.blocked.pop(post.rank, None)
            out.append((post.rank, *reply))
            del self.handles[(post.rank, post.handle)]

    def _wait(self, rank, header, out, test=False):
        key = (rank, header.get("handle"))
        if key not in self.handles:
            raise ValueError("wait() on an operation that already completed or never existed")
        h = self.handles[key]
        if not test or h["done"]:
            self.record.waited.setdefault(key, self.phase[rank])
        if h["done"]:
            out.append((rank, *h["reply"]))
            del self.handles[key]
        elif test:
            out.append((rank, {"pending": True}, []))
        else:
            h["waiting"] = True
            self.blocked[rank] = self.waiting_in.get(key) or \
                f"waits for its {header.get('what', 'isend/irecv')} to complete"

    # -- collectives --------------------------------------------------------------

    def _collective(self, rank, header, blobs, out):
        kind, group = str(header["kind"]), tuple(header.get("group") or range(self.p))
        message = self.forbidden_message(kind, str(header.get("shown", kind)))
        if message:
            self.record.forbidden.append((rank, self.trial[rank], message))
            out.append((rank, {"error": "Forbidden", "message": message}, []))
            return
        if rank not in group or any(not 0 <= r < self.p for r in group):
            raise ValueError(f"{kind}: rank {rank} is not in the group {list(group)}")
        handle = header.get("handle")                   # async_op=True: the rank goes on, waits at wait()
        if handle is not None:
            if not isinstance(handle, int) or (rank, handle) in self.handles:
                raise WireError("an async collective without a handle of its own")
            self.handles[(rank, handle)] = {"done": False, "reply": None, "waiting": False}
        index = self.calls[(rank, group)]
        self.calls[(rank, group)] += 1
        parts = self.joined.setdefault((group, index), {})
        parts[rank] = (header, blobs)
        missing = [r for r in group if r not in parts]
        if missing:
            self.waiting_in[(rank, handle)] = f"waits in {kind} for rank{'s' if len(missing) > 1 else ''} " \
                                              f"{', '.join(map(str, missing))} to join it"
            if handle is None:
                self.blocked[rank] = self.waiting_in[(rank, handle)]
            return
        del self.joined[(group, index)]
        try:
            replies = self._compute(kind, group, parts)
        except (RuntimeError, ValueError, KeyError, IndexError, TypeError) as exc:   # shapes that do not agree
            error = ({"error": "RuntimeError", "message": f"{kind}: the ranks' tensors do not fit together "
                                                          f"({type(exc).__name__}: {exc})"}, [])
            replies = {r: error for r in group}
        for r, reply in replies.items():
            h = parts[r][0].get("handle")
            self.waiting_in.pop((r, h), None)
            self._complete(_Post(r, self.trial[r], {}, handle=h), reply, out)

    def _compute(self, kind, group, parts) -> dict:
        """{rank: reply} of a collective every member of `group` joined."""
        kinds = {str(h["kind"]) for h, _ in parts.values()}
        if len(kinds) > 1:
            error = ({"error": "RuntimeError", "message": f"the ranks of group {list(group)} called different "
                                                          f"collectives at the same point: {sorted(kinds)}"}, [])
            return {r: error for r in group}
        if kind == "all_gather_object":                  # pickled by the ranks, passed on unread: the
            return {r: ({"data": True}, [parts[s][1][0] for s in group]) for r in group}    # checker never unpickles
        if kind == "broadcast_object_list":
            src = parts[group[0]][0]["src"]
            return {r: ({"data": True}, [parts[src][1][0]]) for r in group}
        ins = {r: to_tensor(h["tensor"], b[0]) if b else None for r, (h, b) in parts.items()}
        h0 = parts[group[0]][0]
        if kind == "barrier":
            return {r: ({"ok": True}, []) for r in group}
        if kind == "all_reduce":
            result = _REDUCE[h0.get("reduce", "sum")]([ins[r] for r in group]).to(ins[group[0]].dtype)
            return {r: ({"data": True}, [tensor_bytes(result)]) for r in group}
        if kind == "broadcast":
            src = h0["src"]
            return {r: ({"data": True}, [tensor_bytes(ins[src])]) for r in group}
        if kind == "reduce":                             # the result on dst; the others keep their own tensor
            result = _REDUCE[h0.get("reduce", "sum")]([ins[r] for r in group]).to(ins[group[0]].dtype)
            return {r: ({"data": True}, [tensor_bytes(result if r == h0["dst"] else ins[r])]) for r in group}
        if kind == "all_gather_into_tensor":
            result = torch.cat([ins[r].reshape(-1) for r in group])
            return {r: ({"data": True}, [tensor_bytes(result)]) for r in group}
        if kind == "reduce_scatter_tensor":
            total = _REDUCE[h0.get("reduce", "sum")]([ins[r].reshape(-1) for r in group]).to(ins[group[0]].dtype)
            chunks = total.chunk(len(group))
            return {r: ({"data": True}, [tensor_bytes(chunks[i])]) for i, r in enumerate(group)}
        if kind == "reduce_scatter":                     # the list form: piece i to the group's i-th rank
            sizes = [int(n) for n in h0["sizes"]]
            if any([int(n) for n in h["sizes"]] != sizes for h, _ in parts.values()):
                raise ValueError("reduce_scatter needs input lists of the same sizes on every rank")
            total = _REDUCE[h0.get("reduce", "sum")]([ins[r].reshape(-1) for r in group]).to(ins[group[0]].dtype)
            pieces = total.split(sizes)
            return {r: ({"data": True}, [tensor_bytes(pieces[i])]) for i, r in enumerate(group)}
        if kind == "all_gather":                         # a list of tensors, one from each rank
            if len({(ins[r].dtype, ins[r].shape) for r in group}) > 1:
                raise ValueError("all_gather needs a tensor of the same dtype and shape on every rank")
            result = torch.cat([ins[r].reshape(-1) for r in group])
            return {r: ({"data": True}, [tensor_bytes(result)]) for r in group}
        if kind == "all_to_all_single":                  # rows of dim 0, split evenly or by the split sizes
            pieces = {}
            for r in group:
                h, x = parts[r][0], ins[r]
                row = x[0].numel() if x.dim() else 1
                rows = h.get("input_split_sizes") or [x.shape[0] // len(group)] * len(group) if x.dim() else []
                if len(rows) != len(group) or sum(rows) != (x.shape[0] if x.dim() else 0):
                    raise ValueError(f"rank {r}'s input_split_sizes {rows} do not add up to its input's "
                                     f"{x.shape[0] if x.dim() else 0} rows, one size per rank")
                pieces[r] = x.reshape(-1).split([n * row for n in rows])
            replies = {}
            for i, r in enumerate(group):
                got = torch.cat([pieces[s][i] for s in group])
                want = parts[r][0].get("output_split_sizes")
                sizes = [pieces[s][i].numel() // max(1, ins[s][0].numel() if ins[s].dim() else 1) for s in group]
                if want is not None and list(want) != sizes:
                    raise ValueError(f"rank {r}'s output_split_sizes {list(want)} differ from the rows the "
                                     f"ranks send it, {sizes}")
                if got.numel() * got.element_size() != int(parts[r][0].get("out_nbytes", got.numel() *
                                                                           got.element_size())):
                    raise ValueError(f"rank {r} receives {got.numel()} elements into an output of a different size")
                replies[r] = ({"data": True}, [tensor_bytes(got)])
            return replies
        error = ({"error": "RuntimeError", "message": f"{kind} is not available in a sealed check"}, [])
        return {r: error for r in group}

    # -- one request ------------------------------------------------------------

    def handle(self, rank: int, header: dict, blobs: list) -> list:
        """Serve one request of `rank`; return the replies that can be sent now."""
        out: list = []
        op = header.get("op")
        if op not in ("begin", "phase", "wait", "test"):
            peer = {"send": "dst", "isend": "dst", "recv": "src", "irecv": "src"}.get(op, "kind")
            nbytes = len(blobs[0]) if blobs else header.get("nbytes")       # a receive: the size posted
            self.record.calls.append({"rank": rank, "trial": self.trial[rank], "op": str(op), "peer": header.get(peer),
                                      "bytes": nbytes, "phase": self.phase[rank], "handle": header.get("handle"),
                                      "group": list(header.get("group") or range(self.p))})
        try:
            if op == "begin":
                self.trial[rank], self.phase[rank] = int(header["trial"]), ""
            elif op == "phase":
                self.phase[rank] = str(header["name"])[:100]
            elif op in ("send", "recv"):
                self._post(rank, header, blobs, out, sending=op == "send", blocking=True)
            elif op in ("isend", "irecv"):
                handle = header.get("handle")
                if not isinstance(handle, int) or (rank, handle) in self.handles:
                    raise WireError("an isend/irecv without a handle of its own")
                try:
                    self._post(rank, header, blobs, out, sending=op == "isend", blocking=False)
                except (ValueError, TypeError, KeyError, IndexError) as exc:     # told at its wait()
                    self.handles[(rank, handle)] = {"done": True, "waiting": False,
                                                    "reply": ({"error": "ValueError", "message": str(exc)}, [])}
            elif op in ("wait", "test"):
                self._wait(rank, header, out, test=op == "test")
            elif op == "collective":
                self._collective(rank, header, blobs, out)
            elif op == "forbidden":                 # a library call the rank refused: the router words it
                message = self.forbidden_message(str(header["kind"]), str(header["shown"]))
                if message:
                    self.record.forbidden.append((rank, self.trial[rank], message))
                out.append((rank, {"error": "Forbidden" if message else "none", "message": message or ""}, []))
            else:
                raise WireError(f"an unknown request {op!r}")
        except (ValueError, TypeError, KeyError, IndexError) as exc:
            if isinstance(exc, WireError):
                raise
            out.append((rank, {"error": "ValueError", "message": str(exc)}, []))
        return out

    def finish(self, rank: int) -> None:
        self.finished[rank] = True
        self.blocked.pop(rank, None)

    def deadlock(self) -> list | None:
        """[(rank, what it waits for)] if every rank still running is blocked here, else None."""
        running = [r for r in range(self.p) if not self.finished[r]]
        if not running or any(r not in self.blocked for r in running):
            return None
        return [(r, self.blocked[r]) for r in running]
