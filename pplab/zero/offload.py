"""Offload beyond CPU memory: ZeRO's optimizer state on disk, as ZeRO-Infinity keeps it on NVMe.

A training step touches each kind of model state at a different moment. Forward and backward need
the parameters and make the gradients; the optimizer state (Adam's two moments, and the fp32 master
copy of a model trained in 16 bits) is touched once per step, by the optimizer, and then lies idle
until the next step. So it can live on a slower, larger tier and come in only for the step:

    tier           this course                    ZeRO-Infinity (Rajbhandari et al. 2021)
    fast, small    the model (RAM of the rank)    GPU memory (HBM)
    middle         -                              CPU memory (ZeRO-Offload: pplab.zero, offload="cpu")
    slow, large    a file on disk                 NVMe

    opt = DiskOffloadedZero(model.parameters(), torch.optim.AdamW, stage=2, lr=1e-3)
    ...                                       # train as with ZeroOptimizer: backward, step, zero_grad
    opt.bytes_read, opt.bytes_written         # bytes this rank moved from/to disk, in its last step
    opt.close()                               # or `with DiskOffloadedZero(...) as opt:`

It is a pplab.zero.ZeroOptimizer (stages 1, 2, 3 and master_dtype alike) whose optimizer steps one
shard at a time (one bucket, or one stage-3 parameter), in a fixed order:

    read shard i+1's state from disk (a background thread: the prefetch) | step shard i | write shard i

Between steps this rank holds none of its optimizer state in RAM: per parameter of its shard, the
K bytes of state (K = 8 for fp32 Adam's two moments, 12 with an fp32 master copy of a 16-bit model,
which then goes to disk too) lie on disk, and every step reads them and writes them back:
K·Ψ/N bytes read and K·Ψ/N written per rank per step (`disk_bytes_per_step`). During the step RAM
holds at most three shards' state: the one being stepped, the next one being read, the last one
being written.

At stage 3 the parameters can go to disk too, as ZeRO-Infinity offloads them to NVMe:

    fsdp = FullyShardedModule(model)
    opt = DiskOffloadedZero(fsdp.parameters(), torch.optim.AdamW, 3, offload_params=fsdp, lr=1e-3)

Each unit's shard (the fp32 master the optimizer steps, Ψ/N elements over all units) then lives
in a file between uses. Before the unit's all-gather, forward's and backward's, its shard is read
into RAM, and freed as soon as the all-gather has read it; with prefetch, the read of the unit
gathered next (the next in forward, the one before in backward) is queued on the disk thread at
the same moment, so it travels while this one is gathered and the one before it computes. The
step reads each shard once more with its optimizer state, and writes both back. Per rank per
step, with P bytes per parameter: 3·P·Ψ/N + K·Ψ/N read, P·Ψ/N + K·Ψ/N written
(`param_offload_bytes_per_step`: 20Ψ/N and 12Ψ/N for fp32 Adam), and between steps no parameter,
no optimizer state in RAM: only the gradients' shard (ZeRO-Infinity moves those too).

The files are memory-mapped (torch.from_file on the file's descriptor) and have no name: each is
made with tempfile.TemporaryFile in `folder` (default: the system's temporary folder), which opens
it and removes its name at once. The kernel frees its blocks when the process closes it or ends,
however it ends (an exception, or a rank killed by pplab.launch when another one failed), so
nothing is left behind on disk. drop_cache=True (default) writes each file through to the disk
(fsync) and then asks the kernel to drop its pages from the page cache (posix_fadvise DONTNEED),
so that the next read comes from the disk and not from memory; with drop_cache=False the reads and
writes mostly copy memory to memory, and the "disk" is the page cache.

`fit_disk()` measures this machine's disk the same way (timed writes and reads of one file, from
64 KiB to 4 MiB) and fits t = latency + bytes / bandwidth for each direction; `DiskFit.predict` turns
a step's bytes into the seconds it adds. Every read and write is traced as a "disk_read" or
"disk_write" box in the rank's comm lane (meta["payload"] = its bytes), as pplab.zero traces its
device <-> CPU copies ("d2h", "h2d"): "read<i>"/"write<i>" for the optimizer's, "param<i>" for a
stage-3 shard read before its all-gather (meta["ahead"]: queued ahead, by the prefetch).
"""
from __future__ import annotations

