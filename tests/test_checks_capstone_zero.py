"""Chapter 6's capstone check (a sharded optimizer): other correct designs pass, what the check
computes agrees with values worked out by hand, and the router's `reduce` (which the solution
uses) sums onto dst only. The solution passing, the stub failing and every wrong answer in
wrong_solutions_ch06_sharded_optimizer.py failing with its message are run by tests/test_checks.py, and
the solution as source by tests/test_checks_sealed.py."""
import re

import pytest
import torch
import torch.distributed as dist

from pplab import checks, comm
from pplab.checks import sealed
from pplab.checks.ch06_zero import sharded_optimizer as capstone
from wrong_solutions_ch06_sharded_optimizer import WRONG, OnlyRank0TakesTheUpdates, Owners, StateDictOfMyShard

pytestmark = pytest.mark.usefixtures("no_leftover_processes")


def test_the_capstone_registers_one_exercise_with_its_wrong_answers():
    ids = sorted(i for i, ex in checks.EXERCISES.items() if ex.checker.__module__ == capstone.__name__)
    assert ids == ["sharded_optimizer"] == sorted(WRONG)
    answers = [fn for fn, _, _ in WRONG["sharded_optimizer"]]
    assert len(answers) >= 6
    assert OnlyRank0TakesTheUpdates in answers and StateDictOfMyShard in answers     # right on rank 0 only


# -- other correct answers pass -------------------------------------------------------

