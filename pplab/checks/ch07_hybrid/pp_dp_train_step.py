"""Check of chapter 7's capstone: a pipeline × data parallel trainer.

    pp_dp_train_step   pp_dp_train_step(stage, inputs, targets, loss_fn, m, pp_group, dp_group) -> loss or None

The ranks form a mesh of pp stages × dp replicas (pplab.mesh's layout: rank = stage·dp + replica,
so dp_group holds the copies of one stage and pp_group the stages of one replica). Each rank gets
its stage (a slice of a float64 MLP: the same number of Linear(d, d) + Tanh layers on every stage),
its replica's share of the batch (inputs and targets, B/dp rows each, cut into m micro-batches of
equal size) and the two groups. One call is one training step: the m micro-batches in 1F1B order,
activations sent forward and gradients back to the neighbouring stages of the same replica, then
each stage's gradients averaged over its dp group. The last stage returns its replica's loss (the
mean of its m micro-batch losses); the others return None.

It runs on sealed ranks (sealed.py) in two launches, 2 stages × 2 replicas and 3 stages × 2
replicas, with hidden weights and data, m ≥ pp + 2 micro-batches (so that GPipe's order, and a
warm-up one forward too long, hold more than 1F1B's, and differ from each other). Five parts,
each judged on every rank and reported separately (partial credit):

* gradients: every parameter's .grad equals the gradient of the whole model on the whole batch in
  one process (mean loss; float64, to 1e-9 relative);
* loss: the last stage returns its replica's loss, to 1e-9 relative;
* pipeline traffic: from the router's record, each rank sends one micro-batch's activation
  (b·d float64) per micro-batch to the next stage of its replica and one gradient per micro-batch
  to the previous one, nothing else: 2m messages per stage boundary per replica;
* dp all-reduce: each rank's collectives are all-reduces over its dp group of its stage's
  gradients, each number once (one bucket, or one call per parameter);
* 1F1B memory: each rank runs m forwards and m backwards of its stage and holds at most pp - s
  micro-batches' activations (forwards whose backward has not run), and at its peak exactly that
  many (a shorter warm-up idles), measured through the stage it is given.

The message names the first part that failed, with the first rank and tensor that differ and
why, then the five parts' verdicts.
"""
from __future__ import annotations

import random
import torch
from torch import nn

from .. import sealed
from ..core import Parts, exercise, first_difference, require_function
from ..core import _fmt
from .pp_dp_train_step_rank import _refuse_library_trainer, _trainer_rank, layout


PARTS = ("gradients", "loss", "pipeline traffic", "dp all-reduce", "1F1B memory")


MESHES = ((2, 2), (3, 2))                      # (pp, dp)


_ATOL, _RTOL = 1e-12, 1e-9


def peak_held(order) -> int:
    """The most micro-batches held at once (forwards run whose backward has not) in an order of "F"/"B"."""
    held = peak = 0
    for kind in order:
        held += 1 if kind == "F" else -1
        peak = max(peak, held)
    return peak


def _trial(seed, pp, dp):
    rng = random.Random(seed * 31 + pp * 7 + dp)
    return {"pp": pp, "dp": dp, "d": rng.randint(3, 5), "layers": rng.randint(1, 2), "m": pp + rng.randint(2, pp + 1),
            "b": rng.randint(1, 2), "seed": rng.randrange(2**31)}


def _model(trial) -> list[nn.Sequential]:
    """The whole model, stage by stage: each `layers` × (Linear(d, d) + Tanh), float64."""
    torch.manual_seed(trial["seed"])
    d = trial["d"]
    return [nn.Sequential(*[m for _ in range(trial["layers"]) for m in (nn.Linear(d, d, dtype=torch.float64),
                                                                         nn.Tanh())])
            for _ in range(trial["pp"])]


