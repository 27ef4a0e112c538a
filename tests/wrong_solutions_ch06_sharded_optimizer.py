"""Plausible wrong answers to chapter 6's capstone (a sharded optimizer), each a mistake a student
could make, as in wrong_solutions_ch00_broadcast.py: WRONG[exercise_id] lists (answer, regular expressions the
check's message must match, timeout or None). tests/test_checks.py checks that each fails with
its message.

Each wrong answer is `Owners` (a correct answer, written apart from the solution notebook's:
gradients reduced to their owner only, parameters cut by a running count of elements) with one
method changed.
"""
import torch
import torch.distributed as dist

from pplab import comm
from pplab.zero import ZeroOptimizer


class Owners:
    """Each parameter to the rank with the fewest elements so far, taken in the order given."""

    def __init__(self, params, optimizer_class, group=None, **defaults):
        self.group, self.cls, self.defaults = group, optimizer_class, defaults
        self.me, self.n, self.ranks = comm.rank(group), comm.world_size(group), comm.group_ranks(group)
        self.groups, self.owner, self.count, self.inner = [], {}, [0] * self.n, None
        params = list(params)
        for g in params if isinstance(params[0], dict) else [{"params": params}]:
            self.add_param_group(g)

    def add_param_group(self, group):
        params = list(group["params"])
        for p in params:
            self.owner[id(p)] = r = self.count.index(min(self.count))
            self.count[r] += p.numel()
        self.groups.append(params)
        self._give_inner({**group, "params": [p for p in params if self.owner[id(p)] == self.me]})

    def _give_inner(self, group):
        if self.inner is None:
            self.inner = self.cls([group], **self.defaults)
        else:
            self.inner.add_param_group(group)

    def params(self):
        return [p for g in self.groups for p in g]

    @torch.no_grad()
    def step(self):
        for p in self.params():
            comm.reduce(p.grad, dst=self.ranks[self.owner[id(p)]], group=self.group)   # the owner alone needs it
            p.grad /= self.n
        self.inner.step()
        self._send_back()

    def _send_back(self):
        for p in self.params():
            comm.broadcast(p, src=self.ranks[self.owner[id(p)]], group=self.group)

    def zero_grad(self, set_to_none=True):
        for p in self.params():
            p.grad = None

    def state_dict(self):
        index = {id(p): i for i, p in enumerate(self.params())}
        shards = [None] * self.n
        dist.all_gather_object(shards, {index[id(p)]: s for p, s in self.inner.state.items()}, group=self.group)
        return {"state": {i: s for shard in shards for i, s in shard.items()},
                "groups": [{k: v for k, v in g.items() if k != "params"} for g in self.inner.param_groups]}

    def load_state_dict(self, saved):
        mine = [i for i, p in enumerate(self.params()) if self.owner[id(p)] == self.me]
        ours = self.inner.state_dict()
        for g, options in zip(ours["param_groups"], saved["groups"]):
            g.update({k: v for k, v in options.items() if k != "params"})
        ours["state"] = {k: saved["state"][i] for k, i in enumerate(mine) if i in saved["state"]}
        self.inner.load_state_dict(ours)


# ----------------------------------------------------------------------------------
# One mistake each


class SumsTheGradients(Owners):
    @torch.no_grad()
    def step(self):
        for p in self.params():
            comm.all_reduce(p.grad, group=self.group)          # the sum over ranks: no division
        self.inner.step()
        self._send_back()


class EveryRankStepsEverything(Owners):
    """Right values, but each rank's optimizer holds every parameter: the state is not split."""

    def add_param_group(self, group):
        self.groups.append(list(group["params"]))
        self._give_inner(group)

    @torch.no_grad()
    def step(self):
        for p in self.params():
            comm.all_reduce(p.grad, group=self.group)
            p.grad /= self.n
        self.inner.step()

    def state_dict(self):
        return self.inner.state_dict()                         # the whole state, the same on every rank

    def load_state_dict(self, saved):
        self.inner.load_state_dict(saved)


