"""Check of chapter 2's harder exercise: DDP's bucketed, overlapped all-reduce from scratch.

    ddp_from_scratch   bucketed_ddp(model, group, cap_bytes) -> finish

Unlike exercise 2a, nothing is handed over: the answer returns only `finish`, and the
check finds the buckets from what the answer did. On 2, 3 and 4 sealed ranks (on 4, also
as two data-parallel groups {0, 2} and {1, 3}, each averaging on its own), a random
float64 MLP is trained two SGD steps, every rank on its own data. Every all-reduce is in
the checker's router's record (whether it came through pplab.comm or torch.distributed):
its size, its group, whether it was asynchronous, whether loss.backward() was still
running, and whether its handle was waited on before finish() returned; the rank notes
which gradients were ready when each started.
In the checker's process:

* the all-reduces, in the order they started, are the buckets: the parameters in
  reverse order, cut into consecutive groups, each filled up to cap_bytes (a parameter
  larger than the cap alone); one all-reduce per bucket, over the given group;
* each started asynchronously during backward, before the gradients of any later layer
  were in (that is the overlap), and was waited on in finish();
* after finish(), every .grad equals the single-process gradient of the group's whole
  batch (float64, to 1e-9 relative), at both steps.
"""
from __future__ import annotations

import copy
import random
import torch
import torch.nn.functional as F
from torch import nn

from .. import sealed
from ..core import Fail, exercise, first_difference, known_mistake, require_function
from ..core import _fmt, random_mlp_and_cap
from .ddp_from_scratch_rank import _STEPS, _ddp_rank_of_trials, _mlp, _refuse_library_ddp


_ATOL, _RTOL = 1e-12, 1e-9


def _configs(seed: int, p: int) -> list[dict]:
    """Two models per world size: a cap below the largest weight (it gets a bucket of its
    own), and a cap that holds at least a layer. On 4 ranks the second trains in two groups."""
    rng = random.Random(seed * 13 + p)
    configs = []
    for small_cap in (True, False):
        widths, cap = random_mlp_and_cap(rng, 8, small_cap)                 # float64
        groups = [[0, 2], [1, 3]] if p == 4 and not small_cap else [list(range(p))]
        configs.append({"widths": widths, "cap": cap, "groups": groups, "batch": rng.randint(1, 3),
                        "seed": rng.randrange(2**31)})
    return configs


def _group_batch(config, seed, c, step, g):
    """The whole batch of data-parallel group g at this step; member k gets slice k."""
    gen = torch.Generator().manual_seed(seed * 1000 + c * 100 + step * 10 + g)
    n = config["batch"] * len(config["groups"][g])
    w = config["widths"]
    return (torch.randn(n, w[0], generator=gen, dtype=torch.float64),
            torch.randn(n, w[-1], generator=gen, dtype=torch.float64))


def _all_reduces(collectives, ready) -> list:
    """Each all-reduce of a step as the checks below read it: the router's record (float64), and
    the gradients that were in when it started (the rank's note, in the same order)."""
    calls = [c for c in collectives if c["kind"] == "all_reduce"]
    return [{"numel": c["bytes"] // 8, "async": c["async"], "during": c["phase"] == "backward",
             "ranks": c["group"], "waited": c["waited"] in ("backward", "finish"),
             "ready": ready[i] if i < len(ready) else []} for i, c in enumerate(calls)]


def _reference(config, seed, c, step, g, k) -> dict:
    """{name: (the single-process gradient of group g's whole batch at `step`, after the SGD
    steps before it; that of member k's slice alone; the whole batch's at the step before)}."""
    model = _mlp(config)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = {n: None for n, _ in model.named_parameters()}
    for s in range(step + 1):
        model.zero_grad()
        X, Y = _group_batch(config, seed, c, s, g)
        F.mse_loss(model(X), Y).backward()
        if s < step:
            before = {n: q.grad.clone() for n, q in model.named_parameters()}
            optimizer.step()
    local, b = copy.deepcopy(model), config["batch"]
    local.zero_grad()
    F.mse_loss(local(X[k * b:(k + 1) * b]), Y[k * b:(k + 1) * b]).backward()
    return {n: (q.grad, own.grad, before[n]) for (n, q), own in zip(model.named_parameters(), local.parameters())}