def _batch(trial):
    """Each replica's (inputs, targets): m micro-batches of b rows."""
    g = torch.Generator().manual_seed(trial["seed"] + 1)
    rows = trial["m"] * trial["b"]
    return [(torch.randn(rows, trial["d"], generator=g, dtype=torch.float64),
             torch.randn(rows, trial["d"], generator=g, dtype=torch.float64)) for _ in range(trial["dp"])]


def _grads(stages, X, Y, micro=None):
    """Each stage's parameter gradients of MSE(model(X), Y); micro=(m, keep): of the mean over the
    micro-batches in keep of their losses, each divided by m (a loop that drops some)."""
    for stage in stages:
        stage.zero_grad()
    if micro is None:
        h = X
        for stage in stages:
            h = stage(h)
        nn.MSELoss()(h, Y).backward()
    else:
        m, keep = micro
        for i in keep:
            h = X.chunk(m)[i]
            for stage in stages:
                h = stage(h)
            (nn.MSELoss()(h, Y.chunk(m)[i]) / m).backward()
    return [{n: q.grad.clone() for n, q in stage.named_parameters()} for stage in stages]


def _reference(trial):
    stages, batch = _model(trial), _batch(trial)
    X, Y = torch.cat([x for x, _ in batch]), torch.cat([y for _, y in batch])
    with torch.no_grad():
        losses = []
        for x, y in batch:
            h = x
            for stage in stages:
                h = stage(h)
            losses.append(nn.MSELoss()(h, y).item())
    return {"whole": _grads(stages, X, Y), "replica": [_grads(stages, x, y) for x, y in batch],
            "short": [_grads(stages, x, y, (trial["m"], range(trial["m"] - 1))) for x, y in batch],
            "losses": losses, "stages": stages, "batch": batch}


def _close(got, want) -> bool:
    return isinstance(got, torch.Tensor) and got.shape == want.shape and \
        torch.allclose(got, want, atol=_ATOL, rtol=_RTOL)


def _gradient_problem(res, ref, trial, s, k, dp_problem):
    m, dp = trial["m"], trial["dp"]
    ran = res["events"].count("F")
    for name, want in ref["whole"][s].items():
        got = res["grads"].get(name)
        if got is None:
            return (f"{name}.grad is None: run every micro-batch's backward through the stage "
                    f"(torch.autograd.backward(out, grad)), which adds into .grad.")
        if got.shape != want.shape:
            return f"{name}.grad has shape {list(got.shape)}, expected {list(want.shape)}."
        diff = first_difference(got, want, atol=_ATOL, rtol=_RTOL)
        if diff is None:
            continue
        index, g, w = diff
        if ran != m:
            hint = (f" This rank ran {ran} forwards of its stage, for m = {m} micro-batches: run each micro-batch "
                    f"once (forwards 0..{m - 1}, backwards 0..{m - 1}).")
        elif _close(got, dp * want):
            hint = (f" It is {dp} times that: the sum over the dp = {dp} replicas. The batch's loss is the mean over "
                    f"all replicas' samples: divide the all-reduced gradients by dp.")
        elif _close(got, ref["replica"][k][s][name]):
            hint = (f" It is replica {k}'s own gradient, from its share of the batch only: average the gradients over "
                    f"dp_group (all-reduce, then divide by dp) after the last backward.")
        elif _close(got, m * want):
            hint = (f" It is {m} times that: the step's loss is the mean of the m = {m} micro-batch losses, so divide "
                    f"each micro-batch's loss by m before its backward.")
        elif _close(got, sum(r[s][name] for r in ref["short"]) / dp):
            hint = f" It leaves out the last micro-batch ({m - 1}): the step has m = {m} of them."
        elif dp_problem:
            hint = f" Its gradient all-reduce is wrong: {dp_problem}"
        else:
            hint = (" The gradients of this stage's copies must be averaged over dp_group, the ranks holding the same "
                    "stage in the other replicas.")
        return (f"{name}.grad at {index} is {_fmt(g)}, but the single-process gradient of the whole batch is "
                f"{_fmt(w)}.{hint}")
    return None


