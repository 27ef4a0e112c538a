"""pplab.hybrid and pplab.models.gpt: the tiny GPT trained on a mesh equals the same training
on one process, for every layout of 4 ranks (and dp=2×tp=2×pp=2 on 8).

float64. "Equal" means: the global batch's mean loss after each of STEPS AdamW steps within
TOL = 1e-10 of the single-process loss, and every parameter shard this rank holds after
training within TOL of the same shard cut from the single-process model (parallel_layers, the
split whose forward test_tensor_parallel_transformer shows equal to the dense one). The
parameters move by ~1e-2 in those steps, so a wrong gradient shows.
"""
import math

import pytest
import torch
from torch import nn

import pplab
from pplab import data
from pplab.hybrid import GPTConfig, check_layout, comm_rows, layouts, train, train_single
from pplab.mesh import Mesh
from pplab.models import gpt_layers, gpt_loss, parallel_layers

pytestmark = pytest.mark.usefixtures("no_leftover_processes")

TOL = 1e-10
STEPS, BATCH = 3, 8
CFG = GPTConfig(vocab=len(data.VOCAB), seq=8, hidden=16, heads=4, ffn=24, layers=2)   # vocab 31: uneven over 2, 4


def compare_job(sizes, kw):
    mesh = Mesh(**sizes)
    out = train(CFG, mesh, steps=STEPS, batch_size=BATCH, **kw)
    ref_losses, ref_layers = train_single(CFG, steps=STEPS, batch_size=BATCH)
    tp = mesh.tp_group if mesh.size("tp") > 1 else None
    expect = parallel_layers(ref_layers, tp, kw.get("sequence_parallel", False)) if tp is not None else ref_layers
    expect = dict(nn.Sequential(*expect).named_parameters())
    start = dict(nn.Sequential(*(parallel_layers(gpt_layers(CFG), tp) if tp is not None else gpt_layers(CFG)))
                 .named_parameters())
    return {"losses": out["losses"], "ref": ref_losses, "names": sorted(out["params"]),
            "param_diff": max((p - expect[n]).abs().max().item() for n, p in out["params"].items()),
            "moved": min((p - start[n]).abs().max().item() for n, p in out["params"].items()),
            "state": out["state_bytes"]}


LAYOUTS_4 = [({"dp": 4}, {}),                                        # DDP
             ({"dp": 2, "tp": 2}, {}),                               # DDP over dp, TP inside
             ({"dp": 2, "tp": 2}, {"zero": 1, "sequence_parallel": True}),
             ({"pp": 2, "dp": 2}, {"zero": 1}),                      # ZeRO-1 over dp, 1F1B over pp
             ({"pp": 2, "tp": 2}, {"schedule": "gpipe"}),
             ({"tp": 4}, {"sequence_parallel": True}),
             ({"pp": 4}, {"microbatches": 4}),
             ({"pp": 2, "tp": 2}, {"schedule": "zb-v", "microbatches": 4}),      # the last stage on pp rank 0
             ({"pp": 2, "dp": 2}, {"schedule": "interleaved-1f1b", "zero": 1}),
             ({"dp": 4}, {"zero": 2}),
             ({"pp": 2, "dp": 2}, {}),                               # DDP's all-reduce once per step, after the flush
             ({"pp": 2, "dp": 2}, {"schedule": "zb-v"}),             # ... also where W, not a hook, fills .grad
             ({"dp": 4}, {"zero": 3}),                               # FullyShardedModule over dp
             ({"dp": 2, "tp": 2}, {"zero": 3}),                      # ... sharding each rank's TP shards
             ({"pp": 2, "dp": 2}, {"zero": 3}),                      # ... one per stage, gathered per micro-batch
             ({"pp": 2, "dp": 2}, {"zero": 2})]                      # ZeRO-2 under 1F1B: a reduce-scatter per micro-batch


def check_equal(results, sizes):
    names = set()
    for r, res in enumerate(results):
        assert all(abs(a - b) <= TOL for a, b in zip(res["losses"], res["ref"])), (sizes, r, res["losses"], res["ref"])
        assert res["param_diff"] <= TOL, (sizes, r, res["param_diff"])
        assert res["moved"] > 1e-4, (sizes, r, res["moved"])            # training really changed every parameter
        names |= set(res["names"])
    assert names == {n for n, _ in nn.Sequential(*gpt_layers(CFG)).named_parameters()}   # every parameter is somewhere