def _buckets_of(sizes, params):
    """The all-reduce sizes (elements) as consecutive runs of `params` [(name, numel, bytes)], or None."""
    buckets, j = [], 0
    for n in sizes:
        bucket, total = [], 0
        while j < len(params) and total < n:
            bucket.append(params[j])
            total += params[j][1]
            j += 1
        if total != n:
            return None
        buckets.append(bucket)
    return buckets if j == len(params) else None


def _check_buckets(calls, params, cap, step):
    sizes = [call["numel"] for call in calls]
    if not sizes:
        again = " The first step did: reset what your hooks count or hold in finish(), ready for the next " \
                "backward." if step else ""
        raise Fail(f"step {step + 1} started no all-reduce: each bucket's all-reduce starts from a gradient hook "
                   f"(param.register_post_accumulate_grad_hook) as soon as its last gradient is in.{again}")
    reverse = list(reversed(params))
    buckets = _buckets_of(sizes, reverse)
    if buckets is None:
        hint = " They follow model.parameters() in *forward* order: backward makes the last layer's gradients " \
               "first, so the buckets go last parameter first." if _buckets_of(sizes, params) else ""
        raise Fail(f"step {step + 1}: the all-reduces, of {sizes} elements in the order they started, are not the "
                   f"parameters taken last first, one bucket after the other (parameters, last first: "
                   f"{[(n, k) for n, k, _ in reverse]} elements).{hint} All-reduce one flat buffer per bucket.")
    for b, bucket in enumerate(buckets):
        nbytes = sum(x[2] for x in bucket)
        if nbytes > cap and len(bucket) > 1:
            raise Fail(f"step {step + 1}: bucket {b} holds {[x[0] for x in bucket]}, {nbytes} bytes, more than "
                       f"cap_bytes={cap}: start a new bucket when the next parameter would not fit (only a "
                       f"parameter larger than the cap gets a bucket over it, alone).")
        if b + 1 < len(buckets) and nbytes + buckets[b + 1][0][2] <= cap:
            nxt = buckets[b + 1][0]
            raise Fail(f"step {step + 1}: bucket {b} ({[x[0] for x in bucket]}, {nbytes} bytes) had room for "
                       f"{nxt[0]} ({nxt[2]} bytes) under cap_bytes={cap}, which went to bucket {b + 1}: fill each "
                       f"bucket up to the cap before starting the next (fewer all-reduces, fewer latencies α).")
    return buckets


def _check_launches(calls, buckets, params, members, step):
    layer = {n: n.split(".")[0] for n, _, _ in params}
    position = {n: i for i, (n, _, _) in enumerate(reversed(params))}
    for b, (call, bucket) in enumerate(zip(calls, buckets)):
        where = f"step {step + 1}: bucket {b}'s all-reduce"
        if sorted(call["ranks"]) != members:
            raise Fail(f"{where} went over ranks {sorted(call['ranks'])}, but this rank's data-parallel group is "
                       f"{members}: pass group= to the all-reduce, and divide by the group's size.")
        if not call["during"]:
            raise Fail(f"{where} started only after loss.backward() returned: start it from the hook of the "
                       f"bucket's last gradient, so that it travels while backward computes the earlier layers.")
        if not call["async"]:
            raise Fail(f"{where} was blocking, so backward stopped until it was done: pass async_op=True, keep the "
                       f"handle, and wait for it in finish().")
        last = bucket[-1][0]
        later = [n for n in call["ready"] if position[n] > position[last] and layer[n] != layer[last]]
        if later:
            raise Fail(f"{where} started only once the gradient of {later[0]} was in, which backward computes after "
                       f"bucket {b} is complete: start each bucket as soon as its own last gradient is in, not when "
                       f"all are.")
        if not call["waited"]:
            raise Fail(f"{where} was never waited for: finish() must wait for every handle before it reads the "
                       f"bucket (until then the sum may still be arriving).")