def _loss_problem(res, ref, trial, s, k):
    if s != trial["pp"] - 1:
        return None
    got, want, m = res["loss"], ref["losses"][k], trial["m"]
    if not isinstance(got, float):
        return (f"the last stage returned {got if got is not None else 'None'}: return the replica's loss, the "
                f"mean of its m micro-batch losses (a number or a one-element tensor).")
    if abs(got - want) <= _RTOL * abs(want) + _ATOL:
        return None
    hint = ""
    if abs(got - m * want) <= _RTOL * abs(m * want) + _ATOL:
        hint = f" It is {m} times that: the sum of the micro-batch losses; the step's loss is their mean."
    return (f"the last stage returned loss {_fmt(got)}; replica {k}'s loss (the mean over its batch) is "
            f"{_fmt(want)}.{hint}")


def _traffic_problem(traffic, trial, s, pipeline):
    """The point-to-point sends of the rank at stage s of the replica whose stages are `pipeline`."""
    m, nbytes = trial["m"], 8 * trial["b"] * trial["d"]
    prev = pipeline[s - 1] if s > 0 else None
    nxt = pipeline[s + 1] if s < len(pipeline) - 1 else None
    sent = traffic["sends_in"].get("step", [])
    strangers = sorted({dst for dst, _ in sent} - {prev, nxt})
    if strangers:
        return (f"it sent to rank {strangers[0]}, which is not a neighbouring stage of its replica (the replica's "
                f"stages are ranks {pipeline}): send activations to the next rank of pp_group and gradients to the "
                f"previous one (comm.group_ranks(pp_group)).")
    for peer, what in ((nxt, "activation"), (prev, "gradient")):
        if peer is None:
            continue
        mine = [n for dst, n in sent if dst == peer]
        if len(mine) != m:
            return (f"it sent {len(mine)} messages to rank {peer} ({'next' if peer == nxt else 'previous'} stage); "
                    f"1F1B sends one {what} per micro-batch, m = {m}.")
        odd = [n for n in mine if n != nbytes]
        if odd:
            return (f"it sent a message of {odd[0]} bytes to rank {peer}; one micro-batch's {what} is b × d = "
                    f"{trial['b']} × {trial['d']} float64, {nbytes} bytes: send each micro-batch on its own.")
    return None


def _dp_problem(traffic, trial, s, dp_ranks, pp_ranks, param_bytes):
    calls = [c for c in traffic["collectives"] if c["phase"] == "step"]
    if not calls:
        return (f"it made no collective: each replica's gradients come from its own share of the batch; all-reduce "
                f"them over dp_group (ranks {dp_ranks}, the copies of stage {s}) and divide by dp.")
    for c in calls:
        kind, group = c["kind"], list(c["group"])
        if kind != "all_reduce":
            return f"it made a {kind}: one all-reduce of the stage's gradients over dp_group is all the step needs."
        if group != dp_ranks:
            why = ("its replica's pipeline (pp_group), whose ranks hold different stages" if group == pp_ranks
                   else "not the copies of its stage")
            return (f"it all-reduced over ranks {group}, {why}; the copies of stage {s} are dp_group, ranks "
                    f"{dp_ranks}.")
    total = sum(c["bytes"] for c in calls)
    if total != param_bytes:
        return (f"it all-reduced {total} bytes over dp_group; the stage's gradients are {param_bytes} bytes: "
                f"all-reduce each once.")
    return None


