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
    # session 9, h1: ZeRO-3, ZeRO++, mixed precision, grad clip, offload
    Mutant("pplab/zero/fully_sharded.py", "out.div_(self.world_size)              # the sum over ranks -> the mean",
           "out.div_(max(self.world_size - 1, 1))  # the sum over ranks -> the mean", ZERO, "ZeRO-3: divide by p-1"),
    Mutant("pplab/zero/fully_sharded.py", "u.shard.grad = out if u.shard.grad is None else u.shard.grad.add_(out)",
           "u.shard.grad = out", ZERO, "ZeRO-3: a second backward overwrites the first's gradient"),
    Mutant("pplab/zero/fully_sharded.py", "nxt = self._neighbour(u, +1)", "nxt = self._neighbour(u, -1)", ZERO,
           "ZeRO-3 forward: prefetch the unit before, not the next"),
    Mutant("pplab/zero/fully_sharded.py", "prev = self._neighbour(u, -1)", "prev = self._neighbour(u, +1)", ZERO,
           "ZeRO-3 backward: prefetch the unit after, not the one backward reaches next"),
    Mutant("pplab/zero/fully_sharded.py", "return self.layers[i] if 0 <= i < len(self.layers) else None",
           "return self.layers[i] if 0 < i < len(self.layers) else None", ZERO,
           "ZeRO-3: the first layer is never prefetched"),
    Mutant("pplab/zero/fully_sharded.py", "self.reduce_dtype = reduce_dtype or self.units[0].full.dtype",
           "self.reduce_dtype = self.units[0].full.dtype", T("test_zero", "test_mixed_precision"),
           "ZeRO-3: reduce_dtype ignored (gradients summed in the compute dtype)"),
    Mutant("pplab/zero/fully_sharded.py", "if self.compute_dtype is None:", "if True:", T("test_zero", "test_mixed_precision"),
           "ZeRO-3 checkpoint: bf16-rounded weights instead of the fp32 masters"),
    Mutant("pplab/zero/fully_sharded.py", "for t in [p for p in module.parameters() if not p.requires_grad] + list(module.buffers()):",
           "for t in list(module.buffers()):", T("test_zero", "test_mixed_precision"),
           "ZeRO-3 mixed precision: frozen parameters not cast to the compute dtype"),
    Mutant("pplab/zero/plusplus.py", "by_local = input.reshape(n, r, s).transpose(0, 1).reshape(r, n * s)",
           "by_local = input.reshape(r, n * s)", T("test_zero_plus_plus", "test_zero_plus_plus_more"),
           "qgZ: pieces sent to the wrong local ranks (no reordering)"),
    Mutant("pplab/zero/plusplus.py", "self.local = dist.get_rank() % cluster.ranks_per_node",
           "self.local = dist.get_rank() // cluster.ranks_per_node", T("test_zero_plus_plus", "test_zero_plus_plus_more"),
           "hpZ: the node index used as the local rank (the wrong secondary slice)"),
    Mutant("pplab/zero/plusplus.py", "return u[0::2] | (u[1::2] << 4)", "return u[1::2] | (u[0::2] << 4)",
           T("test_zero_plus_plus", "test_zero_plus_plus_more"), "int4 packing: nibbles swapped"),
    Mutant("pplab/zero/plusplus.py", "payload = (math.ceil(s / 2) if grad_bits == 4 else s) + scales",
           "payload = (s // 2 if grad_bits == 4 else s) + scales", T("test_zero_plus_plus", "test_zero_plus_plus_more"),
           "cross-node formula: an odd shard's last int4 byte dropped"),
    Mutant("pplab/zero/plusplus.py", "self._masters = True", "self._masters = False",
           T("test_zero_plus_plus", "test_zero_plus_plus_more"), "ZeRO++ checkpoint: the int8-rounded weights saved"),
    Mutant("pplab/zero/plusplus.py", "payload = u.shard.numel() + SCALE_BYTES * math.ceil(u.shard.numel() / self.block)",
           "payload = u.shard.numel() + SCALE_BYTES * (u.shard.numel() // self.block)",
           T("test_zero_plus_plus", "test_zero_plus_plus_more"), "qwZ box: the short last block's scale not counted"),
    Mutant("pplab/mixed_precision.py", "if self.good_steps == self.growth_interval:",
           "if self.good_steps > self.growth_interval:", T("test_mixed_precision"), "loss scale grows one step late"),
    Mutant("pplab/mixed_precision.py", "handle = comm.all_reduce(flag, op=\"max\", group=self.group, async_op=True)",
           "handle = comm.all_reduce(flag, op=\"min\", group=self.group, async_op=True)", T("test_mixed_precision"),
           "overflow flag: min over ranks (one rank's inf skips no one)"),
    Mutant("pplab/mixed_precision.py", "if dist.is_initialized() and comm.world_size(self.group) > 1:",
           "if dist.is_initialized() and comm.world_size(self.group) > 2:", T("test_mixed_precision"),
           "overflow flag: not agreed on two ranks"),
    Mutant("pplab/mixed_precision.py", "return per_pass * (reduce_bytes + 2 * compute_bytes)",
           "return per_pass * (2 * reduce_bytes + compute_bytes)", T("test_mixed_precision"),
           "fsdp traffic: two reduce-scatters and one all-gather"),
    Mutant("pplab/mixed_precision.py", "p.copy_(m)                                                 # rounded",
           "m.copy_(p)                                                 # rounded", T("test_mixed_precision"),
           "master weights: the master overwritten by the model (the step lost)"),
    Mutant("pplab/mixed_precision.py", "per_pass = (n - 1) / n * psi", "per_pass = (n - 1) / n * psi * n / (n - 1)",
           T("test_mixed_precision"), "traffic: the ring's (n-1)/n dropped"),
    Mutant("pplab/grad_clip.py", "coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)",
           "coef = max_norm / (total + 1e-6)", T("test_grad_clip"), "clip: small gradients scaled up to max_norm"),
    Mutant("pplab/grad_clip.py", "if g.numel() and (id(p) in split or first_tp_rank)]",
           "if g.numel()]", T("test_grad_clip"), "norm: replicated parameters counted once per tp rank"),
    Mutant("pplab/grad_clip.py", "split |= {id(m.weight)} | ({id(m.bias)} if m.bias is not None else set())",
           "split |= {id(m.weight)}", T("test_grad_clip"), "norm: a column-parallel bias counted on tp rank 0 only"),
    Mutant("pplab/grad_clip.py", "for group in (tp_group, pp_group, zero_group):",
           "for group in (tp_group, pp_group):", T("test_grad_clip"), "norm: ZeRO shards not summed over dp"),
    Mutant("pplab/grad_clip.py", "comm.all_reduce(total, op=\"max\" if norm_type == math.inf else \"sum\", group=group)",
           "comm.all_reduce(total, op=\"sum\", group=group)", T("test_grad_clip"), "inf-norm: summed over ranks"),
    Mutant("pplab/grad_clip.py", "return total if norm_type == math.inf else total.pow(1.0 / norm_type)",
           "return total if norm_type == math.inf else total.pow(0.5)", T("test_grad_clip"),
           "norm: square root whatever p"),
    Mutant("pplab/grad_clip.py", "lo = bucket.rank * bucket.shard_size", "lo = bucket.rank * bucket.shard_size + 1",
           T("test_grad_clip"), "ZeRO norm: my shard's first element left out"),
    Mutant("pplab/offload.py", "return (3 * param_bytes + state_bytes) * psi / n, (param_bytes + state_bytes) * psi / n",
           "return (2 * param_bytes + state_bytes) * psi / n, (param_bytes + state_bytes) * psi / n", T("test_offload"),
           "param offload formula: the shard read twice, not three times"),
    Mutant("pplab/offload.py", "return state_bytes * psi / n", "return state_bytes * psi", T("test_offload"),
           "disk bytes: not divided by N"),
    Mutant("pplab/offload.py", "return files * self.write_latency + nbytes / self.write_bandwidth",
           "return self.write_latency + nbytes / self.write_bandwidth", T("test_offload"),
           "disk fit: one write latency whatever the number of files"),
    Mutant("pplab/offload.py", "return max(0.0, my - slope * mx), 1.0 / slope", "return max(0.0, my + slope * mx), 1.0 / slope",
           T("test_offload"), "disk fit: intercept on the wrong side"),
    Mutant("pplab/offload.py", "self.bytes_read, self.bytes_written = self._moved[\"disk_read\"], self._moved[\"disk_write\"]",
           "self.bytes_written, self.bytes_read = self._moved[\"disk_read\"], self._moved[\"disk_write\"]",
           T("test_offload"), "disk bytes: read and written swapped"),
    Mutant("pplab/offload.py", "self._moved = before", "self._moved = self._moved", T("test_offload"),
           "disk bytes: a checkpoint's moves counted in the step"),
    Mutant("pplab/offload.py", "if ahead is not None and self.disk.prefetch:", "if ahead is not None:", T("test_offload"),
           "shards on disk: prefetch=False still reads ahead"),
    Mutant("pplab/offload.py", "if u.index in self.reading or not parked(shard):", "if u.index in self.reading:",
           T("test_offload"), "shards on disk: a shard in RAM read again over its newer values"),
    Mutant("pplab/offload.py", "st.update({k: v for k, v in loaded.items() if k != \"param\"})", "st.update(loaded)",
           T("test_offload"), "optimizer on disk: the parameter read back installed as optimizer state"),
    Mutant("pplab/zero/fully_sharded.py",
           "for name, t in list(self.module.named_parameters()) + list(self.module.named_buffers()):",
           "for name, t in list(self.module.named_buffers()):", T("test_zero", "test_mixed_precision"),
           "ZeRO-3 load_state_dict: frozen parameters not loaded"),
    Mutant("pplab/mixed_precision.py", "mine = any(not bool(torch.isfinite(g).all()) for g in grads)",
           "mine = any(bool(torch.isinf(g).any()) for g in grads)", T("test_mixed_precision"),
           "overflow check: a NaN gradient not seen"),
    Mutant("pplab/mixed_precision.py", "if not 0 <= index < param.numel():", "if not 0 <= index <= param.numel():",
           T("test_mixed_precision"), "poison_gradient: an index one past the end accepted"),
    Mutant("pplab/zero/plusplus.py", "scales = blocks.abs().amax(dim=1) / qmax", "scales = blocks.amax(dim=1) / qmax",
           T("test_zero_plus_plus", "test_zero_plus_plus_more"), "quantize: scale from the largest, not the largest |x|"),
    Mutant("pplab/grad_clip.py", "local = max((g.abs().max() for g in counted), default=zero)",
           "local = max((g.max() for g in counted), default=zero)", T("test_grad_clip"),
           "inf-norm: the largest gradient, not the largest |gradient|"),
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