def _check_grads(grads, reference, rank, p_group, step):
    for name, (ref, own, before) in reference.items():
        where = f"step {step + 1}: rank {rank}'s {name}.grad"
        got = grads[name]
        if got is None:
            raise Fail(f"{where} is None after finish(): copy the averaged bucket back into each .grad.")
        diff = first_difference(got, ref, atol=_ATOL, rtol=_RTOL)
        if diff is None:
            continue
        hint = known_mistake(got, [
            (p_group * ref, f"It is {p_group} times that: the all-reduce sums the ranks' gradients; divide by the "
                            f"group's size."),
            (own, "It is this rank's own gradient: the averaged bucket never made it back into .grad."),
            (None if before is None else ref + before,
             "It is this step's gradient plus the step before's: what your hooks add into is never emptied; "
             "start every step from zero (in finish(), or by copying rather than adding).")], atol=_ATOL, rtol=_RTOL)
        raise Fail(f"{where} at {diff.index} is {_fmt(diff.got)}, but the single-process gradient of the group's "
                   f"whole batch is {_fmt(diff.expected)}.{hint}")


def _check_ddp(configs, seed):
    def check(p, t, observed, traffic):
        c, step = divmod(t, _STEPS)
        config = configs[p][c]
        model = _mlp(config)
        params = [(n, q.numel(), q.numel() * q.element_size()) for n, q in model.named_parameters()]
        for rank, seen in sorted(observed.items()):
            g = next(g for g, ranks in enumerate(config["groups"]) if rank in ranks)
            calls = _all_reduces(traffic[rank]["collectives"], seen["ready"])
            buckets = _check_buckets(calls, params, config["cap"], step)
            _check_launches(calls, buckets, params, config["groups"][g], step)
            members = config["groups"][g]
            _check_grads(seen["grads"], _reference(config, seed, c, step, g, members.index(rank)), rank,
                         len(members), step)
    return check


@exercise("ddp_from_scratch", "DDP from scratch: buckets, hooks, overlap", answer="bucketed_ddp",
          notebook="02_ddp_from_scratch", sealed=True,
          preload=('pplab.data_parallel', 'torch._dynamo'))   # an optimizer's first step imports it
def check_ddp_from_scratch(fn, seed: int, timeout: float) -> str:
    """bucketed_ddp(model, group, cap_bytes) -> finish: after loss.backward() and finish(),
    every .grad is the mean over the group's ranks (= the group's whole batch's gradient)."""
    require_function(fn, "ddp_from_scratch", "model, group, cap_bytes", nn.Linear(1, 1), None, 100)
    configs = {p: _configs(seed, p) for p in (2, 3, 4)}

    def describe(p, t):
        config = configs[p][t // _STEPS]
        groups = "" if len(config["groups"]) == 1 else f", groups {config['groups']}"
        return f"world_size={p}{groups}, MLP widths {config['widths']}, cap_bytes={config['cap']}"
    for p in configs:
        jobs = [[] for _ in range(p)]                   # rank r's configs: the model, its slice of each batch
        for c, config in enumerate(configs[p]):
            parameters = [q.detach().clone() for q in _mlp(config).parameters()]
            batches = [[_group_batch(config, seed, c, step, g) for g in range(len(config["groups"]))]
                       for step in range(_STEPS)]
            b = config["batch"]
            for r in range(p):
                g = next(g for g, ranks in enumerate(config["groups"]) if r in ranks)
                k = config["groups"][g].index(r)
                jobs[r].append({"widths": config["widths"], "cap": config["cap"], "groups": config["groups"],
                                "seed": 0, "parameters": parameters,
                                "batches": [(X[k * b:(k + 1) * b], Y[k * b:(k + 1) * b])
                                            for X, Y in (batches[step][g] for step in range(_STEPS))]})
        inputs = [[jobs[r] if t == 0 else None for r in range(p)] for t in range(len(configs[p]) * _STEPS)]
        sealed.run_sealed(_ddp_rank_of_trials, fn, inputs, world_size=p, timeout=timeout,
                          exercise=("ddp_from_scratch", "DDP"), forbidden=(), probe=_refuse_library_ddp,
                          describe=describe, check=_check_ddp(configs, seed))
    return ("on world sizes 2, 3, 4 (and two groups of 2 on 4), 6 random float64 MLPs and caps, 2 SGD steps each: one "
            "async all-reduce per bucket (reverse order, filled to the cap) over the group, started during backward "
            "as soon as its bucket was complete and waited for in finish(); .grad = the group's whole-batch gradient "
            "to 1e-9")
