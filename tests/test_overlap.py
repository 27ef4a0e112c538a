"""pplab.data_parallel.overlap: overlap read from the trace, variants taking turns, and the stand-in accelerator.

The stand-in sleeps; tests only use lower bounds on its times (a sleep is never shorter
than asked), never upper bounds, which would depend on the machine's load.
"""
import pytest
import torch
from torch import nn

import pplab
from pplab.data_parallel import overlap
from pplab.data_parallel import DDP, shard
from pplab.trace import Event

from test_data_parallel import TOL, data, loss_fn, make_model, max_diff, single_process

T_F = 0.004                     # seconds per layer forward in the stand-in (backward 2 T_F)


# ----------------------------------------------------------------------------------
# overlap_per_step: a pure function of events, checked on events made by hand


def ar(start, end, bucket, payload=100):
    return Event(0, "all_reduce", "comm", start, end, f"AR{bucket}", meta={"bucket": bucket, "payload": payload})


def test_overlap_per_step_counts_union_of_flight_under_backward():
    events = [Event(0, "F", "compute", 0.0, 1.0),
              Event(0, "B", "compute", 1.0, 3.0, meta={"sync": True}),
              ar(2.0, 2.5, 0), ar(2.2, 4.0, 1),         # overlapping boxes: in flight 2.0-4.0
              Event(0, "all_gather", "comm", 4.0, 4.1, "n"),
              Event(0, "B", "compute", 5.0, 6.0, meta={"sync": False}),   # no_sync: not a step
              Event(0, "B", "compute", 7.0, 8.0, meta={"sync": True}),
              ar(8.0, 9.0, 0, payload=300)]             # overlap off: all after backward
    first, second = overlap.overlap_per_step(events)
    assert (first.backward, first.comm, first.all_reduces, first.payload) == (2.0, 2.0, 2, 200)
    assert first.hidden == pytest.approx(0.5) and first.exposed == pytest.approx(1.0)
    assert (second.hidden, second.exposed, second.all_reduces, second.payload) == (0.0, 1.0, 1, 300)


def test_median_and_range():
    assert overlap.median_and_range([3, 1, 2, 10]) == (2.5, 1, 10)


# ----------------------------------------------------------------------------------
# stand_in_compute in one process: the waits are there, in the right place, and removable


def test_stand_in_waits_before_each_gradient_is_stored_and_changes_no_number():
    model, (x, y) = make_model(layers=3), data()
    reference = make_model(layers=3)
    hooks = overlap.stand_in_compute(model, T_F)
    stored = {}
    def when_stored(name):
        def hook(param):
            stored[name] = pplab.trace.now()
        return hook

    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(when_stored(name))
    start = pplab.trace.now()
    out = model(x)
    forward_done = pplab.trace.now()
    nn.functional.mse_loss(out, y).backward()
    assert forward_done - start >= 3 * T_F                          # 3 layers, T_F each
    # backward runs the layers last to first, 2 T_F each, back to back: layer k's gradient
    # (k = 2, 1, 0) is stored no earlier than (3 - k) * 2 T_F after backward began
    for k in range(3):
        assert stored[f"{2 * k}.weight"] - forward_done >= (3 - k) * 2 * T_F - 1e-4
    nn.functional.mse_loss(reference(x), y).backward()
    assert max_diff([p.grad for p in model.parameters()], [p.grad for p in reference.parameters()]) == 0
    hooks.remove()
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    assert not any(p._backward_hooks for p in model.parameters())


def test_stand_in_compute_takes_a_dict_and_refuses_bad_input():
    model = make_model(layers=2)
    start = pplab.trace.now()
    overlap.stand_in_compute(model, {"F": 0.002, "B": 0.01})
    model(data()[0]).sum().backward()
    assert pplab.trace.now() - start >= 2 * 0.002 + 2 * 0.01
    for bad in (-1, "fast", None, True, {"B": 0.01}, {"F": 0.01, "X": 1}, {"F": -0.1}):
        with pytest.raises(ValueError, match="compute_time must be seconds"):
            overlap.stand_in_compute(make_model(), bad)
    with pytest.raises(ValueError, match="has no parameters"):
        overlap.stand_in_compute(nn.Tanh(), T_F)


# ----------------------------------------------------------------------------------
# On ranks: DDP under the stand-in still equals one process; turns and per-step timelines


