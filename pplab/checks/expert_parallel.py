"""Checks of chapter 8's exercises: the MoE dispatch, and the all-to-all's bytes per rank.

    moe_dispatch     dispatch(expert, num_experts, world_size) -> (send_counts, order)
    moe_bytes        moe_bytes(choices, num_experts, capacity_factor, hidden, element_size)
                     -> [(counts, dispatch, combine) bytes rank r sends, for every rank r]

moe_dispatch runs on 2, 3 and 4 sealed ranks (sealed.py). Every rank gets its own random choices
(expert[s] in 0..E-1, or -1 where the choice was dropped; E a multiple of p, a different
number of choices on every rank), calls the answer, and then, with the answer's send_counts,
exchanges the counts and sends x[order] by the library's uneven all-to-all, x's rows naming
their rank and choice. Checked here: send_counts (one per rank, experts in contiguous blocks
of E/p), order (the kept choices sorted by expert, ties in choice order), and on every rank
the rows that arrived, against `pplab.expert_parallel.dispatch_plan` on the same choices.

moe_bytes calls the answer in one sealed rank on skewed routings (a popular expert, k = 1 or 2,
a different number of tokens per rank, with and without a capacity limit) over 2, 3 and 4
ranks; then, for each, runs the library's MoE layer on that many sealed ranks, steered to the
same routing, and takes the router's record of what each rank really sent in each of the
forward's three all-to-alls. A point each for counts, dispatch and combine, on every rank.
"""
from __future__ import annotations

import math
import random

import torch

from . import sealed
from .expert_parallel_rank import (PHASES, _dispatch_rank, _measure_rank, _refuse_all_to_all_bytes, _refuse_dispatch_plan,
                                   _rows)
from .core import Fail, Parts, exercise, require_function


# ----------------------------------------------------------------------------------
# Exercise "moe_dispatch"


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
    from ..expert_parallel import dispatch_plan             # loaded only when this check runs
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


# ----------------------------------------------------------------------------------
# Exercise "moe_bytes": every rank's bytes under a skewed routing, against the measured layer


