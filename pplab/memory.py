"""What a rank holds in memory, counted in one place: the activations autograd saves for backward,
the model's state (parameters, gradients, optimizer state), and the peak of everything created
over a step. Chapter 5 (sequence parallelism), the planner (chapter 7) and chapter 9 count with it.

    with saved_activations(model.parameters()) as saved:    # what backward will need
        loss = model(x).sum()
    saved.bytes                                              # one storage counted once

    state_bytes(model, optimizer)                            # parameters, gradients, optimizer state

    with PeakMemory() as mem:                                # a whole step, on CPU
        model(x).sum().backward(); optimizer.step()
    mem.peak, mem.live                                       # most bytes held at once; held now

and Korthikanti et al.'s formula for what one transformer layer saves (`activation_bytes_formula`).

Everything here counts *storages*, the memory blocks that tensors look into: two views of one
storage (a slice, a transpose, a reshape without copy) cost the storage once, and a view costs
nothing beyond the storage it looks into.
"""
from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["activation_bytes_formula", "saved_activations", "state_bytes", "count_state", "storage_bytes", "StateBytes", "PeakMemory"]


# ----------------------------------------------------------------------------------
# Activations: the formula, and what autograd really keeps


def activation_bytes_formula(s, b, h, a, t=1, sequence_parallel=True, recompute="none", element_bytes=2):
    """Bytes of activations one transformer layer keeps for backward, by Korthikanti et al.
    (*Reducing Activation Recomputation in Large Transformer Models*, 2022, Table 2): 16-bit
    activations, 1-byte dropout masks, sequence length s, micro-batch b, hidden size h, a heads.

    No parallelism: s·b·h·(34 + 5·a·s/h). Tensor parallel over t: s·b·h·(10 + 24/t + 5·a·s/(h·t)).
    Tensor + sequence parallel: s·b·h·(34 + 5·a·s/h)/t. (LayerNorm's mean and 1/std, 2 numbers per
    token per LayerNorm, are left out, as in the paper.)

    recompute="selective" drops the 5·a·s/h term (scores, softmax, dropout: recomputed in
    backward): s·b·h·(10 + 24/t), or 34·s·b·h/t with sequence parallelism. recompute="full"
    keeps only the layer's input: 2·s·b·h (Table 2's row), 2·s·b·h/t with sequence parallelism,
    where each rank's input is its s/t slice of the sequence.

    element_bytes: bytes of one activation (2 for bf16/fp16, 4 for float32); the two dropout
    masks over [s, b, h] and the one over the a·s·s scores stay 1 byte per element. Of the 34,
    32 are 16 activations of 2 bytes and 2 are the masks, so float32 gives 66; of the 5, 4 are
    the softmax and its dropout's output, 1 the mask, so 9; of the 10, 8 + 2 masks, so 18."""
    if min(s, b, h, a, t) < 1:
        raise ValueError(f"activation_bytes_formula needs s, b, h, a, t >= 1, got s={s}, b={b}, h={h}, a={a}, t={t}")
    if recompute not in ("none", "selective", "full"):
        raise ValueError(f"activation_bytes_formula: recompute must be 'none', 'selective' or 'full', got {recompute!r}")
    if element_bytes not in (1, 2, 4, 8):
        raise ValueError(f"activation_bytes_formula: element_bytes is the bytes of one activation (2 for bf16, "
                         f"4 for float32), got {element_bytes!r}")
    e, sp = element_bytes, sequence_parallel and t > 1
    if recompute == "full":
        return s * b * h * e / (t if sp else 1)
    scores = 0 if recompute == "selective" else (2 * e + 1) * a * s / h            # per s·b·h, unsplit
    if sp or t == 1:
        return s * b * h * (16 * e + 2 + scores) / t
    return s * b * h * (4 * e + 2 + 12 * e / t + scores / t)


class saved_activations:
    """Count the bytes autograd keeps for backward inside the block: each storage once,
    the storages of `exclude`d tensors (the parameters) left out.

        with saved_activations(model.parameters()) as saved:
            loss = model(x).sum()
        saved.bytes

    A tensor saved for backward holds its whole storage: a saved slice of a big tensor costs
    the big tensor. moving=True: the excluded tensors may get new storages inside the block
    (ZeRO-3 gathers its weights during the forward), so look at them again when a storage
    not seen before is saved. slices=True: count each saved region (start, length) once instead
    of its whole storage, for a block whose inputs are slices of a tensor held elsewhere anyway
    (a pipeline's micro-batches, cut from the batch): each micro-batch then counts its own slice.
    """

    def __init__(self, exclude=(), moving: bool = False, slices: bool = False):
        self.exclude, self.moving, self.slices = list(exclude), moving, slices
        self.skip = {t.untyped_storage().data_ptr() for t in self.exclude}
        self.storages, self.bytes = set(), 0

    def _pack(self, t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in self.skip and self.moving:          # gathered since we looked: look again
            self.skip.update(e.untyped_storage().data_ptr() for e in self.exclude)
        key, size = ((t.data_ptr(), t.numel()), t.numel() * t.element_size()) if self.slices else \
            (ptr, t.untyped_storage().nbytes())
        if ptr not in self.skip and key not in self.storages:
            self.storages.add(key)
            self.bytes += size
        return t

    def __enter__(self):
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)
        self._hooks = None        # it holds self._pack, hence self: a cycle that kept `exclude` alive until gc ran


