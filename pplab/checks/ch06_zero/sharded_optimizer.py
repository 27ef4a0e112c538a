"""Check of chapter 6's capstone: a sharded optimizer (ZeRO stage 1) around any torch.optim class.

    sharded_optimizer   ShardedOptimizer(params, optimizer_class, group=None, **defaults)
                        .step()  .zero_grad()  .add_param_group(group)  .state_dict()  .load_state_dict(sd)

Two sealed launches, every input random from the seed:

* 3 ranks: AdamW, then SGD with momentum, each on 7 fp32 parameters of random shapes in three
  param groups with options of their own (lr, weight_decay, betas, nesterov; the defaults
  given as keywords). The third group comes with add_param_group after step 2. Every rank
  has its own gradients (real backward, so .grad accumulates unless zero_grad clears it),
  4 steps. Then state_dict() on every rank. A third trial trains in two process groups,
  [0, 2] and [1] (group= given), each averaging on its own.
* 2 ranks: the same two optimizers afresh, then a resume: a new ShardedOptimizer on 2 ranks,
  the parameters saved at 3 ranks copied into its parameters (as model.load_state_dict does,
  after the optimizer was built), the state_dict saved at 3 ranks loaded, 2 more steps.

Judged here, every rank, every step, each part on its own (partial credit: the message ends
with "Parts: steps = single process ✔ · add_param_group ✔ · zero_grad ✔ · state split over the
ranks ✘ · state_dict 3 → 2 ranks ✔ (4 of 5)", after the first problem found):

* steps: every parameter on every rank equals single-process optimizer_class on the mean
  gradient of its process group, to ATOL + RTOL·|x| (fp32: 1e-6 + 1e-5·|x|); the first step,
  rank and parameter that differ are named;
* add_param_group: the same for the parameters of the group added after step 2;
* zero_grad: before every backward, zero_grad() left no gradient on any rank;
* state sharded: the per-element optimizer state (tensors of dimension >= 1 in the state of
  the optimizer_class instances the rank created: the step counters, one number per tensor,
  are left out) of each rank is at most total/N + the largest parameter's, where total is
  single-process optimizer_class's, N the group's size; and, where every parameter was
  stepped right, all ranks together hold at least total (the state is somewhere);
* state_dict: every rank's state_dict() is the same (the whole state), and loaded at 2 ranks
  it trains on as single process does from the saved state (a parameter that goes on as with
  a fresh state is named with the rank that held its state at 3 ranks).

A rank job only records (parameters after each step, gradients zero_grad left, the state
bytes of its optimizer_class instances, its state_dict); every verdict is reached here.
"""
from __future__ import annotations

import copy
import random
import torch

from .. import sealed
from ..core import Fail, Forbidden, Parts, exercise, first_difference, require_function
from ..core import _fmt
from .sharded_optimizer_rank import _OPTIMIZERS, _rank_job, _refuse_library_optimizers, torch


ATOL, RTOL = 1e-6, 1e-5           # fp32: the same arithmetic in a different order stays far inside


STEPS, ADD_AT, MORE = 4, 2, 2     # steps per run; add_param_group before step ADD_AT + 1; steps after a load


SAVE_AT, LOAD_AT = 3, 2           # the world sizes a state_dict is saved at and loaded at


# The defaults (keywords) and each group's own options. Adam divides a gradient by its own size,
# so a gradient summed over ranks instead of averaged would move it almost as far: eps of the
# gradients' size (1e-3) makes the size count, and a missing mean changes every element.
_OPTIONS = {
    "AdamW": ({"lr": 0.01, "betas": (0.8, 0.95), "eps": 1e-3, "weight_decay": 0.1},
              [{"lr": 0.03}, {"weight_decay": 0.0}], {"lr": 0.02, "betas": (0.9, 0.99)}),
    "SGD": ({"lr": 0.05, "momentum": 0.9, "weight_decay": 0.01},
            [{"lr": 0.1}, {"nesterov": True, "weight_decay": 0.0}], {"lr": 0.02, "dampening": 0.5}),
}


_GRAD_SCALE = {"AdamW": 1e-3, "SGD": 1.0}


_SHAPES = [(9,), (11,), (13,), (17,), (2, 5), (3, 4), (3, 5), (4, 4), (2, 7), (5, 3), (2, 9), (4, 5), (2, 2, 3)]


