"""Run a pipeline schedule on real processes: the same Schedule the simulator plays out.

    def train():
        torch.manual_seed(0)                          # every rank builds the same model...
        layers = [nn.Linear(16, 16), nn.Tanh()] * ...
        schedule = make_schedule("1f1b", num_stages=4, num_microbatches=8)
        return run_pipeline(schedule, layers, x, y, nn.MSELoss())   # ...and keeps its own stages

    results = pplab.launch(train, world_size=4)
    results[r]["grads"], results[r]["peak_activations"]   # what rank r computed and held
    pplab.swimlane.draw(results.timeline)                 # beside simulate(schedule).timeline()

What happens, in the order it happens:

1. `partition` (partition.py) cuts the list of layers into `schedule.num_stages` contiguous stages,
   balanced by parameter count, by measured time, or as given. Rank r keeps the stages
   `schedule.stages_of(r)` and drops the rest.
2. The batch is cut into `schedule.num_microbatches` micro-batches. Before anything is
   sent, every rank runs the whole model once on one micro-batch (no gradients) to learn
   the shape of every message. A model that does not fit together fails here, with the
   same error on every rank, instead of leaving one rank waiting for a message that
   never comes.
3. Rank r runs `schedule.actions[r]` in order:
     F  receive the stage's input (or read the micro-batch, or take it from this rank
        itself at the turn of a V), run the stage, send the output on. The last stage
        also computes the loss.
     B  receive the output's gradient, backpropagate through the stage (its weight
        gradients accumulate in .grad), send the input's gradient back.
     I  the input-gradient half of a split B: only d(loss)/d(input), keeping the graph.
     W  the weight-gradient half, later: d(loss)/d(weights), then free the graph.
   Sends are posted with isend and never waited on until the end of the step, which is
   what `validate` assumes when it proves the schedule cannot deadlock. A receive is
   waited on when its action needs it.
4. After the last action (the flush), each rank steps the optimizer on its own stages.

Every action is a `trace.span`, every message goes through `pplab.comm`, and the
activations a rank holds are recorded with `trace.hold`/`trace.release` (bytes of what
autograd saved for the backward), so `results.timeline` is drawn like a simulated run.
"""
from __future__ import annotations

import contextlib
import time

import torch
import torch.distributed as dist
import torch.fx.experimental.symbolic_shapes  # noqa: F401 - see below
from torch import nn

from ..runtime import comm
from .. import stand_in, trace
from ..memory import saved_activations
from ..runtime.launcher import device as rank_device
from .partition import PipelineError, _as_layers, partition
from .actions import Schedule
from .dependencies import messages
from .validation import validate


# The first backward given an output gradient makes torch import sympy, 1 to 4 s. Importing it
# here, before pplab.launch forks the ranks, pays that once, not in every rank of every run.

# ----------------------------------------------------------------------------------
# 2. The executor


def _fingerprint(layers) -> tuple:
    with torch.no_grad():
        return tuple((tuple(p.shape), p.double().sum().item()) for layer in layers for p in layer.parameters())