def ddp_variants_in_turn(steps):
    models = {}
    for name, wait in (("plain", None), ("stand-in", T_F)):
        model = make_model(seed=pplab.comm.rank())               # DDP broadcasts rank 0's
        if wait:
            overlap.stand_in_compute(model, wait)
        ddp = DDP(model, bucket_cap_mb=5e-4)
        models[name] = (ddp, torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.5))
    x, y = shard(data())

    def step(name):
        ddp, opt = models[name]
        loss_fn(ddp, x, y).backward()
        opt.step()
        opt.zero_grad()

    turns = overlap.steps_in_turn({name: (lambda name=name: step(name)) for name in models}, steps, warmup=1)
    params = {name: [p.detach().clone() for p in ddp.parameters()] for name, (ddp, _) in models.items()}
    return turns, params, len(models["plain"][0].buckets)


@pytest.mark.parametrize("p", [2, 3])
def test_ddp_with_the_stand_in_equals_single_process_and_steps_take_turns(p):
    steps = 2
    results = pplab.launch(ddp_variants_in_turn, steps, world_size=p, timeout=60)
    reference = single_process("sgd", steps + 1)                 # + the warm-up step
    for turns, params, _ in results:
        for name in ("plain", "stand-in"):
            assert max_diff(params[name], reference) <= TOL, name
        starts = sorted((start, name) for name in turns for start, _, _ in turns[name])
        assert [name for _, name in starts] == ["plain", "stand-in"] * steps      # one step each, in turn
    n_buckets = results[0][2]
    for name in ("plain", "stand-in"):
        measured = overlap.measured_steps([turns for turns, _, _ in results], name)
        assert len(measured) == steps
        for s in measured:
            assert s.overlap.all_reduces == n_buckets > 1
            assert s.timeline.world_size == p and len(s.timeline.select(kind="F")) == p   # this step only
            assert s.seconds >= s.overlap.backward > 0
            if name == "stand-in":                                # 3 layers of 2 T_F, back to back
                assert s.overlap.backward >= 3 * 2 * T_F - 1e-4
                assert min(e.duration for e in s.timeline.select(kind="F")) >= 3 * T_F


def test_an_all_reduce_belongs_to_the_step_whose_backward_it_follows():
    # overlap on in both steps: step 2's first all-reduce starts inside step 2's backward, so it is
    # step 2's alone (a step ends where the next backward starts, not where it ends)
    events = [Event(0, "B", "compute", 0.0, 2.0, meta={"sync": True}), ar(1.0, 2.5, 0),
              Event(0, "B", "compute", 4.0, 6.0, meta={"sync": True}), ar(5.0, 6.5, 0, payload=300)]
    first, second = overlap.overlap_per_step(events)
    assert (first.all_reduces, first.payload, first.comm, first.exposed) == (1, 100, 1.5, 0.5)
    assert (second.all_reduces, second.payload, second.comm, second.exposed) == (1, 300, 1.5, 0.5)


def test_measured_steps_runs_from_the_first_start_to_the_last_end():
    """Two ranks' steps_in_turn results made by hand: a step lasts from the earliest rank's
    start to the latest rank's end, and its timeline starts at the earliest start."""
    def rank(r, start, end):
        return {"v": [(start, end, [Event(r, "F", "compute", start, start + 0.5),
                                    Event(r, "B", "compute", start + 0.5, end, meta={"sync": True})])]}
    (step,) = overlap.measured_steps([rank(0, 10.0, 12.0), rank(1, 10.5, 13.0)], "v")
    assert step.seconds == 3.0
    assert [(e.rank, e.kind, e.start) for e in step.timeline.select(kind="F")] == [(0, "F", 0.0), (1, "F", 0.5)]
    assert step.overlap.backward == 1.5 and step.overlap.all_reduces == 0


def test_stand_in_queues_layers_back_to_back_so_host_work_between_them_hides():
    """On a fake clock (time.sleep advances it; nothing real waits): 3 layers of T_F each, and
    host work h < T_F after each layer. The accelerator runs the layers back to back, so the
    host work between them hides under the next layer's time: forward ends at 3·T_F + h (the
    last layer's host work shows), not 3·(T_F + h) as if each layer began after the host."""
    clock = [0.0]

    def sleep(dt):
        clock[0] += max(0.0, dt)
    h = T_F / 4
    model = make_model(layers=3)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(overlap, "now", lambda: clock[0])
        mp.setattr(overlap.time, "sleep", sleep)
        overlap.stand_in_compute(model, T_F)
        for layer in (m for m in model if isinstance(m, nn.Linear)):
            layer.register_forward_hook(lambda *args: sleep(h))      # host work after each layer
        model(data()[0])
    assert clock[0] == pytest.approx(3 * T_F + h, abs=1e-12)