import contextlib
import os
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from .. import trace
from ..runtime import comm
from ..trace import Event, now
from .fully_sharded import FullyShardedModule
from .optimizer import ZeroOptimizer

__all__ = ["DiskOffloadedZero", "DiskOptimizer", "ShardsOnDisk", "TensorFile", "disk_bytes_per_step",
           "param_offload_bytes_per_step", "DiskFit", "fit_disk"]


# ----------------------------------------------------------------------------------
# One tensor's bytes in a file


class TensorFile:
    """The bytes of a tensor of `numel` elements of `dtype`, in a file without a name in `folder`.

    write(t) copies t into the file through a memory map; read(out) copies the file into out.
    With drop_cache, a write ends with fsync (the bytes are on the disk) and both drop the file's
    pages from the page cache, so the next read goes to the disk.
    """

    def __init__(self, numel: int, dtype: torch.dtype, folder: str, drop_cache: bool = True):
        self.numel, self.dtype, self.drop_cache = numel, dtype, drop_cache
        self.nbytes = numel * torch.empty((), dtype=dtype).element_size()
        self.file = tempfile.TemporaryFile(dir=folder)        # opened, then unnamed: freed when closed
        os.ftruncate(self.file.fileno(), self.nbytes)

    def mapped(self) -> torch.Tensor:
        """The file as a tensor: reading or writing it reads or writes the file (a shared memory map)."""
        return torch.from_file(f"/proc/self/fd/{self.file.fileno()}", shared=True, size=self.numel,
                               dtype=self.dtype)

    def _drop_pages(self) -> None:
        if self.drop_cache:
            os.posix_fadvise(self.file.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)

    def write(self, t: torch.Tensor) -> None:
        mapped = self.mapped()
        mapped.copy_(t.reshape(-1))
        del mapped                                            # unmapped: its dirty pages are the file's
        if self.drop_cache:
            os.fsync(self.file.fileno())                      # on the disk, so the pages can be dropped
        self._drop_pages()

    def read(self, out: torch.Tensor) -> None:
        mapped = self.mapped()
        out.view(-1).copy_(mapped)
        del mapped
        self._drop_pages()

    def close(self) -> None:
        self.file.close()


def checked_folder(folder) -> str:
    """The folder the files go in: `folder`, or the system's temporary folder for None."""
    where = tempfile.gettempdir() if folder is None else os.fspath(folder)
    if not os.path.isdir(where):
        raise ValueError(f"folder={folder!r} is not an existing folder: give the folder (on the disk to "
                         f"offload to) where the state files go, or None for {tempfile.gettempdir()}")
    return where


def park(p: torch.Tensor, f: TensorFile) -> None:
    """p's values now live in its file only: p reads them through a memory map of the file (whose pages
    were dropped from the page cache), so p holds no RAM but still reads right if a learner looks at it
    between uses (a tensor whose storage were freed would crash the process instead)."""
    p.data = f.mapped().view(p.shape)


def parked(p: torch.Tensor) -> bool:
    return p.untyped_storage().filename is not None


# ----------------------------------------------------------------------------------
# An optimizer whose state lives on disk between steps