_PARTS = [("steps", "steps = single process"), ("add_param_group", "add_param_group"), ("zero_grad", "zero_grad"),
          ("sharded", "state split over the ranks"), ("state_dict", f"state_dict {SAVE_AT} → {LOAD_AT} ranks")]


def _run(rng, name, members, steps=STEPS):
    """One training run: 7 parameters (8 to 20 elements each, so that no world size divides much)
    in three groups, the third added after step ADD_AT; gradients grads[step][rank][param]."""
    shapes = [rng.choice(_SHAPES) for _ in range(7)]
    order = list(range(7))
    rng.shuffle(order)
    defaults, options, added = _OPTIONS[name]
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    p = max(r for m in members for r in m) + 1
    return {"optimizer": name, "members": members, "defaults": defaults,
            "groups": [(sorted(order[:3]), options[0]), (sorted(order[3:5]), options[1])],
            "added": (sorted(order[5:]), added),
            "start": [torch.randn(s, generator=gen) for s in shapes],
            "grads": [[[torch.randn(s, generator=gen) * _GRAD_SCALE[name] for s in shapes] for _ in range(p)]
                      for _ in range(steps)]}


def _more_grads(rng, run, p):
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    return [[[torch.randn(x.shape, generator=gen) * _GRAD_SCALE[run["optimizer"]] for x in run["start"]]
             for _ in range(p)] for _ in range(MORE)]


def _rank_input(run, rank, *, save=False, resume=None, grads=None, state_dict=None):
    """What rank `rank` gets of a run: no other rank's gradients. A resume builds the optimizer on
    the run's starting values, then copies `resume` into the parameters and loads `state_dict`."""
    grads = run["grads"] if grads is None else grads
    return {"optimizer": run["optimizer"], "members": run["members"], "defaults": run["defaults"],
            "groups": run["groups"], "added": run["added"], "start": run["start"], "resume": resume,
            "grads": [g[rank] for g in grads], "save": save, "load": state_dict,
            "add_at": None if state_dict is not None else ADD_AT}


def _mean(grads, members):
    """Per step, per parameter: the mean over the group's ranks (and their sum)."""
    sums = [[torch.stack([g[r][j] for r in members]).sum(0) for j in range(len(g[0]))] for g in grads]
    return [[s / len(members) for s in step] for step in sums], sums


class _Reference:
    """Single-process optimizer_class on the run; variant "sum" (gradients summed over the ranks,
    not averaged) and "defaults" (every group with the defaults only) say what a mistake gives."""

    def __init__(self, run, grads, variant=None, start=None, load=None):
        self.run, cls = run, _OPTIMIZERS[run["optimizer"]]
        self.params = [torch.nn.Parameter(x.clone()) for x in (start or run["start"])]
        groups = run["groups"] + ([run["added"]] if load is not None else [])
        options = (lambda o: {}) if variant == "defaults" else (lambda o: o)    # noqa: E731
        self.optimizer = cls([{"params": [self.params[j] for j in g], **options(o)} for g, o in groups],
                             **run["defaults"])
        if load is not None:                                   # torch keeps the tensors it is given: a copy
            self.optimizer.load_state_dict(copy.deepcopy(load))
        self.history = []
        for step, mean_and_sum in enumerate(zip(*grads)):
            if step == ADD_AT and load is None:
                g, o = run["added"]
                self.optimizer.add_param_group({"params": [self.params[j] for j in g], **options(o)})
            self.step(mean_and_sum[1] if variant == "sum" else mean_and_sum[0])

    def step(self, grads):
        in_optimizer = {id(p) for g in self.optimizer.param_groups for p in g["params"]}
        for p, g in zip(self.params, grads):
            p.grad = g.clone() if id(p) in in_optimizer else None
        self.optimizer.step()
        self.history.append([p.detach().clone() for p in self.params])

    def state_bytes(self):
        """Per parameter: the bytes of its per-element state."""
        return [sum(v.numel() * v.element_size() for v in self.optimizer.state.get(p, {}).values()
                    if torch.is_tensor(v) and v.dim() > 0) for p in self.params]


def _verdicts() -> Parts:
    """The check's parts: each earns once judged without a problem; one the run never reached
    (a crash before it) shows "not reached" and earns nothing."""
    return Parts([key for key, _ in _PARTS], labels=dict(_PARTS), must_reach=True)


