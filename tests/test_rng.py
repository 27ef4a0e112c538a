"""pplab.rng: the RNG tracker, dropout masks per rank under TP/SP/DP, recomputation replaying them, and
training with dropout on real ranks equal to one process.

Independent references: torch.Generator(...).manual_seed(s) drawing by itself (what a tracker's stream
must equal), masks compared across real ranks, and the gradients of the same blocks without
torch.utils.checkpoint. "Equal" in training: losses and every parameter shard within TOL (float64).
"""
import re

import pytest
import torch

import pplab
from pplab import rng
from pplab.mesh import Mesh
from pplab.rng import MODEL_PARALLEL, RNGTracker, dropout, dropout_mask, model_parallel_seed, seeds

pytestmark = pytest.mark.usefixtures("no_leftover_processes")

TOL = 1e-12
P = 0.3


def torch_mask(seed, shape, p=P):
    """The mask a fresh generator seeded `seed` draws: the reference for a tracker's first draw."""
    return torch.empty(shape, dtype=torch.float64).bernoulli_(1 - p, generator=torch.Generator().manual_seed(seed))


def test_fork_draws_from_its_own_stream_and_leaves_the_default_one_alone():
    tracker = RNGTracker()
    tracker.add("a", 7)
    torch.manual_seed(123)
    with tracker.fork("a"):
        first = torch.rand(4)
    middle = torch.rand(3)                     # the default generator, as if no fork had happened
    with tracker.fork("a"):
        second = torch.rand(4)                 # the stream goes on where it stopped
    stream = torch.rand(8, generator=torch.Generator().manual_seed(7))
    assert torch.equal(torch.cat([first, second]), stream)
    assert torch.equal(middle, torch.rand(3, generator=torch.Generator().manual_seed(123)))


def test_seeds_by_hand_and_distinct_on_small_meshes():
    assert seeds(1234, tp_rank=1, dp_rank=2, pp_rank=1) == {"default": 21334, MODEL_PARALLEL: 21334 + 2718 + 1}
    used = [s for tp in range(8) for dp in range(8) for pp in range(8)
            for s in seeds(5, tp, dp, pp).values()]
    defaults = {seeds(5, tp, dp, pp)["default"] for tp in range(8) for dp in range(8) for pp in range(8)}
    assert len(set(used)) == 8 * 8 * 8 + len(defaults) == 8 * 8 * 8 + 64   # tp ranks share a default seed only


def test_dropout_mask_is_torchs_bernoulli_and_dropout_rescales():
    torch.manual_seed(3)
    x = torch.randn(200, 50, dtype=torch.float64)
    torch.manual_seed(11)
    y = dropout(x, P)
    mask = torch_mask(11, x.shape)
    assert torch.equal(y, x * mask / (1 - P))
    assert abs(mask.mean().item() - (1 - P)) < 0.02             # 10,000 draws: within 4 standard deviations
    assert dropout(x, P, training=False) is x and dropout(x, 0.0) is x


@pytest.mark.parametrize("call,message", [
    (lambda: dropout_mask((2,), 1.0), r"dropout probability must be in \[0, 1\)"),
    (lambda: RNGTracker().fork("nope").__enter__(), "no generator named 'nope'"),
    (lambda: seeds(-1), "seed must be a whole number >= 0"),
])
def test_bad_input_says_what_to_change(call, message):
    with pytest.raises((ValueError, KeyError), match=message):
        call()


def test_adding_a_name_twice_is_refused():
    t = RNGTracker()
    t.add("x", 1)
    with pytest.raises(ValueError, match="already has a generator named 'x'"):
        t.add("x", 2)


# ---------------------------------------------------------------------------------------------
# On real ranks: the same mask where replicated, a different one where split


def masks_job(seed, shape):
    mesh = Mesh(tp=torch.distributed.get_world_size())
    tracker = RNGTracker()
    model_parallel_seed(seed, tracker, tp_rank=mesh.rank_in("tp"))
    replicated = dropout_mask(shape, P)                  # the residual stream, outside the split region
    with tracker.fork():
        split = dropout_mask(shape, P)                   # my heads / my ffn columns
    return {"replicated": replicated, "split": split, "rank": mesh.rank_in("tp")}


