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
    # session 9, h2: pipeline schedules beyond 1F1B, simulator, recompute
    Mutant("pplab/pipeline/looped.py", "for c in reversed(range(v)) for i in reversed(range(m))]",
           "for c in reversed(range(v)) for i in range(m)]", T("test_pipeline_looped"),
           "looped BFS: backwards in forward order"),
    Mutant("pplab/pipeline/looped.py", "warmup = min((v - 1) * g + (p - 1 - r), len(order))",
           "warmup = min(v * g + (p - 1 - r), len(order))", T("test_pipeline_looped"),
           "interleaved zero bubble: one round of warm-up too many"),
    Mutant("pplab/pipeline/looped.py", "if j >= r:", "if j > r:", T("test_pipeline_looped"),
           "interleaved zero bubble: one W too many put off to the cool-down"),
    Mutant("pplab/pipeline/bidirectional.py", "first = 0 if r < p // 2 else 1", "first = 0 if r <= p // 2 else 1",
           T("test_pipeline_bidirectional"), "DualPipe: the middle rank starts in the wrong direction"),
    Mutant("pplab/pipeline/bidirectional.py", "picks[r] = min(runnable, key=lambda a: (a[0] != \"B\", -a[2], a[3]))",
           "picks[r] = min(runnable, key=lambda a: (a[0] != \"B\", a[2], a[3]))", T("test_pipeline_bidirectional"),
           "Chimera: the shallowest piece first"),
    Mutant("pplab/pipeline/bidirectional.py", "\"DualPipe\": ((pp // 2 - 1) * (FB + B - 3 * W), 2, pp + 1)}",
           "\"DualPipe\": ((pp // 2 - 1) * (FB + B - 2 * W), 2, pp + 1)}", T("test_pipeline_bidirectional"),
           "DualPipe table: the bubble's W term"),
    Mutant("pplab/pipeline/bidirectional.py", "return (p - 2) / (2 * m + p - 2)", "return (p - 2) / (2 * m + p)",
           T("test_pipeline_bidirectional"), "Chimera bubble ratio: denominator off by the bubble"),
    Mutant("pplab/pipeline/asynchronous.py", "return max(0, microbatch - (num_stages - 1 - stage))",
           "return max(0, microbatch - (num_stages - stage))", T("test_pipeline_asynchronous"),
           "PipeDream: staleness one update too many"),
    Mutant("pplab/pipeline/asynchronous.py", "return max(0, microbatch // batch_size - 1)",
           "return max(0, microbatch // batch_size)", T("test_pipeline_asynchronous"),
           "2BW: the current version, not the one before"),
    Mutant("pplab/pipeline/asynchronous.py", "self.n = len(self.xs[0]) * self.m",
           "self.n = len(self.xs[0])", T("test_pipeline_asynchronous"),
           "2BW: the batch's gradients summed, not averaged"),
    Mutant("pplab/pipeline/asynchronous.py", "return sum(max(0.0, boxes[k + 1].start - boxes[k].end) for k in range(first_b, last_f))",
           "return sum(max(0.0, boxes[k + 1].start - boxes[k].end) for k in range(first_b + 1, last_f))",
           T("test_pipeline_asynchronous"), "idle after warm-up: the gap after the first backward left out"),
    Mutant("pplab/pipeline/asynchronous.py", "return num_stages - stage if method == \"pipedream\" else 2",
           "return num_stages - stage - 1 if method == \"pipedream\" else 2", T("test_pipeline_asynchronous"),
           "PipeDream: versions held, the newest not counted"),
    Mutant("pplab/pipeline/simulate.py", "return ((p - 1) + (v - 1) * max(0, p - m)) / (v * m)",
           "return ((p - 1) + v * max(0, p - m)) / (v * m)", T("test_pipeline_looped", "test_pipeline_schedules"),
           "bubble fraction: one turn too many when m < p"),
    Mutant("pplab/pipeline/simulate.py", "return 0.0 if src == dst else latency if isinstance(latency, Real) else latency[src][dst]",
           "return 0.0 if src == dst else latency if isinstance(latency, Real) else latency[dst][src]",
           T("test_pipeline_validate_once", "test_pipeline_schedules", "test_placement"),
           "per-hop latency: the matrix read [dst][src]"),
    Mutant("pplab/pipeline/simulate.py", "t = max(t, finished[first + b.microbatch] + hop)",
           "t = max(t, finished[first + b.microbatch])", T("test_pipeline_validate_once", "test_pipeline_bidirectional"),
           "F&B pair: the B's input arrives without its hop's latency"),
    Mutant("pplab/pipeline/simulate.py", "w = [x / 2 for x in b] if t_w is None else _per_stage(t_w, \"t_w\", schedule)",
           "w = [x / 3 for x in b] if t_w is None else _per_stage(t_w, \"t_w\", schedule)",
           T("test_pipeline_schedules", "test_pipeline_looped", "test_pipeline_bidirectional"),
           "default t_w: a third of t_b, not half"),
    Mutant("pplab/pipeline/simulate.py", "_HOLD = {\"F\": +1, \"B\": -1, \"I\": 0, \"W\": -1}",
           "_HOLD = {\"F\": +1, \"B\": -1, \"I\": -1, \"W\": 0}",
           T("test_pipeline_schedules", "test_pipeline_looped", "test_pipeline_bidirectional"),
           "activations freed at I, not at W"),
    Mutant("pplab/pipeline/simulate.py", "return schedule.replicas / schedule.chunks", "return 1 / schedule.chunks",
           T("test_pipeline_schedules", "test_pipeline_bidirectional"), "two replicas: a stage counted as half a share"),
    Mutant("pplab/pipeline/simulate.py", "if F == once and list(map(add, B, I)) == once and I == W:",
           "if F == once and list(map(add, B, I)) == once:", T("test_pipeline_schedules", "test_pipeline_validate_once"),
           "validate: a missing W passes the quick check"),
    Mutant("pplab/pipeline/partition.py", "if cost <= best[j][i]:", "if cost < best[j][i]:",
           T("test_pipeline_partition", "test_pipeline_executor"), "linear partition: the earlier cut wins ties"),
    Mutant("pplab/pipeline/partition.py", "for rnd in range(repeats + 1):", "for rnd in range(repeats):",
           T("test_pipeline_partition"), "layer times: one round fewer than asked (the warm-up eats one)"),
    Mutant("pplab/pipeline/partition.py", "for c in range(j - 1, i):", "for c in range(j, i):",
           T("test_pipeline_partition", "test_pipeline_executor"), "linear partition: the first stage never one layer"),
    Mutant("pplab/pipeline/torch_csv.py", "else 1 + max(a[1] for acts in found for a in acts)",
           "else max(a[1] for acts in found for a in acts)",
           T("test_pipeline_looped"), "CSV import: one micro-batch short"),
    Mutant("pplab/pipeline/actions.py", "nxt = self.stage_to_rank[stage + 1] if (stage + 1) % d else None",
           "nxt = self.stage_to_rank[stage + 1] if stage + 1 < self.num_stages else None",
           T("test_pipeline_bidirectional", "test_pipeline_executor"), "two replicas: replica 0's last stage sends on"),
    Mutant("pplab/pipeline/actions.py", "return range(replica * m // k, (replica + 1) * m // k)",
           "return range(replica * m // k, (replica + 1) * m // k - 1)", T("test_pipeline_bidirectional"),
           "two replicas: each copy's last micro-batch left out"),
    Mutant("pplab/recompute.py", "stats = 0 if policy == \"full\" else 2 * 2 * element_bytes * tokens",
           "stats = 0 if policy == \"full\" else 2 * element_bytes * tokens", T("test_recompute"),
           "saved bytes: one LayerNorm's statistics left out"),
    Mutant("pplab/recompute.py", "tokens = s * b // (t if sequence_parallel and t > 1 else 1)", "tokens = s * b // t",
           T("test_recompute"), "saved bytes: LayerNorm statistics split over t without sequence parallelism"),
    Mutant("pplab/recompute.py", "return min(range(1, n_blocks + 1), key=lambda k: (math.ceil(n_blocks / k) * kept + k * held, k))",
           "return min(range(1, n_blocks + 1), key=lambda k: ((n_blocks // k) * kept + k * held, k))", T("test_recompute"),
           "best every: a shorter last group not counted"),
    Mutant("pplab/recompute.py", "cut = e.start + (e.end - e.start) * t_r / (rest + t_r)",
           "cut = e.start + (e.end - e.start) * t_r / rest", T("test_recompute"),
           "simulated recomputation: the R box too long"),
    Mutant("pplab/recompute.py", "rest = t_b if e.kind == \"B\" else t_b - t_w", "rest = t_b", T("test_recompute"),
           "simulated recomputation: an I box cut as if it were a whole B"),
    Mutant("pplab/recompute.py", "sim = simulate(schedule, t_f, t_b + t_r, t_w=t_w)", "sim = simulate(schedule, t_f, t_b + t_r)",
           T("test_recompute"), "simulated recomputation: W given half the recomputation too"),
    Mutant("pplab/recompute.py", "if len(group) < every:", "if len(group) <= every:", T("test_recompute"),
           "every=k: groups of k+1 blocks"),
    Mutant("pplab/recompute.py", "if calls[0] == 1:", "if calls[0] == 0:", T("test_recompute"),
           "recompute trace: the first forward drawn as a recomputation"),
    Mutant("pplab/pipeline/looped.py", "rounds = max(1, m // p)", "rounds = max(1, m // (p + 1))",
           T("test_pipeline_looped"), "interleaved zero bubble: rounds of the wrong size"),
    Mutant("pplab/pipeline/asynchronous.py", "if (i + 1) % self.m == 0:", "if i % self.m == 0:",
           T("test_pipeline_asynchronous"), "2BW: the update at a batch's first micro-batch, not its last"),
    Mutant("pplab/pipeline/simulate.py", "utilization=sum(busy) / (p * makespan) if makespan > 0 else 0.0,",
           "utilization=sum(busy) / ((p - 1) * makespan) if makespan > 0 else 0.0,",
           T("test_pipeline_schedules", "test_pipeline_validate_once"), "utilization: one rank too few"),
    Mutant("pplab/pipeline/torch_csv.py", "return [pair[0][:3] + (True,), pair[1]]", "return [pair[0][:3] + (False,), pair[1]]",
           T("test_pipeline_looped"), "CSV import: an F&B pair read as two plain actions"),
    Mutant("pplab/pipeline/torch_csv.py", "first, last = 0 in mine, schedule.num_stages - 1 in mine",
           "first, last = 0 in mine, schedule.num_stages in mine", T("test_pipeline_looped"),
           "torch runtime: the last stage never given the targets"),
    Mutant("pplab/pipeline/simulate.py", "steps.append((s if a.kind == \"F\" else e, held * share if share != 1 else held, a))",
           "steps.append((s, held * share if share != 1 else held, a))", T("test_pipeline_validate_once", "test_pipeline_schedules"),
           "activations held: freed when the backward starts, not when it ends"),
    Mutant("pplab/pipeline/actions.py", "prev = self.stage_to_rank[stage - 1] if stage % d > 0 else None",
           "prev = self.stage_to_rank[stage - 1] if stage > 0 else None", T("test_pipeline_bidirectional", "test_pipeline_executor"),
           "two replicas: replica 1's first stage waits for replica 0's last"),
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