def _traffic_trials(seed, p):
    """Two skewed routings on p ranks, a different number of tokens on each: one with a capacity
    limit that must drop (k = 2; three tokens in four pick the popular expert first), one without."""
    rng = random.Random(seed * 13 + p)
    trials = []
    for capacity_factor in (rng.choice([0.5, 0.75]), None):
        while True:
            E, k = p * rng.randint(2 if p == 2 else 1, 2), 2 if capacity_factor else rng.choice([1, 2])   # E > k: room to skew
            g = torch.Generator().manual_seed(rng.randrange(2**31))
            popular = rng.randrange(E)
            choices = []
            for _ in range(p):
                n = rng.randint(6, 14)
                first = torch.randint(0, E, (n,), generator=g)
                first[torch.randperm(n, generator=g)[:math.ceil(0.75 * n) if capacity_factor else n // 2]] = popular
                second = (first + torch.randint(1, E, (n,), generator=g)) % E          # another expert
                choices.append(torch.stack([first, second], 1)[:, :k])
            t = {"choices": choices, "E": E, "k": k, "capacity_factor": capacity_factor,
                 "hidden": E + rng.randint(0, 3),           # with a capacity, never 4 bytes: float32 assumed
                 "element_size": rng.choice([2, 8] if capacity_factor else [2, 4, 8])}    # is wrong on every seed
            if _telling(t, p):
                break
        trials.append(t)
    return trials


def _telling(t, p):
    """Whether this routing tells the right bytes from the usual mistakes: random token counts
    sometimes give every rank the same capacity as rank 0's, or a combine as large as each rank's
    own dispatch. Such a routing is drawn again."""
    def sent(rows):
        return [(sum(rows[r][j] for j in range(p) if j != r), sum(rows[i][r] for i in range(p) if i != r))
                for r in range(p)]
    right = sent(_kept_rows(t, p))
    if all(dispatch == combine for dispatch, combine in right):
        return False
    if t["capacity_factor"] is None:
        return True
    n0, cf, k, E = len(t["choices"][0]), t["capacity_factor"], t["k"], t["E"]
    return right != sent(_kept_rows(t, p, capacity_of=lambda i: math.ceil(cf * n0 * k / E))) and \
        right != sent(_kept_rows(t, p, no_limit=True))


def _describe_traffic(p, t):
    cf = "no capacity limit" if t["capacity_factor"] is None else f"capacity factor {t['capacity_factor']}"
    return (f"p={p}, E={t['E']}, k={t['k']}, {cf}, hidden={t['hidden']}, element_size={t['element_size']}, "
            f"tokens per rank {[len(c) for c in t['choices']]}")


def _kept_rows(t, p, capacity_of=None, no_limit=False):
    """rows[r][j]: the kept choices of rank r whose expert lives on rank j (for the hints only; the
    verdict is the measurement). capacity_of(r): the capacity rank r uses."""
    E, k, cf = t["E"], t["k"], t["capacity_factor"]
    rows = []
    for r, c in enumerate(t["choices"]):
        n = len(c)
        cap = capacity_of(r) if capacity_of else (n * k if cf is None or no_limit else math.ceil(cf * n * k / E))
        taken, to = [0] * E, [0] * p
        for e in c.T.flatten().tolist():
            if taken[e] < cap:
                taken[e] += 1
                to[e // (E // p)] += 1
        rows.append(to)
    return rows


def _traffic_hint(part, got, r, t, p) -> str:
    E, k, row = t["E"], t["k"], t["hidden"] * t["element_size"]
    n = len(t["choices"][r])
    cf = t["capacity_factor"]
    off = lambda rows, who: sum(rows[who][j] for j in range(p) if j != who) * row          # noqa: E731
    back = lambda rows, who: sum(rows[i][who] for i in range(p) if i != who) * row         # noqa: E731
    right = _kept_rows(t, p)
    if part == "counts":
        for value, hint in (((p - 1) * E * 8, " Each rank sends another rank only the counts for that rank's E/p "
                                             "experts."),
                            (p * (E // p) * 8, " A rank keeps its own experts' counts: p - 1 pieces leave it."),
                            ((p - 1) * (E // p) * 4, " The counts are int64: 8 bytes each.")):
            if got == value:
                return hint
        return " Before any row, every rank tells every other rank how many rows each of that rank's E/p experts gets."
    pick = off if part == "dispatch" else back
    candidates = []
    if cf is not None:
        candidates.append((pick(_kept_rows(t, p, no_limit=True), r),
                           " That counts every choice: an expert takes at most ⌈capacity_factor·n·k/E⌉ of a rank's "
                           "choices" + (f" (here {math.ceil(cf * n * k / E)} of rank {r}'s)" if part == "dispatch" else "")
                           + ", and the rest are dropped, never sent."))
        n0 = len(t["choices"][0])
        candidates.append((pick(_kept_rows(t, p, capacity_of=lambda i: math.ceil(cf * n0 * k / E)), r),
                           f" Capacity is per rank-local batch: ⌈capacity_factor·n·k/E⌉ with each rank's own n "
                           f"(here n = {[len(c) for c in t['choices']]}), not rank 0's."))
    if part == "dispatch":
        candidates.append((n * k * (p - 1) / p * row,
                           f" That is the even router's formula, n·k·(p-1)/p rows: this router is skewed, so count the "
                           f"rows of rank {r}'s kept choices whose expert lives on another rank."))
        candidates.append((sum(right[r]) * row, f" Rows for rank {r}'s own experts stay on rank {r}: they are not sent."))
    else:
        candidates.append((off(right, r), f" That is what rank {r} dispatched. The combine sends back the outputs rank "
                                          f"{r}'s experts computed for other ranks' tokens: the rows other ranks "
                                          f"dispatched to rank {r}, which a skewed router makes a different number."))
        candidates.append((n * k * (p - 1) / p * row, " That is the even router's formula, n·k·(p-1)/p rows: this "
                                                     "router is skewed."))
    want = pick(right, r)
    hints = [hint for value, hint in candidates if abs(got - value) < 1e-6 and abs(value - want) > 1e-6]
    return " Or:".join(hints[:2])                   # two mistakes can give the same count: name both


@exercise("moe_bytes", "An MoE layer's bytes per rank under a skewed router with capacity, against the measured layer",
          answer="moe_bytes", notebook="08_moe_bytes", sealed=True, points=len(PHASES),
          preload=('pplab.expert_parallel',))
def check_moe_bytes(fn, seed: int, timeout: float) -> str:
    """moe_bytes(choices, num_experts, capacity_factor, hidden, element_size) -> [(counts, dispatch, combine)
    bytes rank r sends in one forward, for each rank r]."""
    one = [torch.zeros(1, 1, dtype=torch.long)]
    require_function(fn, "moe_bytes", "choices, num_experts, capacity_factor, hidden, element_size", one, 1, None, 1, 4)
    sizes = (2, 3, 4)                               # moe_bytes' world sizes
    trials = [(p, t) for p in sizes for t in _traffic_trials(seed, p)]
    cases = [(t["choices"], t["E"], t["capacity_factor"], t["hidden"], t["element_size"]) for _, t in trials]
    answers = list(sealed.call_each(fn, cases, where=lambda i: _describe_traffic(*trials[i]) + ": ", timeout=timeout,
                                    probe=_refuse_all_to_all_bytes))
    parts = Parts(PHASES)
    for p in sizes:
        mine = [(i, t) for i, (q, t) in enumerate(trials) if q == p]

        def check(world_size, j, observed, traffic, mine=mine):
            i, t = mine[j]
            where = _describe_traffic(p, t)
            got = answers[i]
            if not (isinstance(got, (list, tuple)) and len(got) == p and all(
                    isinstance(x, (list, tuple)) and len(x) == 3 and all(isinstance(v, (int, float)) and
                                                                         not isinstance(v, bool) for v in x)
                    for x in got)):
                raise Fail(f"moe_bytes must return one (counts, dispatch, combine) triple of numbers per rank, "
                           f"{p} of them, got {got!r:.200}.")
            for r in range(p):                      # every rank's three numbers
                for part, value in zip(PHASES, got[r]):
                    measured = sum(n for _, n in traffic[r]["sends_in"].get(part, []))
                    if abs(value - measured) > 1e-6:
                        parts.note(part, f"rank {r} sends {value:,} bytes in the {part}, measured {measured:,} "
                                         f"(what the layer really sent).{_traffic_hint(part, value, r, t, p)}", where)
        inputs = [[{**{key: t[key] for key in ("E", "k", "capacity_factor", "hidden", "element_size")},
                    "choices": t["choices"][r]} for r in range(p)] for _, t in mine]
        sealed.run_sealed(_measure_rank, fn, inputs, world_size=p, timeout=timeout, exercise=("moe_bytes", "MoE"),
                          forbidden=(), describe=lambda world, j, mine=mine: _describe_traffic(p, mine[j][1]),
                          check=check)
    return parts.finish(f"on {len(trials)} skewed routings over 2, 3 and 4 ranks (capacity limits that drop tokens, "
                        f"k = 1 and 2, a different number of tokens on every rank; every rank's counts, dispatch and "
                        f"combine equal to the bytes the library's layer really sent)")
