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


def CHK(exercise, wrong):
    """tests/test_checks.py's cases of one exercise: its right answer (solutions/), and the wrong
    answers (tests/wrong_solutions*.py) whose names match the pytest -k expression `wrong`."""
    return ("tests/test_checks.py", "-k", f"passes and {exercise} or wrong_answer and ({wrong})")


RINGS = CHK("(reduce_scatter or ring_all_reduce)", "all_reduce_ or reduce_scatter_")

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
    # session 9, h3: 2.5D/3D TP, hybrid, mesh, rng, DP extras
    Mutant("pplab/data_parallel/noise_scale.py", "g_sq = (b_big * mean_big - b_small * mean_small) / (b_big - b_small)",
           "g_sq = (b_big * mean_big - b_small * mean_small) / (b_big + b_small)", T("test_noise_scale"),
           "noise scale: |G|² divided by the sum of the batch sizes"),
    Mutant("pplab/data_parallel/noise_scale.py", "(1 / b_small - 1 / b_big)", "(1 / b_small + 1 / b_big)",
           T("test_noise_scale"), "noise scale: tr(Σ) over the sum of 1/b"),
    Mutant("pplab/data_parallel/noise_scale.py", "if b_big <= b_small:", "if b_big < b_small:", T("test_noise_scale"),
           "noise scale: equal batch sizes let through (division by zero)"),
    Mutant("pplab/tensor_parallel/tp25d.py", "row = grid.k * grid.q + grid.i", "row = grid.i * grid.d + grid.k",
           T("test_tensor_parallel_25d_3d"), "2.5D: batch rows dealt layer-minor"),
    Mutant("pplab/tensor_parallel/tp25d.py", "bwd = 2 * (q - 1) * (x + w) + 2 * (d - 1) / d * w",
           "bwd = 2 * (q - 1) * (x + w) + 2 * (d - 1) * w", T("test_tensor_parallel_25d_3d"),
           "2.5D bytes: depth all-reduce without / d"),
    Mutant("pplab/tensor_parallel/tp25d.py", "fwd = (q - 1) * (x + w)", "fwd = q * (x + w)",
           T("test_tensor_parallel_25d_3d"), "2.5D bytes: forward counts the root's own block"),
    Mutant("pplab/tensor_parallel/tp25d.py", "\"saved\": B * c_in / (d * q * q)", "\"saved\": B * c_in / (q * q)",
           T("test_tensor_parallel_25d_3d"), "2.5D memory: saved input not split over the depth"),
    Mutant("pplab/tensor_parallel/tp25d.py", "w = copy_to_parallel(self.weight, g.depth_group)", "w = self.weight",
           T("test_tensor_parallel_25d_3d"), "2.5D: dW not summed over the layers"),
    Mutant("pplab/tensor_parallel/tp25d.py", "m.weight.copy_(wt[grid.i * r:(grid.i + 1) * r, grid.j * c:(grid.j + 1) * c])",
           "m.weight.copy_(wt[grid.j * r:(grid.j + 1) * r, grid.i * c:(grid.i + 1) * c])",
           T("test_tensor_parallel_25d_3d"), "2.5D: weight block (j, i) instead of (i, j)"),
    Mutant("pplab/tensor_parallel/tp3d.py", "return _piece(y, q * q, cube.i * q + cube.l, q, cube.j)",
           "return _piece(y, q * q, cube.i * q + cube.j, q, cube.l)", T("test_tensor_parallel_25d_3d"),
           "3D: output laid out like the input"),
    Mutant("pplab/tensor_parallel/tp3d.py", "dx = _reduce_scatter_rows(dy_ij @ w_lj.T, c.group_j, c.q)",
           "dx = _reduce_scatter_rows(dy_ij @ w_lj.T, c.group_i, c.q)", T("test_tensor_parallel_25d_3d"),
           "3D backward: dX summed over i instead of j"),
    Mutant("pplab/tensor_parallel/tp3d.py", "dw = _reduce_scatter_rows(x_il.T @ dy_ij, c.group_i, c.q)",
           "dw = _reduce_scatter_rows(x_il.T @ dy_ij, c.group_j, c.q)", T("test_tensor_parallel_25d_3d"),
           "3D backward: dW summed over j instead of i"),
    Mutant("pplab/tensor_parallel/tp3d.py", "each = (q - 1) * (B * c_in + c_in * c_out + B * c_out) / q ** 3",
           "each = (q - 1) * (B * c_in + c_in * c_out + B * c_out) / q ** 2", T("test_tensor_parallel_25d_3d"),
           "3D bytes: / q² instead of / q³"),
    Mutant("pplab/tensor_parallel/tp3d.py", "\"saved\": (B * c_in + c_in * c_out) / q ** 2",
           "\"saved\": (B * c_in + c_in * c_out) / q ** 3", T("test_tensor_parallel_25d_3d"),
           "3D memory: gathered blocks counted as pieces"),
    Mutant("pplab/tensor_parallel/tp3d.py", "return {\"forward\": 0.0, \"backward\": 2 * (p - 1) / p * B * c_in * element_size}",
           "return {\"forward\": 0.0, \"backward\": 2 * (p - 1) / p * B * c_out * element_size}",
           T("test_tensor_parallel_25d_3d"), "1D bytes: dY's size instead of dX's"),
    Mutant("pplab/tensor_parallel/tp3d.py", "b = tp25d_bytes(B, c_in, c_out, math.sqrt(p / depth), depth, element_size)",
           "b = tp25d_bytes(B, c_in, c_out, math.sqrt(p), depth, element_size)", T("test_tensor_parallel_25d_3d"),
           "2.5D curve: q taken as sqrt(p), not sqrt(p/d)"),
    Mutant("pplab/tensor_parallel/tp3d.py", "left, right = (mid, right) if diff(left) * diff(mid) > 0 else (left, mid)",
           "left, right = (left, mid) if diff(left) * diff(mid) > 0 else (mid, right)", T("test_tensor_parallel_25d_3d"),
           "crossovers: bisection keeps the wrong half"),
    Mutant("pplab/hybrid.py", "losses.append(total.item() / dp)", "losses.append(total.item())", T("test_hybrid"),
           "hybrid: reported loss not divided by dp"),
    Mutant("pplab/hybrid.py", "mine = loss if loss is not None and mesh.rank_in(\"tp\") == 0 else 0.0",
           "mine = loss if loss is not None else 0.0", T("test_hybrid"), "hybrid: loss summed over the tp ranks too"),
    Mutant("pplab/hybrid.py", "if pp > 1 and batch_size // dp < microbatches:", "if pp > 1 and batch_size // dp <= microbatches:",
           T("test_hybrid"), "check_layout: one micro-batch per sequence refused"),
    Mutant("pplab/hybrid.py", "if zero == 0 and dp > 1:               # once", "if zero == 0 and dp > 2:               # once",
           T("test_hybrid"), "hybrid pp>1: dp=2 gradients never all-reduced"),
    Mutant("pplab/hybrid.py", "if world_size % (pp * tp) == 0 and (pp_max is None or pp <= pp_max):",
           "if world_size % (pp * tp) == 0 and (pp_max is None or pp < pp_max):", T("test_hybrid"),
           "layouts: pp = pp_max left out"),
    Mutant("pplab/hybrid.py", "return {\"TP\": over(\"tp\"), \"PP\": lambda e: e.kind in (\"send\", \"recv\"), \"DP\": over(\"dp\")}",
           "return {\"TP\": over(\"tp\"), \"PP\": lambda e: e.kind in (\"send\", \"recv\"), \"DP\": over(\"pp\")}",
           T("test_hybrid"), "comm_rows: DP row reads the pp groups"),
    Mutant("pplab/mesh.py", "return numbered.permute(*[order.index(d) for d in DIMS])",
           "return numbered.permute(*[DIMS.index(d) for d in order])", T("test_mesh"),
           "grid: the inverse permutation (the same for a swap of two dims)"),
    Mutant("pplab/mesh.py", "return g.permute(*rest, *axes).reshape(-1, size).tolist()",
           "return g.permute(*axes, *rest).reshape(-1, size).tolist()", T("test_mesh"),
           "groups: axes and the rest swapped"),
    Mutant("pplab/mesh.py", "return self.ranks(\"pp\")[i - 1] if i > 0 else None",
           "return self.ranks(\"pp\")[i - 1] if i >= 0 else None", T("test_mesh"),
           "pp_prev: the first stage's previous is the last"),
    Mutant("pplab/mesh.py", "used = [d for d in self.order if self.sizes[d] > 1] or [\"dp\"]",
           "used = [d for d in DIMS if self.sizes[d] > 1] or [\"dp\"]", T("test_mesh"),
           "device_mesh: dims named in the default order, not the mesh's"),
    Mutant("pplab/rng.py", "return {\"default\": default, MODEL_PARALLEL: default + TP_OFFSET + tp_rank}",
           "return {\"default\": default, MODEL_PARALLEL: default + TP_OFFSET}", T("test_rng"),
           "seeds: every tp rank's model-parallel seed the same"),
    Mutant("pplab/rng.py", "default = seed + 100 * pp_rank + 10_000 * dp_rank", "default = seed + 100 * pp_rank",
           T("test_rng"), "seeds: every replica's default seed the same"),
    Mutant("pplab/rng.py", "self.states[name] = _get_state(self.device)", "pass",
           T("test_rng"), "fork: the generator never advances (every fork draws the same mask)"),
    Mutant("pplab/rng.py", "return torch.empty(shape, dtype=dtype, device=device).bernoulli_(1 - p)",
           "return torch.empty(shape, dtype=dtype, device=device).bernoulli_(p)", T("test_rng"),
           "dropout_mask: keeps with probability p"),
    Mutant("pplab/rng.py", "return x * dropout_mask(x.shape, p, x.dtype, x.device) / (1 - p)",
           "return x * dropout_mask(x.shape, p, x.dtype, x.device)", T("test_rng"), "dropout: not rescaled by 1/(1-p)"),
    Mutant("pplab/rng.py", "self.set_states(started)", "self.set_states(now)", T("test_rng"),
           "replay: recompute does not rewind the tracker"),
    Mutant("pplab/rng.py", "with self._fork() if self.sp else contextlib.nullcontext():",
           "with self._fork() if not self.sp else contextlib.nullcontext():", T("test_rng"),
           "RankDropout.outside: tracker used exactly when it should not be"),
    Mutant("pplab/rng.py", "comm.all_reduce(q.grad, group=mesh.dp_group)", "pass", T("test_rng"),
           "rng.train: replicas' gradients not summed"),
    Mutant("pplab/data_parallel/compression.py", "return min(d, max(1, round(self.ratio * d)))",
           "return min(d, max(1, int(self.ratio * d)))", T("test_compression"), "TopK: k rounded down"),
    Mutant("pplab/data_parallel/compression.py", "idx = a.abs().topk(self.k(a.numel()), sorted=False).indices.to(torch.int32)",
           "idx = a.topk(self.k(a.numel()), sorted=False).indices.to(torch.int32)", T("test_compression"),
           "TopK: largest values, not largest magnitudes"),
    Mutant("pplab/data_parallel/compression.py", "self.memory = _unflatten(a - sent, grads)",
           "self.memory = _unflatten(sent - a, grads)", T("test_compression"), "error feedback: residual's sign flipped"),
    Mutant("pplab/data_parallel/compression.py", "bits = (x.reshape(-1) >= 0).to(torch.uint8)",
           "bits = (x.reshape(-1) > 0).to(torch.uint8)", T("test_compression"), "pack_signs: zero sent as -"),
    Mutant("pplab/data_parallel/compression.py", "scales = torch.stack([part.abs().mean() for part in a.split(sizes)])",
           "scales = torch.stack([part.abs().sum() for part in a.split(sizes)])", T("test_compression"),
           "SignSGD: scale is the sum of |g|, not the mean"),
    Mutant("pplab/data_parallel/compression.py", "return t.div_(comm.world_size())", "return t", T("test_compression"),
           "_average: sum, not mean"),
    Mutant("pplab/data_parallel/compression.py", "P = [torch.linalg.qr(p).Q for p in P]", "P = P",
           T("test_compression"), "PowerSGD: P not orthogonalised"),
    Mutant("pplab/data_parallel/compression.py", "self.memory[i] = (m - approx).view_as(grads[i])",
           "self.memory[i] = m.view_as(grads[i])", T("test_compression"), "PowerSGD: memory keeps all of g + e"),
    Mutant("pplab/data_parallel/overlap.py", "under = _union_length([(a.start, min(a.end, b.end)) for a in mine if a.start < b.end])",
           "under = _union_length([(a.start, max(a.end, b.end)) for a in mine if a.start < b.end])", T("test_overlap"),
           "overlap: hidden time not clipped at the end of backward"),
    Mutant("pplab/data_parallel/overlap.py", "max([0.0] + [a.end - b.end for a in mine]), len(mine),",
           "max([0.0] + [a.end - b.start for a in mine]), len(mine),", T("test_overlap"),
           "overlap: exposed time from the start of backward"),
    Mutant("pplab/data_parallel/overlap.py", "mine = [a for a in ars if a.start >= b.start and (nxt is None or a.start < nxt.start)]",
           "mine = [a for a in ars if a.start >= b.start and (nxt is None or a.start < nxt.end)]", T("test_overlap"),
           "overlap: the next step's early all-reduces counted in this one"),
    Mutant("pplab/data_parallel/overlap.py", "busy_until[kind] = busy_until.get(kind, now()) + pad[kind]",
           "busy_until[kind] = now() + pad[kind]", T("test_overlap"),
           "stand-in compute: layers not queued back to back"),
    Mutant("pplab/data_parallel/overlap.py", "if round_ >= warmup:", "if round_ > warmup:", T("test_overlap"),
           "steps_in_turn: one step too few kept"),
    Mutant("pplab/data_parallel/overlap.py", "start = min(r[name][k][0] for r in results)",
           "start = max(r[name][k][0] for r in results)", T("test_overlap"), "measured_steps: from the last rank's start"),
    Mutant("pplab/data_parallel/parameter_server.py", "avg = sum(weight[i] * g for i, g in enumerate(grads))",
           "avg = sum(grads) / len(grads)", T("test_parameter_server"),
           "sync PS: uneven shards weighted equally"),
    Mutant("pplab/data_parallel/parameter_server.py", "sending.append(comm.isend(history[max(0, u - staleness)], worker(u)))",
           "sending.append(comm.isend(history[max(0, u - staleness - 1)], worker(u)))", T("test_parameter_server"),
           "async PS: one version staler than asked"),
    Mutant("pplab/data_parallel/parameter_server.py", "history.append(history[-1] - lr * W * weight[worker(u) - 1] * g)",
           "history.append(history[-1] - lr * weight[worker(u) - 1] * g)", T("test_parameter_server"),
           "async PS: gradient not scaled by W"),
    Mutant("pplab/data_parallel/parameter_server.py", "if len(X) < workers:", "if len(X) <= workers:",
           T("test_parameter_server"), "shards: one sample per worker refused"),
    Mutant("pplab/data_parallel/parameter_server.py", "return W, parts, model, flat_params(model), [len(X) / N for X, _ in parts]",
           "return W, parts, model, flat_params(model), [1 / W for X, _ in parts]", T("test_parameter_server"),
           "PS weights: 1/W instead of n_w/N"),
    Mutant("pplab/rng.py", "summed_over = [mesh.dp_group] + ([mesh.tp_group] if sequence_parallel else [])",
           "summed_over = [mesh.dp_group]", T("test_rng"), "rng.train: under SP the loss of my tokens only"),
    Mutant("pplab/data_parallel/compression.py", "x, y = X.tensor_split(p)[rank], Y.tensor_split(p)[rank]",
           "x, y = X.tensor_split(p)[0], Y.tensor_split(p)[0]", T("test_compression"),
           "train_with: every rank trains on rank 0's samples"),
    Mutant("pplab/hybrid.py", "if pp > 1 and batch_size // dp < microbatches:", "if pp > 1 and batch_size < microbatches:",
           T("test_hybrid"), "check_layout: micro-batches compared with the global batch, not the replica's"),
    Mutant("pplab/data_parallel/noise_scale.py", "mean_small, mean_big = sum(small) / len(small), sum(big) / len(big)",
           "mean_small, mean_big = sum(small) / len(big), sum(big) / len(small)", T("test_noise_scale"),
           "noise scale: means over the other list's number of draws"),
    Mutant("pplab/tensor_parallel/tp3d.py", "return _piece(w, q * q, cube.l * q + cube.i, q, cube.j)",
           "return _piece(w, q * q, cube.i * q + cube.l, q, cube.j)", T("test_tensor_parallel_25d_3d"),
           "3D: weight rows dealt i-major instead of l-major"),
    Mutant("pplab/hybrid.py", "shard(data.batch(batch_size, cfg.seq, step, seed), mesh.rank_in(\"dp\"), dp)",
           "shard(data.batch(batch_size, cfg.seq, step, seed), mesh.rank_in(\"tp\"), dp)", T("test_hybrid"),
           "hybrid: the batch sharded by the tp index"),
    Mutant("pplab/data_parallel/overlap.py", "return statistics.median(values), min(values), max(values)",
           "return statistics.mean(values), min(values), max(values)", T("test_overlap"),
           "median_and_range: the mean, which one slow repeat drags"),
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
    # checks/collectives.py, data_parallel.py, zero.py, tensor_parallel.py, pipeline.py: the graders.
    # A survivor here is a checker that accepts a wrong answer: tests/test_checks.py runs each
    # exercise's right answer (solutions/) and its registered wrong ones (tests/wrong_solutions*.py).
    Mutant("pplab/checks/collectives.py", "sizes = (2, 3, 4)                                    # 3: not a power",
           "sizes = (2,)                                    # 3: not a power", CHK("broadcast", "broadcast_"),
           "broadcast check: tried on 2 ranks only"),
    Mutant("pplab/checks/collectives.py", "else {\"atol\": 1e-5, \"rtol\": 1e-5}",
           "else {\"atol\": 1e-2, \"rtol\": 1e-2}", CHK("ring_all_reduce", "all_reduce_"),
           "ring checks: float32 tolerance widened 1000x"),
    Mutant("pplab/checks/collectives.py", "trials = {p: _trials(seed, p, cases) for p in (2, 3, 4)}",
           "trials = {p: _trials(seed, p, cases) for p in (2, 4)}", RINGS,
           "ring checks: the world size that is not a power of two dropped"),
    Mutant("pplab/checks/collectives.py", "    return ordinary + edge", "    return ordinary", RINGS,
           "ring checks: tensors smaller than p never tried"),
    Mutant("pplab/checks/collectives.py",
           "limit = 2 * (p - 1) * math.ceil(tensor.numel() / p) * tensor.element_size()",
           "limit = 2 * (p - 1) * tensor.numel() * tensor.element_size()", CHK("ring_all_reduce", "all_reduce_"),
           "ring all-reduce check: the byte limit of a whole tensor per step"),
    Mutant("pplab/checks/collectives.py", "if first_difference(input, inputs[rank]) is not None:",
           "if first_difference(input, inputs[rank]) is not None and False:",
           CHK("reduce_scatter", "reduce_scatter_"), "reduce-scatter check: a changed input accepted"),
    Mutant("pplab/checks/collectives.py", "FIT_TOLERANCE = 0.10", "FIT_TOLERANCE = 1.0",
           CHK("predict_time", "predict_"), "predict_time: the fit of alpha and beta within 100%"),
    Mutant("pplab/checks/data_parallel.py", "trials = {p: _ddp_trials(seed, p) for p in (2, 3)}",
           "trials = {p: _ddp_trials(seed, p) for p in (2,)}", CHK("ddp_buckets", "ddp_"),
           "DDP check: 2 ranks only"),
    Mutant("pplab/checks/data_parallel.py", "for step, done in enumerate(seen[\"steps\"]):",
           "for step, done in enumerate(seen[\"steps\"][:1]):", CHK("ddp_buckets", "ddp_"),
           "DDP check: only the first training step checked"),
    Mutant("pplab/checks/data_parallel.py", "if not during:", "if not during and False:",
           CHK("ddp_buckets", "ddp_"), "DDP check: an all-reduce after backward accepted"),
    Mutant("pplab/checks/data_parallel.py", "for _ in range(3)] + [(rng.randint(5, 20), \"all\")]",
           "for _ in range(3)]", CHK("topk_error_feedback", "topk_"), "top-k check: k = d never tried"),
    Mutant("pplab/checks/zero.py", "if observed[rank][\"sizes\"] != [n // p]:",
           "if len(observed[rank][\"sizes\"]) != 1:", CHK("zero1_step", "zero1_"),
           "ZeRO-1 check: an optimizer over the whole parameter accepted"),
    Mutant("pplab/checks/zero.py", "diff = first_difference(mine, ref, atol=TOL, rtol=TOL)",
           "diff = first_difference(mine, ref, atol=TOL * 1e6, rtol=TOL * 1e6)", CHK("zero1_step", "zero1_"),
           "ZeRO-1 check: tolerance 1e-9 widened to 1e-3"),
    Mutant("pplab/checks/tensor_parallel.py", "c_in = 3 * rng.randint(2, 3) + 1 if p == 3 else",
           "c_in = 3 * rng.randint(2, 3) if p == 3 else", CHK("row_parallel_linear", "row_"),
           "row-parallel check: in_features always divisible by 3 on 3 ranks"),
    Mutant("pplab/checks/tensor_parallel.py", "diff = first_difference(got, want, atol=TOL, rtol=0)",
           "diff = first_difference(got, want, atol=TOL * 1e6, rtol=0)", CHK("row_parallel_linear", "row_"),
           "TP checks: tolerance 1e-10 widened to 1e-4"),
    Mutant("pplab/checks/tensor_parallel.py", "    if sub_groups:", "    if False:",
           CHK("f_g", "f_g or f_backward or g_backward or f_and_g"), "TP checks: the sub-group trial never run"),
    Mutant("pplab/checks/pipeline.py", "        if late_f is not None:", "        if late_f is not None and False:",
           CHK("gpipe_order", "gpipe_"), "GPipe check: a forward after a backward accepted"),

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
