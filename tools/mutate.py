"""Plant realistic one-line bugs in pplab, one at a time, and see whether the tests catch them.

    nice -n 10 .venv/bin/python tools/mutate.py           # every mutant
    nice -n 10 .venv/bin/python tools/mutate.py 3 7       # mutants 3 and 7 only
    .venv/bin/python tools/mutate.py --list               # what each one plants (and check they apply)
    ... --no-baseline                                     # skip the first run of the tests unmutated

Each mutant replaces a piece of exactly one line of a pplab file (a peer off by one, a
wrong reduction, a missing division by the world size, ...), runs the tests that cover that
file (pytest -x, launches timing out after PPLAB_LAUNCH_TIMEOUT=20 s), puts the file back,
and reports one of:

    assertion   a test failed on a wrong value or a raised error: the bug is caught
    timeout     only a hang caught it (a launch or pytest-timeout gave up): caught, slowly
    SURVIVED    every test passed with the bug in: a test is missing

The file is restored in a `finally` (Ctrl-C and SIGTERM included). The tool edits the files
of the checkout it sits in: run it in a clean one (it refuses files with uncommitted
changes); if it was killed with SIGKILL, `git checkout -- pplab` puts everything back.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAUNCH_TIMEOUT = "20"          # seconds a launch in a test may hang (tests/conftest.py's default is longer)
TEST_TIMEOUT = "240"           # pytest-timeout, per test
RUN_TIMEOUT = 900              # one mutant's whole test run


@dataclass
class Mutant:
    file: str
    original: str              # a substring of exactly one line of `file`
    replacement: str
    tests: tuple               # pytest arguments: test files, and maybe "-k", "expression"
    what: str


def T(*names, k=None):
    args = tuple(f"tests/{n}.py" for n in names)
    return args + (("-k", k) if k else ())


COLL, DP, TP, ZERO = T("test_collectives"), T("test_data_parallel", "test_data_parallel_more"), \
    T("test_tensor_parallel"), T("test_zero")
PIPE, SP, EP, TRACE = T("test_pipeline_schedules", "test_pipeline_executor"), T("test_sequence_parallel"), \
    T("test_expert_parallel", "test_expert_parallel_more"), T("test_trace")
TPT = T("test_tensor_parallel_transformer", "test_tensor_parallel_transformer_more")

MUTANTS = [
    # collectives.py: the algorithms behind every chapter
    Mutant("pplab/collectives.py", "comm.send(flat, ranks[(root + vr + mask) % p], group)",
           "comm.send(flat, ranks[(root + vr + mask - 1) % p], group)", COLL, "tree broadcast: child off by one"),
    Mutant("pplab/collectives.py", "comm.recv(incoming, ranks[(root + vr + mask) % p], group)",
           "comm.recv(incoming, ranks[(root + vr - mask) % p], group)", COLL, "tree reduce: receive from the parent"),
    Mutant("pplab/collectives.py", "_sendrecv(chunks[(me - s) % p], right, chunks[(me - s - 1) % p], left, group)",
           "_sendrecv(chunks[(me - s) % p], right, chunks[(me - s + 1) % p], left, group)", COLL,
           "ring all-gather: received chunk stored at the wrong place"),
    Mutant("pplab/collectives.py", "out, into = chunks[(me - s - 1) % p], chunks[(me - s - 2) % p]",
           "out, into = chunks[(me - s) % p], chunks[(me - s - 1) % p]", COLL,
           "ring reduce-scatter: each rank ends with the wrong chunk"),
    Mutant("pplab/collectives.py", "to, frm = (me + s) % p, (me - s) % p", "to, frm = (me + s) % p, (me + s) % p",
           COLL, "all-to-all: receive from the rank we send to"),
    Mutant("pplab/collectives.py", "OPS = {\"sum\": torch.add, \"product\": torch.mul, \"max\": torch.maximum,",
           "OPS = {\"sum\": torch.add, \"product\": torch.mul, \"max\": torch.minimum,", COLL,
           "max computed as min"),
    Mutant("pplab/collectives.py", "_sendrecv(part(lo, hi), partner, part(other, other + mask), partner, group)",
           "_sendrecv(part(lo, hi), partner, part(other, other + mask - 1), partner, group)", COLL,
           "halving-doubling: all-gather receives one chunk short"),
    Mutant("pplab/collectives.py", "if r != src and piece.numel()]", "if r != src and piece.numel() > 1]", COLL,
           "scatter: one-element pieces never sent"),
    Mutant("pplab/collectives.py", "chunks = flat.tensor_split(len(ranks))",
           "chunks = flat[:flat.numel() - flat.numel() % len(ranks)].tensor_split(len(ranks))", COLL,
           "ring all-reduce: the remainder of an uneven split dropped"),
    Mutant("pplab/collectives.py", "stay = ranks[1:2 * rem:2] + ranks[2 * rem:]",
           "stay = ranks[0:2 * rem:2] + ranks[2 * rem:]", COLL, "fold to a power of two: the wrong ranks stay"),
    # comm.py: the traced point-to-point layer
    Mutant("pplab/runtime/comm.py", "bytes_sent=n if sending else 0, bytes_recv=0 if sending else n, peer=peer,",
           "bytes_sent=n if sending else 0, bytes_recv=n if sending else 0, peer=peer,",
           T("test_collectives", "test_trace"), "trace: a send counted as received bytes"),
    # data_parallel.py
    Mutant("pplab/data_parallel/ddp.py", "    flat.div_(world_size)", "    flat.div_(max(world_size - 1, 1))", DP,
           "DDP: divide by p-1"),
    Mutant("pplab/data_parallel/ddp.py", "parts = [t[rank * k:(rank + 1) * k] for t in tensors]",
           "parts = [t[rank * k:(rank + 1) * k - (rank == p - 1)] for t in tensors]", DP,
           "shard: the last rank drops its last sample"),
    Mutant("pplab/data_parallel/ddp.py", "if current is None or size + nbytes > cap_bytes or p.dtype",
           "if current is None or size + nbytes >= cap_bytes or p.dtype", DP,
           "buckets: a bucket exactly at the cap split"),
    Mutant("pplab/data_parallel/ddp.py", "comm.broadcast(t.detach(), src=self._root, group=group)",
           "comm.broadcast(t.detach(), src=0, group=group)", DP, "DDP on a sub-group: broadcast from global rank 0"),
    # tensor_parallel*.py
    Mutant("pplab/split.py", "return [n // p + (r < n % p) for r in range(p)]",
           "return [n // p + (r > p - 1 - n % p) for r in range(p)]", TP,
           "uneven split: the last ranks get the extra rows"),
    Mutant("pplab/tensor_parallel/layers.py", "return _all_reduce(grad.clone(), ctx.group), None",
           "return grad.clone(), None", TP, "f: no all-reduce in backward"),
    Mutant("pplab/tensor_parallel/summa.py", "self.i, self.j = divmod(ranks.index(dist.get_rank()), q)",
           "self.j, self.i = divmod(ranks.index(dist.get_rank()), q)", T("test_tensor_parallel_2d"),
           "2D grid: rows and columns swapped"),
    Mutant("pplab/tensor_parallel/transformer.py", "mine = (targets >= start) & (targets < start + logits.shape[-1])",
           "mine = (targets >= start) & (targets <= start + logits.shape[-1])", TPT,
           "vocab-parallel loss: a target owned by two ranks"),
    Mutant("pplab/tensor_parallel/transformer.py", "comm.all_reduce(m, op=\"max\", group=group)",
           "comm.all_reduce(m, op=\"min\", group=group)", TPT,
           "vocab-parallel loss: min instead of max"),
    Mutant("pplab/tensor_parallel/cnn.py", "m.weight.copy_(conv.weight[start:end])",
           "m.weight.copy_(conv.weight[start:end].flip(0))", T("test_tensor_parallel_cnn"),
           "conv shard: output channels reversed"),
    # zero/
    Mutant("pplab/zero/flat.py", "self.shard_size = math.ceil(self.numel / world_size)",
           "self.shard_size = self.numel // world_size", ZERO, "flat bucket: padding lost (floor)"),
    Mutant("pplab/zero/flat.py", "return flat[r * self.shard_size:(r + 1) * self.shard_size]",
           "r = (r + 1) % self.world_size; return flat[r * self.shard_size:(r + 1) * self.shard_size]",
           ZERO, "flat bucket: rank r steps its right neighbour's shard"),
    Mutant("pplab/zero/optimizer.py", "out.div_(self.world_size)    # the sum over ranks", "out.div_(1)    # the sum over ranks",
           ZERO, "ZeRO: the summed gradient not divided by p"),
    Mutant("pplab/zero/flat.py", "torch.sum(self._pieces.view(self._n, -1), dim=0, out=self._out)",
           "torch.sum(self._pieces.view(self._n, -1)[1:], dim=0, out=self._out)", ZERO,
           "reduce-scatter by all-to-all: the first rank's piece left out"),
    # pipeline/
    Mutant("pplab/pipeline/schedules.py", "ranks.append(_one_f_one_b_order(forwards, backwards, warmup=min(p - 1 - r, m)))",
           "ranks.append(_one_f_one_b_order(forwards, backwards, warmup=min(p - r, m)))", PIPE,
           "1F1B: one warm-up forward too many"),
    Mutant("pplab/pipeline/schedules.py", "return [s % p for s in range(p * v)]",
           "return [s // v for s in range(p * v)]", PIPE, "interleaved: consecutive stages on one rank"),
    Mutant("pplab/pipeline/executor.py", "out = self.loss_fn(out, self.ys[i]) * (len(self.xs[i]) / self.n)",
           "out = self.loss_fn(out, self.ys[i])", PIPE, "pipeline loss: micro-batch losses summed, not averaged"),
    Mutant("pplab/pipeline/executor.py", "self._send((\"grad\", s, i), grad if grad is not None else torch.zeros_like(x), prev)",
           "self._send((\"grad\", s, i), torch.zeros_like(x), prev)", PIPE,
           "pipeline backward: zeros sent to the previous stage"),
    # sequence_parallel.py, ring_attention.py
    Mutant("pplab/sequence_parallel/ulysses.py", "ins = [x[..., j * h:(j + 1) * h, :, :].contiguous() for j in range(len(ranks))]",
           "ins = [x[..., j * h:(j + 1) * h, :, :].contiguous() for j in reversed(range(len(ranks)))]", SP,
           "Ulysses: head blocks to the wrong ranks"),
    Mutant("pplab/sequence_parallel/ulysses.py", "outs = [y.new_empty(y.shape[:-2] + (lengths[me], y.shape[-1])) for _ in ranks]",
           "outs = [y.new_empty(y.shape[:-2] + (lengths[0], y.shape[-1])) for _ in ranks]", SP,
           "Ulysses back: every rank assumes rank 0's length"),
    Mutant("pplab/sequence_parallel/ring_attention.py", "if qb > qa and kb > ka and ka < qb:", "if qb > qa and kb > ka and ka < qa:",
           SP, "causal ring: the diagonal block skipped"),
    Mutant("pplab/sequence_parallel/ring_attention.py", "dtype=torch.bool, device=s.device).triu(1), -math.inf)",
           "dtype=torch.bool, device=s.device).triu(2), -math.inf)", SP,
           "causal mask off by one: a query sees the next key"),
    Mutant("pplab/sequence_parallel/ring_attention.py", "lse = torch.logaddexp(lse1, lse2)", "lse = torch.maximum(lse1, lse2)", SP,
           "merge: max instead of log-sum-exp"),
    # expert_parallel.py
    Mutant("pplab/expert_parallel.py", "order = kept[torch.argsort(expert[kept], stable=True)]",
           "order = kept[torch.argsort(expert[kept], stable=True, descending=True)]", EP,
           "dispatch: experts in reverse order"),
    Mutant("pplab/expert_parallel.py", "return math.ceil(capacity_factor * tokens * k / num_experts)",
           "return int(capacity_factor * tokens * k / num_experts)", EP, "capacity rounded down"),
    Mutant("pplab/expert_parallel.py", "weights = weights / weights.sum(-1, keepdim=True)",
           "weights = weights", EP, "top-k weights not renormalised"),
    # trace.py
    Mutant("pplab/trace.py", "cur_e = max(cur_e, e)", "cur_e = e", TRACE, "busy time: a nested span cuts the union"),
    Mutant("pplab/trace.py", "r = recvs.get((e.rank, e.peer, e.seq))", "r = recvs.get((e.peer, e.rank, e.seq))",
           TRACE, "messages: send matched with the reverse direction"),
    Mutant("pplab/trace.py", "return sum(self.busy(r) for r in range(self.world_size)) / (self.world_size * span)",
           "return sum(self.busy(r) for r in range(self.world_size - 1)) / (self.world_size * span)", TRACE,
           "utilization: the last rank left out"),
    # session 9, h4: FLOPs, memory, cluster, cost model
    # flops.py
    Mutant('pplab/flops.py', '"scores": l * 2 * batch * s * s * h,',
           '"scores": 2 * batch * s * s * h,', T("test_flops", "test_flops_more"),
           'FLOPs: attention scores counted for one layer only'),
    Mutant('pplab/flops.py', '"full": forward - parts["head"]}[recompute]',
           '"full": forward}[recompute]', T("test_flops", "test_flops_more"),
           'full recomputation runs the output layer again too'),
    Mutant('pplab/flops.py', 'return cfg.layers * (4 * h * h + 2 * h * cfg.ffn) + h * cfg.vocab',
           'return cfg.layers * (3 * h * h + 2 * h * cfg.ffn) + h * cfg.vocab', T("test_flops", "test_flops_more"),
           "6N: the output projection's weights left out"),
    Mutant('pplab/flops.py', 'return six_n(cfg) + 12 * cfg.layers * s * cfg.hidden',
           'return six_n(cfg) + 4 * cfg.layers * s * cfg.hidden', T("test_flops", "test_flops_more"),
           "per token: attention's backward forgotten"),
    Mutant('pplab/flops.py', 'return _utilization(step.hardware, seconds, peak * devices)',
           'return _utilization(step.hardware, seconds, peak)', T("test_flops", "test_flops_more"),
           'HFU: devices ignored'),
    Mutant('pplab/flops.py', 'qkvo = 4 * batch * heads * seq * head_dim',
           'qkvo = 3 * batch * heads * seq * head_dim', T("test_flops", "test_flops_more"),
           "fused attention: the output's write not counted"),
    Mutant('pplab/flops.py', 'elementwise(t * f, 1, 8, dtype_bytes, "gelu"),',
           'elementwise(t * h, 1, 8, dtype_bytes, "gelu"),', T("test_flops", "test_flops_more"),
           'roofline: GeLU over h elements, not f'),
    Mutant('pplab/flops.py', 'layer_norm(t, h, dtype_bytes, "ln2"),',
           'layer_norm(t, f, dtype_bytes, "ln2"),', T("test_flops", "test_flops_more"),
           "roofline: the second LayerNorm over the MLP's width"),
    Mutant('pplab/flops.py', 'ridge = peak / bandwidth',
           'ridge = bandwidth / peak', T("test_flops", "test_flops_more"),
           'roofline: the ridge upside down'),
    Mutant('pplab/flops.py', 'return sum(max(op.flops / peak, op.bytes / bandwidth) for op in ops)',
           'return sum(min(op.flops / peak, op.bytes / bandwidth) for op in ops)', T("test_flops", "test_flops_more"),
           'roofline time: the lower of the two limits'),
    Mutant('pplab/flops.py', 'scale = DTYPE_BYTES[preset_dtype] / DTYPE_BYTES[dtype]',
           'scale = DTYPE_BYTES[dtype] / DTYPE_BYTES[preset_dtype]', T("test_flops", "test_flops_more"),
           'MFU report: dtype conversion inverted'),
    Mutant('pplab/flops.py', 'compute, memory_bound = flops / ranks / preset.peak(preset_dtype), None',
           'compute, memory_bound = flops / preset.peak(preset_dtype), None', T("test_flops", "test_flops_more"),
           'MFU report: each rank does all the FLOPs'),
    Mutant('pplab/flops.py', 'whole = payload * p if kind == "all_gather" else payload',
           'whole = payload', T("test_flops", "test_flops_more"),
           "sent_per_rank: an all-gather's payload taken as the whole"),
    Mutant('pplab/flops.py', '_OTHER_SENDS = {"scatter": lambda p: p - 1,',
           '_OTHER_SENDS = {"scatter": lambda p: p,', T("test_flops", "test_flops_more"),
           "sent_per_rank: a scatter's root sends its own piece too"),
    Mutant('pplab/flops.py', 'most = max(most, sent)',
           'most = sent', T("test_flops", "test_flops_more"),
           'sent_per_rank: the last rank, not the most'),
    Mutant('pplab/flops.py', 'if ranks > 8:',
           'if ranks >= 8:', T("test_flops", "test_flops_more"),
           'MFU report: 8 GPUs taken for two nodes'),
    Mutant('pplab/flops.py', 'by_dtype[dtype] = by_dtype.get(dtype, 0) + op.flops',
           'by_dtype[dtype] = by_dtype.get(dtype, 0) + 1', T("test_flops", "test_flops_more"),
           'count_step: the dtype of most products, not FLOPs'),
    Mutant('pplab/flops.py', 'return 96 * b * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))',
           'return 96 * b * s * l * h * h * (1 + s / (6 * h) + v / (16 * h))', T("test_flops", "test_flops_more"),
           "Megatron's formula: the output layer counted per layer"),
    # split.py
    Mutant('pplab/split.py', 'return 2 * n - c[me] - c[(me + 1) % p]',
           'return 2 * n - c[me] - c[(me - 1) % p]', T("test_flops", "test_flops_more"),
           "ring all-reduce sends: the left neighbour's chunk kept, not the right's"),
    # memory.py
    Mutant('pplab/memory.py', 'return s * b * h * (4 * e + 2 + 12 * e / t + scores / t)',
           'return s * b * h * (5 * e + 12 * e / t + scores / t)', T("test_memory", "test_recompute"),
           "activations, tp without sp: the masks counted at the activations' width"),
    Mutant('pplab/memory.py', 'return s * b * h * e / (t if sp else 1)',
           'return s * b * h * e / t', T("test_memory", "test_recompute"),
           'full recomputation: the input split over t without sequence parallelism'),
    Mutant('pplab/memory.py', 'self.peak = max(self.peak, self.live)',
           'self.peak = self.live', T("test_memory", "test_recompute"),
           'PeakMemory: the peak is the last value'),
    Mutant('pplab/memory.py', 'if size == 0 or key in inputs or storage.filename',
           'if size == 0 or storage.filename', T("test_memory", "test_recompute"),
           "PeakMemory: an in-place op's output counted as new"),
    Mutant('pplab/memory.py', 'if storage.nbytes() and storage.data_ptr() not in seen:',
           'if storage.nbytes():', T("test_memory", "test_recompute"),
           'state_bytes: a shared storage counted twice'),
    Mutant('pplab/memory.py', 'key, size = ((t.data_ptr(), t.numel()), t.numel() * t.element_size()) if self.slices else',
           'key, size = ((t.data_ptr(), t.numel()), t.numel()) if self.slices else', T("test_memory", "test_recompute"),
           'saved slices: elements, not bytes'),
    # hardware.py
    Mutant('pplab/hardware.py', 'return 2 * src.nbytes / _fastest_seconds(',
           'return src.nbytes / _fastest_seconds(', T("test_hardware", "test_flops"),
           'copy bandwidth: the write not counted'),
    Mutant('pplab/hardware.py', 'return 2 * n ** 3 / _fastest_seconds(',
           'return n ** 3 / _fastest_seconds(', T("test_hardware", "test_flops"),
           'matmul FLOP/s: a multiply-add counted as one FLOP'),
    Mutant('pplab/hardware.py', 'return min(times)',
           'return sorted(times)[len(times) // 2]', T("test_hardware", "test_flops"),
           'a peak fitted from the median try, not the fastest'),
    Mutant('pplab/hardware.py', 'return cores * measure_matmul_flops(512, dtype, repeats=3, min_seconds=0.05)',
           'return measure_matmul_flops(512, dtype, repeats=3, min_seconds=0.05)', T("test_hardware", "test_flops"),
           "this machine's peak: one core's"),
    Mutant('pplab/hardware.py', 'nvlink=900 / 2 * GB,                    # NVLink 4',
           'nvlink=900 * GB,                    # NVLink 4', T("test_hardware", "test_flops"),
           "H100's NVLink: both directions counted"),
    # costmodel.py
    Mutant('pplab/costmodel.py', 'log = (p - 1).bit_length()                             #',
           'log = p.bit_length()                             #', T("test_costmodel"),
           'tree: one round too many at powers of two'),
    Mutant('pplab/costmodel.py', 'return body if q == p else body + Cost(2, 2 * N, N)',
           'return body if q == p else body + Cost(2, N, N)', T("test_costmodel"),
           "folding in: the result's way back not counted"),
    Mutant('pplab/costmodel.py', '("reduce", "tree"): Cost(log, log * N, log * N),',
           '("reduce", "tree"): Cost(log, log * N),', T("test_costmodel"),
           'tree reduce: its additions not counted'),
    Mutant('pplab/costmodel.py', 'if vr < 2 ** k and vr + 2 ** k < p)',
           'if vr < 2 ** k and vr + 2 ** k <= p)', T("test_costmodel"),
           'tree broadcast sends: a child past the last rank'),
    Mutant('pplab/costmodel.py', 'return (me != 0) * n + _tree_sends(me, p) * n',
           'return n + _tree_sends(me, p) * n', T("test_costmodel"),
           'tree all-reduce sends: the root sends to itself'),
    Mutant('pplab/costmodel.py', 'return self.latency_rounds * alpha + self.bytes * beta + self.reduce_bytes * gamma',
           'return self.latency_rounds * alpha + self.bytes * beta', T("test_costmodel"),
           'predict: γ dropped'),
    Mutant('pplab/costmodel.py', 'last_into = {max(into, key=lambda j: pairs[j][1].start)} if into else set()',
           'last_into = set()', T("test_costmodel"),
           'critical path: a receiver takes many messages at once'),
    # costfit.py
    Mutant('pplab/costfit.py', 'return min(p, 2 * (p - 1) / (p - 1).bit_length())',
           'return min(p, 2 * p / (p - 1).bit_length())', T("test_costmodel", "test_costfit_median"),
           'busy ranks of a tree: p messages, not p-1'),
    Mutant('pplab/costfit.py', 'buffers = {"ring": [N / p], "tree": [N]',
           'buffers = {"ring": [N], "tree": [N]', T("test_costmodel", "test_costfit_median"),
           "fresh memory: the ring's receive buffer taken as the whole tensor"),
    Mutant('pplab/costfit.py', 'sigma = {kind: max(0.0, (seconds - delta / steps - s * (alpha if',
           'sigma = {kind: max(0.0, (seconds - s * (alpha if', T("test_costmodel", "test_costfit_median"),
           "σ fitted with δ's share left in"),
    Mutant('pplab/costfit.py', 'a, b = (self.alpha, self.beta) if kind == "one-way" else (self.alpha2, self.beta2)',
           'a, b = (self.alpha, self.beta) if kind != "one-way" else (self.alpha2, self.beta2)', T("test_costmodel", "test_costfit_median"),
           'one-way steps priced as exchanges'),
    Mutant('pplab/costfit.py', 'return sorted(times)[(len(times) - 1) // 4]',
           'return sorted(times)[len(times) // 4]', T("test_costmodel", "test_costfit_median"),
           'quick quarter: one try too high'),
    Mutant('pplab/costfit.py', 'kinds = [(self.round_trip_delays, (steps + 1) // 2)]',
           'kinds = [(self.round_trip_delays, steps)]', T("test_costmodel", "test_costfit_median"),
           "spread: a round trip's delay drawn for every one-way step"),
    Mutant('pplab/costfit.py', 'size = max(1.0, c.bytes / steps)',
           'size = max(1.0, c.bytes)', T("test_costmodel", "test_costfit_median"),
           "spread: delays drawn at the whole collective's size, not a step's"),
    Mutant('pplab/costfit.py', 'cores = self.cores or busy',
           'cores = self.cores or 1', T("test_costmodel", "test_costfit_median"),
           'one GPU per rank: the ranks made to share one core'),
    Mutant('pplab/costfit.py', 'alpha, beta = 0.0, snt / snn',
           'alpha, beta = 0.0, st / sn', T("test_costmodel", "test_costfit_median"),
           'fit through 0: a ratio of sums, not least squares'),
    Mutant('pplab/costfit.py', 'alpha, beta = st / sw, 0.0',
           'alpha, beta = sum(times) / len(times), 0.0', T("test_costmodel", "test_costfit_median"),
           'flat fit: the plain mean, not the relative-error fit'),
    # cluster.py
    Mutant('pplab/cluster.py', 'return rank // self.ranks_per_node',
           'return rank % self.n_nodes', T("test_cluster", "test_placement", "test_placement_more"),
           'cluster: ranks dealt round the nodes'),
    Mutant('pplab/cluster.py', 'meta={"payload": tensor.numel() * tensor.element_size(), "via": "p2p"}))',
           'meta={"payload": tensor.numel() * tensor.element_size()}))',
           T("test_cluster", "test_placement", "test_placement_more", "test_flops_more"),
           'two tiers: a collective run over sends not marked, so its bytes are counted twice'),
    Mutant('pplab/cluster.py', 'left = _Link.free_at + latency - now()',
           'left = _Link.free_at - now()', T("test_cluster", "test_placement", "test_placement_more"),
           'two tiers: latency not held'),
    Mutant('pplab/cluster.py', 'shard.grad.div_(cluster.n_nodes)',
           'shard.grad.div_(cluster.ranks_per_node)', T("test_cluster", "test_placement", "test_placement_more"),
           'HSDP: divided by ranks per node, not nodes'),
    Mutant('pplab/cluster.py', 'collectives.all_reduce(piece, op=op, group=rail)',
           'collectives.all_reduce(piece, op=op, group=node)', T("test_cluster", "test_placement", "test_placement_more"),
           'hierarchical all-reduce: step 2 inside the node'),
    Mutant('pplab/cluster.py', 'across = 2 * (n - 1) * (a_x + nbytes / (r * n) * b_x)',
           'across = 2 * (n - 1) * (a_x + nbytes / r * b_x)', T("test_cluster", "test_placement", "test_placement_more"),
           'two-tier model: the piece across not split over nodes'),
    Mutant('pplab/cluster.py', '"reduce_scatter": p - 1}',
           '"reduce_scatter": p}', T("test_cluster", "test_placement", "test_placement_more"),
           'crossing time: a reduce-scatter one step too long'),
    Mutant('pplab/cluster.py', 'out += [(a, b, 1 / (n - 1)) for a in g for b in g if a != b]',
           'out += [(a, b, 1 / n) for a in g for b in g if a != b]', T("test_cluster", "test_placement", "test_placement_more"),
           "ep placement: a rank's own piece counted as sent"),
    Mutant('pplab/cluster.py', 'return tuple(sorted(traffic, key=lambda d: (traffic[d], mesh.DIMS.index(d))))',
           'return tuple(sorted(traffic, key=lambda d: (traffic[d], -mesh.DIMS.index(d))))', T("test_cluster", "test_placement", "test_placement_more"),
           "placement rule: ties broken against mesh.DIMS's order"),
]


def _line_of(text: str, m: Mutant) -> int:
    lines = [i for i, line in enumerate(text.splitlines()) if m.original in line]
    if len(lines) != 1 or text.count(m.original) != 1:
        raise SystemExit(f"{m.file}: {m.original!r} is on {len(lines)} lines (must be exactly one): fix MUTANTS")
    return lines[0] + 1


def _classify(rc: int, output: str, ran_out: bool) -> str:
    if rc == 0:
        return "SURVIVED"
    if ran_out or re.search(r"still (running|waiting) after|Timeout \(|Failed: Timeout", output):
        return "timeout"
    if rc == 1:
        return "assertion"
    return f"error (pytest exit {rc})"       # collection or usage error: look at it


def _run_tests(tests) -> tuple[str, float, str]:
    pyc = tempfile.TemporaryDirectory(prefix="pplab-mutate-pyc-")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PPLAB_LAUNCH_TIMEOUT": LAUNCH_TIMEOUT,
           # a fresh bytecode cache: a mutant of the same size written in the same second as the
           # original must not be served from the original's .pyc (or the other way round)
           "PYTHONPYCACHEPREFIX": pyc.name}
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", f"--timeout={TEST_TIMEOUT}",
           *tests]
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)      # its own group: its ranks end with it
    ran_out = False
    try:
        out, _ = proc.communicate(timeout=RUN_TIMEOUT)
    except subprocess.TimeoutExpired:
        ran_out, out = True, ""
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
        pyc.cleanup()
    tail = [line for line in (out or "").splitlines() if line.startswith(("FAILED", "ERROR"))][:1]
    return _classify(proc.returncode if not ran_out else 1, out or "", ran_out), time.monotonic() - start, \
        (tail[0] if tail else "")


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt


def main(argv):
    chosen = [int(a) for a in argv if a.isdigit()] or range(len(MUTANTS))
    for i in chosen:                                   # every mutant applies, before any is planted
        m = MUTANTS[i]
        _line_of((ROOT / m.file).read_text(), m)
    if "--list" in argv:
        for i in chosen:
            m = MUTANTS[i]
            print(f"{i:2} {m.file}:{_line_of((ROOT / m.file).read_text(), m)}  {m.what}")
        return 0
    files = sorted({MUTANTS[i].file for i in chosen})
    dirty = subprocess.run(["git", "status", "--porcelain", "--", *files], cwd=ROOT, capture_output=True,
                           text=True).stdout.strip()
    if dirty:
        raise SystemExit(f"uncommitted changes in files to mutate; commit or stash them first:\n{dirty}")
    signal.signal(signal.SIGTERM, _raise_interrupt)      # kill, and Ctrl-C even where SIGINT came in
    signal.signal(signal.SIGINT, signal.default_int_handler)  # ignored (nohup): the file goes back
    if "--no-baseline" not in argv:    # unmutated, the same tests must pass, or every mutant looks caught
        tests = sorted({t for i in chosen for t in MUTANTS[i].tests if t.endswith(".py")})
        verdict, seconds, first = _run_tests(tests)
        shown = "passed" if verdict == "SURVIVED" else verdict
        print(f"baseline   {shown:10} {seconds:6.0f} s  {' '.join(tests)}", flush=True)
        if verdict != "SURVIVED":
            raise SystemExit(f"the tests fail without any mutant: {first}")
    counts = {}
    for i in chosen:
        m = MUTANTS[i]
        path = ROOT / m.file
        original = path.read_bytes()
        line = _line_of(original.decode(), m)
        try:
            path.write_bytes(original.decode().replace(m.original, m.replacement).encode())
            verdict, seconds, first = _run_tests(m.tests)
        finally:
            path.write_bytes(original)                 # put it back, whatever happened
        counts[verdict] = counts.get(verdict, 0) + 1
        print(f"{i:2} {verdict:10} {seconds:6.0f} s  {m.file}:{line}  {m.what}" + (f"   [{first}]" if first else ""),
              flush=True)
    print(f"\n{len(chosen)} planted: " + ", ".join(f"{n} {v}" for v, n in sorted(counts.items())))
    return 1 if counts.get("SURVIVED") else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