class DiskOptimizer:
    """`optimizer_class(params, **defaults)` stepped one tensor at a time, its per-element state on disk.

    State that has one number per element of a parameter (Adam's exp_avg, exp_avg_sq) is written to
    disk after each tensor's step and read back, ahead of time on a background thread when prefetch
    is on, before its next one; small state (the step counter) stays in RAM. `offload_params()`
    sends the parameters themselves to disk too (ZeRO's fp32 master copies: they are the optimizer's,
    not the model's), and `release_params()` frees them again once the caller has used the new values.
    """

    def __init__(self, optimizer_class, params, *, folder: str | None = None, prefetch: bool = True,
                 drop_cache: bool = True, **defaults):
        self.params = list(params)
        self.optimizer = optimizer_class(self.params, **defaults)
        if len(self.optimizer.param_groups) != 1:
            raise ValueError("DiskOptimizer takes one list of parameters (one parameter group)")
        self.folder = checked_folder(folder)
        self.prefetch, self.drop_cache = prefetch, drop_cache
        self.files: dict[tuple[int, str], TensorFile] = {}    # (parameter's index, state key) -> its file
        self.params_on_disk = False
        self.bytes_read = self.bytes_written = 0              # in the last training step
        self._moved = {"disk_read": 0, "disk_write": 0}       # since the last step ended
        self._in_memory = 0                                   # depth of all_in_memory blocks
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pplab-disk")   # one disk, one queue

    @property
    def state(self):
        return self.optimizer.state

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    # What goes to disk, and the moves with their trace boxes

    def _on_disk(self, i: int) -> dict:
        """{key: tensor in RAM} of what parameter i keeps on disk now: its per-element state, and itself."""
        p = self.params[i]
        out = {k: v for k, v in self.optimizer.state.get(p, {}).items()
               if torch.is_tensor(v) and v.shape == p.shape and v.dim() > 0}
        if self.params_on_disk:
            out["param"] = p.detach()
        return out

    def _file(self, i: int, key: str, t: torch.Tensor) -> TensorFile:
        if (i, key) not in self.files:
            self.files[i, key] = TensorFile(t.numel(), t.dtype, self.folder, self.drop_cache)
        return self.files[i, key]

    def _move(self, kind: str, i: int, pairs, label: str | None = None, **meta) -> None:
        """Run the reads or writes of parameter i's tensors; one traced box (label: read<i>, write<i>)."""
        start, nbytes = now(), 0
        for f, t in pairs:
            f.read(t) if kind == "disk_read" else f.write(t)
            nbytes += f.nbytes
        trace.record(Event(comm.rank(), kind, "comm", start, now(), label or f"{kind[5:]}{i}",
                           meta={"payload": nbytes, **meta}))
        self._moved[kind] += nbytes

    @contextlib.contextmanager
    def _uncounted(self):
        """Moves that are no training step's (setting up, checkpoints) leave the step's counts alone."""
        before = dict(self._moved)
        try:
            yield
        finally:
            self._moved = before

    def _store(self, i: int):
        """Start writing parameter i's state (and itself) to disk; its state leaves the optimizer now,
        and its RAM is freed when the write is done. Returns the write's future."""
        tensors = self._on_disk(i)
        st = self.optimizer.state.get(self.params[i], {})
        for key in tensors:
            st.pop(key, None)
        pairs = [(self._file(i, k, t), t) for k, t in tensors.items()]
        return self._io.submit(self._move, "disk_write", i, pairs)

    def _load(self, i: int):
        """Start reading parameter i's state (and itself) from disk into fresh RAM; returns a future of
        the {key: tensor} read (empty before the first step: no state yet)."""
        p = self.params[i]
        into = {}
        for (j, key), f in self.files.items():
            if j != i:
                continue
            if key == "param":
                p.data = torch.empty(p.shape, dtype=f.dtype, device=p.device)    # RAM again, then filled
                into[key] = p.detach()
            else:
                into[key] = torch.empty(p.shape, dtype=f.dtype, device=p.device)
        pairs = [(self.files[i, k], t) for k, t in into.items()]

        def read():
            self._move("disk_read", i, pairs)
            return into
        return self._io.submit(read)

    def _install(self, i: int, loaded: dict) -> None:
        st = self.optimizer.state[self.params[i]]
        st.update({k: v for k, v in loaded.items() if k != "param"})

    # The step

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("DiskOptimizer.step does not take a closure")
        todo = [i for i, p in enumerate(self.params) if p.grad is not None]
        group = self.optimizer.param_groups[0]
        every = group["params"]
        writes, ahead = [], (self._load(todo[0]) if todo else None)
        try:
            for k, i in enumerate(todo):
                loaded = ahead.result()
                if k + 1 < len(todo):
                    ahead = self._load(todo[k + 1])            # read the next while this one steps
                    if not self.prefetch:
                        ahead.result()                         # (no prefetch: wait for it here)
                self._install(i, loaded)
                group["params"] = [self.params[i]]             # torch's optimizer steps this tensor only
                self.optimizer.step()
                writes.append(self._store(i))
        finally:
            group["params"] = every
            for w in writes:
                w.result()
        self.bytes_read, self.bytes_written = self._moved["disk_read"], self._moved["disk_write"]
        self._moved = {"disk_read": 0, "disk_write": 0}

    def offload_params(self) -> None:
        """Write the parameters to disk and free their RAM (their shape stays: a .grad can be set)."""
        self.params_on_disk = True
        with self._uncounted():
            for w in [self._store(i) for i in range(len(self.params))]:
                w.result()
        self.release_params()

    def release_params(self) -> None:
        """Free the RAM of parameters kept on disk (after a step, once their new values were used)."""
        if self.params_on_disk:
            for i, p in enumerate(self.params):
                park(p, self.files[i, "param"])

    @contextlib.contextmanager
    def all_in_memory(self):
        """Everything read back into RAM inside the block (a checkpoint), written back after it.
        Blocks may nest: the outermost one reads and writes."""
        if self._in_memory:
            self._in_memory += 1
            try:
                yield self
            finally:
                self._in_memory -= 1
            return
        with torch.no_grad(), self._uncounted():
            for i in range(len(self.params)):
                self._install(i, self._load(i).result())
            self._in_memory = 1
            try:
                yield self
            finally:
                self._in_memory = 0
                for w in [self._store(i) for i in range(len(self.params))]:
                    w.result()
                self.release_params()

    def close(self) -> None:
        """Close the files (the disk space is freed) and stop the background thread."""
        self._io.shutdown(wait=True)
        for f in self.files.values():
            f.close()
        self.files.clear()