class FullStateBesideAShardForShow(EveryRankStepsEverything):
    """Right values from a full optimizer of torch's class (found under the one given) on every
    rank, so none of its state is split; the optimizer_class instance steps copies of this rank's
    shard, for show, so that the instances the check hands out look split."""

    def __init__(self, params, optimizer_class, group=None, **defaults):
        self.real = next(c for c in optimizer_class.__mro__ if c.__module__.startswith("torch.optim"))
        self.full, self.shows = None, []
        super().__init__(params, optimizer_class, group=group, **defaults)

    def add_param_group(self, group):
        params = list(group["params"])
        self.groups.append(params)
        for p in params:
            self.owner[id(p)] = r = self.count.index(min(self.count))
            self.count[r] += p.numel()
        if self.full is None:
            self.full = self.real([{**group, "params": params}], **self.defaults)
        else:
            self.full.add_param_group({**group, "params": params})
        copies = [(p, p.detach().clone().requires_grad_()) for p in params if self.owner[id(p)] == self.me]
        self.shows += copies
        self._give_inner({**group, "params": [c for _, c in copies]})

    @torch.no_grad()
    def step(self):
        for p in self.params():
            comm.all_reduce(p.grad, group=self.group)
            p.grad /= self.n
        self.full.step()
        for p, c in self.shows:
            c.grad = p.grad.clone()
        self.inner.step()

    def state_dict(self):
        return self.full.state_dict()

    def load_state_dict(self, saved):
        self.full.load_state_dict(saved)


class NeverSendsTheUpdates(Owners):
    def _send_back(self):
        pass                                                   # the other ranks keep their stale copies


class IgnoresAddedGroups(Owners):
    def __init__(self, params, optimizer_class, group=None, **defaults):
        super().__init__(params, optimizer_class, group, **defaults)
        self.built = True

    def add_param_group(self, group):
        if not getattr(self, "built", False):
            super().add_param_group(group)


class DropsGroupOptions(Owners):
    """Each group's own lr and weight_decay lost: the optimizer gets the defaults only."""

    def add_param_group(self, group):
        super().add_param_group({"params": group["params"]})


class ZeroGradOfMyShardOnly(Owners):
    def zero_grad(self, set_to_none=True):
        self.inner.zero_grad()                                 # only the parameters this rank steps


class StateDictOfRank0sShard(Owners):
    """The same dict on every rank, but it holds rank 0's shard only."""

    def state_dict(self):
        index = {id(p): i for i, p in enumerate(self.params())}
        box = [{"state": {index[id(p)]: s for p, s in self.inner.state.items()},
                "groups": [{k: v for k, v in g.items() if k != "params"} for g in self.inner.param_groups]}]
        dist.broadcast_object_list(box, src=self.ranks[0], group=self.group)
        return box[0]


class StateDictOfMyShard(Owners):
    """Rank 0's state_dict has everything; every other rank returns only its own shard."""

    def state_dict(self):
        whole = super().state_dict()
        if self.me == 0:
            return whole
        index = {id(p): i for i, p in enumerate(self.params())}
        return {**whole, "state": {index[id(p)]: s for p, s in self.inner.state.items()}}


class KeepsAMasterCopy(Owners):
    """Its optimizer steps copies of its parameters made when they were given, copied back after each
    step: right until someone writes into the parameters (a resume's model.load_state_dict)."""

    def add_param_group(self, group):
        params = list(group["params"])
        self.masters = getattr(self, "masters", {})
        self.masters.update({id(p): p.detach().clone() for p in params})
        for p in params:
            self.owner[id(p)] = r = self.count.index(min(self.count))
            self.count[r] += p.numel()
        self.groups.append(params)
        self._give_inner({**group, "params": [self.masters[id(p)] for p in params if self.owner[id(p)] == self.me]})

    @torch.no_grad()
    def step(self):
        for p in self.params():
            comm.reduce(p.grad, dst=self.ranks[self.owner[id(p)]], group=self.group)
            self.masters[id(p)].grad = p.grad / self.n
        self.inner.step()
        for p in self.params():
            if self.owner[id(p)] == self.me:
                p.copy_(self.masters[id(p)])
        self._send_back()

    def state_dict(self):
        index = {id(self.masters[id(p)]): i for i, p in enumerate(self.params())}
        shards = [None] * self.n
        dist.all_gather_object(shards, {index[id(m)]: s for m, s in self.inner.state.items()}, group=self.group)
        return {"state": {i: s for shard in shards for i, s in shard.items()},
                "groups": [{k: v for k, v in g.items() if k != "params"} for g in self.inner.param_groups]}