@pytest.mark.parametrize("sizes,kw", LAYOUTS_4, ids=[f"{s}{k}" for s, k in LAYOUTS_4])
def test_every_4_rank_layout_trains_like_one_process(sizes, kw):
    results = pplab.launch(compare_job, sizes, kw, world_size=4)
    check_equal(results, sizes)
    # model state held, measured from the tensors: float64 parameters, gradients, AdamW's 2 moments
    psi, state = CFG.parameters(), [r["state"] for r in results]
    if sizes == {"dp": 4} and not kw:
        assert state == [4 * 8 * psi] * 4                     # DDP: a full copy on every rank
    if sizes == {"pp": 4}:
        assert sum(state) == 4 * 8 * psi                      # stages: each layer on one rank only
    if sizes == {"dp": 4} and kw.get("zero") == 2:            # ZeRO-2: params whole, the rest split (+ padding)
        assert all(0 <= s - (8 * psi + 3 * 8 * psi / 4) < 8 * 4 * 4 for s in state), state
    if sizes == {"dp": 4} and kw.get("zero") == 3:            # ZeRO-3: all four split (+ padding, per layer)
        assert all(0 <= s - 4 * 8 * psi / 4 < 4 * 8 * 4 * (CFG.layers + 2) for s in state), state


def test_dp_tp_pp_on_8_ranks_trains_like_one_process():
    sizes = {"pp": 2, "dp": 2, "tp": 2}
    results = pplab.launch(compare_job, sizes, {"zero": 1}, world_size=8)
    check_equal(results, "2x2x2")
    # every message and collective of the run serves exactly one dimension of the mesh
    rows = comm_rows(sizes)
    comm = [e for e in results.timeline.events if e.category == "comm" and e.kind != "barrier"]
    claimed = [[name for name, serves in rows.items() if serves(e)] for e in comm]
    assert all(len(c) == 1 for c in claimed), [(e.kind, e.rank, e.group) for e, c in zip(comm, claimed) if len(c) != 1][:5]
    kinds = {name: {e.kind for e, c in zip(comm, claimed) if c == [name]} for name in rows}
    assert kinds["TP"] >= {"all_reduce"} and kinds["PP"] == {"send", "recv"}
    assert kinds["DP"] >= {"reduce_scatter", "all_gather"}


def test_swimlane_comm_rows_put_each_event_on_its_row():
    from pplab.swimlane import _Panel, draw
    from pplab.trace import Event, Timeline
    events = [Event(0, "F", "compute", 0.0, 1.0, "F0"),
              Event(0, "all_reduce", "comm", 0.1, 0.2, "AR", group=(0, 1)),
              Event(0, "send", "comm", 0.3, 0.4, "→1", peer=1),
              Event(0, "broadcast", "comm", 0.5, 0.6, "bc", group=(0, 1)),
              Event(1, "all_reduce", "comm", 0.1, 0.2, "AR", group=(0, 1))]
    tl = Timeline(events, world_size=2)
    rows = {"TP": lambda e: e.kind == "all_reduce", "PP": lambda e: e.kind == "send"}
    p = _Panel(tl, "auto", 0.0, 1.0, rows)
    rows_of = {(e.rank, e.kind): p.row_of(e) for e in p.shown if e.category == "comm"}
    assert p.rows == ["TP", "PP", "other"]
    assert rows_of == {(0, "all_reduce"): 0, (0, "send"): 1, (0, "broadcast"): 2, (1, "all_reduce"): 0}
    fig = draw(tl, comm_rows=rows)
    assert [t.get_text() for t in fig.axes[0].get_yticklabels(minor=True)] == ["TP", "PP", "other"] * 2
    with pytest.raises(ValueError, match="comm_rows must be a non-empty dict"):
        draw(tl, comm_rows=["TP"])


def test_the_text_is_learned_and_the_model_has_the_parameters_of_its_formula():
    cfg = GPTConfig(vocab=len(data.VOCAB))
    assert sum(p.numel() for layer in gpt_layers(cfg) for p in layer.parameters()) == cfg.parameters()
    losses, _ = train_single(cfg, steps=40, batch_size=16, lr=1e-2)
    assert abs(losses[0] - math.log(cfg.vocab)) < 0.5          # starts near the uniform guess
    assert losses[-1] < 0.75 * losses[0], losses               # and falls well below it
    x, y = data.batch(4, 16, step=0)
    assert torch.equal(x[:, 1:], y[:, :-1]) and data.decode(data.encode("jack")) == "jack"


def test_layouts_of_4():
    got = {(s["dp"], s["tp"], s["pp"]) for s in layouts(4)}
    assert got == {(4, 1, 1), (2, 2, 1), (2, 1, 2), (1, 4, 1), (1, 2, 2), (1, 1, 4)}
    # at most 2 stages on 8 ranks: pp = 2 (the bound itself) is in
    got = {(s["dp"], s["tp"], s["pp"]) for s in layouts(8, pp_max=2)}
    assert got == {(8, 1, 1), (4, 2, 1), (2, 4, 1), (1, 8, 1), (4, 1, 2), (2, 2, 2), (1, 4, 2)}