def _where(p, j, run):
    """'parameter 4 (group 1, shape [3, 4])'."""
    groups = run["groups"] + [run["added"]]
    g = next(k for k, (indices, _) in enumerate(groups) if j in indices)
    return f"parameter {j} (group {g}{' added by add_param_group' if g == 2 else ''}, shape {list(p.shape)})"


def _compare(observed, ref, run, members, params, steps, alternatives, held):
    """The message for the first (step, rank, parameter) that differs from the reference, or None."""
    name = run["optimizer"]
    for s in steps:
        for rank in members:
            for j in params:
                got, want = observed[rank]["history"][s][j], ref.history[s][j]
                diff = first_difference(got, want, atol=ATOL, rtol=RTOL)
                if diff is None:
                    continue
                index, a, b = diff
                hint = _hint(observed, ref, s, rank, j, members, alternatives, held, run)
                return (f"after step {s + 1}, rank {rank}'s {_where(got, j, run)} at {index} is {_fmt(a)}, "
                        f"expected {_fmt(b)}{_off(a, b)} (single-process {name} on the mean gradient of ranks "
                        f"{members}).{hint}")
    return None


def _off(a, b) -> str:
    """', off by 3.1e-05 (1e-06 + 1e-05·|x| allowed)' where the two would print alike."""
    return f" (off by {abs(a - b):.2g}, {ATOL:g} + {RTOL:g}·|x| = {ATOL + RTOL * abs(b):.2g} allowed)" \
        if _fmt(a) == _fmt(b) else ""


def _hint(observed, ref, s, rank, j, members, alternatives, held, run) -> str:
    def same(x, y):
        return first_difference(x, y, atol=ATOL, rtol=RTOL) is None
    got = observed[rank]["history"][s][j]
    owners = [r for r in members if j in held.get(r, [])]
    right = [r for r in members if r != rank and same(observed[r]["history"][s][j], ref.history[s][j])]
    if right:
        who = ", ".join(f"rank {r}" for r in right)
        if owners:
            who = f"rank {owners[0]}, whose optimizer steps it" if right == owners[:1] else \
                f"{who}; rank {owners[0]}'s optimizer steps it"
        return (f" Other ranks have it right ({who}): rank {rank} did not "
                f"take in the updated parameter. After the step, each parameter goes from the rank that stepped it "
                f"to every rank.")
    left = next((r for r in [rank, *members] if observed[r]["leftover"][s]), None)
    if left is not None:                        # another rank's leftovers reach this one through the reduce
        return (f" Rank {left}'s zero_grad() left gradients behind (parameters {observed[left]['leftover'][s]}), and "
                f"backward added to them" + (f"; they reach rank {rank} through the reduce." if left != rank else "."))
    if "sum" in alternatives and same(got, alternatives["sum"].history[s][j]):
        return (f" It is what the sum of the ranks' gradients gives: a reduce or all-reduce adds them up; divide "
                f"by the number of ranks, {len(members)}, for the mean.")
    if "defaults" in alternatives and same(got, alternatives["defaults"].history[s][j]):
        return (" It is what the defaults give: this parameter's group has options of its own (lr, weight_decay, "
                "...); give each group to the optimizer with its options.")
    before = ref.history[s - 1][j] if s else run["start"][j]
    if same(got, before) and not same(ref.history[s][j], before):
        return (" It did not move in this step: no rank stepped it (is it in some rank's optimizer?) or the rank "
                "that did never sent it to the others.")
    return ""


def _check_fresh(run, trial_observed, verdicts):
    """steps, add_param_group, zero_grad and state sharded, for one run of STEPS steps."""
    for members in run["members"]:
        observed = {r: trial_observed[r] for r in members}
        grads = _mean(run["grads"], members)
        ref = _Reference(run, grads)
        alternatives = {"sum": _Reference(run, grads, "sum"), "defaults": _Reference(run, grads, "defaults")}
        held = {r: observed[r]["held"] for r in members}
        first, added = [j for g, _ in run["groups"] for j in g], run["added"][0]
        wrong_steps = (_compare(observed, ref, run, members, first, range(STEPS), alternatives, held)
                       or _compare(observed, ref, run, members, added, range(ADD_AT), alternatives, held))
        verdicts.note("steps", wrong_steps)
        wrong_added = _compare(observed, ref, run, members, added, range(ADD_AT, STEPS), alternatives, held)
        if wrong_added and "did not move" in wrong_added:
            wrong_added += (" Parameters of a group added with add_param_group need an owner and a place in that "
                            "owner's optimizer (optimizer.add_param_group) like the others.")
        verdicts.note("add_param_group", wrong_added)
        verdicts.note("zero_grad", _check_zero_grad(observed, members, first))
        # All the state must be somewhere only if all the parameters were stepped right.
        verdicts.note("sharded", _check_sharded(observed, ref, run, members, whole=not (wrong_steps or wrong_added)))