class OnlyRank0TakesTheUpdates(Owners):
    """Right on rank 0; the others receive each update into a scratch copy and drop it."""

    def _send_back(self):
        for p in self.params():
            got = p.detach().clone()
            comm.broadcast(got, src=self.ranks[self.owner[id(p)]], group=self.group)
            if self.me == 0:
                p.copy_(got)


class GlobalRankInAGroup(Owners):
    """Owners counted in the group, but `me` is the global rank: wrong in any group but the world."""

    def __init__(self, params, optimizer_class, group=None, **defaults):
        params = list(params)
        super().__init__(params, optimizer_class, group, **defaults)
        if self.me != dist.get_rank():
            self.me, self.groups, self.owner, self.count, self.inner = dist.get_rank(), [], {}, [0] * self.n, None
            for g in params if isinstance(params[0], dict) else [{"params": params}]:
                self.add_param_group(g)


class FromTheLibrary(Owners):
    def __init__(self, params, optimizer_class, group=None, **defaults):
        self.inner = ZeroOptimizer(params, optimizer_class, group=group, **defaults)


# Near misses (issue 38): wrong on a rank other than 0 only, just outside the fp32 tolerance.


class ZeroGradEverywhereOnRank0Only(Owners):
    """zero_grad clears every gradient on rank 0 (where it was tried by hand), only this rank's own
    parameters' elsewhere: ranks 1 and 2 carry their old gradients of other ranks' parameters into
    the next backward, and from there into the owner's reduce."""

    def zero_grad(self, set_to_none=True):
        if self.me == 0:
            super().zero_grad(set_to_none)
        else:
            self.inner.zero_grad()


class MeanByARoundedThird(Owners):
    """The mean as the sum times 1/N written to 4 digits: exact for N = 2 (0.5), 1e-4 too small for
    N = 3 (0.3333): SGD's parameters land some 1e-5 off, outside fp32's 1e-6 + 1e-5·|x|, inside 100
    times it (Adam, which divides the gradient by its own size, barely notices)."""

    @torch.no_grad()
    def step(self):
        for p in self.params():
            comm.reduce(p.grad, dst=self.ranks[self.owner[id(p)]], group=self.group)
            p.grad *= round(1 / self.n, 4)
        self.inner.step()
        self._send_back()


class MeanByMultiplying(Owners):
    """Correct: p.grad *= 1/N rounds differently from p.grad /= N, within fp32's 1e-7 (a passing case, in
    tests/test_checks_zero_near.py)."""

    @torch.no_grad()
    def step(self):
        for p in self.params():
            comm.reduce(p.grad, dst=self.ranks[self.owner[id(p)]], group=self.group)
            p.grad *= 1.0 / self.n
        self.inner.step()
        self._send_back()


def parts(steps="✔", added="✔", zero_grad="✔", sharded="✔", state_dict="✔"):
    """The parts' marks the message must end with (before the seed)."""
    marks = [steps, added, zero_grad, sharded, state_dict]
    return (rf" Parts: steps = single process {steps} · add_param_group {added} · zero_grad {zero_grad} · state "
            rf"split over the ranks {sharded} · state_dict 3 → 2 ranks {state_dict} \({marks.count('✔')} of 5\)\. "
            rf".*\[{marks.count('✔')} of 5 points\]$")


