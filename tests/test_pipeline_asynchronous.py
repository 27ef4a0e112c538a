"""Asynchronous pipelines (PipeDream, PipeDream-2BW) on real ranks, against one process.

The model is 3 x (Linear(4, 4), Tanh) per stage in float64. The references replay the papers'
update rules in one process with the unsplit nn.Sequential and torch's autograd:
  PipeDream: micro-batch i is run with stage s at version max(0, i-(p-1-s)) (worked out by hand
    from 1F1B's order: p-1-s forwards run ahead of the first backward), then every stage steps
    W_s(i+1) = W_s(i) - lr * its gradient.
  2BW: W(t+1) = W(t) - lr * grad f(W(t-1)) over batch t, W(-1) = W(0).
Compared with rtol=1e-10, atol=1e-12 (observed: about 1e-16; only the order of sums differs).
"""
import itertools

import pytest
import torch
from torch import nn

import pplab
from pplab.pipeline import PipelineError, make_schedule, simulate, validate
from pplab.pipeline.asynchronous import (AsyncPipeline, flushed_steps, idle_after_warmup, versions_held_formula,
                                         weight_version)

F64 = torch.float64
RTOL, ATOL = 1e-10, 1e-12
LR, WIDTH, B = 0.2, 4, 2                      # learning rate, layer width, samples per micro-batch


def layers(p):
    torch.manual_seed(0)
    return [m for _ in range(2 * p) for m in (nn.Linear(WIDTH, WIDTH, dtype=F64), nn.Tanh())]


def stream(n):
    g = torch.Generator().manual_seed(1)
    return torch.randn(n * B, WIDTH, dtype=F64, generator=g), torch.randn(n * B, WIDTH, dtype=F64, generator=g)


def run(method, p, n, m, stash):
    x, y = stream(n)
    pipe = AsyncPipeline(method, p, layers(p), nn.MSELoss(), lr=LR, batch_size=m, stash=stash)
    return pipe.train(x, y, n)


def merged(results, key):
    out = {}
    for res in results:
        out.update(res[key])
    return out


def stage_of(name):
    return int(name.split(".")[0]) // 4            # 4 layers (2 Linear + 2 Tanh) per stage


def grads_at(model, weights, x, y):
    """Loss and gradients of the unsplit model with these weights ({name: tensor}) on (x, y)."""
    with torch.no_grad():
        for k, w in model.named_parameters():
            w.copy_(weights[k])
    model.zero_grad()
    loss = nn.MSELoss()(model(x), y)
    loss.backward()
    return loss.item(), {k: w.grad.clone() for k, w in model.named_parameters()}


def pipedream_reference(p, n):
    """Versions per stage, per-micro-batch gradients and losses, replayed in one process."""
    model = nn.Sequential(*layers(p))
    x, y = stream(n)
    xs, ys = torch.tensor_split(x, n), torch.tensor_split(y, n)
    start = {k: w.detach().clone() for k, w in model.named_parameters()}
    history = {s: [{k: w for k, w in start.items() if stage_of(k) == s}] for s in range(p)}
    grads, losses = {}, []
    for i in range(n):
        weights = {}
        for s in range(p):
            weights.update(history[s][max(0, i - (p - 1 - s))])
        loss, g = grads_at(model, weights, xs[i], ys[i])
        losses.append(loss)
        for s in range(p):
            grads[(s, i)] = {k: v for k, v in g.items() if stage_of(k) == s}
            history[s].append({k: w - LR * g[k] for k, w in history[s][-1].items()})
    return history, grads, losses


def close(a, b):
    return all(torch.allclose(a[k], b[k], rtol=RTOL, atol=ATOL) for k in b) and set(a) == set(b)


# ----------------------------------------------------------------------------------
# PipeDream with weight stashing: every gradient is the gradient of the version it used

@pytest.mark.parametrize("p,n", [(3, 8), (2, 5), (4, 7)])
def test_pipedream_gradients_equal_one_process_at_the_stashed_versions(p, n):
    results = pplab.launch(run, "pipedream", p, n, 1, True, world_size=p)
    versions = merged(results, "versions")
    # staleness, by hand for p = 3: stage 0 runs 2 forwards ahead, stage 1 one, stage 2 none
    if p == 3:
        assert [versions[(0, i)] for i in range(n)] == [0, 0, 0, 1, 2, 3, 4, 5]
        assert [versions[(1, i)] for i in range(n)] == [0, 0, 1, 2, 3, 4, 5, 6]
        assert [versions[(2, i)] for i in range(n)] == list(range(n))
    assert versions == {(s, i): weight_version("pipedream", s, i, p) for s in range(p) for i in range(n)}

    history, grads, losses = pipedream_reference(p, n)
    got_grads, got_history = merged(results, "grads"), merged(results, "history")
    for (s, i), g in grads.items():
        assert close(got_grads[(s, i)], g), f"stage {s}, micro-batch {i}: not the gradient at its stashed version"
    for s in range(p):
        assert len(got_history[s]) == n + 1                  # one version per backward, plus the first
        for k, ref in enumerate(history[s]):
            assert close(got_history[s][k], ref), f"stage {s}, version {k}"
    assert results[p - 1]["losses"] == pytest.approx(losses, rel=1e-12)
    assert all(not res["losses"] for res in results[:-1])

    # memory: stage s keeps up to p - s versions, counted from the tensors still alive
    for r, res in enumerate(results):
        assert res["peak_versions"] == {r: versions_held_formula("pipedream", r, p)} == {r: p - r}