# ----------------------------------------------------------------------------------
# Stage 3's parameter shards on disk between uses


class ShardsOnDisk:
    """A FullyShardedModule's `shard_store`: each unit's shard (the fp32 master the optimizer steps)
    is read from its file before the unit's all-gather and freed once the all-gather has read it.

    The files are the DiskOptimizer's own ("param" files, which its step reads and writes back), and
    the reads go through its one disk thread, after any write still queued. With prefetch, fetching
    unit u starts reading the unit gathered after it, so that read runs while u is gathered and the
    one before it computes.
    """

    def __init__(self, fsdp, disk: DiskOptimizer):
        self.fsdp, self.disk = fsdp, disk
        self.index = {id(p): i for i, p in enumerate(disk.params)}   # unit's shard -> its files' index
        self.reading = {}               # unit index -> the future of its shard's read
        self.fetched = {}               # unit index -> bytes this store brought into RAM (freed by evict)

    def _start(self, u, ahead: bool) -> None:
        shard = u.shard
        if u.index in self.reading or not parked(shard):
            return                      # on its way, or in RAM already (a checkpoint's all_in_memory)
        i = self.index[id(shard)]
        f = self.disk.files[i, "param"]
        shard.data = torch.empty(shard.shape, dtype=f.dtype, device=shard.device)
        trace.hold(f.nbytes, f"read {u.name}")
        self.fetched[u.index] = f.nbytes
        self.reading[u.index] = self.disk._io.submit(self.disk._move, "disk_read", i, [(f, shard.detach())],
                                                     f"param{i}", unit=u.name, ahead=ahead)

    def fetch(self, u, ahead) -> None:
        """Unit u's shard in RAM (read now, or waited for if read ahead); start reading `ahead`."""
        self._start(u, ahead=False)
        if u.index in self.reading:
            self.reading.pop(u.index).result()
        if ahead is not None and self.disk.prefetch:
            self._start(ahead, ahead=True)

    def evict(self, u) -> None:
        """u's all-gather is done: free its shard (the file holds the same values: only the step changes them)."""
        nbytes = self.fetched.pop(u.index, None)
        if nbytes is not None:
            park(u.shard, self.disk.files[self.index[id(u.shard)], "param"])
            trace.release(nbytes, f"evict {u.name}")

    def settle(self) -> None:
        """Before the optimizer's step: no read in flight; a shard read ahead but never gathered is
        left to the step (which reads it again and frees it)."""
        for f in self.reading.values():
            f.result()
        self.reading.clear()
        for nbytes in self.fetched.values():
            trace.release(nbytes, "evict")
        self.fetched.clear()

    @contextlib.contextmanager
    def in_memory(self):
        """Every shard (and the optimizer state) in RAM inside the block, written back after it."""
        self.settle()
        with self.disk.all_in_memory():
            yield