@pytest.mark.parametrize("sizes,kw,message", [
    ({"tp": 3}, {}, "4 attention heads, which tp=3 does not divide"),
    ({"pp": 5}, {}, "pp=5 stages, but the model has only 4 pipeline layers"),
    ({"dp": 3}, {}, "batch of 8 sequences does not split over dp=3"),
    ({"dp": 2, "pp": 2}, {"microbatches": 8, "zero": 1}, "too few for 8 micro-batches"),
    ({"dp": 2, "pp": 2}, {"zero": 3, "schedule": "zb-h1"}, "splits each backward into I and W"),
    ({"dp": 2, "pp": 2}, {"zero": 2, "schedule": "interleaved-1f1b"}, "each rank holds 2 chunks"),
    ({"pp": 4}, {"schedule": "zb-v"}, "pp=4 × 2 chunks"),
    ({"dp": 2}, {"zero": 4}, "use 0 .DDP., 1 or 2 .ZeroOptimizer., 3"),
    ({"tp": 2, "pp": 2}, {"world_size": 8}, "dp·tp·pp = 1·2·2 = 4 but the world has 8 ranks"),
    ({"tp": 3}, {"sequence_parallel": True, "world_size": 3}, "tp=3 does not divide"),
    ({"ep": 2}, {}, "no experts"),
])
def test_bad_layouts_say_what_to_change(sizes, kw, message):
    with pytest.raises(ValueError, match=message.replace("·", ".").replace("(", r"\(")):
        check_layout(CFG, sizes, BATCH, kw.pop("microbatches", 1), **kw)


def test_planner_never_proposes_a_layout_train_refuses():
    """ZeRO-2 under a pipeline runs with one stage per rank (tested above), and is refused where a rank
    holds several chunks (interleaved-1f1b) or the backward is split (zb-h1, zb-v): the planner, which
    asks check_layout, must then leave those layouts out, so that everything it lists trains."""
    from pplab import planner
    for schedule, zero2_with_pp in [("1f1b", True), ("gpipe", True), ("interleaved-1f1b", False),
                                    ("zb-h1", False), ("zb-v", False)]:
        valid, rejected = planner.enumerate_layouts(CFG, BATCH, 4, schedule=schedule)
        for L in valid:
            check_layout(CFG, {"dp": L.dp, "tp": L.tp, "pp": L.pp}, BATCH, L.m, L.zero, world_size=4,
                         schedule=schedule)
        proposed = any(L.zero == 2 and L.pp > 1 and L.dp > 1 for L in valid)
        assert proposed == zero2_with_pp, schedule
        if not zero2_with_pp:
            assert any(L.zero == 2 and L.pp > 1 and L.dp > 1 for L, _ in rejected), schedule


def bad_job():
    try:
        train(CFG, {"tp": 2, "pp": 2, "dp": 2}, steps=1)
    except ValueError as e:
        return str(e)


def test_a_bad_mesh_is_refused_on_every_rank_before_any_group_is_made():
    for msg in pplab.launch(bad_job, world_size=4):
        assert "= 8 but the world has 4 ranks" in msg


def sp_loss_job():
    mine = parallel_layers(gpt_layers(CFG), group=None, sequence_parallel=False)
    x, y = data.batch(2, CFG.seq)
    return gpt_loss(nn.Sequential(*mine)(x), y, group=torch.distributed.group.WORLD, vocab=CFG.vocab).item()


def test_parallel_layers_on_one_rank_give_the_dense_loss():
    x, y = data.batch(2, CFG.seq)
    dense = gpt_loss(nn.Sequential(*gpt_layers(CFG))(x), y).item()
    assert abs(pplab.launch(sp_loss_job, world_size=1)[0] - dense) < TOL


def _cpu_or_sleep(hook_seconds, spin):
    import time

    def before_step(model, opt, mesh):
        if spin:                     # CPU work: the process's CPU clock moves hook_seconds
            start = time.process_time()
            while time.process_time() - start < hook_seconds:
                pass
        else:                        # waiting: the wall clock moves, the CPU clock does not
            time.sleep(hook_seconds)

    r = train(CFG, dict(dp=2), steps=2, before_step=before_step)
    return r["step_times"], r["step_cpu_times"]


@pytest.mark.parametrize("spin", [True, False])
def test_step_cpu_times_count_the_work_of_a_step_and_not_its_waiting(spin):
    # a hook inside each step that burns 0.15 CPU seconds, or sleeps 0.15 s: the CPU count must see
    # the first and not the second, however busy the machine (CPU seconds do not grow with load)
    for wall, cpu in pplab.launch(_cpu_or_sleep, 0.15, spin, world_size=2):
        assert len(wall) == len(cpu) == 2 and all(w >= 0.15 for w in wall)
        if spin:
            assert all(c >= 0.15 for c in cpu), cpu
        else:
            assert all(c < w - 0.1 for c, w in zip(cpu, wall)), (cpu, wall)
