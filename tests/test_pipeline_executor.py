"""The pipeline executor: every schedule, run on real ranks, trains exactly like one process.

The model is 8 x (Linear(16, 16), Tanh) in float64, 16 layers. Gradients, the loss and
the parameters after one SGD step are compared with single-process training of the
unsplit model on the whole batch: rtol=1e-10, atol=1e-12 (observed differences are
about 1e-17, the order of summation being the only difference). Batches are chosen so
that the micro-batches are not all the same size (10 samples in 3 micro-batches, 13 in 6).
Every launch has a 60 s timeout, so a hang fails the test instead of blocking it.
"""
import pytest
import torch
from torch import nn

import pplab
from pplab import trace
from pplab.pipeline import (PipelineError, PipelineExecutor, ScheduleError, layer_times, make_schedule,
                            partition, run_pipeline, simulate)
from pplab.pipeline.dependencies import messages
from pplab.pipeline.partition import balanced_split

from pipeline_models import data, mlp, reference     # the MLP, its data, one process training it

F64 = torch.float64
RTOL, ATOL = 1e-10, 1e-12
TIMEOUT = 60

# torch imports torch._dynamo the first time an optimizer is built (seconds). Doing it once here,
# before the ranks are forked, keeps every rank of every launch from paying for it again.
torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)




def train(name, p, m, n, chunks, balance, lr):
    layers = mlp()
    optimizer = torch.optim.SGD(nn.Sequential(*layers).parameters(), lr=lr)   # every layer: only ours get grads
    x, y = data(n)
    return run_pipeline(make_schedule(name, p, m, chunks), layers, x, y, nn.MSELoss(),
                        balance=balance, optimizer=optimizer)


@pytest.fixture
def fresh_trace():
    """Tests that run the executor in this process (1 rank) must not leave events behind."""
    trace.reset(0)
    yield
    trace.reset(0)


# ----------------------------------------------------------------------------------
# gradients equal single-process training, for every schedule

CASES = [  # name, p, m, batch, chunks, balance
    ("naive", 2, 3, 10, None, "params"),
    ("naive", 4, 6, 13, None, "params"),
    ("gpipe", 2, 3, 10, None, [6, 10]),
    ("gpipe", 4, 6, 13, None, "params"),
    ("1f1b", 2, 3, 10, None, "params"),
    ("1f1b", 4, 6, 13, None, "time"),
    ("1f1b", 4, 3, 7, None, "params"),                  # fewer micro-batches than stages
    ("interleaved-1f1b", 2, 4, 10, 2, [8, 8]),           # one count per rank, split over 2 chunks
    ("interleaved-1f1b", 2, 4, 10, 3, "params"),
    ("interleaved-1f1b", 4, 8, 13, 2, "params"),
    ("interleaved-1f1b", 4, 6, 13, 2, "params"),         # m not a multiple of p: one group of 6
    ("interleaved-1f1b", 4, 3, 7, 2, "params"),          # fewer micro-batches than ranks
    ("zb-h1", 2, 3, 10, None, "params"),
    ("zb-h1", 4, 6, 13, None, "params"),
    ("zb-v", 2, 3, 10, None, "params"),
    ("zb-v", 4, 6, 13, None, "params"),
]