def test_without_stashing_the_gradients_are_no_versions_gradients():
    """The backward then runs through the newest weights on activations of older ones. Every
    gradient of an in-flight micro-batch (stages before the last, after the first backward)
    differs from the gradient of the model at every combination of versions that ever
    existed; with no update in between (the last stage, micro-batch 0), it is exact."""
    p, n = 3, 5
    results = pplab.launch(run, "pipedream", p, n, 1, False, world_size=p)
    versions, got, history = merged(results, "versions"), merged(results, "grads"), merged(results, "history")
    # a forward sees the weights as they are, the same versions as with stashing; its backward sees i updates
    assert versions == {(s, i): weight_version("pipedream", s, i, p) for s in range(p) for i in range(n)}
    model = nn.Sequential(*layers(p))
    x, y = stream(n)
    xs, ys = torch.tensor_split(x, n), torch.tensor_split(y, n)
    candidates = {i: [] for i in range(n)}          # the gradient at every combination of versions
    for combo in itertools.product(*(range(len(history[s])) for s in range(p))):
        weights = {}
        for s, k in enumerate(combo):
            weights.update(history[s][k])
        for i in range(n):
            candidates[i].append(grads_at(model, weights, xs[i], ys[i])[1])

    def distance(g, ref):
        return max(((g[k] - ref[k]).abs().max() / ref[k].abs().max()).item() for k in g)

    for (s, i), g in got.items():
        nearest = min(distance(g, c) for c in candidates[i])
        stale = s < p - 1 and i > 0                  # the stage was updated between its forward and backward
        if stale:
            assert nearest > 1e-4, f"stage {s}, micro-batch {i}: matched a version's gradient ({nearest:.1e})"
        elif s == p - 1:                             # the last stage: forward and backward back to back
            assert nearest < 1e-10, f"stage {s}, micro-batch {i}: should be a true gradient ({nearest:.1e})"
    assert all(res["peak_versions"] == {r: 1} for r, res in enumerate(results))   # one copy: nothing stashed


# ----------------------------------------------------------------------------------
# PipeDream-2BW: the delayed-by-one rule, two versions