class FlatShards:
    """The other design: each group's parameters end to end in one flat buffer, padded to a multiple
    of N, cut into N equal pieces; reduce-scatter, step my piece, all-gather. torch.distributed
    directly, a state_dict of per-element tensors keyed by parameter name, resharded on load."""

    def __init__(self, params, optimizer_class, group=None, **defaults):
        self.group, self.cls, self.defaults = group, optimizer_class, defaults
        self.n, self.me = dist.get_world_size(group), dist.get_rank(group)
        self.groups, self.pieces, self.inner = [], [], None
        params = list(params)
        for g in params if isinstance(params[0], dict) else [{"params": params}]:
            self.add_param_group(g)

    def add_param_group(self, group):
        params = list(group["params"])
        numel = sum(p.numel() for p in params)
        size = -(-numel // self.n)
        piece = torch.zeros(size, dtype=params[0].dtype)
        flat = torch.cat([p.detach().reshape(-1) for p in params] + [torch.zeros(size * self.n - numel)])
        piece.copy_(flat[self.me * size:(self.me + 1) * size])
        self.groups.append((params, size))
        self.pieces.append(piece)
        options = {k: v for k, v in group.items() if k != "params"}
        if self.inner is None:
            self.inner = self.cls([{"params": [piece], **options}], **self.defaults)
        else:
            self.inner.add_param_group({"params": [piece], **options})

    @torch.no_grad()
    def step(self):
        for (params, size), piece in zip(self.groups, self.pieces):
            if all(p.grad is None for p in params):
                continue
            values = torch.cat([p.reshape(-1) for p in params] + [torch.zeros(size * self.n - sum(
                p.numel() for p in params))])
            piece.copy_(values[self.me * size:(self.me + 1) * size])    # the parameters may have been loaded
            grads = [p.grad.reshape(-1) if p.grad is not None else torch.zeros(p.numel()) for p in params]
            flat = torch.cat(grads + [torch.zeros(size * self.n - sum(p.numel() for p in params))])
            mine = torch.empty(size)
            dist.reduce_scatter_tensor(mine, flat, group=self.group)
            piece.grad = mine / self.n
        self.inner.step()
        for (params, size), piece in zip(self.groups, self.pieces):
            whole = torch.empty(size * self.n)
            dist.all_gather_into_tensor(whole, piece.detach(), group=self.group)
            for p, new in zip(params, whole.split([p.numel() for p in params] + [size * self.n - sum(
                    p.numel() for p in params)])):
                p.copy_(new.view_as(p))

    def zero_grad(self, set_to_none=True):
        for params, _ in self.groups:
            for p in params:
                p.grad = None

    def state_dict(self):
        state = {}
        for g, ((params, size), piece) in enumerate(zip(self.groups, self.pieces)):
            for key, value in self.inner.state.get(piece, {}).items():
                whole = [torch.empty_like(value) for _ in range(self.n)]
                dist.all_gather(whole, value, group=self.group)
                parts = torch.cat(whole).split([p.numel() for p in params] + [size * self.n - sum(
                    p.numel() for p in params)]) if value.dim() else [value] * len(params)
                for k, (p, part) in enumerate(zip(params, parts)):
                    state.setdefault(f"{g}.{k}", {})[key] = part.clone()
        options = [{k: v for k, v in g.items() if k != "params"} for g in self.inner.param_groups]
        return {"per_parameter": state, "options": options}

    def load_state_dict(self, saved):
        for g, ((params, size), piece) in enumerate(zip(self.groups, self.pieces)):
            self.inner.param_groups[g].update(saved["options"][g])
            entries = [saved["per_parameter"].get(f"{g}.{k}") for k in range(len(params))]
            if entries[0] is None:
                continue
            mine = {}
            for key, value in entries[0].items():
                if value.dim():
                    flat = torch.cat([e[key].reshape(-1) for e in entries] + [torch.zeros(size * self.n - sum(
                        p.numel() for p in params))])
                    mine[key] = flat[self.me * size:(self.me + 1) * size].clone()
                else:
                    mine[key] = value.clone()
            self.inner.state[piece] = mine


@pytest.mark.parametrize("answer", [FlatShards, Owners])
def test_other_correct_designs_pass(answer):
    """Flat shards (reduce-scatter, all-gather, a format of its own); whole parameters in the order
    given, reduced to their owner (comm.reduce) and a format of its own."""
    result = checks.run_check("sharded_optimizer", answer)
    assert result, result.message


# -- what the check computes, against values worked out by hand ----------------------

def test_the_reference_follows_sgd_by_hand_with_groups_and_an_added_group():
    """SGD with momentum 0.5 and weight decay 0.1 (defaults), group 1 at lr 0.2 with nesterov;
    parameter 2 comes after step 2 with its own lr. The mean gradient of 2 ranks."""
    run = {"optimizer": "SGD", "members": [[0, 1]], "start": [torch.tensor([1.0]), torch.tensor([2.0]),
                                                               torch.tensor([3.0])],
           "defaults": {"lr": 0.1, "momentum": 0.5, "weight_decay": 0.1},
           "groups": [([0], {}), ([1], {"lr": 0.2, "nesterov": True})], "added": ([2], {"lr": 0.3}),
           "grads": [[[torch.tensor([g + r]) for g in (1.0, 2.0, 3.0)] for r in (0, 2)] for _ in range(4)]}
    ref = capstone._Reference(run, capstone._mean(run["grads"], [0, 1]))    # mean gradient: g + 1

    def sgd(x, g, lr, nesterov, steps, buf=None):
        out = []
        for _ in range(steps):
            d = g + 0.1 * x
            buf = d if buf is None else 0.5 * buf + d
            x = x - lr * (d + 0.5 * buf if nesterov else buf)
            out.append(x)
        return out
    want = [sgd(1.0, 2.0, 0.1, False, 4), sgd(2.0, 3.0, 0.2, True, 4), [3.0, 3.0] + sgd(3.0, 4.0, 0.3, False, 2)]
    got = [[ref.history[s][j].item() for s in range(4)] for j in range(3)]
    for j in range(3):
        assert got[j] == pytest.approx(want[j], rel=1e-6, abs=1e-6), f"parameter {j}"  # fp32
    summed = capstone._Reference(run, capstone._mean(run["grads"], [0, 1]), "sum")
    assert summed.history[0][0].item() == pytest.approx(1.0 - 0.1 * (4.0 + 0.1))     # g summed: 1 + 3
    defaults = capstone._Reference(run, capstone._mean(run["grads"], [0, 1]), "defaults")
    assert defaults.history[0][1].item() == pytest.approx(2.0 - 0.1 * (3.0 + 0.2))   # lr 0.1, no nesterov
    assert ref.state_bytes() == [4, 4, 4]                                # one fp32 momentum each


def test_each_rank_gets_its_own_gradients_only_and_the_runs_differ_by_seed():
    import random
    run = capstone._run(random.Random(1), "AdamW", [[0, 2], [1]])
    assert len(run["grads"]) == capstone.STEPS and all(len(step) == 3 for step in run["grads"])
    mine = capstone._rank_input(run, 1)
    assert all(g is run["grads"][s][1] for s, g in enumerate(mine["grads"]))
    assert sorted(j for g, _ in run["groups"] + [run["added"]] for j in g) == list(range(7))
    assert all(8 <= x.numel() <= 20 for x in run["start"])
    other = capstone._run(random.Random(2), "AdamW", [[0, 2], [1]])
    assert [x.shape for x in run["start"]] != [x.shape for x in other["start"]] or \
        not torch.equal(run["start"][0], other["start"][0])


def test_where_two_state_dicts_differ():
    a = {"state": {0: {"m": torch.ones(2)}, 1: {"m": torch.zeros(3)}}, "groups": [{"lr": 0.1}]}
    b = {"state": {0: {"m": torch.ones(2)}, 1: {"m": torch.tensor([0.0, 1.0, 0.0])}}, "groups": [{"lr": 0.1}]}
    assert capstone._difference(a, a) is None
    assert capstone._difference(a, b) == "['state'][1]['m'] (values differ)"
    assert capstone._difference(a, {**a, "groups": [{"lr": 0.2}]}) == "['groups'][0]['lr'] (0.1 vs 0.2)"
    assert capstone._difference(a, {"state": {0: a["state"][0]}, "groups": a["groups"]}) == \
        "['state'] (keys 1 in one only)"
    assert capstone._difference(None, a) == " (None vs dict)"


def test_the_breakdown_names_each_part():
    verdicts = capstone._verdicts()
    verdicts.note("steps", None)
    verdicts.note("sharded", "rank 1 holds too much")
    verdicts.note("sharded", None)                                       # a problem stays a problem
    assert verdicts.breakdown() == ("Parts: steps = single process ✔ · add_param_group not reached · zero_grad not "
                                    "reached · state split over the ranks ✘ · state_dict 3 → 2 ranks not reached "
                                    "(1 of 5)")
    assert verdicts.first() == "rank 1 holds too much" and verdicts.earned() == 1


class CrashesOnLoad(Owners):
    def load_state_dict(self, saved):
        raise KeyError("no such parameter")


def test_a_crash_keeps_what_was_judged_before_it():
    result = checks.run_check("sharded_optimizer", CrashesOnLoad)
    assert not result
    assert re.search(r"^world_size=2, AdamW, .*: rank [01] raised KeyError: 'no such parameter' \(in "
                     r"load_state_dict, line \d+: `raise KeyError", result.message)
    assert ("Parts: steps = single process ✔ · add_param_group ✔ · zero_grad ✔ · state split over the ranks ✔ · "
            "state_dict 3 → 2 ranks not reached (4 of 5).") in result.message


# -- the router's reduce and get_global_rank, which the solution uses in a sealed rank --------

def _reduce_job(fn, inputs):
    sealed.begin(0)
    group = dist.new_group([0, 2])
    x = inputs[0].clone()
    if dist.get_rank() in (0, 2):
        comm.reduce(x, dst=dist.get_global_rank(group, 1), group=group)     # group rank 1 is global rank 2
    y = inputs[0].clone()
    dist.reduce(y, dst=1, op=dist.ReduceOp.MAX)
    sealed.observe(0, {"x": x, "y": y})


def test_reduce_sums_onto_dst_only_and_a_groups_ranks_are_global():
    seen = {}

    @checks.exercise("test_reduce", "reduce", answer="f", sealed=True)
    def check_reduce(fn, seed, timeout):
        def keep(p, i, observed, traffic):
            seen.update(observed)
        sealed.run_sealed(_reduce_job, fn, [[torch.tensor([1.0, 10.0 * r]) for r in range(3)]], world_size=3,
                          timeout=timeout, exercise=("x", "y"), check=keep, forbidden=())
        return ""
    try:
        result = checks.run_check("test_reduce", lambda: None, timeout=20)
    finally:
        del checks.EXERCISES["test_reduce"]
    assert result, result.message
    assert [seen[r]["x"].tolist() for r in range(3)] == [[1.0, 0.0], [1.0, 10.0], [2.0, 20.0]]
    assert [seen[r]["y"].tolist() for r in range(3)] == [[1.0, 0.0], [1.0, 20.0], [1.0, 20.0]]
