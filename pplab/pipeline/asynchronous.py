"""Asynchronous pipelines: PipeDream (weight stashing) and PipeDream-2BW, on real ranks.

A flushed pipeline (GPipe, 1F1B) stops at the end of every step: the last micro-batches drain
out, every rank steps its optimizer, and the next step fills the pipeline again. That fill and
drain is the bubble, (p-1)/m of the useful time. An asynchronous pipeline never stops: micro-batches
keep entering, and a stage updates its weights while later micro-batches are still in flight.
The order of the work is 1F1B's, over the whole stream of micro-batches (`make_schedule("pipedream",
p, n)` builds it, the same IR every other schedule uses): the bubble is paid once per training
instead of once per step. The price is that micro-batches see different weight versions.

PipeDream (Narayanan et al. 2019). Stage s updates its weights after every backward. Micro-batch i
enters stage s after p-1-s other micro-batches entered and have not come back yet, so its forward
sees version i-(p-1-s) (0 during the warm-up) and, by the time its backward comes, the stage has
moved on by p-1-s updates. Weight STASHING keeps the version each in-flight micro-batch used, so
that its backward runs through the same weights as its forward: the gradient is a true gradient,
of a slightly older model (staleness p-1-s updates). Stage s holds up to p-s versions at once.
Without stashing the backward runs through the newest weights on activations computed with older
ones: the result is the gradient of no model at all (`stash=False` shows it).

PipeDream-2BW (Narayanan et al. 2021). Each stage accumulates gradients over m micro-batches (a
batch) and makes a new version once per batch. Every micro-batch of batch t, on every stage, uses
version t-1 (version 0 for batches 0 and 1), so the update is the paper's delayed-by-one rule
    W(t+1) = W(t) - lr * grad f(W(t-1))          (with W(-1) = W(0))
and a stage never needs more than two versions: the one in-flight micro-batches use and the
newest (double-buffered weights). It needs m >= p, so that version t-1 exists when batch t enters.

    def train():
        torch.manual_seed(0)
        layers = [nn.Linear(8, 8), nn.Tanh()] * ...
        run = AsyncPipeline("pipedream", 3, layers, nn.MSELoss(), lr=0.1)
        return run.train(x, y)                      # x, y: the whole stream, cut into micro-batches
    results = pplab.launch(train, world_size=3)
    results[r]["versions"][(s, i)]                  # the version micro-batch i used on stage s

How it maps onto pplab's executor (extended, not changed): AsyncPipeline is a PipelineExecutor
whose stages run through `torch.func.functional_call` with the weights of a chosen version, so the
executor's forward and backward (messages, trace spans, activations held) run unchanged; it adds
what a flushed executor does not have: an update after each backward, and the versions.
"""
from __future__ import annotations

import weakref

import torch
from torch import nn
from torch.func import functional_call

from ..memory import storage_bytes
from .dependencies import messages
from .executor import PipelineExecutor
from .actions import Action, Schedule
from .partition import PipelineError
from .schedules import make_schedule

METHODS = ("pipedream", "pipedream-2bw")


