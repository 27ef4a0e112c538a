"""GPUs the course's runs stand for, and this machine measured the same way.

    H100_SXM.peak("bf16")            # 989.5e12 FLOP/s, dense (no 2:4 sparsity)
    H100_SXM.memory_bandwidth        # 3.35e12 B/s of HBM3
    here = fit_this_machine()        # a matmul and a copy timed in turn for a second or two

Every figure of a preset is from the vendor's datasheet named in its `source`. Two conventions
to know when reading a datasheet:

* **Dense, not sparse.** NVIDIA quotes tensor-core FLOP/s "with sparsity" (2:4 structured
  sparsity, twice the dense figure) and marks it with an asterisk; training runs dense, so the
  presets hold the dense figures, written as half the headline numbers.
* **Per direction.** NVLink is quoted as the total of both directions (600 GB/s on A100, 900 GB/s
  on H100/H200); a message goes one way, so `nvlink` holds half. `network` is the InfiniBand
  bandwidth per GPU of NVIDIA's reference nodes (DGX: one adapter per GPU), one direction.

"this machine" is fitted as chapter 1 fits the network (`pplab.costfit`): time the real thing and
keep a robust figure. A peak is what the machine can do when nothing gets in the way, so each
figure is the fastest of a few tries (on a shared machine the other tries are slowed by whoever
else runs) of a square matmul (2n³ FLOPs) and of a large copy (reads and writes the tensor once
each: 2 × its bytes). `fit_this_machine` times the two in turn, in tries short enough and on one
core, so that its ridge comes out the same on a busy machine as on a quiet one.
"""
from __future__ import annotations

import functools
import os
import time
from dataclasses import dataclass, field

GB = 1e9
TB = 1e12

DTYPE_NAMES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "fp64": "float64"}


@dataclass(frozen=True)
class Hardware:
    """One device: dense FLOP/s per dtype, its memory (bytes, B/s) and its links (B/s, one direction)."""

    name: str
    flops: dict = field(hash=False)        # {"bf16": FLOP/s, ...}, dense
    memory_bandwidth: float                # B/s, device memory (HBM) to the chip
    memory: float                          # bytes of device memory
    nvlink: float | None = None            # B/s per GPU, one direction, inside a node
    network: float | None = None           # B/s per GPU, one direction, between nodes
    source: str = ""

    def peak(self, dtype: str = "bf16") -> float:
        """Dense peak FLOP/s in `dtype` ("bf16", "fp16", "fp32", "fp64")."""
        if dtype not in self.flops:
            raise ValueError(f"{self.name} has no {dtype!r} figure; it has {sorted(self.flops)}")
        return self.flops[dtype]

    def ridge(self, dtype: str = "bf16") -> float:
        """FLOPs per byte where compute and memory bandwidth limit alike (the roofline's ridge)."""
        return self.peak(dtype) / self.memory_bandwidth


A100_80GB = Hardware(
    "A100 80GB SXM",
    flops={"bf16": 624 / 2 * TB, "fp16": 624 / 2 * TB, "fp32": 19.5 * TB, "tf32": 312 / 2 * TB, "fp64": 9.7 * TB},
    memory_bandwidth=2039 * GB, memory=80 * GB,
    nvlink=600 / 2 * GB,                    # NVLink 3: 600 GB/s both directions
    network=200 / 8 * GB,                   # HDR InfiniBand, 200 Gb/s per GPU (DGX A100)
    source="NVIDIA A100 Tensor Core GPU datasheet (80GB SXM column); NVIDIA DGX A100 datasheet",
)

H100_SXM = Hardware(
    "H100 SXM",
    flops={"bf16": 1979 / 2 * TB, "fp16": 1979 / 2 * TB, "fp32": 67 * TB, "tf32": 989 / 2 * TB, "fp64": 34 * TB},
    memory_bandwidth=3.35 * TB, memory=80 * GB,
    nvlink=900 / 2 * GB,                    # NVLink 4: 900 GB/s both directions
    network=400 / 8 * GB,                   # NDR InfiniBand, 400 Gb/s per GPU (DGX H100)
    source="NVIDIA H100 Tensor Core GPU datasheet (H100 SXM column); NVIDIA DGX H100 datasheet",
)

H200 = Hardware(
    "H200 SXM",
    flops={"bf16": 1979 / 2 * TB, "fp16": 1979 / 2 * TB, "fp32": 67 * TB, "tf32": 989 / 2 * TB, "fp64": 34 * TB},
    memory_bandwidth=4.8 * TB, memory=141 * GB,
    nvlink=900 / 2 * GB,
    network=400 / 8 * GB,                   # NDR InfiniBand, 400 Gb/s per GPU (DGX H200)
    source="NVIDIA H200 Tensor Core GPU datasheet (H200 SXM column); NVIDIA DGX H200 datasheet",
)

PRESETS = {hw.name: hw for hw in (A100_80GB, H100_SXM, H200)}


# ----------------------------------------------------------------------------------
# This machine, measured