@pytest.mark.parametrize("name,p,m,n,chunks,balance", CASES, ids=[f"{c[0]}-p{c[1]}-m{c[2]}-{c[5]}" for c in CASES])
def test_gradients_and_sgd_step_equal_single_process(name, p, m, n, chunks, balance):
    lr = 0.1
    results = pplab.launch(train, name, p, m, n, chunks, balance, lr, world_size=p, timeout=TIMEOUT)
    ref_loss, ref_grads, ref_params = reference(n, lr)
    schedule = make_schedule(name, p, m, chunks)

    grads, params = {}, {}
    for r, res in enumerate(results):
        assert res["stages"] == schedule.stages_of(r)
        assert not set(grads) & set(res["grads"])            # no parameter lives on two ranks
        grads.update(res["grads"])
        params.update(res["params"])
    assert set(grads) == set(ref_grads)                       # every parameter, once
    for k in ref_grads:
        torch.testing.assert_close(grads[k], ref_grads[k], rtol=RTOL, atol=ATOL, msg=f"grad of {k}")
        torch.testing.assert_close(params[k], ref_params[k], rtol=RTOL, atol=ATOL, msg=f"{k} after SGD")

    last = schedule.stage_to_rank[-1]
    assert results[last]["loss"] == pytest.approx(ref_loss, rel=1e-12)
    assert all(res["loss"] is None for r, res in enumerate(results) if r != last)

    # the split: contiguous, every layer once, the same on every rank
    bounds = sorted(b for res in results for b in res["layers"].values())
    assert bounds[0][0] == 0 and bounds[-1][1] == 16
    assert all(a[1] == b[0] and a[0] < a[1] for a, b in zip(bounds, bounds[1:]))
    if isinstance(balance, list):
        counts = [results[schedule.stage_to_rank[s]]["layers"][s] for s in range(schedule.num_stages)]
        per_stage = balance if len(balance) == schedule.num_stages else \
            [balance[r] // schedule.chunks for r in schedule.stage_to_rank]
        assert [e - s for s, e in counts] == per_stage

    # activations held: the executor frees at the moments the simulator counts
    assert [res["peak_activations"] for res in results] == pytest.approx(simulate(schedule).peak_activations)


# ----------------------------------------------------------------------------------
# the measured timeline


def timed_run(name, p, m, chunks, compute_time):
    layers = mlp()
    x, y = data(2 * m)
    return run_pipeline(make_schedule(name, p, m, chunks), layers, x, y, nn.MSELoss(), compute_time=compute_time)


@pytest.mark.parametrize("name,p,m,chunks,compute_time", [
    ("1f1b", 4, 4, None, 0.01),
    ("zb-v", 2, 3, None, {"F": 0.01, "B": 0.02, "W": 0.01}),
    ("interleaved-1f1b", 2, 4, 2, 0.01),
])
def test_measured_timeline_follows_the_schedule(name, p, m, chunks, compute_time):
    results = pplab.launch(timed_run, name, p, m, chunks, compute_time, world_size=p, timeout=TIMEOUT)
    schedule, tl = make_schedule(name, p, m, chunks), results.timeline
    chunked = schedule.chunks > 1
    spans = {}                                  # (kind, stage, microbatch) -> measured event
    for r in range(p):
        mine = tl.select(rank=r, category="compute")
        # one span per action, in the schedule's order
        assert [e.label for e in mine] == [a.label(chunked) for a in schedule.actions[r]]
        assert [e.meta["stage"] for e in mine] == [a.stage for a in schedule.actions[r]]
        for e in mine:
            spans[(e.kind, e.meta["stage"], e.meta["microbatch"])] = e
    # each span is padded to at least compute_time (per chunk: 1/v of a rank's share)
    pad = {"F": 0.01, "B": 0.02, "I": 0.01, "W": 0.01}
    assert all(e.duration >= pad[e.kind] / schedule.chunks - 1e-6 for e in spans.values())
    # data flows: nothing starts before what it needs has finished on another rank
    for (kind, s, i), e in spans.items():
        needs = [("F", s - 1)] if kind == "F" and s > 0 else \
            [("B", s + 1), ("I", s + 1)] if kind in "BI" and s + 1 < schedule.num_stages else []
        for k, s2 in needs:
            if (k, s2, i) in spans:
                assert e.start >= spans[(k, s2, i)].end
    # the pipeline fills in order of stage 0, 1, ... (what the simulation shows at its left edge)
    sim = simulate(schedule).timeline()
    first = lambda t, r: min(e.start for e in t.select(rank=r, category="compute"))  # noqa: E731
    order = sorted(range(p), key=lambda r: first(sim, r))
    assert sorted(range(p), key=lambda r: first(tl, r)) == order

    # every message pairs a send with the receive of the same tensor, even where (ZB-V) the
    # two ranks use their messages in different orders
    pairs = tl.messages()
    owner = schedule.stage_to_rank
    crossings = sum(owner[s] != owner[s + 1] for s in range(schedule.num_stages - 1))
    assert len(pairs) == 2 * m * crossings          # each micro-batch: forward and back across each
    for send, recv in pairs:
        assert send.meta["message"] == recv.meta["message"] and send.meta["shape"] == recv.meta["shape"]

    # memory: one hold per F, one release per B or W; the trace's peak is the result's
    assert len(tl.select(category="memory")) == 2 * m * schedule.num_stages
    assert [tl.peak_memory(r) for r in range(p)] == [res["peak_activation_bytes"] for res in results]
    # and the renderer draws it like a simulated run
    pplab.swimlane.draw(tl, memory=True)


def test_activation_bytes_are_what_autograd_saves():
    """1F1B, 4 stages of (Linear, Tanh, Linear, Tanh), micro-batches of 2 samples: autograd keeps
    each Linear's input and each Tanh's output, three (2, 16) float64 tensors = 768 B per
    micro-batch (the loss stage also keeps the targets: 1024 B). Peak = that x micro-batches."""
    p, m = 4, 4
    results = pplab.launch(timed_run, "1f1b", p, m, None, None, world_size=p, timeout=TIMEOUT)
    per_mb = [768, 768, 768, 1024]
    assert [res["peak_activations"] for res in results] == [4, 3, 2, 1]
    assert [res["peak_activation_bytes"] for res in results] == [k * b for k, b in zip([4, 3, 2, 1], per_mb)]


# ----------------------------------------------------------------------------------
# partition


def test_partition_by_params_keeps_free_layers_with_their_linear():
    assert partition(mlp(), 4) == [(0, 4), (4, 8), (8, 12), (12, 16)]
    assert partition(mlp(), 3) == [(0, 6), (6, 12), (12, 16)]      # 3, 3, 2 Linears
    big = [nn.Linear(4, 64), nn.Linear(64, 64), nn.Linear(64, 4), nn.Linear(4, 4)]
    # 320 | 4160 + 260 + 20 = 4440 beats 320 + 4160 = 4480 | 280: the slowest stage decides
    assert partition(big, 2) == [(0, 1), (1, 4)]


def testbalanced_split_minimises_the_slowest_stage():
    assert balanced_split([1, 1, 1, 1, 4], 2) == [4, 1]
    assert balanced_split([5, 1, 1, 1, 1, 1], 2) == [1, 5]
    assert balanced_split([3, 3, 3], 3) == [1, 1, 1]
    assert balanced_split([2] * 7, 3) == [3, 3, 1]            # ties: the later cut
    assert balanced_split([1, 0, 1, 0], 2) == [2, 2]          # a free layer stays with the one before


def test_partition_by_time_gives_a_valid_split():
    layers = mlp()
    times = layer_times(layers, data(4)[0])
    assert len(times) == 16 and all(t > 0 for t in times)
    assert all(p.grad is None for layer in layers for p in layer.parameters())   # measuring leaves no grads
    bounds = partition(layers, 4, "time", sample=data(4)[0])
    assert len(bounds) == 4 and bounds[0][0] == 0 and bounds[-1][1] == 16
    assert all(a[1] == b[0] and a[0] < a[1] for a, b in zip(bounds, bounds[1:]))


def test_partition_per_rank_counts_with_chunks():
    s = make_schedule("zb-v", 2, 3)                   # stages 0, 1, 2, 3 on ranks 0, 1, 1, 0
    assert partition(mlp(), s, [6, 10]) == [(0, 3), (3, 8), (8, 13), (13, 16)]
    assert partition(mlp(), s, [3, 5, 5, 3]) == [(0, 3), (3, 8), (8, 13), (13, 16)]


@pytest.mark.parametrize("layers,stages,balance,message", [
    (mlp()[:4], 6, "params", "got 6 stages for 4 layers: every stage needs at least one layer; use at most 4 "
                             "stages or split the model into more layers"),
    (mlp()[:6], make_schedule("interleaved-1f1b", 4, 4, 2), "params",
     "got 8 stages (4 ranks x 2 chunks) for 6 layers"),
    (mlp(), 4, [4, 4, 4], "balance lists 3 layer counts, but there are 4 stages: give one count per stage"),
    (mlp(), 4, [4, 4, 4, 5], "balance=[4, 4, 4, 5] adds up to 17 layers, but the model has 16: make the "
                             "counts add up to 16"),
    (mlp(), 4, [8, 8, 0, 0], "each count must be a whole number of layers >= 1"),
    (mlp(), make_schedule("interleaved-1f1b", 2, 2, 2), [7, 9],
     "balance gives rank 0 7 layers, which do not split into its 2 chunks: give each rank a multiple of 2 "
     "layers, or one count per stage (4 values)"),
    (mlp(), make_schedule("interleaved-1f1b", 2, 2, 2), [16],
     "balance lists 1 layer counts, but there are 4 stages (2 ranks x 2 chunks): give one count per stage, "
     "or one per rank (2)"),
    (mlp(), 4, "even", "balance must be 'params', 'time' or a list of layer counts, got 'even'"),
    (mlp(), 4, "time", "balance='time' measures each layer on a sample input: pass sample="),
    (mlp() + ["relu"], 4, "params", "layers[16] is a str, not an nn.Module"),
    (mlp(), 0, "params", "the number of stages must be a positive integer, got 0"),
])
def test_partition_errors(layers, stages, balance, message):
    with pytest.raises(PipelineError) as err:
        partition(layers, stages, balance)
    assert message in str(err.value)


# ----------------------------------------------------------------------------------
# bad input: clear errors, on every rank, never a hang


def misfit_layers():
    """Layer 2 widens to 32, so stage 0 (layers 0-3) hands 32 features to layer 4, a Linear(16, ...)."""
    torch.manual_seed(0)
    return [nn.Linear(16, 16, dtype=F64), nn.Tanh(), nn.Linear(16, 32, dtype=F64), nn.Tanh(),
            nn.Linear(16, 16, dtype=F64), nn.Tanh(), nn.Linear(16, 16, dtype=F64), nn.Tanh()]


def error_on_every_rank(make_layers, schedule_args, world=None, targets_width=16, seeded=True):
    """Run a step; return the error this rank raised (as text), or None."""
    import torch.distributed as dist
    if not seeded:
        torch.manual_seed(dist.get_rank())             # each rank a different model: a mistake
        layers = [nn.Linear(16, 16, dtype=F64) for _ in range(4)]
    else:
        layers = make_layers()
    x, _ = data(10)
    y = torch.zeros(10, targets_width, dtype=F64)
    try:
        run_pipeline(make_schedule(*schedule_args), layers, x, y, nn.MSELoss())
    except (PipelineError, ScheduleError) as err:
        return str(err)
    return None


def test_shape_mismatch_between_stages_is_reported_on_every_rank(no_leftover_processes):
    results = pplab.launch(error_on_every_rank, misfit_layers, ("1f1b", 2, 2), world_size=2, timeout=TIMEOUT)
    assert results[0] == results[1] is not None
    assert results[0].startswith(
        "stage 0 (rank 0) outputs shape (5, 32) but stage 1 (rank 1) starts with layer 4 (Linear(in_features=16, "
        "out_features=16, bias=True)), which expects (5, 16): the layers at the split do not fit; check the "
        "model (layer 3 feeds layer 4) or the split")


def test_targets_that_do_not_fit_the_loss_are_reported_on_every_rank():
    results = pplab.launch(error_on_every_rank, mlp, ("gpipe", 2, 2), None, 3, world_size=2, timeout=TIMEOUT)
    assert results[0] == results[1]
    assert results[0].startswith("loss_fn cannot take the last stage's output, shape (5, 16), with targets "
                                 "of shape (5, 3)")


def test_ranks_that_built_different_models_are_told_to_seed():
    results = pplab.launch(error_on_every_rank, None, ("gpipe", 2, 2), None, 16, False, world_size=2,
                           timeout=TIMEOUT)
    assert results[0] == results[1]
    assert "rank 1 built different layers from rank 0" in results[0]
    assert "torch.manual_seed(0) just before creating it" in results[0]


def test_world_size_must_match_the_schedule(no_leftover_processes):
    results = pplab.launch(error_on_every_rank, mlp, ("1f1b", 4, 4), world_size=2, timeout=TIMEOUT)
    assert results[0] == results[1] == \
        "the schedule has 4 ranks but 2 are running: launch with world_size=4"
    # uncaught, as a learner meets it: the launch fails at once and says the same
    with pytest.raises(pplab.LaunchError, match="PipelineError: the schedule has 4 ranks but 2 are running"):
        pplab.launch(train, "1f1b", 4, 4, 8, None, "params", 0.1, world_size=2, timeout=TIMEOUT)


def test_errors_in_one_process(fresh_trace):
    """Two stages on one rank (interleaved, p = 1) run without any process group."""
    s = make_schedule("interleaved-1f1b", 1, 2, chunks=2)
    x, y = data(4)
    with pytest.raises(PipelineError, match=r"stage 0 \(rank 0\) outputs shape \(2, 32\) but stage 1 \(rank 0\)"):
        PipelineExecutor(s, misfit_layers(), nn.MSELoss(), balance=[4, 4]).step(x, y)
    with pytest.raises(PipelineError, match=r"layer 4 \(Linear.*\), inside stage 0, cannot take the output of "
                                            r"layer 3, of shape \(2, 32\): the model does not fit together"):
        PipelineExecutor(s, misfit_layers(), nn.MSELoss(), balance=[6, 2]).step(x, y)
    with pytest.raises(PipelineError, match=r"a batch of 1 inputs and 1 targets cannot make 2 micro-batches"):
        PipelineExecutor(s, mlp(), nn.MSELoss()).step(x[:1], y[:1])
    with pytest.raises(PipelineError, match="loss_fn must return a single number per micro-batch"):
        PipelineExecutor(s, mlp(), nn.MSELoss(reduction="none")).step(x, y)
    with pytest.raises(PipelineError, match="compute_time must be seconds >= 0 per forward, or a dict"):
        PipelineExecutor(s, mlp(), nn.MSELoss(), compute_time={"B": 1})
    with pytest.raises(PipelineError, match="W <= B; got W=3, B=2"):
        PipelineExecutor(s, mlp(), nn.MSELoss(), compute_time={"F": 1, "B": 2, "W": 3})


def test_one_process_run_equals_reference(fresh_trace):
    """p = 1 with two chunks: stage 1 takes its input from its own rank (as at the turn of a V)."""
    s = make_schedule("interleaved-1f1b", 1, 3, chunks=2)
    layers = mlp()
    x, y = data(10)
    out = PipelineExecutor(s, layers, nn.MSELoss()).step(x, y)
    ref_loss, ref_grads, _ = reference(10, 0.1)
    assert out["loss"] == pytest.approx(ref_loss, rel=1e-12)
    for k, g in ref_grads.items():
        torch.testing.assert_close(out["grads"][k], g, rtol=RTOL, atol=ATOL)


def test_receives_are_posted_in_the_senders_order():
    # ZB-V, p = 2: rank 0 sends rank 1 the output of stage 0 and the input gradient of stage 3;
    # rank 1 needs them in another order than rank 0 sends them, so it posts in rank 0's order.
    s = make_schedule("zb-v", 2, 3)
    sent = [("act", a.stage, a.microbatch) if a.kind == "F" else ("grad", a.stage, a.microbatch)
            for a in s.actions[0] if (a.kind == "F" and a.stage == 0) or (a.kind == "I" and a.stage == 3)]
    assert list(messages(s, 1)[0]) == sent
    used = [("act", a.stage - 1, a.microbatch) if a.kind == "F" else ("grad", a.stage + 1, a.microbatch)
            for a in s.actions[1] if (a.kind == "F" and a.stage == 1) or (a.kind == "I" and a.stage == 2)]
    assert sorted(used) == sorted(sent) and used != sent