# ----------------------------------------------------------------------------------
# The model's state


@dataclass
class StateBytes:
    """Bytes of a model's state, by kind; a storage shared by two kinds is counted in the first."""
    parameters: int
    gradients: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer


def state_bytes(model, optimizer=None) -> StateBytes:
    """Bytes of `model`'s parameters, of their gradients (those that exist now) and of
    `optimizer`'s state (Adam: exp_avg and exp_avg_sq per parameter and a step counter, once the
    first step has made them), every storage counted once.

    model: an nn.Module or an iterable of parameters. Parameters that share a storage (tied
    weights, views of one flat buffer) count it once; so do gradients that are views of one bucket.
    """
    if isinstance(model, torch.nn.Module):
        params = list(model.parameters())
    else:
        try:
            params = list(model)
        except TypeError:
            raise TypeError(f"state_bytes takes an nn.Module or an iterable of parameters, "
                            f"not {type(model).__name__}") from None
    if not all(isinstance(p, torch.Tensor) for p in params):
        raise TypeError("state_bytes: the iterable must hold tensors (the parameters); "
                        "pass model.parameters() or the module itself")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"state_bytes: optimizer must be a torch.optim.Optimizer, not {type(optimizer).__name__}")
    states = [] if optimizer is None else [v for state in optimizer.state.values() for v in state.values()
                                           if isinstance(v, torch.Tensor)]
    return count_state(params, (p.grad for p in params), states)


def count_state(parameters, gradients, optimizer_state) -> StateBytes:
    """Bytes of the storages behind three lists of tensors, every storage once: a storage met in
    an earlier list (a gradient that is a view of a parameter's buffer) counts in that one.

    The one count of model state: state_bytes counts a model and its optimizer with it, and
    pplab.zero.held_bytes what a ZeRO rank holds besides (master copies, kept gradient shards).
    """
    seen: set = set()
    return StateBytes(storage_bytes(parameters, seen), storage_bytes(gradients, seen),
                      storage_bytes(optimizer_state, seen))


def storage_bytes(tensors, seen: set | None = None) -> int:
    """Bytes of the storages behind `tensors` (None entries skipped), each storage once: once
    in this call, and not again in a later call given the same `seen` set."""
    seen = set() if seen is None else seen
    total = 0
    for t in tensors:
        if t is None:
            continue
        storage = t.untyped_storage()
        if storage.filename is not None:           # a memory map of a file: its bytes are on the disk
            continue
        if storage.nbytes() and storage.data_ptr() not in seen:      # a freed storage holds nothing
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


# ----------------------------------------------------------------------------------
# The peak over a step


class PeakMemory(TorchDispatchMode):
    """The bytes of tensors created inside the block that are alive, now (`live`) and at most
    (`peak`), on the process that runs the block.

        with PeakMemory() as mem:
            out = attention(q, k, v)            # q, k, v made before: not counted
            out.sum().backward()
        mem.peak                                # most bytes alive at once, between two ops

    What it counts, exactly: every storage that a torch operation run inside the block returns
    and that is new (not one of the operation's inputs', not one already counted), from the op
    that creates it until the storage is freed (a weakref finalizer), whether that is inside the
    block or later. Each storage counts once, whole; a view costs nothing. `count`, if given,
    picks which new tensors to follow (`lambda t: t.dtype == torch.bfloat16`: the 16-bit ones);
    the others are left out of `live` and `peak`.

    Not counted: tensors that existed before the block (inputs, parameters), an op's own scratch
    that it frees before returning (the peak is between ops), memory a library takes outside
    torch's operators (a communication backend's buffers), and ops run on threads other than the
    caller's and autograd's. A storage freed on another thread (a backend letting go of a message)
    is subtracted when it is freed. `peak` moves inside the block only; `live` keeps falling after
    it, as the storages made inside are freed.
    """

    def __init__(self, count=None):
        super().__init__()
        if count is not None and not callable(count):
            raise TypeError(f"PeakMemory(count=...) takes a function of a tensor that says whether to count it, "
                            f"not {type(count).__name__}")
        self.count = count
        self.live = self.peak = 0
        self._sizes = {}                                   # storage's id -> its bytes, while alive
        self._lock = threading.RLock()                     # a storage may be freed on another thread

    def _freed(self, key):
        with self._lock:
            self.live -= self._sizes.pop(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {_storage_key(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.is_sparse or t.device.type == "meta":
                continue
            storage = t.untyped_storage()
            key, size = _storage_key(t), storage.nbytes()
            if size == 0 or key in inputs or storage.filename is not None or (self.count and not self.count(t)):
                continue
            with self._lock:
                if key in self._sizes:
                    continue
                self._sizes[key] = size
                self.live += size
                self.peak = max(self.peak, self.live)
                weakref.finalize(storage, self._freed, key)
        return out


def _storage_key(t: torch.Tensor):
    """Which storage t looks into (its address in memory while it lives)."""
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):           # sparse and other storage-less tensors
        return None
