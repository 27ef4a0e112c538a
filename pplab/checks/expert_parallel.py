"""Checks of chapter 8's exercises: the MoE dispatch, and the all-to-all's bytes per rank.

    moe_dispatch     dispatch(expert, num_experts, world_size) -> (send_counts, order)
    moe_bytes        moe_bytes(tokens, k, experts, ranks, hidden, element_size) -> bytes one rank sends

moe_dispatch runs on 2, 3 and 4 sealed ranks (sealed.py). Every rank gets its own random choices
(expert[s] in 0..E-1, or -1 where the choice was dropped; E a multiple of p, a different
number of choices on every rank), calls the answer, and then, with the answer's send_counts,
exchanges the counts and sends x[order] by the library's uneven all-to-all, x's rows naming
their rank and choice. Checked here: send_counts (one per rank, experts in contiguous blocks
of E/p), order (the kept choices sorted by expert, ties in choice order), and on every rank
the rows that arrived, against `pplab.expert_parallel.dispatch_plan` on the same choices.

moe_bytes needs no ranks: random sizes; an even router, nothing dropped: the counts'
all-to-all (int64) + dispatch + combine, what one rank sends in one forward.
"""
from __future__ import annotations

import random

import torch
import torch.distributed as dist

from . import sealed
from .core import Fail, check_number, exercise, refuse_library, require_function


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


def _rows(rank, n):
    """Row s of rank r's tokens reads [r, s]: what arrives says where it came from."""
    return torch.stack([torch.full((n,), float(rank)), torch.arange(n, dtype=torch.float64)], 1)


def _dispatch_rank(fn, trials):
    """In every sealed rank: the answer on this rank's choices, then the exchange it plans."""
    from .. import collectives
    rank, p = dist.get_rank(), dist.get_world_size()
    for i, trial in enumerate(trials):
        sealed.begin(i)
        expert = trial["expert"]
        got = fn(expert.clone(), trial["E"], p)
        seen = {"answer": tuple(got) if isinstance(got, (tuple, list)) else repr(type(got)), "received": None,
                "error": None}
        try:
            counts, order = got
            counts = [int(c) for c in counts]
            usable = len(counts) == p and isinstance(order, torch.Tensor) and sum(counts) == len(order)
        except Exception:                                   # noqa: BLE001 - judged in the checker
            usable = False
        flag = torch.tensor([int(usable)])
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)         # exchange only if every rank has something to send
        if flag.item():
            recv = torch.empty(p, dtype=torch.int64)
            collectives.all_to_all_single(recv, torch.tensor(counts))
            x = _rows(rank, len(expert))[order.long()]
            received = x.new_empty(int(recv.sum()), 2)
            try:
                collectives.all_to_all_single(received, x, recv.tolist(), counts)
                seen["received"] = received
            except ValueError as err:
                seen["error"] = str(err)
        sealed.observe(i, seen)


def _refuse_dispatch_plan(fn) -> None:
    """In the sealed rank: Forbidden if the answer uses the library's dispatch_plan."""
    from ..expert_parallel import dispatch_plan             # loaded only when this check runs
    refuse_library(fn, "moe_dispatch", "the dispatch", {"dispatch_plan": dispatch_plan},
                   "pplab.expert_parallel.dispatch_plan")


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
          answer="dispatch", notebook="08a_moe_dispatch", sealed=True,
          preload=('pplab.expert_parallel',))
def check_moe_dispatch(fn, seed: int, timeout: float) -> str:
    """dispatch(expert, num_experts, world_size) -> (send_counts, order): order = the kept choices
    sorted (stably) by expert; send_counts[j] = how many of them go to rank j's experts."""
    require_function(fn, "moe_dispatch", "expert, num_experts, world_size", torch.zeros(2, dtype=torch.long), 2, 1)
    from ..expert_parallel import dispatch_plan             # loaded only when this check runs
    count = 0
    for p in (2, 3, 4):
        trials = _dispatch_trials(seed, p)

        def describe(world_size, i, trials=trials):
            return (f"world_size={world_size}, E={trials[i]['E']} experts, "
                    f"{[len(e) for e in trials[i]['expert']]} choices per rank")
        def check(p, i, observed, traffic, trials=trials):
            trial = trials[i]
            E, plans = trial["E"], [dispatch_plan(e, trial["E"], p) for e in trial["expert"]]
            for rank in sorted(observed):                   # every rank's answer, then what arrived
                _check_answer(observed[rank], rank, trial["expert"], plans, E, p, f"rank {rank}")
            for rank in sorted(observed):
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
# Exercise "moe_bytes"