@pytest.mark.parametrize("p,m,batches", [(3, 3, 4), (2, 3, 3), (4, 5, 3)])
def test_2bw_equals_the_delayed_update_rule_in_one_process(p, m, batches):
    n = m * batches
    results = pplab.launch(run, "pipedream-2bw", p, n, m, True, world_size=p)
    versions = merged(results, "versions")
    assert versions == {(s, i): max(0, i // m - 1) for s in range(p) for i in range(n)}

    model = nn.Sequential(*layers(p))
    x, y = stream(n)
    xs, ys = torch.tensor_split(x, batches), torch.tensor_split(y, batches)   # one batch = m micro-batches
    W = [{k: w.detach().clone() for k, w in model.named_parameters()}]        # W(0)
    for t in range(batches):
        _, g = grads_at(model, W[max(0, t - 1)], xs[t], ys[t])                 # grad f(W(t-1)), W(-1) = W(0)
        W.append({k: w - LR * g[k] for k, w in W[t].items()})                  # W(t+1) = W(t) - lr * that
    history = merged(results, "history")
    for s in range(p):
        assert len(history[s]) == batches + 1
        for t, ref in enumerate(W):
            mine = {k: w for k, w in ref.items() if stage_of(k) == s}
            assert close(history[s][t], mine), f"stage {s}, W({t})"
    assert close(merged(results, "params"), W[-1])
    # the losses the last stage reports: each micro-batch's own mean loss at the weights it used, W(t-1)
    # in batch t; the 1/m weighting of the update is not the loss (a report divided by m fails here)
    xm, ym = torch.tensor_split(x, n), torch.tensor_split(y, n)
    want = [grads_at(model, W[max(0, i // m - 1)], xm[i], ym[i])[0] for i in range(n)]
    assert results[p - 1]["losses"] == pytest.approx(want, rel=1e-9)
    assert all(not res["losses"] for res in results[:-1])
    for r, res in enumerate(results):
        assert res["peak_versions"] == {r: versions_held_formula("pipedream-2bw", r, p)} == {r: 2}
        # bytes: the versions held times one version's bytes, from pplab.memory
        assert max(res["held_bytes"][r]) == 2 * res["version_bytes"][r]


# ----------------------------------------------------------------------------------
# The simulator: no bubble after the warm-up; the flushed pipeline pays it every step

@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("t_b", [1.0, 2.0, 3.0])
def test_no_idle_time_after_warmup(p, t_b):
    m, steps = 4, 3
    stream_ = simulate(make_schedule("pipedream", p, m * steps), t_f=1.0, t_b=t_b)
    flushed = simulate(flushed_steps(p, m, steps), t_f=1.0, t_b=t_b)
    for r in range(p):
        assert idle_after_warmup(stream_.timeline(), r) == 0.0
        assert stream_.bubble[r] == pytest.approx((p - 1) * (1 + t_b))         # fill and drain, once
        assert flushed.bubble[r] == pytest.approx(steps * (p - 1) * (1 + t_b))  # once per step
        assert idle_after_warmup(flushed.timeline(), r) > 0


def test_idle_after_warmup_by_hand():
    """Two flushed steps of 1F1B, p = 2, m = 2, t_f = 1, t_b = 2. Rank 0: F0 F1 [0, 2], B0 [4, 6],
    B1 [7, 9], F2 F3 [9, 11], then the drain: idle 6-7 between its first backward and its last
    forward. Rank 1: F0 B0 F1 B1 [1, 7], F2 at 10 (rank 0's F2 ends then): idle 7-10."""
    timeline = simulate(flushed_steps(2, 2, 2), t_f=1.0, t_b=2.0).timeline()
    assert [idle_after_warmup(timeline, r) for r in range(2)] == [1.0, 3.0]


def test_the_stream_is_1f1b_order_and_flushed_steps_validate():
    s = make_schedule("pipedream-2bw", 3, 6)
    assert s.actions == make_schedule("1f1b", 3, 6).actions
    validate(flushed_steps(3, 2, 3))
    assert [a.label() for a in flushed_steps(2, 2, 2).actions[1]] == ["F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3"]


def test_bad_input_says_what_to_change():
    with pytest.raises(PipelineError, match="batch_size .* >= p"):
        AsyncPipeline("pipedream-2bw", 3, layers(3), nn.MSELoss(), batch_size=2)
    with pytest.raises(PipelineError, match="unknown asynchronous method"):
        weight_version("gpipe", 0, 0, 2)
    with pytest.raises(PipelineError, match="stash=False"):
        AsyncPipeline("pipedream-2bw", 1, layers(1), nn.MSELoss(), batch_size=2, stash=False)
    pipe = AsyncPipeline("pipedream", 1, layers(1), nn.MSELoss())
    x, y = stream(3)
    with pytest.raises(PipelineError, match="equal micro-batches"):
        pipe.train(x, y, 4)
    with pytest.raises(PipelineError, match="call train"):
        pipe.step(x, y)
    with pytest.raises(PipelineError, match="multiple of 3"):
        AsyncPipeline("pipedream-2bw", 1, layers(1), nn.MSELoss(), batch_size=3).train(x, y, 2)


@pytest.mark.parametrize("p,n", [(3, 7), (4, 9), (2, 4)])
def test_torch_validates_and_simulates_the_stream(p, n):
    """torch.distributed.pipelining's own checks: its validator, then its simulator after adding
    the sends and receives (it raises on a deadlock); every F and B must come out of it."""
    from torch.distributed.pipelining.schedules import (_Action, _add_send_recv, _ComputationType,
                                                        _simulate_comms_compute, _validate_schedule)
    s = make_schedule("pipedream", p, n)
    kind = {"F": _ComputationType.FORWARD, "B": _ComputationType.FULL_BACKWARD}
    order = {r: [_Action(a.stage, kind[a.kind], a.microbatch) for a in acts] for r, acts in enumerate(s.actions)}
    _validate_schedule(order, p, p, n)
    simulated = _simulate_comms_compute(_add_send_recv(order, s.stage_to_rank.__getitem__, p),
                                        s.stage_to_rank.__getitem__, p)
    for r in range(p):
        done = [a for a in simulated[r] if a is not None and a.computation_type in kind.values()]
        assert sorted((a.computation_type.name, a.microbatch_index) for a in done) == \
            sorted((kind[a.kind].name, a.microbatch) for a in s.actions[r])
