"""pplab.data_parallel.parameter_server: synchronous training equals single-process gradient descent on
all the data, the server's link carries exactly 2·W·d numbers a step (a ring, 2(W-1)/W·d
per rank), the asynchronous protocol applies exactly the stale gradients it says it does,
and too much staleness makes a step size that worked diverge.

Tolerances: float64 runs agree with the references to rtol=atol=1e-12 (the server sums
the workers' shard gradients; the reference takes one gradient over all samples: the
same numbers added in another order). Bytes are exact.
"""
import pytest
import torch
import torch.nn.functional as F

import pplab
from pplab import collectives
from pplab.data_parallel import parameter_server as ps

pytestmark = pytest.mark.usefixtures("no_leftover_processes")
TIGHT = dict(rtol=1e-12, atol=1e-12)


def _data(n, d_in, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(n, d_in, generator=g, dtype=dtype)
    y = X @ torch.randn(d_in, 1, generator=g, dtype=dtype) + 0.1 * torch.randn(n, 1, generator=g, dtype=dtype)
    return X, y


def _mlp():                                       # a tiny non-linear model, d = 5·4 + 4 + 4 + 1 = 29
    return torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1)).double()


def _sgd_reference(model_fn, X, y, steps, lr):
    """torch's own SGD on all the samples at once, one process."""
    torch.manual_seed(0)                          # the seed train_sync builds the model with
    model = model_fn()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    history = [ps.flat_params(model).clone()]
    for _ in range(steps):
        opt.zero_grad()
        F.mse_loss(model(X), y).backward()
        opt.step()
        history.append(ps.flat_params(model).clone())
    return torch.stack(history)


@pytest.mark.parametrize("workers", [1, 2, 3, 4])
def test_sync_equals_single_process_sgd_even_with_uneven_shards(workers):
    X, y = _data(10, 5)                           # 10 samples: shards 10 | 5,5 | 4,3,3 | 3,3,2,2
    run = ps.run(ps.train_sync, _mlp, (X, y), workers=workers, steps=15, lr=0.2)
    ref = _sgd_reference(_mlp, X, y, 15, 0.2)
    assert run.history.shape == (16, 29)
    torch.testing.assert_close(run.history, ref, **TIGHT)
    assert run.losses[-1] < 0.5 * run.losses[0]   # and it did learn something
    assert [len(s) for s, _ in ps.shards((X, y), workers)] == {1: [10], 2: [5, 5], 3: [4, 3, 3],
                                                               4: [3, 3, 2, 2]}[workers]


def test_bytes_server_link_2Wd_against_ring_2_W_minus_1_over_W_d():
    X, y = _data(30, 11, dtype=torch.float32)
    d, W, steps, B = 12, 3, 5, 4                  # Linear(11, 1): d = 12 numbers of 4 bytes
    run = ps.run(ps.train_sync, lambda: torch.nn.Linear(11, 1), (X, y), workers=W, steps=steps, lr=0.1)
    tl = run.timeline
    assert tl.bytes_sent(0) == tl.bytes_received(0) == steps * W * d * B
    assert run.server_link_bytes == steps * 2 * W * d * B == 1440
    for w in range(1, W + 1):
        assert tl.bytes_sent(w) == tl.bytes_received(w) == steps * d * B
        assert {e.peer for e in tl.select(w, "comm")} == {0}          # workers talk only to the server
    assert len(tl.messages()) == 2 * W * steps                         # every send met its receive
    assert len(tl.select(0, "compute", "update")) == steps
    assert all(len(tl.select(w, "compute", "grad")) == steps for w in range(1, W + 1))

    def ring():                                   # the same W workers, no server, one all-reduce
        collectives.all_reduce(torch.zeros(d), algorithm="ring")

    rt = pplab.launch(ring, world_size=W).timeline
    for r in range(W):
        assert rt.bytes_sent(r) == rt.bytes_received(r) == 2 * (W - 1) * d * B // W == 64
    # One step: the server's link carries 2·W·d = 72 numbers, a ring rank's 2·2(W-1)/W·d = 32.
    assert ps.link_bytes(tl, 0) // steps == 288 and ps.link_bytes(rt, 0) == 128


def test_one_step_sent_and_received_by_phase():
    """One synchronous step, W = 3, d = 12 float32 (48 bytes): before computing, a worker has
    received d and sent nothing; after, it has sent d. Before updating, the server has sent d
    to each worker (W·d in all) and received d from each: then it sends nothing more."""
    X, y = _data(30, 11, dtype=torch.float32)
    W, d = 3, 12 * 4
    tl = ps.run(ps.train_sync, lambda: torch.nn.Linear(11, 1), (X, y), workers=W, steps=1, lr=0.1).timeline

    def traffic(rank, before=None, after=None):       # (sent, received, peers) in a time window
        es = [e for e in tl.select(rank, "comm") if (before is None or e.start < before)
              and (after is None or e.start >= after)]
        return sum(e.bytes_sent for e in es), sum(e.bytes_recv for e in es), sorted(e.peer for e in es)

    for w in range(1, W + 1):
        (grad,) = tl.select(w, "compute", "grad")
        assert traffic(w, before=grad.start) == (0, d, [0])
        assert traffic(w, after=grad.end) == (d, 0, [0])
    (update,) = tl.select(0, "compute", "update")
    assert traffic(0, before=update.start) == (W * d, W * d, [1, 1, 2, 2, 3, 3])
    assert traffic(0, after=update.end) == (0, 0, [])
    pull = [e for e in tl.select(0, "comm") if e.kind == "send"]
    push = [e for e in tl.select(0, "comm") if e.kind == "recv"]
    assert [(e.peer, e.bytes_sent, e.bytes_recv) for e in pull] == [(w, d, 0) for w in range(1, W + 1)]
    assert [(e.peer, e.bytes_sent, e.bytes_recv) for e in push] == [(w, 0, d) for w in range(1, W + 1)]
    assert max(e.end for e in pull) <= min(e.end for e in push)   # no gradient before its parameters


