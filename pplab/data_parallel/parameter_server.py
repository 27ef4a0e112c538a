"""Parameter server: one rank keeps the model, the others compute its gradients.

    run = parameter_server.run(parameter_server.train_sync, model_fn, (X, y), workers=3,
                               steps=50, lr=0.1)
    run.losses                     # full-data loss of every parameter version, from the start
    pplab.swimlane.draw(run.timeline, arrows=True)

Rank 0 is the server; ranks 1..W are the workers (so W = world_size - 1). The data
(X, y) is cut into W contiguous shards, `X.tensor_split(W)`: worker w gets shard w-1,
and when W does not divide the number of samples N the first shards get one sample
more. Every rank knows this rule, so the server knows each shard's size n_w without
being told.

Synchronous training (`train_sync`), one step:

    server ──params──▶ every worker        pull: d numbers to each of W workers
    worker: gradient of the mean loss on its shard
    worker ──gradient──▶ server            push: d numbers from each
    server: params -= lr · Σ_w (n_w / N) · g_w

Weighting by n_w / N makes the sum the gradient of the mean loss over all N samples
(for a loss that averages over samples, like mse_loss), so the run equals plain
gradient descent on the union of the shards, whatever the shard sizes. The price: all
the traffic goes through one link. Per step the server sends W·d numbers and receives
W·d: 2·W·d in all (the α-β model's β·2pd with p = W workers), while each worker's link
carries only 2d. A ring all-reduce among the same W workers has every rank send
2(W-1)/W·d and receive as much, and no link carries more than that.

Asynchronous training (`train_async`): the server applies each gradient as soon as it
has it, without waiting for the others, so a gradient may have been computed on
parameters that are several updates old ("stale"). Real asynchronous runs get their
staleness from timing, which differs run to run; here it is set by the protocol so the
run is deterministic: update u applies the gradient of worker (u mod W) + 1, computed
on version max(0, u - staleness) of the parameters (version v = after v updates). The
server sends that version to the worker as soon as it exists, and the worker computes
while the server goes on applying other workers' gradients. With staleness = W - 1
this is what W equally fast workers would see; staleness 0 makes the workers take
turns (sequential SGD, one shard at a time); larger values model slow workers or a
busy network. Every message is real: each update moves d numbers each way. Each
gradient is scaled by W·n_w/N (1 for even shards), so a round of W updates weighs the
samples as one synchronous step does.

What staleness does (tests/test_parameter_server.py): linear regression, 3 workers,
lr = 0.1, 60 updates. Staleness 0 and 2 end at the least-squares loss; 6 and 12
diverge. The step size that stays stable shrinks as staleness grows. (At a small step
a little staleness can even help early on, a bit like momentum: the loss curve, not
one number, tells the story.)
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..runtime import comm
from .. import trace
from ..runtime.launcher import device, launch

SERVER = 0


# ----------------------------------------------------------------------------------
# Small helpers: the model as one flat vector of d numbers, shards, gradients.


def flat_params(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def load_params(model, flat) -> None:
    torch.nn.utils.vector_to_parameters(flat, model.parameters())


def shards(data, workers: int):
    """The W shards (X_w, y_w) of data = (X, y): contiguous, sizes differ by at most one."""
    X, y = data
    if len(X) != len(y):
        raise ValueError(f"data = (X, y) must have one target per sample: got {len(X)} samples "
                         f"and {len(y)} targets")
    if len(X) < workers:
        raise ValueError(f"every worker needs at least one sample: got N={len(X)} samples for "
                         f"W={workers} workers; use more data or fewer workers (world_size = W + 1)")
    return list(zip(X.tensor_split(workers), y.tensor_split(workers)))


def gradient(model, params, X, y, loss_fn) -> torch.Tensor:
    """The gradient of loss_fn(model(X), y) at `params`, as one flat vector."""
    load_params(model, params)
    model.zero_grad(set_to_none=False)
    loss_fn(model(X), y).backward()
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def _setup(model_fn, data, seed):
    p = comm.world_size()
    if p < 2:
        raise ValueError(f"a parameter server needs at least 2 ranks (rank 0 serves, ranks 1.. work): "
                         f"got world_size={p}")
    W = p - 1
    parts = [(X.to(device()), y.to(device())) for X, y in shards(data, W)]   # GPU under NCCL, else CPU
    torch.manual_seed(seed)                       # same initial model on every rank (only the server's is used)
    model = model_fn().to(device())
    N = len(data[0])
    return W, parts, model, flat_params(model), [len(X) / N for X, _ in parts]


# ----------------------------------------------------------------------------------
# Synchronous


def train_sync(model_fn, data, steps: int, lr: float, loss_fn=F.mse_loss, seed: int = 0):
    """Run on every rank (inside pplab.launch). The server returns the history of the
    parameters, a (steps + 1) x d tensor (row t = after t steps); workers return None."""
    W, parts, model, params, weight = _setup(model_fn, data, seed)
    workers = range(1, W + 1)
    if comm.rank() == SERVER:
        history = [params.clone()]
        for t in range(steps):
            for h in [comm.isend(params, w) for w in workers]:          # pull: d to each worker
                h.wait()
            grads = [torch.empty_like(params) for _ in workers]
            for h in [comm.irecv(g, w) for g, w in zip(grads, workers)]:  # push: d from each
                h.wait()
            with trace.span("update", label=f"u{t}"):
                avg = sum(weight[i] * g for i, g in enumerate(grads))
                params -= lr * avg
            history.append(params.clone())
        return torch.stack(history)
    X, y = parts[comm.rank() - 1]
    for t in range(steps):
        comm.recv(params, SERVER)
        with trace.span("grad", label=f"g{t}"):
            g = gradient(model, params, X, y, loss_fn)
        comm.send(g, SERVER)
    return None


# ----------------------------------------------------------------------------------
# Asynchronous, with staleness set by the protocol


def train_async(model_fn, data, updates: int, lr: float, staleness: int, loss_fn=F.mse_loss, seed: int = 0):
    """Run on every rank. Update u applies worker (u mod W) + 1's gradient, computed on
    version max(0, u - staleness), scaled by W·n_w/N. The server returns the
    (updates + 1) x d history of parameter versions; workers return None."""
    if not (isinstance(staleness, int) and staleness >= 0):
        raise ValueError(f"staleness must be a whole number of updates >= 0, got {staleness!r}")
    W, parts, model, params, weight = _setup(model_fn, data, seed)

    def worker(u):                                # who computes the gradient of update u
        return u % W + 1

    if comm.rank() == SERVER:
        history, sending = [params.clone()], []

        def serve(u):                             # send update u's worker the version it must use
            if u < updates:
                sending.append(comm.isend(history[max(0, u - staleness)], worker(u)))

        for u in range(min(staleness + 1, updates)):
            serve(u)                              # the first staleness+1 updates all start from version 0
        g = torch.empty_like(params)
        for u in range(updates):
            comm.recv(g, worker(u))               # push
            with trace.span("update", label=f"u{u}"):
                history.append(history[-1] - lr * W * weight[worker(u) - 1] * g)
            serve(u + staleness + 1)              # version u+1 exists now: the pull it answers
        for h in sending:
            h.wait()
        return torch.stack(history)
    X, y = parts[comm.rank() - 1]
    for u in range(comm.rank() - 1, updates, W):  # my updates, in order
        comm.recv(params, SERVER)
        with trace.span("grad", label=f"g{u}"):
            g = gradient(model, params, X, y, loss_fn)
        comm.send(g, SERVER)
    return None


# ----------------------------------------------------------------------------------
# Running it and reading the result


def loss_curve(model_fn, data, history, loss_fn=F.mse_loss) -> list[float]:
    """The full-data loss at every row of `history` (evaluated here, not on the ranks)."""
    model = model_fn()
    X, y = data
    with torch.no_grad():
        out = []
        for params in history:
            load_params(model, params)
            out.append(float(loss_fn(model(X), y)))
    return out


def link_bytes(timeline, rank: int) -> int:
    """Bytes through `rank`'s link, both ways, from the trace."""
    return timeline.bytes_sent(rank) + timeline.bytes_received(rank)


@dataclass
class Run:
    history: torch.Tensor          # (updates + 1) x d parameter versions
    losses: list                   # full-data loss of each version
    timeline: "trace.Timeline"

    @property
    def server_link_bytes(self) -> int:
        return link_bytes(self.timeline, SERVER)


def run(train, model_fn, data, *, workers: int = 3, loss_fn=F.mse_loss, timeout: float = 120.0, **kwargs) -> Run:
    """Launch `train` (train_sync or train_async) on 1 server + `workers` workers."""
    if not (isinstance(workers, int) and workers >= 1):
        raise ValueError(f"workers must be a whole number >= 1, got {workers!r}")
    res = launch(train, model_fn, data, loss_fn=loss_fn, world_size=workers + 1, timeout=timeout, **kwargs)
    history = res[SERVER]
    return Run(history, loss_curve(model_fn, data, history, loss_fn), res.timeline)
