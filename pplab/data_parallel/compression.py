"""Gradient compression: send less than the gradient, and remember what was left out.

    comp = compression.TopK(ratio=0.01, error_feedback=True)
    avg = comp.reduce(grads)          # on every rank, in place of all_reduce(grads) / p
    comp.bytes_sent                   # what this rank put on the wire so far (from the trace)

    run = compression.train_with(compression.PowerSGD(rank=2), steps=100, world_size=4)
    run.losses, run.ratio             # loss curve; bytes sent / bytes an uncompressed ring would send

Data-parallel training averages every rank's gradient each step: with a ring
all-reduce every rank sends 2(p-1)/p·d numbers of 32 bits. A compressor sends a
smaller message that stands for its gradient, and every rank rebuilds the average
from the messages:

* `TopK(ratio)`: keep the k = ratio·d entries largest in magnitude; send k values and
  k int32 indices to every other rank, packed in one message (an all-gather: ranks
  pick different entries, so their messages cannot be summed on the way).
* `SignSGD()`: send one bit per entry, its sign, packed 8 to a byte, plus one float
  per tensor, the mean |g| of that tensor, so that scale·sign has the gradient's size.
  An all-gather again. (A zero entry is sent as +: one bit has no room for 0.)
* `PowerSGD(rank=r)`: a gradient matrix M (n x m) is approximated by P Qᵀ of rank r.
  P = M Q, all-reduce P, orthogonalise it, Q = Mᵀ P, all-reduce Q: two all-reduces of
  (n + m)·r numbers instead of n·m. Because P and Q are averaged, the rebuilt P Qᵀ is
  a rank-r approximation of the *average* gradient. With warm start each step begins
  from the last step's Q, so one power iteration per step keeps refining the same
  subspace. Tensors with one dimension (biases) are small and sent uncompressed.

Error feedback: what a compressor leaves out this step is not thrown away but kept in
a memory e and added to the next gradient: it sends C(g + e) and keeps
e <- g + e - C(g + e). So everything is sent eventually, only late, and summed over the
steps, what was sent plus what is still in the memory equals the sum of the true
gradients. Without it, top-k at a small ratio never sends the small entries at all,
and training stalls; with it, compressed training comes close to uncompressed.

What it costs, per rank and step, next to a ring all-reduce's 2(p-1)/p·d numbers:
top-k sends (p-1)·k·(value + index), a ratio of about p·k/d, and sign (p-1)·d/8
bytes, a ratio of about p/64. Both grow with p: all-gathered messages pile up, where
summed ones would not. P and Q *can* be summed on the way (M ↦ M Q is linear), so PowerSGD's ratio,
(n + m)·r / (n·m), does not depend on p. Measured on make_task's MLP (d = 808 float32,
biases sent as they are), p = 2 / 4 / 8: top-k 1% 0.020 / 0.040 / 0.079, top-k 10%
0.20 / 0.40 / 0.80, sign 0.036 / 0.072 / 0.145, PowerSGD rank 1 0.158, rank 2 0.267.

Every message goes through pplab.collectives (ring all-gather, ring all-reduce, built
from traced point-to-point sends), so `bytes_sent` counts real bytes on the wire.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .. import collectives, trace
from ..runtime import comm
from ..runtime.launcher import device, launch


def _flatten(tensors):
    return torch.cat([t.reshape(-1) for t in tensors])


def _unflatten(flat, like):
    return [piece.view_as(t) for piece, t in zip(flat.split([t.numel() for t in like]), like)]


def _to_bytes(*tensors):
    """One uint8 message holding the raw bytes of several tensors (one message: one α)."""
    return torch.cat([t.reshape(-1).view(torch.uint8) for t in tensors])


def _from_bytes(message, like):
    """The tensors _to_bytes packed, shaped and typed like the tensors in `like`."""
    sizes = [t.numel() * t.element_size() for t in like]
    return [part.clone().view(t.dtype).view_as(t) for part, t in zip(message.split(sizes), like)]


def _all_gather(*tensors):
    """Every rank's `tensors`, as a list in rank order: [(t1, t2, ...) of rank 0, ...].
    They travel as one uint8 message per rank in a traced ring all-gather."""
    mine = _to_bytes(*tensors)
    out = [torch.empty_like(mine) for _ in range(comm.world_size())]
    collectives.all_gather(out, mine)
    return [_from_bytes(m, tensors) for m in out]


def _average(t):
    """t <- the mean of every rank's t (a traced ring all-reduce)."""
    collectives.all_reduce(t, algorithm="ring")
    return t.div_(comm.world_size())