def _check_zero_grad(observed, members, params):
    """Gradients zero_grad() left on the parameters given at construction (those of an added group
    are add_param_group's part)."""
    for s in range(1, STEPS):
        for rank in members:
            left = [j for j in observed[rank]["leftover"][s] if j in params]
            if left:
                return (f"after zero_grad(), before step {s + 1}, rank {rank}'s parameters {left} still had a "
                        f"gradient. Backward adds into .grad on every rank, whichever rank steps the parameter: "
                        f"zero_grad must clear the .grad of every parameter (set it to None), not only of those "
                        f"in this rank's optimizer.")
    return None


def _check_sharded(observed, ref, run, members, whole):
    per_param = ref.state_bytes()
    total, largest, n, name = sum(per_param), max(per_param), len(members), run["optimizer"]
    bound = total / n + largest
    for rank in members:
        mine, resident = observed[rank]["state_bytes"], observed[rank]["resident_bytes"]
        if resident > bound and resident > mine:
            return (f"rank {rank}'s optimizers hold {resident:,} bytes of per-element state in all (every torch "
                    f"optimizer in the rank counted; its optimizer_class instances hold {mine:,} of them): "
                    f"single-process {name} holds {total:,}, so each of {n} ranks should hold at most {total:,}/{n} "
                    f"+ {largest} (the largest parameter's state) = {bound:,.0f}. It held the whole state (Ψ·K "
                    f"bytes) instead of its 1/N (Ψ·K/N): keep one optimizer, of optimizer_class, over this rank's "
                    f"parameters only.")
        if mine > bound:
            held = observed[rank]["held"]
            holds = f" (its optimizers hold parameters {held}, {len(held)} of {len(per_param)})" if held else ""
            return (f"rank {rank}'s {name} state is {mine:,} bytes{holds}; single-process {name} holds {total:,} in "
                    f"all, so each of {n} ranks should hold at most {total:,}/{n} + {largest} (the largest "
                    f"parameter's state) = {bound:,.0f}. Give this rank's optimizer_class only the parameters this "
                    f"rank owns.")
    together = sum(observed[r]["state_bytes"] for r in members)
    if whole and together < total:
        return (f"the {name} instances of ranks {members} hold {together:,} bytes of state together, less than the "
                f"{total:,} single-process {name} holds: step each rank's parameters with a real optimizer_class "
                f"instance, so that its state is kept.")
    return None


def _difference(a, b, path=""):
    """Where two plain-data values first differ, "['state'][3]['exp_avg'] (values differ)", or None."""
    if torch.is_tensor(a) or torch.is_tensor(b):
        if not (torch.is_tensor(a) and torch.is_tensor(b)) or a.shape != b.shape or a.dtype != b.dtype:
            return f"{path} ({_kind(a)} vs {_kind(b)})"
        return None if torch.equal(a, b) else f"{path} (values differ)"
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            only = sorted(map(repr, set(a) ^ set(b)))[:4]
            return f"{path} (keys {', '.join(only)} in one only)"
        for k in a:
            found = _difference(a[k], b[k], f"{path}[{k!r}]")
            if found:
                return found
        return None
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and type(a) is type(b):
        if len(a) != len(b):
            return f"{path} (length {len(a)} vs {len(b)})"
        return next((d for k, (x, y) in enumerate(zip(a, b)) if (d := _difference(x, y, f"{path}[{k}]"))), None)
    return None if type(a) is type(b) and a == b else f"{path} ({_kind(a)} vs {_kind(b)})"


def _kind(x) -> str:
    if torch.is_tensor(x):
        return f"tensor{list(x.shape)}"
    return repr(x) if isinstance(x, (int, float, str, type(None))) else type(x).__name__