# ----------------------------------------------------------------------------------
# ZeRO with its optimizer state on disk


class DiskOffloadedZero(ZeroOptimizer):
    """pplab.zero.ZeroOptimizer whose optimizer state lives on disk between steps (see the module doc).

    folder: where the (nameless) state files go: a folder on the disk to offload to; None = the
      system's temporary folder. prefetch: read the next shard on a background thread while this one
      steps. drop_cache: write through to disk and drop the pages after each move (see the module doc).
    offload_params: at stage 3, the FullyShardedModule whose shards `params` are: its shards go to
      disk too, read back before each all-gather (with prefetch: the unit gathered next on the disk
      thread meanwhile) and by the step, written back after it (see the module doc).
    Everything else as ZeroOptimizer (stage, bucket_cap_mb, master_dtype, group, the optimizer's
    keywords). With a separate master copy (master_dtype other than the model's dtype), the master
    goes to disk too.
    """

    def __init__(self, params, optimizer_class, stage: int = 1, *, folder: str | None = None,
                 prefetch: bool = True, drop_cache: bool = True, offload_params=None, **kwargs):
        if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
            raise TypeError(f"optimizer_class must be a torch.optim.Optimizer class (e.g. torch.optim.AdamW), "
                            f"not {optimizer_class!r}")
        if offload_params is not None and not (isinstance(offload_params, FullyShardedModule) and stage == 3):
            raise ValueError(f"offload_params takes the FullyShardedModule whose shards are `params`, at stage=3 "
                             f"(fsdp = FullyShardedModule(model); DiskOffloadedZero(fsdp.parameters(), ..., 3, "
                             f"offload_params=fsdp)); got {type(offload_params).__name__} at stage={stage!r}")
        if offload_params is not None and offload_params.shard_store is not None:
            raise ValueError("this FullyShardedModule's shards are offloaded already: one DiskOffloadedZero per module")
        folder = checked_folder(folder)

        def on_disk(masters, **defaults):
            return DiskOptimizer(optimizer_class, masters, folder=folder, prefetch=prefetch,
                                 drop_cache=drop_cache, **defaults)

        super().__init__(params, on_disk, stage, **kwargs)
        self.shards_on_disk = None
        if offload_params is not None:
            if {id(u.shard) for u in offload_params.units} != set(map(id, self.params)):
                raise ValueError("offload_params must be the FullyShardedModule whose parameters() were given "
                                 "as params (its shards, all of them)")
            self.shards_on_disk = ShardsOnDisk(offload_params, self.inner)
        if self.masters is not self.shards or offload_params is not None:
            self.inner.offload_params()          # the masters belong to the optimizer: to disk
        if offload_params is not None:
            trace.release(sum(u.shard.numel() * u.shard.element_size() for u in offload_params.units),
                          "shards to disk")
            offload_params.shard_store = self.shards_on_disk

    @torch.no_grad()
    def step(self, closure=None):
        if self.shards_on_disk is not None:
            self.shards_on_disk.settle()
        super().step(closure)                    # steps on disk-backed state; masters copied into the model
        self.inner.release_params()              # then the masters' RAM is freed again

    @contextlib.contextmanager
    def all_in_memory(self):
        """The optimizer state and the masters (stage 3 with offload_params: the module's shards) in
        RAM inside the block, written back to disk after it: to read or change them directly."""
        if self.shards_on_disk is not None:
            self.shards_on_disk.settle()
        with self.inner.all_in_memory():
            yield self

    @property
    def bytes_read(self) -> int:
        """Bytes this rank read from disk in its last training step: from the end of the step before
        (so the forward and backward's reads of offloaded stage-3 shards count) to the end of this one."""
        return self.inner.bytes_read

    @property
    def bytes_written(self) -> int:
        """Bytes this rank wrote to disk in its last training step (counted as bytes_read)."""
        return self.inner.bytes_written

    def state_dict(self):
        with self.all_in_memory():
            return super().state_dict()

    def load_state_dict(self, state_dict) -> None:
        with self.all_in_memory():
            super().load_state_dict(state_dict)

    def close(self) -> None:
        """Close the files (their disk space is freed). With offload_params, the module's shards are
        read back into RAM first, and it goes on without offload."""
        if self.shards_on_disk is not None:
            self.shards_on_disk.settle()
            with torch.no_grad(), self.inner._uncounted():
                for i in range(len(self.inner.params)):
                    self.inner._load(i).result()          # (the optimizer state read here is let go)
            self.shards_on_disk.fsdp.shard_store = self.shards_on_disk = None
            self.inner.params_on_disk = False
        self.inner.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def disk_bytes_per_step(psi: int, n: int, state_bytes: int = 8) -> float:
    """Bytes one rank reads from disk per step, and as many it writes: the K·Ψ/N bytes of optimizer state
    of its shard (K = state_bytes: 8 for fp32 Adam's two moments, 12 with an fp32 master copy)."""
    if not (isinstance(n, int) and n >= 1):
        raise ValueError(f"n is a number of ranks >= 1, got {n!r}")
    if psi < 0 or state_bytes < 0:
        raise ValueError(f"psi and state_bytes are counts >= 0, got psi={psi!r}, state_bytes={state_bytes!r}")
    return state_bytes * psi / n


