"""Check of exercise moe_dispatch (exercises/08_moe_dispatch.ipynb): MoE dispatch: counts per rank and the permutation for the all-to-all.

    moe_dispatch     dispatch(expert, num_experts, world_size) -> (send_counts, order)

moe_dispatch runs on 2, 3 and 4 sealed ranks (sealed.py). Every rank gets its own random choices
(expert[s] in 0..E-1, or -1 where the choice was dropped; E a multiple of p, a different
number of choices on every rank), calls the answer, and then, with the answer's send_counts,
exchanges the counts and sends x[order] by the library's uneven all-to-all, x's rows naming
their rank and choice. Checked here: send_counts (one per rank, experts in contiguous blocks
of E/p), order (the kept choices sorted by expert, ties in choice order), and on every rank
the rows that arrived, against `pplab.expert_parallel.dispatch_plan` on the same choices.
"""
from __future__ import annotations

import random
import torch

from .. import sealed
from ..core import Fail, exercise, require_function
from .moe_dispatch_rank import _dispatch_rank, _refuse_dispatch_plan, _rows


def _dispatch_trials(seed, p):
    rng = random.Random(seed * 31 + p)
    trials = []
    for t in range(2):
        E = p * rng.randint(2 - t, 3)                     # the first trial has several experts per rank
        g = torch.Generator().manual_seed(rng.randrange(2**31))
        experts = []
        for r in range(p):
            n = rng.randint(4, 12)
            e = torch.randint(0, E, (n,), generator=g)
            e[torch.rand(n, generator=g) < 0.2] = -1                       # some choices over capacity
            e[rng.randrange(n)] = -1                                        # at least one on every rank
            experts.append(e)
        trials.append({"E": E, "expert": experts})
    return trials


def _counts_hint(counts, expert, E, p) -> str:
    kept = expert[expert >= 0]
    if len(counts) == E and E != p:
        return (f" That is one count per expert ({E}); the all-to-all needs one per rank ({p}): rank j holds "
                f"experts j·{E // p} .. (j+1)·{E // p}-1, so add up their counts.")
    if counts == torch.bincount(kept % p, minlength=p).tolist():
        return (f" Those are the counts for experts dealt round-robin (expert e on rank e % {p}); here each rank "
                f"holds a contiguous block: expert e lives on rank e // (E/p) = e // {E // p}.")
    if sum(counts) == len(expert):
        return " That counts every choice; those with expert -1 were dropped (over capacity) and go nowhere."
    return ""


