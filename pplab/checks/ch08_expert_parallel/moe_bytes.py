"""Check of exercise moe_bytes (exercises/08_moe_bytes.ipynb): An MoE layer's bytes per rank under a skewed router with capacity, against the measured layer.

    moe_bytes        moe_bytes(choices, num_experts, capacity_factor, hidden, element_size)

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

from .. import sealed
from ..core import Fail, Parts, exercise, require_function
from .moe_bytes_rank import PHASES, _measure_rank, _refuse_all_to_all_bytes


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