@pytest.mark.parametrize("world", [2, 3])
def test_masks_are_equal_on_replicated_tensors_and_differ_on_split_ones(world):
    seed, shape = 17, (6, 5)
    out = pplab.launch(masks_job, seed, shape, world_size=world)
    for r, res in enumerate(out):
        assert torch.equal(res["replicated"], torch_mask(seed, shape)), f"rank {r}: replicated mask is not seed {seed}'s"
        assert torch.equal(res["split"], torch_mask(seed + 2718 + r, shape)), f"rank {r}: split mask is not its own"
    for a in range(world):
        for b in range(a + 1, world):
            assert not torch.equal(out[a]["split"], out[b]["split"]), f"ranks {a}, {b} drew the same split mask"


def test_checkpoint_replays_the_trackers_masks():
    """One process: a block that draws in the tracker's stream and in the default one. Recomputed with
    replay, its gradients equal the plain run's exactly; without replay the tracker's mask changes."""
    def grads(mode):
        torch.manual_seed(0)
        w = torch.randn(5, 5, dtype=torch.float64, requires_grad=True)
        x = torch.randn(4, 5, dtype=torch.float64)
        tracker = RNGTracker()
        tracker.add(MODEL_PARALLEL, 99)
        torch.manual_seed(1)

        def block(x):
            with tracker.fork():
                h = dropout(x @ w, P)
            return dropout(h.tanh(), P)            # the default generator: torch.utils.checkpoint restores it
        if mode == "plain":
            y = block(x)
        else:
            kw = {"context_fn": tracker.replay} if mode == "replay" else {}
            y = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False, **kw)
        y.pow(2).sum().backward()
        after = tracker.get_states()[MODEL_PARALLEL]
        return w.grad, after
    plain, state_plain = grads("plain")
    replayed, state_replayed = grads("replay")
    forgot, _ = grads("no replay")
    assert torch.equal(plain, replayed)
    assert torch.equal(state_plain, state_replayed)       # the recompute left the stream where forward did
    assert not torch.allclose(plain, forgot)


# ---------------------------------------------------------------------------------------------
# Training with dropout on dp × tp ranks equals one process


def train_job(layouts):
    out = []
    for sizes, kw in layouts:
        res = rng.train(sizes, **kw)
        ref_losses, ref = rng.train_single(sizes, sequence_parallel=kw.get("sequence_parallel", False))
        mesh = Mesh(**sizes)
        expect = torch.nn.ModuleList([rng.ParallelDropoutMLP.from_dense(b, None, mesh.tp_group,
                                                                        kw.get("sequence_parallel", False))
                                      for b in ref])
        expect = dict(expect.named_parameters())
        out.append({"losses": res["losses"], "ref": ref_losses,
                    "diff": max((q - expect[n]).abs().max().item() for n, q in res["params"].items())})
    return out


LAYOUTS = {
    2: [({"tp": 2}, {}), ({"tp": 2}, {"sequence_parallel": True, "checkpoint": True}), ({"dp": 2}, {"checkpoint": True})],
    3: [({"tp": 3}, {"checkpoint": True}), ({"tp": 3}, {"sequence_parallel": True})],
    4: [({"dp": 2, "tp": 2}, {"sequence_parallel": True, "checkpoint": True})],
}


@pytest.mark.parametrize("world", sorted(LAYOUTS))
def test_training_with_dropout_equals_one_process(world):
    results = pplab.launch(train_job, LAYOUTS[world], world_size=world)
    for r, per_layout in enumerate(results):
        for (sizes, kw), res in zip(LAYOUTS[world], per_layout):
            where = f"rank {r}, {sizes} {kw}"
            assert all(abs(a - b) <= TOL for a, b in zip(res["losses"], res["ref"])), (where, res)
            assert res["diff"] <= TOL, (where, res["diff"])


WRONG = [({"tp": 2}, {"checkpoint": True, "replay": False}),      # recomputation draws new split masks
         ({"tp": 2}, {"tracked": False}),                          # every tp rank's slice gets the same mask
         ({"tp": 2}, {"sequence_parallel": True, "tracked": False})]   # ... and every rank's tokens too


def test_each_wrong_way_differs_from_one_process():
    results = pplab.launch(train_job, WRONG, world_size=2)
    for (sizes, kw), res in zip(WRONG, results[0]):
        assert abs(res["losses"][-1] - res["ref"][-1]) > 1e-4, (kw, res)
        assert res["diff"] > 1e-3, (kw, res["diff"])


def refuse_job():
    try:
        rng.train({"tp": 2}, seq=5, sequence_parallel=True)
    except ValueError as e:
        return str(e)


def test_uneven_sequence_under_sp_is_refused():
    for msg in pplab.launch(refuse_job, world_size=2):
        assert msg is not None and re.search("cuts the 5 positions over tp=2", msg), msg