def _check_saved(trial_observed, members):
    """Every rank's state_dict() the same: the whole state, wherever it is asked for."""
    first = trial_observed[members[0]]["state_dict"]
    for rank in members[1:]:
        found = _difference(trial_observed[rank]["state_dict"], first)
        if found:
            where = f"the top{found}" if found.startswith(" ") else found
            return (f"rank {rank}'s state_dict() differs from rank {members[0]}'s at {where}. state_dict() must "
                    f"return the whole optimizer state on every rank, every rank's shard gathered "
                    f"(torch.distributed.all_gather_object, say), so that whichever rank saves it saves all of it."
                    f"{_own_shards_hint(trial_observed, members)}")
    return None


def _own_shards_hint(trial_observed, members) -> str:
    keys = {}
    for r in members:
        sd = trial_observed[r]["state_dict"]
        state = sd.get("state") if isinstance(sd, dict) else None
        if isinstance(state, dict):
            keys[r] = sorted(k for k in state if isinstance(k, (int, str)))
    if len(keys) == len(members) and all(not set(keys[a]) & set(keys[b]) for a in keys for b in keys if a < b):
        return " Here each rank returned only its own shard's state: " + ", ".join(
            f"rank {r} for {keys[r]}" for r in members) + "."
    return ""


def _check_loaded(run, saved_ref, start, grads, observed, saved_held):
    """A state_dict saved at SAVE_AT ranks, loaded at LOAD_AT: trains on like single process."""
    members = list(range(LOAD_AT))
    mean = _mean(grads, members)
    ref = _Reference(run, mean, start=start, load=saved_ref)
    fresh = _Reference(run, mean, start=start, load={"state": {}, "param_groups": saved_ref["param_groups"]})
    stale = _Reference(run, mean, load=saved_ref)              # from the values the optimizer was built with
    everything = list(range(len(start)))
    for s in range(MORE):
        for rank in members:
            for j in everything:
                got = observed[rank]["history"][s][j]
                diff = first_difference(got, ref.history[s][j], atol=ATOL, rtol=RTOL)
                if diff is None:
                    continue
                index, a, b = diff
                hint = ""
                if first_difference(got, fresh.history[s][j], atol=ATOL, rtol=RTOL) is None:
                    owner = [r for r, held in saved_held.items() if j in held]
                    where = f", held by rank {owner[0]}'s optimizer at {SAVE_AT} ranks," if owner else ""
                    hint = (f" It went on as if its optimizer state were new: its state{where} did not reach the "
                            f"rank that owns it now (missing from the state_dict, or not loaded there).")
                elif first_difference(got, stale.history[s][j], atol=ATOL, rtol=RTOL) is None:
                    hint = (" It went on from the value the parameter had when the ShardedOptimizer was built, not "
                            "from the value copied into it afterwards (as model.load_state_dict does when a run "
                            "resumes): a copy of the parameters kept since construction is stale. Step the "
                            "parameters themselves, or take their values again at each step.")
                return (f"after loading, step {s + 1}: rank {rank}'s {_where(got, j, run)} at {index} is {_fmt(a)}, "
                        f"expected {_fmt(b)} (single-process {run['optimizer']} going on from the saved state).{hint}")
    return None


@exercise("sharded_optimizer", "A sharded optimizer (ZeRO stage 1) for any torch.optim class",
          answer="ShardedOptimizer", notebook="06_sharded_optimizer", sealed=True, points=len(_PARTS),
          preload=("pplab.zero", "torch._dynamo"))   # an optimizer's first step imports it