def weight_version(method: str, stage: int, microbatch: int, num_stages: int, batch_size: int = 1) -> int:
    """Which weight version micro-batch `microbatch` uses on `stage` (its forward and, stashed, its backward).

    pipedream: the stage has finished (and applied) the backwards of micro-batches 0 .. i-(p-s), so
        its forward sees version max(0, i - (p-1-s)).
    pipedream-2bw (batch_size = m micro-batches per batch): batch t = i // m uses version max(0, t-1).
    """
    _check_method(method)
    if method == "pipedream":
        return max(0, microbatch - (num_stages - 1 - stage))
    return max(0, microbatch // batch_size - 1)


def versions_held_formula(method: str, stage: int, num_stages: int) -> int:
    """The most weight versions stage `stage` keeps at once: p - s in PipeDream (one per in-flight
    micro-batch, the newest included), 2 in PipeDream-2BW (given at least two batches)."""
    _check_method(method)
    return num_stages - stage if method == "pipedream" else 2


def _check_method(method):
    if method not in METHODS:
        raise PipelineError(f"unknown asynchronous method {method!r}: use one of {', '.join(METHODS)}")


def flushed_steps(num_stages: int, num_microbatches: int, steps: int) -> Schedule:
    """`steps` training steps of 1F1B with a flush (m micro-batches each), one after another, as
    one schedule over steps*m micro-batches: what an asynchronous pipeline is compared against.
    Step k+1 can only start once its first stage has finished step k (the flush), which the
    order of each rank's actions says: no new dependency is needed."""
    one = make_schedule("1f1b", num_stages, num_microbatches)
    actions = [[Action(a.kind, a.microbatch + k * num_microbatches, a.stage)
                for k in range(steps) for a in one.actions[r]] for r in range(num_stages)]
    return Schedule(f"1f1b, flushed every {num_microbatches}", num_stages, steps * num_microbatches, 1,
                    actions, one.stage_to_rank)


def idle_after_warmup(timeline, rank: int) -> float:
    """Idle time of `rank` between the start of its first backward (the warm-up is over) and the
    end of its last forward (what follows is the drain at the end of the stream): the gaps
    between its compute boxes in that window. Works on simulated and measured timelines alike."""
    boxes = sorted((e for e in timeline.events if e.rank == rank and e.category == "compute"
                    and e.kind in ("F", "B")), key=lambda e: e.start)
    first_b = next((k for k, e in enumerate(boxes) if e.kind == "B"), None)
    last_f = max((k for k, e in enumerate(boxes) if e.kind == "F"), default=None)
    if first_b is None or last_f is None:
        raise PipelineError(f"rank {rank} has no backward or no forward in this timeline")
    return sum(max(0.0, boxes[k + 1].start - boxes[k].end) for k in range(first_b, last_f))


class _Versioned(nn.Module):
    """A stage run with the weights of the version `pipeline.active[stage]` (not its own)."""

    def __init__(self, bare: nn.Module, pipeline: "AsyncPipeline", stage: int):
        super().__init__()
        self.bare, self.pipeline, self.stage = bare, pipeline, stage

    def forward(self, x):
        return functional_call(self.bare, self.pipeline.active[self.stage], (x,))


class AsyncPipeline(PipelineExecutor):
    """One rank's part of an asynchronous pipeline (PipeDream or PipeDream-2BW) with plain SGD.

    method: "pipedream" (an update after every micro-batch) or "pipedream-2bw" (after every
        `batch_size` micro-batches, gradients accumulated, delayed by one version).
    num_stages: p, the ranks; layers, loss_fn: as for PipelineExecutor (loss_fn returns the mean
        over its micro-batch). lr: the SGD learning rate.
    stash: keep the version each in-flight micro-batch used (True, as the papers do); False runs
        backwards through whatever weights the stage holds now (to show why stashing is needed).
    record: keep every version's weights and every micro-batch's gradient in the result (for tests
        and notebooks; a real run would not).
    compute_time: as for PipelineExecutor, seconds each action is padded to.

    The versions are fresh tensors (version 0 a copy of the layers' own parameters, which stay in
    the stage as the template functional_call fills in; they are not counted among the versions).
    """

    def __init__(self, method: str, num_stages: int, layers, loss_fn, *, lr: float = 0.1,
                 batch_size: int = 1, stash: bool = True, record: bool = True, compute_time=None,
                 balance="params"):
        _check_method(method)
        if not isinstance(lr, (int, float)) or lr <= 0:
            raise PipelineError(f"lr must be a positive number, got {lr!r}")
        if method == "pipedream-2bw":
            if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < num_stages:
                raise PipelineError(f"pipedream-2bw needs batch_size (m, micro-batches per batch) >= p = "
                                    f"{num_stages}, so that version t-1 exists when batch t enters; "
                                    f"got {batch_size!r}")
            if not stash:
                raise PipelineError("pipedream-2bw always keeps the two versions it uses: stash=False "
                                    "applies to 'pipedream' only")
        elif batch_size != 1:
            raise PipelineError("pipedream updates after every micro-batch: batch_size applies to "
                                "'pipedream-2bw' only")
        # the schedule's length is set in train(); this one, for 2 micro-batches, builds the stages
        super().__init__(make_schedule(method, num_stages, max(2, num_stages)), layers, loss_fn,
                         balance=balance, compute_time=compute_time)
        self.method, self.lr, self.m, self.stash, self.record = method, float(lr), batch_size, stash, record
        self.stages = {s: _Versioned(bare, self, s) for s, bare in self.bare.items()}

    def step(self, inputs, targets):
        raise PipelineError("an asynchronous pipeline has no steps (nothing is flushed): call "
                            "train(inputs, targets, num_microbatches) with the whole stream")

    # -- the versions ------------------------------------------------------------------
    def _new_version(self, s, weights):
        """Make `weights` ({local name: tensor}) stage s's newest version; track whether it is alive."""
        k = self.latest[s] = self.latest[s] + 1
        tensors = {n: w.detach().clone().requires_grad_() for n, w in weights.items()}
        self.versions[s][k] = tensors
        self.alive[s].append((k, [weakref.ref(t) for t in tensors.values()]))
        if self.record:
            self.history[s].append({self._global(s, n): t.detach().clone() for n, t in tensors.items()})

    def _forget(self, s):
        """Drop the versions no micro-batch will use again: not the newest, not an in-flight
        micro-batch's (autograd's graph holds those anyway), not the next forward's."""
        needed = {self.latest[s]} | {k for key, k in self.used.items() if key[0] == s and key in self.held}
        nxt = self.next_forward.get(s)
        if nxt is not None:
            needed.add(weight_version(self.method, s, nxt, self.schedule.num_stages, self.m))
        for k in [k for k in self.versions[s] if k not in needed]:
            del self.versions[s][k]

    def _count_versions(self, s):
        """Versions of stage s still in memory, found by whether their tensors are alive (weak
        references: whatever holds them, the dict of versions or autograd's saved graph)."""
        live = [k for k, refs in self.alive[s] if any(r() is not None for r in refs)]
        self.alive[s] = [(k, refs) for k, refs in self.alive[s] if k in live]
        tensors = [r() for k, refs in self.alive[s] for r in refs]
        self.held_versions[s].append(len(live))
        self.held_bytes[s].append(storage_bytes(t for t in tensors if t is not None))

    def _global(self, s, name):
        j, rest = name.split(".", 1)
        return f"{self.bounds[s][0] + int(j)}.{rest}"

    # -- the stream --------------------------------------------------------------------
    def train(self, inputs, targets, num_microbatches: int) -> dict:
        """Run the whole stream: `inputs` and `targets` cut into `num_microbatches` equal micro-batches
        (PipeDream: one update each; 2BW: one per batch of `batch_size`), in 1F1B order, no flush.

        Returns, for this rank: "versions" {(stage, i): version micro-batch i used}, "losses" [the
        loss of each micro-batch, on the last stage's rank], "params" {name: newest weights},
        "held_versions" {stage: [versions in memory after each action]}, "held_bytes" (the same
        in bytes, pplab.memory.storage_bytes of the tensors alive), "peak_versions" {stage:
        the most}, "version_bytes" {stage: bytes of one version}, and with record=True "history"
        {stage: [{name: weights} of version 0, 1, ...]} and "grads" {(stage, i): {name: gradient}}.
        """
        n, p = num_microbatches, self.schedule.num_ranks
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise PipelineError(f"num_microbatches must be a positive integer, got {n!r}")
        if len(inputs) != len(targets) or len(inputs) % n:
            raise PipelineError(f"{len(inputs)} inputs and {len(targets)} targets cannot make {n} equal "
                                f"micro-batches: give as many targets as inputs, a multiple of {n}")
        if n % self.m:
            raise PipelineError(f"pipedream-2bw updates once per batch of {self.m} micro-batches: "
                                f"give a multiple of {self.m}, got {n}")
        sched = self.schedule = make_schedule(self.method, p, n)
        self.xs = torch.tensor_split(inputs.to(self.device), n)
        self.ys = torch.tensor_split(targets.to(self.device), n)
        self.n = len(self.xs[0]) * self.m          # each loss weighted 1 (PipeDream), 1/m (2BW: the batch's mean)
        self.shapes = {len(self.xs[0]): self._check_shapes(self.xs[0], self.ys[0])}
        mine = list(self.bare)
        self.versions, self.latest = {s: {} for s in mine}, {s: -1 for s in mine}
        self.alive, self.history = {s: [] for s in mine}, {s: [] for s in mine}
        self.held_versions, self.held_bytes = {s: [] for s in mine}, {s: [] for s in mine}
        for s, bare in self.bare.items():
            self._new_version(s, dict(bare.named_parameters()))            # version 0: the layers' own
        self.used, self.grads, self.sum = {}, {}, {s: None for s in mine}
        self.next_forward = {s: 0 for s in mine}
        self.held, self.local, self.posted, self.sends = {}, {}, {}, []
        self.incoming = messages(sched, self.rank)
        self.activations, self.losses, self.bytes_held, self.peak_bytes = [], [], 0, 0
        self.active = {}
        for a in sched.actions[self.rank]:
            (self._forward_at_version if a.kind == "F" else self._backward_and_update)(a)
            self._finish_sends(block=False)
            self._count_versions(a.stage)
        self._finish_sends(block=True)             # only at the very end: the stream is over
        out = {"rank": self.rank, "stages": mine, "layers": {s: self.bounds[s] for s in mine},
               "versions": dict(self.used), "losses": [x.item() * self.m for x in self.losses],
               "params": {self._global(s, k): t.detach().clone()
                          for s in mine for k, t in self.versions[s][self.latest[s]].items()},
               "held_versions": self.held_versions, "held_bytes": self.held_bytes,
               "peak_versions": {s: max(c) for s, c in self.held_versions.items()},
               "version_bytes": {s: storage_bytes(self.bare[s].parameters()) for s in mine}}
        if self.record:
            out.update(history=self.history, grads=self.grads)
        return out

    def _forward_at_version(self, a):
        s, i = a.stage, a.microbatch
        k = weight_version(self.method, s, i, self.schedule.num_stages, self.m) if self.stash else self.latest[s]
        if k not in self.versions[s]:
            raise PipelineError(f"stage {s} no longer holds version {k} for micro-batch {i}")
        self.used[(s, i)] = k
        self.active[s] = self.versions[s][k]
        self._weights = list(self.active[s].values())       # weights, not activations: not counted as held
        self.next_forward[s] = i + 1 if i + 1 < self.schedule.num_microbatches else None
        self._forward(a)
        self.active[s], self._weights = None, []      # from now on only this micro-batch's graph holds them

    def _backward_and_update(self, a):
        s, i = a.stage, a.microbatch
        weights = self.versions[s][self.used[(s, i)] if self.stash else self.latest[s]]
        self._backward(a)                  # autograd fills .grad of the tensors this micro-batch's graph holds
        grad = {}
        for name, t in weights.items():
            grad[name] = t.grad if t.grad is not None else torch.zeros_like(t)
            t.grad = None                  # the next micro-batch's gradient starts from nothing
        if self.record:
            self.grads[(s, i)] = {self._global(s, k): g.clone() for k, g in grad.items()}
        if self.method == "pipedream":
            self._update(s, grad)
        else:                              # 2BW: sum the batch's gradients, update at its last micro-batch
            total = self.sum[s]
            self.sum[s] = grad if total is None else {k: total[k] + g for k, g in grad.items()}
            if (i + 1) % self.m == 0:
                self._update(s, self.sum[s])
                self.sum[s] = None
        self._forget(s)

    def _update(self, s, grad):
        """SGD on the newest version: W(new) = W(newest) - lr * grad."""
        newest = self.versions[s][self.latest[s]]
        if self.stash:
            self._new_version(s, {k: w.detach() - self.lr * grad[k] for k, w in newest.items()})
            return
        # Without stashing there is one set of weights, changed in place. Through .data, so that autograd
        # does not notice: its version counter would refuse (rightly) to backpropagate the in-flight
        # micro-batches through weights changed since their forward. That is the naive implementation.
        for k, w in newest.items():
            w.data.sub_(self.lr * grad[k])
        self.latest[s] += 1
        self.versions[s] = {self.latest[s]: newest}
        if self.record:
            self.history[s].append({self._global(s, k): w.detach().clone() for k, w in newest.items()})