class Compressor:
    """Base class: `reduce(grads)` returns the averaged gradients (a list shaped like
    `grads`) on every rank, and keeps the books: `bytes_sent` (this rank, all calls),
    `calls`, `sent` (what this rank's message stood for, decompressed, last call) and
    `memory` (the error-feedback residual, a list of tensors, or None)."""

    error_feedback = False

    def __init__(self):
        self.bytes_sent, self.calls, self.sent, self.memory = 0, 0, None, None

    def reduce(self, grads):
        if not grads or any(g is None for g in grads):
            raise ValueError("reduce() needs a non-empty list of gradient tensors (a None gradient: "
                             "call backward() first, or leave out parameters that get no gradient)")
        grads = [g.detach() for g in grads]
        before = len(trace.events())
        out = self._reduce(grads)
        self.bytes_sent += sum(e.bytes_sent for e in trace.events()[before:])
        self.calls += 1
        return out

    def _with_memory(self, grads):
        """g + e as one flat vector with error feedback, else g."""
        if not self.error_feedback:
            return _flatten(grads)
        if self.memory is None:
            self.memory = [torch.zeros_like(g) for g in grads]
        return _flatten(grads) + _flatten(self.memory)

    def _remember(self, a, sent, grads):
        """Keep what the message stood for and, with error feedback, e = (g + e) - sent."""
        self.sent = _unflatten(sent, grads)
        if self.error_feedback:
            self.memory = _unflatten(a - sent, grads)

    def __repr__(self):
        args = ", ".join(f"{k}={v!r}" for k, v in self._args().items())
        return f"{type(self).__name__}({args})"

    def _args(self):
        return {}


class Dense(Compressor):
    """No compression: one ring all-reduce of all d numbers."""

    def _reduce(self, grads):
        flat = _flatten(grads)
        self.sent = [g.clone() for g in grads]
        return _unflatten(_average(flat), grads)


class TopK(Compressor):
    """Send the k = max(1, round(ratio·d)) largest-magnitude entries of the whole
    (flattened) gradient: k values + k int32 indices, all-gathered."""

    def __init__(self, ratio: float, error_feedback: bool = True):
        super().__init__()
        if not (isinstance(ratio, (int, float)) and 0 < ratio <= 1):
            raise ValueError(f"TopK ratio is the fraction of entries sent: use 0 < ratio <= 1, got {ratio!r}")
        self.ratio, self.error_feedback = ratio, error_feedback

    def _args(self):
        return {"ratio": self.ratio, "error_feedback": self.error_feedback}

    def k(self, d: int) -> int:
        return min(d, max(1, round(self.ratio * d)))

    def _reduce(self, grads):
        a = self._with_memory(grads)
        idx = a.abs().topk(self.k(a.numel()), sorted=False).indices.to(torch.int32)
        vals = a[idx.long()]
        sent = torch.zeros_like(a).index_put_((idx.long(),), vals)
        self._remember(a, sent, grads)
        out = torch.zeros_like(a)
        for v, i in _all_gather(vals, idx):           # rank order: the same sums on every rank
            out.index_add_(0, i.long(), v)
        return _unflatten(out.div_(comm.world_size()), grads)


def pack_signs(x: torch.Tensor) -> torch.Tensor:
    """One bit per entry (1 = x >= 0), 8 to a uint8: ceil(n/8) bytes."""
    bits = (x.reshape(-1) >= 0).to(torch.uint8)
    bits = F.pad(bits, (0, -len(bits) % 8)).view(-1, 8)
    return (bits << torch.arange(8, dtype=torch.uint8, device=x.device)).sum(1, dtype=torch.uint8)