def _memory_problem(res, trial, s):
    events, m, pp = res["events"], trial["m"], trial["pp"]
    forwards, backwards = events.count("F"), events.count("B")
    if forwards != m or backwards != m:
        return (f"it ran {forwards} forwards and {backwards} backwards of its stage; the step has m = {m} "
                f"micro-batches, one forward and one backward each.")
    peak, limit = peak_held(events), pp - s
    if peak == limit:                    # m >= pp + 2: 1F1B's peak is pp - s exactly, no more and no less
        return None
    if peak < limit:                     # a warm-up too short: right values, but the pipeline idles
        held = "micro-batches'" if peak > 1 else "micro-batch's"
        return (f"it held at most {peak} {held} activations at once; 1F1B holds "
                f"pp - s = {limit} at stage {s}: its warm-up is too short, so the stage waits for gradients while "
                f"forwards it could run are ready. Run pp - s - 1 = {limit - 1} warm-up forwards (pp is the size of "
                f"pp_group), then alternate one forward and one backward.")
    gpipe = events[:m] == ["F"] * m
    why = f"All {m} forwards ran before the first backward: that is GPipe's order. " if gpipe else ""
    return (f"it held up to {peak} micro-batches' activations at once (forwards whose backward had not run); "
            f"1F1B holds at most pp - s = {limit} at stage {s}. {why}Run pp - s - 1 = {limit - 1} warm-up forwards, "
            f"then alternate one forward and one backward, then the remaining backwards.")


def _judge(trial, ref, observed, traffic):
    found = dict.fromkeys(PARTS)
    pp, dp = trial["pp"], trial["dp"]
    mesh = layout(pp, dp)
    for rank in range(pp * dp):
        s, k = divmod(rank, dp)
        res = observed[rank]
        where = f"rank {rank} (stage {s} of replica {k})"
        param_bytes = 8 * sum(g.numel() for g in ref["whole"][s].values())
        dp_problem = _dp_problem(traffic[rank], trial, s, mesh["dp"][s], mesh["pp"][k], param_bytes)
        problems = {"gradients": _gradient_problem(res, ref, trial, s, k, dp_problem),
                    "loss": _loss_problem(res, ref, trial, s, k),
                    "pipeline traffic": _traffic_problem(traffic[rank], trial, s, mesh["pp"][k]),
                    "dp all-reduce": dp_problem,
                    "1F1B memory": _memory_problem(res, trial, s)}
        for part in PARTS:
            if problems[part] and not found[part]:
                found[part] = f"{where}: {problems[part]}"
    return found


def _describe(trial):
    return (f"pp={trial['pp']} stages × dp={trial['dp']} replicas, m={trial['m']} micro-batches of {trial['b']}×"
            f"{trial['d']}, {trial['layers']} layer(s) a stage")


@exercise("pp_dp_train_step", "A pipeline × data parallel trainer: 1F1B between stages, all-reduce across replicas",
          answer="pp_dp_train_step", notebook="07_pp_dp_train_step", sealed=True, points=len(PARTS),
          preload=("pplab.pipeline", "pplab.hybrid"))
def check_pp_dp_train_step(fn, seed: int, timeout: float) -> str:
    require_function(fn, "pp_dp_train_step", "stage, inputs, targets, loss_fn, m, pp_group, dp_group",
                     None, None, None, None, 1, None, None)
    parts = Parts(PARTS)
    for pp, dp in MESHES:
        trial = _trial(seed, pp, dp)
        ref = _reference(trial)
        inputs = [{**trial, "parameters": [q.detach().clone() for q in ref["stages"][rank // dp].parameters()],
                   "inputs": ref["batch"][rank % dp][0], "targets": ref["batch"][rank % dp][1]}
                  for rank in range(pp * dp)]
        found = {}

        def judge(p, i, observed, traffic):
            if len(observed) == p:
                found.update(_judge(trial, ref, observed, traffic))
        sealed.run_sealed(_trainer_rank, fn, [inputs], world_size=pp * dp, timeout=timeout,
                          exercise=("pp_dp_train_step", "the training step"), forbidden=(),
                          probe=_refuse_library_trainer, describe=lambda p, i: _describe(trial), check=judge)
        for part in PARTS:
            parts.note(part, found.get(part), where=_describe(trial))
    return parts.finish("on 2 stages × 2 replicas and 3 stages × 2 replicas (every gradient equal to one process's "
                        "on the whole batch and the loss to its replica's, float64 to 1e-9; per rank one activation "
                        "and one gradient per micro-batch to its neighbouring stages, one all-reduce of its gradients "
                        "over its dp group, and at most pp - s micro-batches held)")