class PipelineExecutor:
    """One rank's part of a pipeline: its stages, and `step(inputs, targets)` to train on a batch.

    Create it on every rank (every rank passes the same full list of layers, built from the
    same seed); each keeps only its own stages. loss_fn(output, target) must return the
    mean over its micro-batch: micro-batch i's loss is weighted by its share of the batch,
    so the accumulated gradients are those of the mean loss over the whole batch.
    optimizer: optional, stepped after the flush; it may hold every layer's parameters,
    since only this rank's have gradients (torch optimizers skip the others).
    compute_time: None, or seconds to pad each action to (see `pplab.stand_in.durations`), so that on a
    laptop with fewer cores than ranks the measured timeline still shows the schedule's shape.
    group: the ranks of the pipeline (None: every rank), e.g. a mesh's pp group; stage ranks in
    the schedule are ranks within it, and messages go to their global ranks.
    wrap_stage: None, or a function stage -> the module that runs it, e.g. ZeRO-3's
    `lambda stage: FullyShardedModule(stage, group=dp_group)`; the optimizer then takes the
    wrapped stages' parameters, and `named_parameters` still names the layers' own.
    """

    def __init__(self, schedule: Schedule, layers, loss_fn, *, balance="params", sample=None,
                 compute_time=None, optimizer=None, group=None, wrap_stage=None):
        validate(schedule)
        self.schedule, self.loss_fn, self.optimizer, self.group = schedule, loss_fn, optimizer, group
        self.rank, world = comm.rank(group), comm.world_size(group)
        self.peers = list(comm.group_ranks(group))
        if world != schedule.num_ranks:
            fix = (f"give it a group of {schedule.num_ranks} ranks (e.g. a mesh with pp={schedule.num_ranks})"
                   if group is not None else f"launch with world_size={schedule.num_ranks}")
            raise PipelineError(f"the schedule has {schedule.num_ranks} ranks but {world} are running"
                                f"{' in the pipeline group' if group is not None else ''}: {fix}")
        self.pad = stand_in.durations(compute_time, schedule.chunks // schedule.replicas, error=PipelineError)   # as simulate scales t_f
        self.device = rank_device()
        layers = _as_layers(layers)
        self.model_bounds = self._agree(layers, balance, sample)      # one (start, end) per piece of the model
        self.bounds = [self.model_bounds[schedule.model_stage(s)] for s in range(schedule.num_stages)]
        self.layers = layers                # all of them, for the shape check only (a system for models
                                            # too big for one rank would exchange shapes instead)
        self.bare = {s: nn.Sequential(*layers[slice(*self.bounds[s])]).to(self.device)
                     for s in schedule.stages_of(self.rank)}                  # my stages' layers
        self.stages = {s: wrap_stage(st) if wrap_stage else st for s, st in self.bare.items()}   # what runs them
        self.wrapped = wrap_stage is not None
        self._shapes = {}                    # micro-batch shape -> shape and dtype of every stage's output
        self._weights = list({id(p): p for p in [p for _, p in self.named_parameters()] +   # the layers',
                              [p for st in self.stages.values() for p in st.parameters()]}.values())  # a wrapper's

    def _agree(self, layers, balance, sample):
        """Every rank must cut the same model at the same places; check, rather than hang later.
        With two replicas, the model is cut into stages_per_replica pieces, each held twice."""
        pieces = self.schedule if self.schedule.replicas == 1 else self.schedule.stages_per_replica
        if balance == "time" and comm.world_size(self.group) > 1:   # timings differ by rank: rank 0's count
            bounds = [None]
            if self.rank == 0:
                try:
                    bounds = [partition(layers, pieces, "time", sample)]
                except PipelineError as err:       # raised on every rank, not only here
                    bounds = [err]
            with trace.paused():
                dist.broadcast_object_list(bounds, src=self.peers[0], group=self.group)
            if isinstance(bounds[0], PipelineError):
                raise bounds[0]
            bounds = bounds[0]
        else:
            bounds = partition(layers, pieces, balance, sample)
        if comm.world_size(self.group) > 1:
            everyone = [None] * comm.world_size(self.group)
            with trace.paused():
                dist.all_gather_object(everyone, _fingerprint(layers), group=self.group)
            for r, fp in enumerate(everyone):
                if fp != everyone[0]:
                    raise PipelineError(f"rank {r} built different layers from rank 0 (their parameters "
                                        f"differ): build the model the same way on every rank, e.g. call "
                                        f"torch.manual_seed(0) just before creating it")
        return bounds

    def named_parameters(self):
        """This rank's parameters, named as in nn.Sequential(*layers): "4.weight" is layer 4's weight."""
        for s, stage in self.bare.items():
            start = self.bounds[s][0]
            for name, p in stage.named_parameters():
                j, rest = name.split(".", 1)
                yield f"{start + int(j)}.{rest}", p

    # -- the shape check -----------------------------------------------------------
    def _check_shapes(self, x, y):
        """Run every stage of the whole model on micro-batch x (no gradients) and note the
        shape of each stage's output, which its receiver allocates. Every rank does this, so
        a mismatch raises the same error everywhere. Layers run in eval mode, so that the
        check moves no BatchNorm statistics and draws no dropout masks."""
        key = (tuple(x.shape), x.dtype)
        if key in self._shapes:
            return self._shapes[key]
        modes = [layer.training for layer in self.layers]
        shapes = []
        try:
            with torch.no_grad():
                for layer in self.layers:
                    layer.eval()
                for s, (start, end) in enumerate(self.model_bounds):
                    for j in range(start, end):
                        try:
                            x = self.layers[j](x)
                        except Exception as err:  # noqa: BLE001 - said again, with where and what to change
                            raise PipelineError(self._misfit(s, j, x, err)) from None
                    shapes.append((tuple(x.shape), x.dtype))
                try:
                    loss = self.loss_fn(x, y)
                except Exception as err:  # noqa: BLE001
                    raise PipelineError(f"loss_fn cannot take the last stage's output, shape {tuple(x.shape)}, "
                                        f"with targets of shape {tuple(y.shape)}: {err}") from None
                if not (isinstance(loss, torch.Tensor) and loss.dim() == 0):
                    raise PipelineError("loss_fn must return a single number per micro-batch (the mean "
                                        "over its samples), e.g. nn.MSELoss() or nn.CrossEntropyLoss()")
        finally:
            for layer, mode in zip(self.layers, modes):
                layer.train(mode)
        self._shapes[key] = shapes
        return shapes

    def _misfit(self, s, j, x, err) -> str:
        layer, shape = self.layers[j], tuple(x.shape)
        n = getattr(layer, "in_features", None)
        expects = f"expects {shape[:-1] + (n,)}" if isinstance(n, int) and shape else "cannot take it"
        if j == 0:
            return f"layer 0 ({layer}) cannot take the inputs, of shape {shape}: {err}"
        if j > self.bounds[s][0]:
            return (f"layer {j} ({layer}), inside stage {s}, cannot take the output of layer {j - 1}, of "
                    f"shape {shape}: the model does not fit together there, whatever the split: {err}")
        owner = self.schedule.stage_to_rank
        return (f"stage {s - 1} (rank {owner[s - 1]}) outputs shape {shape} but stage {s} "
                f"(rank {owner[s]}) starts with layer {j} ({layer}), which {expects}: the layers at the "
                f"split do not fit; check the model (layer {j - 1} feeds layer {j}) or the split ({err})")

    # -- one training step -----------------------------------------------------------
    def step(self, inputs, targets) -> dict:
        """Forward and backward every micro-batch in the schedule's order, then the optimizer.

        Returns, for this rank: "loss" (the batch's mean loss, on the rank holding the last
        stage, else None), "grads" {name: gradient} of its parameters, "stages" and their
        "layers" (start, end), "peak_activations" (micro-batches held at once, a chunk
        counting 1/v, as in the simulator), "activations" [(time, held)], and
        "peak_activation_bytes" (the most bytes autograd held for backward at once).
        """
        sched, m = self.schedule, self.schedule.num_microbatches
        if len(inputs) < m or len(targets) != len(inputs):
            raise PipelineError(f"a batch of {len(inputs)} inputs and {len(targets)} targets cannot make "
                                f"{m} micro-batches: give at least {m} samples, as many targets as inputs")
        self.xs = torch.tensor_split(inputs.to(self.device), m)
        self.ys = torch.tensor_split(targets.to(self.device), m)
        self.n = len(inputs)
        self.shapes = {len(x): self._check_shapes(x, y) for x, y in zip(self.xs, self.ys)}
        for p in self._weights:
            p.grad = None                              # gradients accumulate over micro-batches only
        self.held = {}                                 # (stage, mb) -> what backward needs
        self.local = {}                                # messages from this rank to itself (the V's turn)
        self.posted, self.sends = {}, []
        self.incoming = messages(sched, self.rank)
        self.activations, self.losses, self.bytes_held, self.peak_bytes = [], [], 0, 0
        run = {"F": self._forward, "B": self._backward, "I": self._backward_input, "W": self._backward_weight}
        for a in sched.actions[self.rank]:
            run[a.kind](a)
            self._finish_sends(block=False)
        self._finish_sends(block=True)                 # the flush: every message has left
        if sched.replicas > 1:
            self._add_replica_gradients()
        if self.optimizer is not None:
            self.optimizer.step()
        counts = [held for _, held in self.activations]
        return {"rank": self.rank,
                "loss": sum(self.losses).item() if self.losses else None,
                "grads": {name: p.grad for name, p in self.named_parameters()},
                "stages": list(self.stages), "layers": {s: self.bounds[s] for s in self.stages},
                "peak_activations": max(counts, default=0), "activations": self.activations,
                "peak_activation_bytes": self.peak_bytes}

    # -- moving tensors ----------------------------------------------------------------
    def _send(self, key, tensor, dst):
        if dst == self.rank:
            self.local[key] = tensor
        else:
            tensor = tensor.contiguous()
            handle = comm.isend(tensor, self.peers[dst])
            handle.event.meta["message"] = key          # which tensor it carries, for whoever reads the trace
            self.sends.append((handle, tensor))         # the tensor must live until the send is done

    def _finish_sends(self, block):
        """Close the sends that are done (all of them if block): their trace event ends now.
        NCCL says when a send is done; gloo says so only once it is waited on, so on gloo
        every send's event lasts until the flush (it arrived when its receive ended)."""
        pending = []
        for handle, tensor in self.sends:
            if block or handle.is_completed():
                handle.wait()
            else:
                pending.append((handle, tensor))
        self.sends = pending

    def _receive(self, key, src):
        """The tensor `key` from rank `src`; receives are posted in the order src sends."""
        if src == self.rank:
            return self.local.pop(key)
        while key not in self.posted:
            nxt = self.incoming[src].popleft()
            kind, s, i = nxt
            piece = self.schedule.model_stage(s if kind == "act" else s - 1)
            shape, dtype = self.shapes[len(self.xs[i])][piece]
            buffer = torch.empty(shape, dtype=dtype, device=self.device)
            handle = comm.irecv(buffer, self.peers[src])
            handle.event.meta["message"] = nxt
            self.posted[nxt] = (buffer, handle)
        buffer, handle = self.posted.pop(key)
        handle.wait()
        return buffer

    @contextlib.contextmanager
    def _compute(self, a):
        """A trace span around the work of action `a`, padded to compute_time if set."""
        chunk = a.chunk if self.schedule.chunks > 1 else None
        with trace.span(a.kind, microbatch=a.microbatch, chunk=chunk, stage=a.stage):
            start = time.perf_counter()
            yield
            if self.device.type == "cuda":
                torch.cuda.synchronize()               # the box must cover the GPU's work, not its launch
            if self.pad is not None:
                time.sleep(max(0.0, self.pad[a.kind] - (time.perf_counter() - start)))

    def _add_replica_gradients(self):
        """Two copies of the model (Chimera, DualPipe): each piece's two copies trained on different
        halves of the batch, so they add their gradients, and step to the same weights. The rank
        holding the other copy of my piece s holds the other copy of my other piece too (stage s
        on rank r, its copy on rank p-1-r), so one exchange with that rank covers both."""
        sched = self.schedule
        pieces = sorted(self.stages, key=sched.model_stage)      # the same order on both ranks
        for s in pieces:
            twin = (s + sched.stages_per_replica) % sched.num_stages
            peer = sched.stage_to_rank[twin]
            params = list(self.bare[s].parameters())
            mine = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                              for p in params]) if params else torch.zeros(0, device=self.device)
            theirs = torch.empty_like(mine)
            sent = comm.isend(mine, self.peers[peer])
            got = comm.irecv(theirs, self.peers[peer])
            got.wait()
            sent.wait()
            total, start = mine + theirs, 0                       # a + b == b + a: both copies agree bit for bit
            for p in params:
                p.grad = total[start:start + p.numel()].view_as(p).clone()
                start += p.numel()

    def _count(self):
        share = self.schedule.replicas / self.schedule.chunks   # a stage's part of a rank's share (simulate)
        held = len(self.held) * share if share != 1 else len(self.held)
        self.activations.append((trace.now(), held))

    # -- the four actions ----------------------------------------------------------------
    def _forward(self, a):
        s, i = a.stage, a.microbatch
        prev, nxt = self.schedule.neighbour_ranks(s)
        if prev is None:
            x = self.xs[i]
        else:
            x = self._receive(("act", s - 1, i), prev).requires_grad_()   # we will send back its gradient
        # what autograd keeps for the backward is activation memory; the weights are not (under
        # ZeRO-3 they are gathered during this forward: saved_activations looks at them again);
        # a micro-batch is a slice of the batch, so each counts its own slice
        with self._compute(a), saved_activations(self._weights, moving=self.wrapped,
                                                                   slices=True) as saved:
            out = self.stages[s](x)
            if nxt is None:                # the last stage: weighted so that the sum is the batch mean
                out = self.loss_fn(out, self.ys[i]) * (len(self.xs[i]) / self.n)   # (x may be [s, b, h])
                self.losses.append(out.detach())
        nbytes = saved.bytes
        self.held[(s, i)] = {"input": x, "output": out, "bytes": nbytes}
        self._count()
        trace.hold(nbytes, label=a.label())
        self.bytes_held += nbytes
        self.peak_bytes = max(self.peak_bytes, self.bytes_held)
        if nxt is not None:
            self._send(("act", s, i), out.detach(), nxt)

    def _output_grad(self, s, i):
        """The gradient of stage s's output: from stage s+1, or None for the loss (d loss/d loss = 1)."""
        nxt = self.schedule.neighbour_ranks(s)[1]
        return None if nxt is None else self._receive(("grad", s + 1, i), nxt)

    def _send_input_grad(self, s, i, grad, x):
        prev = self.schedule.neighbour_ranks(s)[0]
        if prev is not None:               # an input that did not reach the output has gradient 0
            self._send(("grad", s, i), grad if grad is not None else torch.zeros_like(x), prev)

    def _release(self, a, entry):
        self._count()
        trace.release(entry["bytes"], label=a.label())
        self.bytes_held -= entry["bytes"]

    def _backward(self, a):
        s, i = a.stage, a.microbatch
        grad = self._output_grad(s, i)
        entry = self.held.pop((s, i))
        x, out = entry["input"], entry["output"]
        with self._compute(a):
            if out.requires_grad:
                torch.autograd.backward(out, grad)     # fills x.grad and adds into every weight's .grad
        self._release(a, entry)
        self._send_input_grad(s, i, x.grad, x)

    def _backward_input(self, a):
        s, i = a.stage, a.microbatch
        grad = self._output_grad(s, i)
        entry = self.held[(s, i)]                      # kept: W walks the same graph
        entry["grad"] = grad
        x, out = entry["input"], entry["output"]
        gx = None
        with self._compute(a):
            if x.requires_grad and out.requires_grad:  # stage 0's input needs no gradient: nothing to do
                (gx,) = torch.autograd.grad(out, x, grad, retain_graph=True, allow_unused=True)
        self._send_input_grad(s, i, gx, x)

    def _backward_weight(self, a):
        s, i = a.stage, a.microbatch
        entry = self.held.pop((s, i))
        params = [p for p in self.stages[s].parameters() if p.requires_grad]
        with self._compute(a):
            if params and entry["output"].requires_grad:
                # Autograd offers no public way to reuse what I computed, so this walks the graph
                # again: exact gradients, at more compute than one B (torch.distributed.pipelining
                # avoids that through autograd internals). compute_time gives W its intended length.
                grads = torch.autograd.grad(entry["output"], params, entry["grad"], allow_unused=True)
                for p, g in zip(params, grads):
                    if g is not None:
                        p.grad = g if p.grad is None else p.grad + g
        self._release(a, entry)


def run_pipeline(schedule: Schedule, layers, inputs, targets, loss_fn, *, balance="params",
                 compute_time=None, optimizer=None) -> dict:
    """Build a PipelineExecutor on this rank, train one step, return what `step` returns plus
    "params" {name: value after the step} of this rank's parameters. Call it on every rank."""
    sample = torch.tensor_split(inputs, schedule.num_microbatches)[0] if balance == "time" else None
    ex = PipelineExecutor(schedule, layers, loss_fn, balance=balance, sample=sample,
                          compute_time=compute_time, optimizer=optimizer)
    out = ex.step(inputs, targets)
    out["params"] = {name: p.detach().clone() for name, p in ex.named_parameters()}
    return out
