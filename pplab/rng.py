"""Randomness under parallelism: dropout masks that agree where a tensor is replicated and differ
where it is split, and recomputation that draws the same masks again.

    tracker = RNGTracker()
    model_parallel_seed(1234, tracker, tp_rank=mesh.rank_in("tp"), dp_rank=mesh.rank_in("dp"))
    y = dropout(y, 0.1)                      # replicated y: the default generator, seeded alike on every tp rank
    with tracker.fork():                     # split h (my heads, my ffn columns): my tp rank's own generator
        h = dropout(h, 0.1)
    out = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False, context_fn=tracker.replay)

Under tensor parallelism every tp rank holds a copy of the activations outside the split
layers (the residual stream) and a different slice of those inside (heads, ffn columns).
Dropout on a copy must draw the same mask on every rank, or the copies stop being copies;
dropout on a slice must draw a different mask on every rank, or every head shard would drop
the same pattern. Megatron-LM (Shoeybi et al. 2019, its model-parallel RNG states) keeps two
generators per rank: torch's default one, seeded the same on every tp rank, and a second one
seeded `seed + 2718 + tp_rank`, which an `RNGTracker.fork()` swaps in around the split region.
With sequence parallelism the residual stream is cut along the sequence, so its dropout moves
into the fork too (each rank holds different tokens).

Recomputation (torch.utils.checkpoint) runs a block's forward twice. torch saves and restores
its default generator around the second run, but not the tracker's: `context_fn=tracker.replay`
does that, so the recomputed forward draws the masks the first one drew.

A single process can draw exactly the masks of a parallel run if it holds every rank's
generators and draws each piece of a mask with the generator of the rank that holds that
piece: `ReferenceDropout` does so, which is how `train_single` equals `train` with dropout.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from .mesh import Mesh
from .runtime import comm
from .split import split_sizes
from .tensor_parallel import ColumnParallelLinear, RowParallelLinear

__all__ = ["RNGTracker", "model_parallel_seed", "seeds", "dropout", "dropout_mask", "RankDropout",
           "ReferenceDropout", "DropoutMLP", "ParallelDropoutMLP", "train", "train_single", "MODEL_PARALLEL"]

MODEL_PARALLEL = "model-parallel"
TP_OFFSET = 2718                    # Megatron-LM's offset between the default and model-parallel seeds


def _get_state(device: torch.device) -> torch.Tensor:
    return torch.get_rng_state() if device.type == "cpu" else torch.cuda.get_rng_state(device)


def _set_state(device: torch.device, state: torch.Tensor) -> None:
    if device.type == "cpu":
        torch.set_rng_state(state)
    else:
        torch.cuda.set_rng_state(state, device)


class RNGTracker:
    """Named generator states that `fork(name)` swaps in for torch's default generator of `device`
    (what dropout draws from), saving where they got to on the way out."""

    def __init__(self, device="cpu"):
        self.device = torch.device(device)
        self.states: dict[str, torch.Tensor] = {}

    def add(self, name: str, seed: int) -> None:
        if name in self.states:
            raise ValueError(f"the tracker already has a generator named {name!r}: use another name")
        self.states[name] = torch.Generator(device=self.device).manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL):
        """Inside the block, torch's default generator is the tracker's `name` one."""
        if name not in self.states:
            raise KeyError(f"no generator named {name!r} in the tracker (it has {sorted(self.states)}): "
                           f"call model_parallel_seed(...) or tracker.add({name!r}, seed) first")
        outside = _get_state(self.device)
        _set_state(self.device, self.states[name])
        try:
            yield
        finally:
            self.states[name] = _get_state(self.device)
            _set_state(self.device, outside)

    def get_states(self) -> dict:
        return {k: v.clone() for k, v in self.states.items()}

    def set_states(self, states: dict) -> None:
        self.states = {k: v.clone() for k, v in states.items()}

    def replay(self):
        """context_fn for torch.utils.checkpoint(..., use_reentrant=False): the recomputed forward starts
        from the tracker states the first forward started from, and leaves the states as it found them."""
        started = {}

        @contextlib.contextmanager
        def first_forward():
            started.update(self.get_states())
            yield

        @contextlib.contextmanager
        def recompute():
            now = self.get_states()
            self.set_states(started)
            try:
                yield
            finally:
                self.set_states(now)
        return first_forward(), recompute()


def seeds(seed: int, tp_rank: int = 0, dp_rank: int = 0, pp_rank: int = 0) -> dict:
    """The two seeds of a rank. default: the same on every tp rank of a replica and stage (different
    per replica, as each replica's samples are; per stage, as Megatron-LM does); model-parallel:
    different on every rank."""
    for name, v in (("seed", seed), ("tp_rank", tp_rank), ("dp_rank", dp_rank), ("pp_rank", pp_rank)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"{name} must be a whole number >= 0, got {v!r}")
    default = seed + 100 * pp_rank + 10_000 * dp_rank
    return {"default": default, MODEL_PARALLEL: default + TP_OFFSET + tp_rank}


def model_parallel_seed(seed: int, tracker: RNGTracker, tp_rank: int = 0, dp_rank: int = 0,
                        pp_rank: int = 0) -> dict:
    """Seed torch's default generator (for replicated tensors) and add the tracker's model-parallel
    one (for split tensors), as Megatron-LM's model_parallel_cuda_manual_seed does. Returns the seeds."""
    s = seeds(seed, tp_rank, dp_rank, pp_rank)
    if tracker.device.type == "cpu":
        torch.manual_seed(s["default"])
    else:
        torch.cuda.manual_seed(s["default"])
    tracker.add(MODEL_PARALLEL, s[MODEL_PARALLEL])
    return s


def dropout_mask(shape, p: float, dtype=torch.float64, device="cpu") -> torch.Tensor:
    """1 where an element is kept (probability 1 - p), 0 where dropped, drawn from torch's current
    default generator of `device` (inside tracker.fork(): the tracker's)."""
    if not 0 <= p < 1:
        raise ValueError(f"dropout probability must be in [0, 1), got {p!r}")
    return torch.empty(shape, dtype=dtype, device=device).bernoulli_(1 - p)


def dropout(x: torch.Tensor, p: float, training: bool = True) -> torch.Tensor:
    """Inverted dropout, x · mask / (1 - p), its mask drawn by dropout_mask (so a tracker decides it)."""
    if not training or p == 0:
        return x
    return x * dropout_mask(x.shape, p, x.dtype, x.device) / (1 - p)


# ---------------------------------------------------------------------------------------------
# Where each mask comes from: a rank's two generators, or one process playing all ranks' generators


class RankDropout:
    """Dropout on one rank. split(x): x is this rank's slice of a tensor cut over tp (columns, heads):
    drawn with the tracker's generator. outside(x): the residual stream, the same on every tp rank
    (default generator), or with sequence parallelism this rank's tokens (the tracker's)."""

    def __init__(self, tracker: RNGTracker | None, sequence_parallel: bool = False):
        self.tracker, self.sp = tracker, sequence_parallel

    def _fork(self):
        return self.tracker.fork() if self.tracker is not None else contextlib.nullcontext()

    def split(self, x, p, training=True):
        with self._fork():             # tracker=None: the wrong way, every rank's slice gets the same mask
            return dropout(x, p, training)

    def outside(self, x, p, training=True):
        with self._fork() if self.sp else contextlib.nullcontext():
            return dropout(x, p, training)


class ReferenceDropout:
    """Dropout on one process that draws the masks of a run on dp replicas × tp ranks: it holds every
    rank's two generators (seeds(seed, r, j)) and draws each piece of a mask with the generator of the
    rank that holds the piece in that run, in the same order. Tensors are [s, b, ...]: the batch
    (dim 1) is cut over the dp replicas; split(x) cuts the last dim over tp as the column-parallel
    layers do (split_sizes); outside(x) is drawn once per replica with the default generator (every
    tp rank draws the same), or with sequence parallelism cut along dim 0."""

    def __init__(self, seed: int, tp: int = 1, dp: int = 1, sequence_parallel: bool = False, device="cpu"):
        self.tp, self.dp, self.sp = tp, dp, sequence_parallel
        self.trackers = {}
        for j in range(dp):
            for r in range(tp):
                t = self.trackers[j, r] = RNGTracker(device)
                s = seeds(seed, tp_rank=r, dp_rank=j)
                t.add("default", s["default"])
                t.add(MODEL_PARALLEL, s[MODEL_PARALLEL])

    def _mask(self, x, p, dim):
        if x.shape[1] % self.dp:
            raise ValueError(f"a batch of {x.shape[1]} (dim 1) does not split over dp={self.dp} replicas")
        rows = []
        for j, xb in enumerate(x.chunk(self.dp, dim=1)):
            if dim is None:            # replicated: every tp rank draws (the same) mask; tp rank 0's is used
                drawn = [self._draw(j, r, "default", xb.shape, p, x) for r in range(self.tp)]
                rows.append(drawn[0])
            else:
                sizes = split_sizes(x.shape[dim], self.tp)
                rows.append(torch.cat([self._draw(j, r, MODEL_PARALLEL, piece.shape, p, x)
                                       for r, piece in enumerate(xb.split(sizes, dim))], dim))
        return torch.cat(rows, dim=1)

    def _draw(self, j, r, name, shape, p, like):
        with self.trackers[j, r].fork(name):
            return dropout_mask(shape, p, like.dtype, like.device)

    def split(self, x, p, training=True):
        if not training or p == 0:
            return x
        return x * self._mask(x, p, x.dim() - 1) / (1 - p)

    def outside(self, x, p, training=True):
        if not training or p == 0:
            return x
        if self.sp and x.shape[0] % self.tp:
            raise ValueError(f"sequence parallelism cuts {x.shape[0]} positions over tp={self.tp}: use a multiple")
        return x * self._mask(x, p, 0 if self.sp else None) / (1 - p)


# ---------------------------------------------------------------------------------------------
# A block with dropout in both places, and its training on dp × tp ranks and on one process


class DropoutMLP(nn.Module):
    """x + dropout(fc2(dropout(gelu(fc1(x))))), x: [s, b, h]. The inner dropout acts on the ffn
    activations (split under TP), the outer one on the residual stream (replicated, or split by
    the sequence with SP). `drop` draws the masks (RankDropout or ReferenceDropout)."""

    def __init__(self, hidden: int, ffn: int, p: float, drop=None):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(hidden, ffn), nn.Linear(ffn, hidden)
        self.p, self.drop = p, drop

    def forward(self, x):
        h = self.drop.split(F.gelu(self.fc1(x)), self.p, self.training)
        return x + self.drop.outside(self.fc2(h), self.p, self.training)


class ParallelDropoutMLP(DropoutMLP):
    """This rank's share of a DropoutMLP: fc1 column-parallel, fc2 row-parallel (chapter 3), with
    Megatron sequence parallelism if asked (x: [s/t, b, h])."""

    @classmethod
    def from_dense(cls, dense: DropoutMLP, drop: RankDropout, group=None, sequence_parallel=False):
        m = cls.__new__(cls)
        nn.Module.__init__(m)
        m.fc1 = ColumnParallelLinear.from_dense(dense.fc1, sequence_parallel=sequence_parallel, group=group)
        m.fc2 = RowParallelLinear.from_dense(dense.fc2, sequence_parallel=sequence_parallel, group=group)
        m.p, m.drop = dense.p, drop
        return m


def _dense_blocks(hidden, ffn, layers, p, seed, dtype):
    torch.manual_seed(seed)
    return [DropoutMLP(hidden, ffn, p).to(dtype) for _ in range(layers)]


def batch(step: int, seq: int, batch_size: int, hidden: int, seed: int = 0, dtype=torch.float64):
    """Step `step`'s inputs [s, B, h], from a generator of their own (the dropout streams stay untouched)."""
    g = torch.Generator().manual_seed(10_007 * seed + step)
    return torch.randn(seq, batch_size, hidden, generator=g, dtype=dtype)


def _loss(y, total):
    return y.pow(2).sum() / total          # the mean over the whole global tensor, from any piece of it


def train(sizes: dict, steps: int = 3, seq: int = 6, batch_size: int = 4, hidden: int = 8, ffn: int = 10,
          layers: int = 2, p: float = 0.3, lr: float = 0.5, sequence_parallel: bool = False,
          checkpoint: bool = False, replay: bool = True, tracked: bool = True, seed: int = 0,
          dtype=torch.float64) -> dict:
    """SGD on a stack of DropoutMLP blocks over dp × tp ranks (call on every rank of a world of dp·tp).
    checkpoint: recompute each block in backward (torch.utils.checkpoint); replay=False leaves out the
    tracker's replay (the wrong way); tracked=False draws split masks with the default generator (the
    wrong way). Returns {"losses", "params": {name: my shard}, "coords": my place in the mesh}."""
    mesh = Mesh(dp=sizes.get("dp", 1), tp=sizes.get("tp", 1))
    tp, dp = mesh.size("tp"), mesh.size("dp")
    if sequence_parallel and seq % tp:
        raise ValueError(f"sequence parallelism cuts the {seq} positions over tp={tp}: use a multiple of {tp}")
    if batch_size % dp:
        raise ValueError(f"a batch of {batch_size} does not split over dp={dp}: use a multiple of {dp}")
    tracker = RNGTracker()
    drop = RankDropout(tracker if tracked else None, sequence_parallel)
    dense = _dense_blocks(hidden, ffn, layers, p, seed, dtype)
    blocks = nn.ModuleList([ParallelDropoutMLP.from_dense(b, drop, mesh.tp_group, sequence_parallel) for b in dense])
    # seeded after building (the layers' own initialisation draws from the default generator)
    model_parallel_seed(seed, tracker, tp_rank=mesh.rank_in("tp"), dp_rank=mesh.rank_in("dp"))
    opt = torch.optim.SGD(blocks.parameters(), lr=lr)
    losses = []
    b = batch_size // dp
    for step in range(steps):
        x = batch(step, seq, batch_size, hidden, seed, dtype)[:, mesh.rank_in("dp") * b:(mesh.rank_in("dp") + 1) * b]
        if sequence_parallel:
            x = x.chunk(tp, dim=0)[mesh.rank_in("tp")]
        for block in blocks:
            if checkpoint:
                x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False,
                                                      **({"context_fn": tracker.replay} if replay else {}))
            else:
                x = block(x)
        loss = _loss(x, seq * batch_size * hidden)
        loss.backward()
        for q in blocks.parameters():      # the replicas' gradients: summed, as the loss is a sum over them
            if dp > 1:
                comm.all_reduce(q.grad, group=mesh.dp_group)
        opt.step()
        opt.zero_grad()
        total = loss.detach().reshape(1).clone()
        summed_over = [mesh.dp_group] + ([mesh.tp_group] if sequence_parallel else [])
        for g in summed_over:              # the loss of the whole batch: pieces held by dp (and SP) ranks
            if comm.world_size(g) > 1:
                comm.all_reduce(total, group=g)
        losses.append(total.item())
    return {"losses": losses, "params": {n: q.detach().clone() for n, q in blocks.named_parameters()},
            "coords": mesh.coords}


def train_single(sizes: dict, steps: int = 3, seq: int = 6, batch_size: int = 4, hidden: int = 8, ffn: int = 10,
                 layers: int = 2, p: float = 0.3, lr: float = 0.5, sequence_parallel: bool = False, seed: int = 0,
                 dtype=torch.float64):
    """The reference: the same blocks and data on one process, its masks drawn by ReferenceDropout for the
    layout `sizes` (so they are the masks that layout's ranks draw). Returns (losses, blocks)."""
    drop = ReferenceDropout(seed, tp=sizes.get("tp", 1), dp=sizes.get("dp", 1), sequence_parallel=sequence_parallel)
    blocks = nn.ModuleList(_dense_blocks(hidden, ffn, layers, p, seed, dtype))
    for block in blocks:
        block.drop = drop
    opt = torch.optim.SGD(blocks.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        x = batch(step, seq, batch_size, hidden, seed, dtype)
        for block in blocks:
            x = block(x)
        loss = _loss(x, seq * batch_size * hidden)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, blocks