def _moe_bytes(tokens, k, experts, ranks, hidden, element_size):
    counts = (ranks - 1) * (experts // ranks) * 8                   # int64 counts for the other ranks' experts
    rows = 2 * tokens * k * (ranks - 1) / ranks                     # dispatch out + combine back
    return counts + rows * hidden * element_size


def _refuse_all_to_all_bytes(fn) -> None:
    """In the sealed rank: Forbidden if the answer asks pplab.expert_parallel for the bytes."""
    from ..expert_parallel import all_to_all_bytes            # loaded only when this check runs
    refuse_library(fn, "moe_bytes", "the bytes per rank", {"all_to_all_bytes": all_to_all_bytes},
                   "pplab.expert_parallel.all_to_all_bytes")


@exercise("moe_bytes", "Predict the bytes one rank sends in an MoE layer's forward", answer="moe_bytes",
          notebook="08b_moe_bytes", sealed=True,
          preload=('pplab.expert_parallel',))
def check_moe_bytes(fn, seed: int, timeout: float) -> str:
    """moe_bytes(tokens, k, experts, ranks, hidden, element_size) = counts + dispatch + combine bytes."""
    require_function(fn, "moe_bytes", "tokens, k, experts, ranks, hidden, element_size", 8, 1, 4, 2, 16, 4)
    rng = random.Random(seed)
    cases = [(4096, 2, 8, 4, 1024, 2)]
    for _ in range(12):
        ranks = rng.choice([1, 2, 3, 4, 8, 16, 64])
        experts = ranks * rng.choice([1, 2, 4])
        cases.append((experts * rng.randint(1, 512), rng.choice([1, 2]), experts, ranks, rng.choice([64, 512, 4096]),
                      rng.choice([2, 4])))
    def what_of(tokens, k, experts, ranks, hidden, es):
        return f"tokens={tokens}, k={k}, experts={experts}, ranks={ranks}, hidden={hidden}, element_size={es}"
    outs = sealed.call_each(fn, cases, where=lambda i: what_of(*cases[i]) + ": ", timeout=timeout,
                            probe=_refuse_all_to_all_bytes)
    for case, got in zip(cases, outs):
        what = what_of(*case)
        try:
            check_number(got, _moe_bytes(*case), what=f"{what}: bytes one rank sends")
        except Fail as fail:
            raise Fail(f"{fail}{_bytes_hint(got, *case)}") from None
    return f"on {len(cases)} cases (1 to 64 ranks, k = 1 and 2, counts + dispatch + combine)"


def _bytes_hint(got, tokens, k, experts, ranks, hidden, es) -> str:
    if isinstance(got, bool) or not isinstance(got, (int, float)):
        return ""
    counts, row = (ranks - 1) * (experts // ranks) * 8, hidden * es
    off = (ranks - 1) / ranks
    hints = [(2 * tokens * k * off * row, " The counts are missing: before the tokens, each rank tells every other "
                                          "rank how many rows to expect for each of its experts (int64, 8 bytes)."),
             (counts + tokens * k * off * row, " That is the dispatch only: the outputs come back by a second "
                                                 "all-to-all of the same size (combine)."),
             (counts + 2 * tokens * off * row, " Each token goes to k experts: k rows per token."),
             (counts + 2 * tokens * k * row, " A rank keeps the rows for its own experts: only (ranks-1)/ranks "
                                              "of them cross the wire."),
             ((ranks - 1) * experts * 8 + 2 * tokens * k * off * row,
              " Each rank sends another rank only the counts of that rank's E/ranks experts.")]
    right = _moe_bytes(tokens, k, experts, ranks, hidden, es)
    return "".join(hint for value, hint in hints                 # k = 2: forgetting k = forgetting the combine
                   if abs(got - value) <= 1e-6 * max(1.0, abs(value)) and abs(value - right) > 1e-9)