def test_shards_one_sample_per_worker_is_enough():
    X, y = _data(3, 5)
    parts = ps.shards((X, y), 3)
    assert [len(a) for a, _ in parts] == [1, 1, 1]
    assert all(torch.equal(a, X[w:w + 1]) and torch.equal(b, y[w:w + 1]) for w, (a, b) in enumerate(parts))


def _grad_at(params, X, y):
    """The gradient of the mean squared error of _mlp at flat `params` (plain autograd)."""
    model = _mlp()
    torch.nn.utils.vector_to_parameters(params.clone(), model.parameters())
    F.mse_loss(model(X), y).backward()
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def _sequential_reference(model_fn, X, y, W, updates, lr):
    """Staleness 0: the workers take turns, each gradient on the latest parameters."""
    torch.manual_seed(0)
    params = ps.flat_params(model_fn()).clone()
    parts = [(a, b) for a, b in zip(X.tensor_split(W), y.tensor_split(W))]
    history = [params.clone()]
    for u in range(updates):
        Xw, yw = parts[u % W]
        params = params - lr * (W * len(Xw) / len(X)) * _grad_at(params, Xw, yw)
        history.append(params.clone())
    return torch.stack(history)


def test_async_staleness_zero_is_sequential_sgd():
    X, y = _data(10, 5)                           # uneven shards 4, 3, 3
    run = ps.run(ps.train_async, _mlp, (X, y), workers=3, updates=20, lr=0.1, staleness=0)
    torch.testing.assert_close(run.history, _sequential_reference(_mlp, X, y, 3, 20, 0.1), **TIGHT)


@pytest.mark.parametrize("staleness", [2, 5])
def test_async_applies_exactly_the_stale_gradients_it_promises(staleness):
    """Recompute every update from the history: update u must be worker u mod W's
    gradient at version max(0, u - staleness). Bytes: d numbers each way per update."""
    X, y = _data(10, 5)
    W, U, lr = 3, 14, 0.05
    run = ps.run(ps.train_async, _mlp, (X, y), workers=W, updates=U, lr=lr, staleness=staleness)
    h = run.history
    parts = list(zip(X.tensor_split(W), y.tensor_split(W)))
    for u in range(U):
        Xw, yw = parts[u % W]
        g = _grad_at(h[max(0, u - staleness)], Xw, yw)
        torch.testing.assert_close(h[u + 1], h[u] - lr * (W * len(Xw) / len(X)) * g, **TIGHT)
    tl, d = run.timeline, h.shape[1]
    assert run.server_link_bytes == 2 * U * d * 8
    for w in range(1, W + 1):                     # worker w computes updates w-1, w-1+W, ...
        mine = len(range(w - 1, U, W))
        assert tl.bytes_sent(w) == tl.bytes_received(w) == mine * d * 8
        assert [e.label for e in tl.select(w, "compute", "grad")] == [f"g{u}" for u in range(w - 1, U, W)]


def test_too_much_staleness_diverges_at_a_step_size_that_works_without_it():
    """Linear regression, 3 workers, lr = 0.1, 60 updates. Staleness 0 (turns) and 2 (= W-1,
    what 3 equally fast workers see) end within 1% of the least-squares loss; staleness 6
    and 12 end above the loss they started from. (At smaller lr a little staleness can even
    help early on, like momentum; the robust fact is that the stable step size shrinks.)"""
    X, y = _data(120, 8, dtype=torch.float32)
    Xa = torch.cat([X, torch.ones(len(X), 1)], 1)
    best = float(F.mse_loss(Xa @ torch.linalg.lstsq(Xa, y).solution, y))
    final = {}
    for tau in (0, 2, 6, 12):
        run = ps.run(ps.train_async, lambda: torch.nn.Linear(8, 1), (X, y), workers=3, updates=60,
                     lr=0.1, staleness=tau)
        final[tau], start = run.losses[-1], run.losses[0]
    assert final[0] < 1.01 * best and final[2] < 1.01 * best, (final, best)
    assert final[6] > start and final[12] > start, (final, start)


def test_bad_input_says_what_to_change():
    X, y = _data(10, 5)
    with pytest.raises(pplab.LaunchError, match="at least 2 ranks.*world_size=1"):
        pplab.launch(ps.train_sync, _mlp, (X, y), steps=1, lr=0.1, world_size=1, timeout=30)
    with pytest.raises(pplab.LaunchError, match="N=2 samples for W=3 workers"):
        ps.run(ps.train_sync, _mlp, (X[:2], y[:2]), workers=3, steps=1, lr=0.1, timeout=30)
    with pytest.raises(pplab.LaunchError, match="staleness must be a whole number"):
        ps.run(ps.train_async, _mlp, (X, y), workers=2, updates=4, lr=0.1, staleness=-1, timeout=30)
    with pytest.raises(ValueError, match="workers must be"):
        ps.run(ps.train_sync, _mlp, (X, y), workers=0, steps=1, lr=0.1)