def unpack_signs(packed: torch.Tensor, n: int, dtype=torch.float32) -> torch.Tensor:
    """The n signs (+1 / -1) that pack_signs packed."""
    bits = (packed.unsqueeze(1) >> torch.arange(8, dtype=torch.uint8, device=packed.device)) & 1
    return bits.reshape(-1)[:n].to(dtype) * 2 - 1


class SignSGD(Compressor):
    """1-bit: every entry's sign, times one scale per tensor (its mean |g|); all-gathered.
    With error feedback this is EF-signSGD (Karimireddy et al., 2019)."""

    def __init__(self, error_feedback: bool = True):
        super().__init__()
        self.error_feedback = error_feedback

    def _args(self):
        return {"error_feedback": self.error_feedback}

    @staticmethod
    def _expand(scales, signs, sizes):
        return torch.repeat_interleave(scales, torch.tensor(sizes, device=scales.device)) * signs

    def _reduce(self, grads):
        sizes = [g.numel() for g in grads]
        a = self._with_memory(grads)
        scales = torch.stack([part.abs().mean() for part in a.split(sizes)])
        bits = pack_signs(a)
        self._remember(a, self._expand(scales, unpack_signs(bits, a.numel(), a.dtype), sizes), grads)
        out = torch.zeros_like(a)
        for s, b in _all_gather(scales, bits):
            out += self._expand(s, unpack_signs(b, a.numel(), a.dtype), sizes)
        return _unflatten(out.div_(comm.world_size()), grads)


class PowerSGD(Compressor):
    """Rank-r approximation P Qᵀ of each gradient matrix (Vogels et al., 2019): two ring
    all-reduces per step: one of every matrix's P (with the 1-d tensors, uncompressed,
    in the same message), one of every Q. A tensor of shape (n, ...) is n x (the rest).
    Error feedback keeps e = (g + e) - P Qᵀ, with P Qᵀ the shared approximation of the
    average (as torch's PowerSGD hook does): `sent` is P Qᵀ, the same on every rank."""

    def __init__(self, rank: int = 1, warm_start: bool = True, error_feedback: bool = True, seed: int = 0):
        super().__init__()
        if not (isinstance(rank, int) and rank >= 1):
            raise ValueError(f"PowerSGD rank must be a whole number >= 1, got {rank!r}")
        self.rank, self.warm_start, self.error_feedback, self.seed = rank, warm_start, error_feedback, seed
        self.Q = None

    def _args(self):
        return {"rank": self.rank, "warm_start": self.warm_start, "error_feedback": self.error_feedback}

    def _reduce(self, grads):
        mats = [i for i, g in enumerate(grads) if g.dim() >= 2]
        vecs = [i for i, g in enumerate(grads) if g.dim() < 2]
        self.sent = [g.clone() for g in grads]        # the 1-d ones are sent exactly
        if self.error_feedback and self.memory is None:
            self.memory = [torch.zeros_like(g) for g in grads]   # stays 0 for the 1-d ones
        M = [(grads[i] + self.memory[i] if self.error_feedback else grads[i]).reshape(grads[i].shape[0], -1)
             for i in mats]
        if M and (self.Q is None or not self.warm_start):   # the same random Q on every rank: a shared seed
            gen = torch.Generator().manual_seed(self.seed + (0 if self.warm_start else self.calls))
            self.Q = [torch.randn(m.shape[1], min(self.rank, *m.shape), generator=gen, dtype=m.dtype).to(m.device)
                      for m in M]
        P = [m @ q for m, q in zip(M, self.Q or [])]
        # All-reduce 1: every P (Σ n·r numbers), and the 1-d tensors riding along uncompressed.
        message = P + [grads[i] for i in vecs]
        message = _unflatten(_average(_flatten(message)), message)
        P, out = message[:len(P)], [None] * len(grads)
        for i, v in zip(vecs, message[len(P):]):
            out[i] = v
        if not M:
            return out
        P = [torch.linalg.qr(p).Q for p in P]         # orthonormal columns: a basis of the column space
        Q = [m.T @ p for m, p in zip(M, P)]
        self.Q = _unflatten(_average(_flatten(Q)), Q)  # all-reduce 2: Σ m·r numbers; kept for the warm start
        for i, m, p, q in zip(mats, M, P, self.Q):
            approx = p @ q.T                          # rank r, the same on every rank
            out[i] = self.sent[i] = approx.view_as(grads[i])
            if self.error_feedback:
                self.memory[i] = (m - approx).view_as(grads[i])
        return out