def _order_hint(order, want, expert, E, p, rank) -> str:
    kept = (expert >= 0).nonzero().flatten()
    round_robin = order == kept[torch.argsort(expert[kept] % p * E + expert[kept], stable=True)].tolist()
    mine_first = order == kept[torch.argsort((expert[kept] - rank * (E // p)) % E, stable=True)].tolist()
    if round_robin and mine_first:              # with few choices both mistakes can give this one order
        return (f" Either the experts were dealt round-robin (expert e on rank e % {p}; here expert e lives on "
                f"rank e // {E // p}), or this rank's own experts came first: the block for rank 0's experts "
                f"comes first, then rank 1's, whatever rank you are.")
    if round_robin:
        return (f" That is the order for experts dealt round-robin (expert e on rank e % {p}); here each rank "
                f"holds a contiguous block: expert e lives on rank e // (E/p) = e // {E // p}.")
    if len(order) == len(expert):
        return " It includes the dropped choices (expert -1): leave them out."
    if sorted(order) == sorted(want):
        if [int(expert[s]) for s in order] == [int(expert[s]) for s in want]:
            return (" The experts are in the right order, but choices of one expert are not in their own "
                    "order: sort stably (torch.argsort(..., stable=True)), so ties keep choice order.")
        return (" The right choices, in another order: sort by expert, so that the block for rank 0's experts "
                "comes first, then rank 1's, whatever rank you are.")
    return ""


@exercise("moe_dispatch", "MoE dispatch: counts per rank and the permutation for the all-to-all",
          answer="dispatch", notebook="08_moe_dispatch", sealed=True,
          preload=('pplab.expert_parallel',))
def check_moe_dispatch(fn, seed: int, timeout: float) -> str:
    """dispatch(expert, num_experts, world_size) -> (send_counts, order): order = the kept choices
    sorted (stably) by expert; send_counts[j] = how many of them go to rank j's experts."""
    require_function(fn, "moe_dispatch", "expert, num_experts, world_size", torch.zeros(2, dtype=torch.long), 2, 1)
    from ...expert_parallel import dispatch_plan             # loaded only when this check runs
    count = 0
    for p in (2, 3, 4):                             # dispatch: 3 ranks, E/p experts not a power of 2
        trials = _dispatch_trials(seed, p)

        def describe(world_size, i, trials=trials):
            return (f"world_size={world_size}, E={trials[i]['E']} experts, "
                    f"{[len(e) for e in trials[i]['expert']]} choices per rank")
        def check(p, i, observed, traffic, trials=trials):
            trial = trials[i]
            E, plans = trial["E"], [dispatch_plan(e, trial["E"], p) for e in trial["expert"]]
            for rank in sorted(observed):                   # every rank's answer, then what arrived
                _check_answer(observed[rank], rank, trial["expert"], plans, E, p, f"rank {rank}")
            for rank in sorted(observed):                   # what arrived, every rank
                _check_received(observed[rank], rank, trial["expert"], plans, p, f"rank {rank}")
        inputs = [[{"expert": e, "E": t["E"]} for e in t["expert"]] for t in trials]
        sealed.run_sealed(_dispatch_rank, fn, inputs, world_size=p, timeout=timeout,
                          exercise=("moe_dispatch", "the dispatch"), forbidden=(), probe=_refuse_dispatch_plan,
                          describe=describe, check=check)
        count += len(trials)
    return (f"on world sizes 2, 3, 4 ({count} trials with random choices and drops: send_counts, order and the "
            f"rows each rank received, against the single-process routing)")


def _check_answer(seen, rank, experts, plans, E, p, where):
    answer, expert = seen["answer"], experts[rank]
    if not isinstance(answer, tuple) or len(answer) != 2:
        raise Fail(f"{where}: dispatch must return a pair (send_counts, order), got {answer}.", seed_matters=False)
    counts, order = answer
    want_counts, want_order = plans[rank]
    try:
        counts = [int(c) for c in counts]
    except (TypeError, ValueError):
        raise Fail(f"{where}: send_counts must be a list of {p} integers, got {counts!r}.") from None
    if counts != want_counts:
        raise Fail(f"{where}'s send_counts is {counts}, expected {want_counts} (rows for each rank's experts)."
                   + _counts_hint(counts, expert, E, p))
    if not isinstance(order, torch.Tensor) or order.dtype not in (torch.int64, torch.int32) or order.dim() != 1:
        raise Fail(f"{where}: order must be a 1-d tensor of choice indices (torch.long), got "
                   f"{order.dtype if isinstance(order, torch.Tensor) else type(order).__name__}.")
    order = order.tolist()
    if order != want_order.tolist():
        raise Fail(f"{where}'s order is {order}, expected {want_order.tolist()} (experts of the choices: "
                   f"{expert.tolist()})." + _order_hint(order, want_order.tolist(), expert, E, p, rank))


def _check_received(seen, rank, experts, plans, p, where):
    if seen["error"] or seen["received"] is None:
        why = seen["error"] or "another rank had no usable answer"
        raise Fail(f"{where}: the all-to-all with these counts failed: {why}.")
    want = torch.cat([_rows(i, len(experts[i]))[plans[i][1]].split(plans[i][0])[rank] for i in range(p)])
    if not torch.equal(seen["received"], want):
        raise Fail(f"{where} received the rows {seen['received'].long().tolist()} ([source rank, choice]), expected "
                   f"{want.long().tolist()}.")