def check_sharded_optimizer(fn, seed: int, timeout: float) -> str:
    """ShardedOptimizer(params, optimizer_class, group=None, **defaults): trains like single-process
    optimizer_class, keeps ~1/N of its state per rank, saves a state_dict any world size can load."""
    require_function(fn, "sharded_optimizer", "params, optimizer_class, group=None, **defaults",
                     [torch.zeros(1)], torch.optim.SGD)
    rng = random.Random(seed)
    verdicts = _verdicts()
    everyone = [list(range(SAVE_AT))]
    runs = [_run(rng, "AdamW", everyone), _run(rng, "SGD", everyone),
            _run(rng, rng.choice(["AdamW", "SGD"]), [[0, 2], [1]])]
    saved = {}

    def describe(p, i, runs_here):
        run = runs_here[i]
        groups = "" if len(run["members"]) == 1 else ", process groups " + " and ".join(map(str, run["members"]))
        load = f", resumed from {SAVE_AT} ranks (parameters, state_dict)" if i >= 2 and p == LOAD_AT else ""
        return f"world_size={p}, {run['optimizer']}, 7 parameters in 3 groups{groups}{load}"

    def check_save(p, i, observed, traffic):
        _check_fresh(runs[i], observed, verdicts)
        if i < 2:
            problem = _check_saved(observed, list(range(p)))
            if problem is not None:                        # right only once loaded and trained on, at 2 ranks
                verdicts.note("state_dict", problem)
            else:
                saved[i] = (observed[0]["state_dict"], {r: observed[r]["held"] for r in observed})

    inputs = [[_rank_input(run, r, save=i < 2) for r in range(SAVE_AT)] for i, run in enumerate(runs)]
    _launch(fn, inputs, SAVE_AT, timeout, runs, describe, check_save, verdicts)

    # At 2 ranks: both optimizers afresh, then each state_dict saved at 3 ranks, loaded and trained on.
    fresh = [_run(rng, "AdamW", [[0, 1]]), _run(rng, "SGD", [[0, 1]])]
    loads = []
    for i in sorted(saved):
        run = runs[i]
        ref = _Reference(run, _mean(run["grads"], everyone[0]))
        loads.append((run, copy.deepcopy(ref.optimizer.state_dict()), [p.detach().clone() for p in ref.params],
                      _more_grads(rng, run, LOAD_AT), *saved[i]))
    runs_here = fresh + [load[0] for load in loads]

    def check_load(p, i, observed, traffic):
        if i < len(fresh):
            _check_fresh(fresh[i], observed, verdicts)
        else:
            run, saved_ref, start, grads, _, saved_held = loads[i - len(fresh)]
            verdicts.note("state_dict", _check_loaded(run, saved_ref, start, grads, observed, saved_held))

    inputs = [[_rank_input(run, r) for r in range(LOAD_AT)] for run in fresh]
    inputs += [[_rank_input(run, r, resume=start, grads=grads, state_dict=sd) for r in range(LOAD_AT)]
               for run, _, start, grads, sd, _ in loads]
    _launch(fn, inputs, LOAD_AT, timeout, runs_here, describe, check_load, verdicts)

    return verdicts.finish(f"on world sizes {SAVE_AT} and {LOAD_AT} (AdamW and SGD with momentum, 7 fp32 parameters in 3 "
                           f"groups with their own options, the third added by add_param_group after step {ADD_AT}, "
                           f"{STEPS} steps; and two process groups [0, 2] and [1]): every parameter on every rank = "
                           f"single-process to {ATOL:g} + {RTOL:g}·|x|, zero_grad clears every .grad, optimizer state "
                           f"per rank <= total/N + the largest parameter's, a state_dict saved at {SAVE_AT} ranks and "
                           f"loaded at {LOAD_AT} trains on identically)")


def _launch(fn, inputs, p, timeout, runs_here, describe, check, verdicts):
    """One sealed launch; each problem found goes to `verdicts` with where it was found. A launch
    that fails (a raise, a hang) fails the check, with what was judged before it."""
    def judged(world_size, i, observed, traffic):
        if len(observed) < world_size:                     # the launch failed in this trial: said below
            return
        before = dict(verdicts.problems)
        check(world_size, i, observed, traffic)
        for key, value in verdicts.problems.items():      # a new problem says where it was found
            if value and value != before[key]:
                verdicts.problems[key] = f"{describe(world_size, i, runs_here)}: {value}"
    try:
        sealed.run_sealed(_rank_job, fn, inputs, world_size=p, timeout=timeout,
                          exercise=("sharded_optimizer", "a sharded optimizer"), forbidden=(),
                          probe=_refuse_library_optimizers, describe=lambda w, i: describe(w, i, runs_here),
                          check=judged)
    except Fail as failure:
        if verdicts.reached and not isinstance(failure, Forbidden):
            earlier = f" Before that: {verdicts.first()}" if verdicts.first() else ""
            raise Fail(f"{failure}{earlier} {verdicts.breakdown()}.", failure.seed_matters,
                       earned=verdicts.earned()) from None
        raise