# ----------------------------------------------------------------------------------
# A small task to compare them on: a tiny MLP learning a random teacher MLP.


def make_task(n: int = 240, d_in: int = 16, hidden: int = 32, d_out: int = 8, noise: float = 0.05,
              seed: int = 0, dtype=torch.float32):
    """(X, Y, model_fn): inputs, targets and a function building the student model."""
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(n, d_in, generator=g, dtype=dtype)
    A = torch.randn(d_in, hidden, generator=g, dtype=dtype) / d_in ** 0.5
    B = torch.randn(hidden, d_out, generator=g, dtype=dtype) / hidden ** 0.5
    Y = torch.tanh(X @ A) @ B + noise * torch.randn(n, d_out, generator=g, dtype=dtype)

    def model_fn():
        torch.manual_seed(seed + 1)
        return torch.nn.Sequential(torch.nn.Linear(d_in, hidden), torch.nn.Tanh(),
                                   torch.nn.Linear(hidden, d_out)).to(dtype)
    return X, Y, model_fn


def _train_rank(compressor, steps, lr, task):
    X, Y, model_fn = make_task(**task)
    X, Y = X.to(device()), Y.to(device())         # this rank's GPU under NCCL, else the CPU
    p, rank = comm.world_size(), comm.rank()
    if len(X) % p:
        raise ValueError(f"the task's {len(X)} samples must split evenly over {p} ranks: pass n= a multiple of {p}")
    model = model_fn().to(device())                   # the same on every rank: make_task seeds it
    x, y = X.tensor_split(p)[rank], Y.tensor_split(p)[rank]
    params = list(model.parameters())
    losses = []
    for t in range(steps + 1):
        if rank == 0:                                 # full-data loss; every rank holds the same model
            with torch.no_grad():
                losses.append(float(F.mse_loss(model(X), Y)))
        if t == steps:
            break
        with trace.span("grad", label=f"g{t}"):
            model.zero_grad()
            F.mse_loss(model(x), y).backward()
        with torch.no_grad():
            for prm, g in zip(params, compressor.reduce([prm.grad for prm in params])):
                prm -= lr * g
    dense = Dense()                                   # what the same gradient costs uncompressed
    dense.reduce([torch.zeros_like(prm) for prm in params])
    return {"losses": losses, "bytes": compressor.bytes_sent, "dense_bytes": dense.bytes_sent,
            "params": _flatten([prm.detach() for prm in params])}


@dataclass
class Run:
    losses: list                  # full-data loss before each step, and after the last
    bytes_per_step: list          # per rank, measured
    dense_bytes_per_step: list    # per rank: one ring all-reduce of the same gradient, run at the end
    params: list                  # per rank, final parameters (flat)
    timeline: "trace.Timeline"

    @property
    def ratio(self) -> float:
        """Bytes sent / bytes an uncompressed ring all-reduce sends (all ranks together)."""
        return sum(self.bytes_per_step) / sum(self.dense_bytes_per_step)


def train_with(compressor=None, steps: int = 100, world_size: int = 4, lr: float = 0.1,
               timeout: float = 120.0, **task) -> Run:
    """Full-batch data-parallel SGD on make_task(**task), each rank on 1/p of the samples,
    averaging gradients with `compressor` (None: uncompressed). Each rank works on its
    own copy of the compressor (its own error-feedback memory)."""
    compressor = Dense() if compressor is None else compressor
    if not isinstance(compressor, Compressor):
        raise TypeError(f"compressor must be a pplab.data_parallel.compression.Compressor (Dense, TopK, SignSGD, "
                        f"PowerSGD) or None, got {type(compressor).__name__}")
    res = launch(_train_rank, compressor, steps, lr, task, world_size=world_size, timeout=timeout)
    return Run(res[0]["losses"], [r["bytes"] / max(steps, 1) for r in res],
               [r["dense_bytes"] for r in res], [r["params"] for r in res], res.timeline)