FRESH = r"^world_size=[23], (AdamW|SGD), 7 parameters in 3 groups: "
WRONG = {"sharded_optimizer": [
    (SumsTheGradients,
     [parts(steps="✘", added="✘", state_dict="✘"), FRESH + r"after step 1, rank 0's parameter \d",
      r"It is what the sum of the ranks' gradients gives", r"divide by the number of ranks, 3"], None),
    (EveryRankStepsEverything,
     [parts(sharded="✘"), FRESH + r"rank 0's (AdamW|SGD) state is [\d,]+ bytes \(its optimizers hold parameters "
      r"\[0, 1, 2, 3, 4, 5, 6\], 7 of 7\)", r"Give this rank's optimizer_class only the parameters this rank owns"],
     None),
    (FullStateBesideAShardForShow,
     [parts(sharded="✘"), FRESH + r"rank 0's optimizers hold [\d,]+ bytes of per-element state in all \(every torch "
      r"optimizer in the rank counted; its optimizer_class instances hold [\d,]+ of them\)",
      r"It held the whole state \(Ψ·K bytes\) instead of its 1/N \(Ψ·K/N\)"], None),
    (NeverSendsTheUpdates,
     [parts(steps="✘", added="✘", state_dict="✘"), FRESH + r"after step 1, rank 0's parameter",
      r"Other ranks have it right \(rank [12](, whose optimizer steps it|, rank 2; rank [12]'s optimizer steps it)\): "
      r"rank 0 did not take in"],
     None),
    (IgnoresAddedGroups,
     [parts(added="✘", state_dict="✘"), FRESH + r"after step 3, rank 0's parameter \d \(group 2 added by "
      r"add_param_group", r"It did not move in this step", r"need an owner and a place in that owner's optimizer"],
     None),
    (DropsGroupOptions,
     [parts(steps="✘", added="✘", state_dict="✘"), r"It is what the defaults give"], None),
    (ZeroGradOfMyShardOnly,
     [parts(steps="✘", added="✘", zero_grad="✘", state_dict="✘"),
      r"Rank \d's zero_grad\(\) left gradients behind \(parameters \[\d"], None),
    (StateDictOfRank0sShard,
     [parts(state_dict="✘"), r"^world_size=2, (AdamW|SGD), 7 parameters in 3 groups, resumed from 3 ranks "
      r"\(parameters, state_dict\): after loading, step 1: rank 0's parameter \d",
      r"It went on as if its optimizer state were new: its state, held by rank [12]'s optimizer at 3 ranks,"], None),
    (StateDictOfMyShard,
     [parts(state_dict="✘"), r"^world_size=3, AdamW, 7 parameters in 3 groups: rank 1's state_dict\(\) differs "
      r"from rank 0's at \['state'\]", r"must return the whole optimizer state on every rank"], None),
    (KeepsAMasterCopy,
     [parts(state_dict="✘"), r"^world_size=2, (AdamW|SGD), 7 parameters in 3 groups, resumed from 3 ranks "
      r"\(parameters, state_dict\): after loading, step 1: rank 0's parameter \d", r"It went on from the value the parameter had "
      r"when the ShardedOptimizer was built"], None),
    (OnlyRank0TakesTheUpdates,
     [parts(steps="✘", added="✘", state_dict="✘"), FRESH + r"after step 1, rank 1's parameter",
      r"Other ranks have it right \(rank 0(, whose optimizer steps it|, rank 2; rank [02]'s optimizer steps it)\): "
      r"rank 1 did not"], None),
    (GlobalRankInAGroup,
     [parts(steps="✘", added="✘"), r"^world_size=3, (AdamW|SGD), 7 parameters in 3 groups, process groups "
      r"\[0, 2\] and \[1\]: after step 1, rank [02]'s parameter"], None),
    (ZeroGradEverywhereOnRank0Only,
     [parts(steps="✘", added="✘", zero_grad="✘", state_dict="✘"), FRESH + r"after step 2, rank 0's parameter \d",
      r"Rank [12]'s zero_grad\(\) left gradients behind \(parameters \[\d.*\]\), and backward added to them; "
      r"they reach rank 0 through the reduce"], None),
    (MeanByARoundedThird,
     [r"Parts: steps = single process ✘", r"^world_size=3, (AdamW|SGD), 7 parameters in 3 groups: after step \d, rank [012]'s "
      r"parameter \d.* is [-\d.e]+, expected [-\d.e]+( \(off by [-\d.e]+, 1e-06 \+ 1e-05·\|x\| = [-\d.e]+ allowed\))? "
      r"\(single-process (AdamW|SGD)"], None),
    (FromTheLibrary,
     [r"^exercise 'sharded_optimizer' asks you to work out the sharding of the optimizer yourself; you use a "
      r"library's sharded optimizer"], None),
]}