def param_offload_bytes_per_step(psi: int, n: int, state_bytes: int = 8, param_bytes: int = 4) -> tuple[float, float]:
    """(read, written): bytes one rank moves per step at stage 3 with its parameter shards on disk too
    (offload_params). Its Ψ/N-element shard (param_bytes each: 4 for the fp32 masters) is read three
    times, before the unit's all-gather in forward, again in backward, and by the optimizer's step,
    and written once, after the step; its K = state_bytes of optimizer state per element are read
    and written once. So ((3·P + K)·Ψ/N, (P + K)·Ψ/N): 20Ψ/N and 12Ψ/N for fp32 Adam. (A root unit,
    gathered once per step and kept until backward is done, is read twice, not three times.)"""
    if not (isinstance(n, int) and n >= 1):
        raise ValueError(f"n is a number of ranks >= 1, got {n!r}")
    if min(psi, state_bytes, param_bytes) < 0:
        raise ValueError(f"psi, state_bytes and param_bytes are counts >= 0, got {psi!r}, {state_bytes!r}, "
                         f"{param_bytes!r}")
    return (3 * param_bytes + state_bytes) * psi / n, (param_bytes + state_bytes) * psi / n


# ----------------------------------------------------------------------------------
# This machine's disk, fitted


@dataclass
class DiskFit:
    """t = latency + bytes / bandwidth for one move of a file, each direction (seconds, bytes/s)."""
    read_latency: float
    read_bandwidth: float
    write_latency: float
    write_bandwidth: float
    drop_cache: bool = True

    def read_time(self, nbytes: float, files: int = 1) -> float:
        return files * self.read_latency + nbytes / self.read_bandwidth

    def write_time(self, nbytes: float, files: int = 1) -> float:
        return files * self.write_latency + nbytes / self.write_bandwidth

    def predict(self, read_bytes: float, written_bytes: float, files: int = 1) -> float:
        """Seconds a step spends moving `read_bytes` in and `written_bytes` out, in `files` files each,
        one after the other (one disk, one queue; the reads that prefetch hides behind the optimizer's
        arithmetic are not taken off: that arithmetic is short next to the disk)."""
        return self.read_time(read_bytes, files) + self.write_time(written_bytes, files)