def _fastest_seconds(fn, repeats: int, min_seconds: float) -> float:
    """The fastest of at least `repeats` tries, trying on for `min_seconds` in all: a quiet moment
    of a shared machine is more likely found in half a second than in 7 back-to-back tries."""
    fn()                                   # warm up: allocation, thread pool, caches
    times, began = [], time.perf_counter()
    while len(times) < repeats or time.perf_counter() - began < min_seconds:
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def measure_matmul_flops(n: int = 512, dtype: str = "fp32", repeats: int = 7, min_seconds: float = 0.0) -> float:
    """FLOP/s of an [n, n] @ [n, n] product in `dtype` on this machine (the fastest of `repeats`
    tries or more, for at least `min_seconds`)."""
    import torch

    if dtype not in DTYPE_NAMES:
        raise ValueError(f"dtype must be one of {sorted(DTYPE_NAMES)}, got {dtype!r}")
    a = torch.randn(n, n, dtype=getattr(torch, DTYPE_NAMES[dtype]))
    b = torch.randn(n, n, dtype=a.dtype)
    out = torch.empty(n, n, dtype=a.dtype)
    return 2 * n ** 3 / _fastest_seconds(lambda: torch.mm(a, b, out=out), repeats, min_seconds)


def measure_copy_bandwidth(nbytes: int = 64 * 2 ** 20, repeats: int = 7, min_seconds: float = 0.0) -> float:
    """B/s of memory traffic copying a tensor of `nbytes` (one read and one write: 2 × nbytes), the
    fastest of `repeats`."""
    import torch

    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    return 2 * src.nbytes / _fastest_seconds(lambda: dst.copy_(src), repeats, min_seconds)


def _fastest_interleaved(fns, repeats: int, min_seconds: float) -> list:
    """The fastest try of each of `fns`, tried in turn (one of each, then again) for at least
    `repeats` rounds and `min_seconds`: every figure then sees the same moments of a shared machine,
    instead of one finding a quiet second that the other never had."""
    for fn in fns:
        fn()                               # warm up each
    best, rounds, began = [float("inf")] * len(fns), 0, time.perf_counter()
    while rounds < repeats or time.perf_counter() - began < min_seconds:
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - start)
        rounds += 1
    return best


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def fit_this_machine(dtypes=("fp32", "fp64"), matmul_n: int = 512, copy_bytes: int = 64 * 2 ** 20,
                     repeats: int = 7, seconds_each: float = 0.5, chunks: int = 16) -> Hardware:
    """This machine as a Hardware, its FLOP/s and bandwidth timed here (`seconds_each` per figure).

    Made to give the same figures on a busy machine (others' processes on every core) as on a quiet
    one: every try is short enough to run without being descheduled (a 512 x 512 matmul, a copy of
    one of `chunks` slices of a `copy_bytes` buffer, about a millisecond each), runs on one thread
    (two threads stall whenever either is descheduled), and the figures are tried in turn, each the
    fastest of its tries. The slices are swept in turn through a buffer far larger than the caches,
    so that each comes from memory. Both figures are one core's times the cores this process may use
    (what `peak_here` gives, what a run's threads or ranks share): the ridge (peak / bandwidth) is
    one core's, whatever the number of cores. Cores that share a memory bus may together get less
    than their sum, so the bandwidth is an upper bound and the ridge, if anything, low.
    """
    import torch

    for d in dtypes:
        if d not in DTYPE_NAMES:
            raise ValueError(f"dtype must be one of {sorted(DTYPE_NAMES)}, got {d!r}")
    operands = {d: [torch.randn(matmul_n, matmul_n, dtype=getattr(torch, DTYPE_NAMES[d])) for _ in range(3)]
                for d in dtypes}
    src, chunk = torch.ones(copy_bytes // 4), copy_bytes // 4 // chunks
    dst, sweep = torch.zeros_like(src), iter(range(10 ** 12))      # zeros: its pages are mapped before timing

    def copy_next_slice():
        k = next(sweep) % chunks
        dst[k * chunk:(k + 1) * chunk].copy_(src[k * chunk:(k + 1) * chunk])

    fns = [lambda a=a, b=b, out=out: torch.mm(a, b, out=out) for a, b, out in operands.values()] + [copy_next_slice]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        *matmul_seconds, copy_seconds = _fastest_interleaved(fns, repeats, seconds_each * len(fns))
    finally:
        torch.set_num_threads(threads)
    cores = _cores()
    flops = {d: cores * 2 * matmul_n ** 3 / t for d, t in zip(dtypes, matmul_seconds)}
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return Hardware("this machine", flops, cores * 2 * chunk * 4 / copy_seconds, float(memory),
                    source=f"fitted here: fastest of {seconds_each} s of timed {matmul_n}x{matmul_n} matmuls "
                           f"and of copies of {copy_bytes / 2 ** 20:.0f} MiB "
                           f"in {chunks} slices, one core's times {cores} cores, tried in turn")


def core_share(seconds: float = 0.2) -> float:
    """The share of one core this process gets right now: CPU seconds over wall-clock seconds of a
    busy loop of `seconds`. About 1 on a quiet machine; about cores / (runnable processes + 1)
    on a busy one (0.4 beside two spin loops per core of 2 cores). A cell whose claim needs a quiet
    machine asks this first, and only prints what it measured when the answer is low."""
    wall, cpu = time.perf_counter(), time.process_time()
    while time.perf_counter() - wall < seconds:
        pass
    return min(1.0, (time.process_time() - cpu) / (time.perf_counter() - wall))


@functools.cache
def peak_here(dtype: str = "fp32") -> float:
    """This machine's peak FLOP/s in `dtype`, fitted quickly the first time a process asks, then kept:
    what `pplab.flops.mfu_report` divides by (`fit_this_machine` tries longer).

    One core's peak (the fastest of 0.05 s of 512 x 512 matmuls on one thread) times the cores this
    process may use, which the ranks of a run share. One thread finds a quiet moment on a loaded
    machine far more often than several, which stall whenever one of them is descheduled.
    """
    import torch

    cores = _cores()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return cores * measure_matmul_flops(512, dtype, repeats=3, min_seconds=0.05)
    finally:
        torch.set_num_threads(threads)