def _line(sizes, times) -> tuple[float, float]:
    """Least-squares t = a + n/b through (size, time) points; a clipped at 0."""
    mx, my = statistics.fmean(sizes), statistics.fmean(times)
    slope = sum((x - mx) * (y - my) for x, y in zip(sizes, times)) / sum((x - mx) ** 2 for x in sizes)
    if slope <= 0:
        raise RuntimeError(f"the timings {times} did not grow with the sizes {sizes}: the machine was too busy "
                           f"to measure; try again, or with more repeats and larger sizes")
    return max(0.0, my - slope * mx), 1.0 / slope


def fit_disk(folder: str | None = None, sizes=(2 ** 16, 2 ** 18, 2 ** 20, 2 ** 22), repeats: int = 7,
             drop_cache: bool = True) -> DiskFit:
    """Time writes and reads of one float32 file of each size (bytes) through TensorFile, the moves the
    optimizer makes; take each size's median over `repeats` tries and fit a line per direction.
    The sizes take turns (one try of each, `repeats` times), so that a burst of load on a shared
    machine slows every size alike instead of the ones that happened to be timed then.

    The copies run on one thread, as in a rank of pplab.launch (a copy of 1 MiB or more would
    otherwise wake torch's other threads, which on a loaded machine wait for a core). Run it on the
    ranks that will share the disk, at the same time (pplab.launch(fit_disk, world_size=N)), to
    price the disk as they will share it.
    """
    if len(sizes) < 2 or repeats < 1:
        raise ValueError(f"fit_disk needs at least 2 sizes and 1 repeat, got sizes={sizes!r}, repeats={repeats!r}")
    folder = checked_folder(folder)
    files = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for n in sizes:
            t = torch.rand(n // 4)
            files.append((TensorFile(t.numel(), t.dtype, folder, drop_cache), t))
            files[-1][0].write(t)                                 # the blocks exist before the first timing
        for attempt in range(MEASUREMENTS):     # a long burst of load can still bend one size's median:
            r, w = [[] for _ in sizes], [[] for _ in sizes]      # then measure again, as a person would
            for _ in range(repeats):
                for i, (f, t) in enumerate(files):
                    start = time.perf_counter()
                    f.write(t)
                    w[i].append(time.perf_counter() - start)
                    start = time.perf_counter()
                    f.read(t)
                    r[i].append(time.perf_counter() - start)
            reads, writes = [statistics.median(x) for x in r], [statistics.median(x) for x in w]
            try:
                (ra, rb), (wa, wb) = _line(sizes, reads), _line(sizes, writes)
                break
            except RuntimeError:
                if attempt == MEASUREMENTS - 1:
                    raise
    finally:
        torch.set_num_threads(threads)
        for f, _ in files:
            f.close()
    return DiskFit(ra, rb, wa, wb, drop_cache)


MEASUREMENTS = 3                        # fit_disk's tries at a line that grows with the size
