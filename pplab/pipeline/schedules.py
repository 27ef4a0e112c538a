"""The one-way schedule generators (GPipe, 1F1B, interleaved, zero-bubble, V), and make_schedule:
every schedule pplab has, by name.

Each generator returns actions[rank], the ordered list of what each rank computes (see
actions.py for what an Action and a Schedule are). The generators of looped.py (Looped BFS,
interleaved zero bubble) and bidirectional.py (Chimera, DualPipe, DualPipeV) are the same kind
of function. SCHEDULES names them all, one Recipe each: the generator, where it places the
stages, how many chunks a rank holds, how many copies of the model it runs, what p and m it
needs. make_schedule checks the sizes against the recipe, builds the Schedule and validates it
(validation.py).

    make_schedule("1f1b", 4, 8)                   # p = 4 ranks, m = 8 micro-batches
    make_schedule("interleaved-1f1b", 4, 8, chunks=3)
    make_schedule("dualpipev", 4, 8)              # 2p stages in a V; m >= 2p
"""
from __future__ import annotations

from typing import Callable, NamedTuple

from .actions import Action, Schedule, ScheduleError, gc_paused
from .bidirectional import bidirectional_placement, chimera, dualpipe, dualpipe_v
from .looped import interleaved_zero_bubble, looped_bfs, zero_bubble_rounds
from .validation import validate

# ----------------------------------------------------------------------------------
# Generators. Each returns actions[rank]; make_schedule wraps and validates them.
# p = ranks, m = micro-batches, v = chunks per rank.

def naive(p, m):
    """Model parallelism, no pipelining: a micro-batch goes all the way forward and back
    before the next one enters. m > 1 is gradient accumulation, still one at a time, so
    only one rank works at any moment: utilisation 1/p whatever m is."""
    return [[Action(k, i, r) for i in range(m) for k in "FB"] for r in range(p)]


def gpipe(p, m):
    """GPipe (all forward, all backward): every rank holds all m micro-batches' activations.
    Backwards in micro-batch order, as in torch.distributed.pipelining's ScheduleGPipe."""
    return [[Action("F", i, r) for i in range(m)] + [Action("B", i, r) for i in range(m)]
            for r in range(p)]


def _one_f_one_b_order(forwards, backwards, warmup):
    """Warm-up forwards, then alternate one forward and one backward, then the last backwards."""
    order = forwards[:warmup]
    for i in range(len(forwards) - warmup):
        order += [forwards[warmup + i], backwards[i]]
    return order + backwards[len(forwards) - warmup:]


def one_f_one_b(p, m):
    """1F1B (PipeDream-Flush, Megatron): rank r runs p-1-r forwards ahead, then alternates,
    so it never holds more than p-r micro-batches. Same bubble as GPipe, less memory."""
    ranks = []
    for r in range(p):
        forwards = [Action("F", i, r) for i in range(m)]
        backwards = [Action("B", i, r) for i in range(m)]
        ranks.append(_one_f_one_b_order(forwards, backwards, warmup=min(p - 1 - r, m)))
    return ranks


def interleaved_groups(p, m):
    """Sizes of the groups micro-batches go through the chunks in: as torch's
    ScheduleInterleaved1F1B, max(1, m // p) groups ("rounds") as even as can be, each of
    at least p micro-batches when m >= p (m = 10, p = 4: 5 and 5; m = 9: 5 and 4)."""
    rounds = max(1, m // p)
    return [m // rounds + (1 if i < m % rounds else 0) for i in range(rounds)]


def interleaved_1f1b(p, m, v):
    """Interleaved 1F1B (Megatron-LM): v chunks per rank, stage = chunk * p + rank.

    Forwards go in groups of micro-batches: the first group through chunk 0, the same
    ones through chunk 1, ..., then the next group. Backwards visit chunks in reverse.
    A chunk is 1/v of a rank's layers, so filling and draining the pipeline takes p-1
    chunk-times instead of p-1 stage-times: the bubble shrinks by 1/v, for v times more
    messages and more activations held during the longer warm-up.

    Groups. With m a multiple of p, micro-batches go in groups of p (Megatron). Otherwise,
    as torch's ScheduleInterleaved1F1B does, in max(1, m // p) groups ("rounds") of about
    m / rounds >= p micro-batches each (interleaved_groups: m = 10, p = 4 -> 5 + 5). Each
    rank warms up with (v-1)*g + 2(p-1-r) chunk-forwards, g the first group's size.

    Bubble (idle / useful time, measured by simulate): (p-1)/(v*m) for every m >= p, even
    or uneven groups. For m < p there is one group of m < p micro-batches, and at each of
    the v-1 turns from a chunk to the next, rank 0 has sent all m micro-batches on before
    the first comes back from rank p-1: it waits p-m chunk-times, forward and backward.
    The bubble becomes ((p-1) + (v-1)(p-m)) / (v*m), as bubble_fraction gives it.
    """
    ranks = []
    order = []                                       # (micro-batch, chunk) of the k-th chunk-forward
    first = 0
    for g in interleaved_groups(p, m):
        order += [(first + i, c) for c in range(v) for i in range(g)]
        first += g
    g0 = interleaved_groups(p, m)[0]
    for r in range(p):
        forwards = [Action("F", i, c * p + r, c) for i, c in order]
        backwards = [Action("B", i, (v - 1 - c) * p + r, v - 1 - c) for i, c in order]
        warmup = min((v - 1) * g0 + 2 * (p - 1 - r), len(order))
        ranks.append(_one_f_one_b_order(forwards, backwards, warmup))
    return ranks


def zb_h1(p, m):
    """ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", 2024): 1F1B with each B split
    into I and W. Rank r puts off its first r weight gradients (W) and does them in the
    cool-down, where 1F1B would sit idle. It then holds at most p micro-batches between
    an F and its W, the same peak as rank 0 of 1F1B; with m >= p and W no longer than
    F or I, the bubble drops from (p-1)(F+I+W) to (p-1)(F+I-W)."""
    ranks = []
    for r in range(p):
        warmup = min(p - 1 - r, m)
        order = [Action("F", i, r) for i in range(warmup)]
        weights = 0
        for i in range(m):
            if warmup + i < m:
                order.append(Action("F", warmup + i, r))
            order.append(Action("I", i, r))
            if i >= r:                              # r weight gradients stay deferred
                order.append(Action("W", weights, r))
                weights += 1
        ranks.append(order + [Action("W", i, r) for i in range(weights, m)])
    return ranks


def zb_v(p, m):
    """ZB-V (same paper, section 6): two chunks per rank in a V, chunk 0 = stage r going down,
    chunk 1 = stage 2p-1-r coming back up, B split into I and W. The last rank turns a
    micro-batch around without sending it anywhere, and the first rank computes the loss
    stage as well as the first one. Order as in torch.distributed.pipelining.
    """
    n = max(2 * p - 1, m)   # build the order for >= 2p-1 micro-batches, then drop the extra ones
    ranks = []
    for r in range(p):
        stage = (r, 2 * p - 1 - r)
        order, f, b = [], [0, 0], [0, 0]             # f, b: next F and I micro-batch per chunk

        def F(c):
            order.append(Action("F", f[c], stage[c], c))
            f[c] += 1

        def I(c, then_w=False):                     # input gradient, maybe weight gradient at once
            order.append(Action("I", b[c], stage[c], c))
            if then_w:
                order.append(Action("W", b[c], stage[c], c))
            b[c] += 1

        for _ in range(2 * (p - r) - 1):            # warm-up: fill the way down the V,
            F(0)
        for _ in range(r):                          # meet the first micro-batches coming back up,
            F(1)
            F(0)
        for _ in range(p - r):                      # and start their backwards at the top
            F(1)
            I(1, then_w=True)
        while f[1] < f[0] or f[0] < n:              # steady state: F I W on each chunk in turn
            if f[0] < n:
                F(0)
            I(0, then_w=True)
            F(1)
            I(1, then_w=True)
        w = list(b)                                 # cool-down: I first, W fills the gaps
        for _ in range(r):
            I(0)
            I(1)
        for _ in range(p - r):
            I(0)
            order.append(Action("W", w[0], stage[0], 0))
            w[0] += 1
        order += [Action("W", i, stage[1], 1) for i in range(w[1], b[1])]
        order += [Action("W", i, stage[0], 0) for i in range(w[0], b[0])]
        ranks.append([a for a in order if a.microbatch < m])
    return ranks


# ----------------------------------------------------------------------------------
# Where the stages live: stage -> rank, for p ranks holding v stages each.

def one_stage_per_rank(p, v=1):
    return list(range(p))                               # stage r on rank r


def interleaved_placement(p, v):
    return [s % p for s in range(p * v)]               # stage = chunk * p + rank


def v_placement(p, v=2):
    return [s if s < p else 2 * p - 1 - s for s in range(2 * p)]   # down the ranks, back up


# ----------------------------------------------------------------------------------
# What p and m a schedule needs, when it needs more than p, m >= 1: None, or why not.

def _even_ranks(name, p):
    if p % 2:
        return (f"{name} runs two pipelines in opposite directions, so that every rank holds two different "
                f"pieces of the model: it needs an even number of ranks, got {p} (use {p + 1} or {p - 1} "
                f"ranks, or a one-direction schedule such as '1f1b')")


def _chimera_fits(p, m):
    return _even_ranks("chimera", p) or (
        None if m % p == 0 else f"chimera runs basic units of p = {p} micro-batches (p/2 each way): m must be "
                                f"a multiple of {p}, got m={m}")


def _dualpipe_fits(p, m):
    return _even_ranks("dualpipe", p) or (
        None if m % 2 == 0 and m >= 2 * p else
        f"dualpipe sends m/2 micro-batches each way and needs at least p of them in each direction: m must "
        f"be even and >= 2p = {2 * p}, got m={m}")


def _interleaved_zb_fits(p, m):
    try:
        zero_bubble_rounds(p, m)
    except ScheduleError as err:
        return str(err)


def _dualpipev_fits(p, m):
    if m < 2 * p:
        return (f"dualpipev needs at least as many micro-batches as stages (2p = {2 * p}), as torch's "
                f"ScheduleDualPipeV does: got m={m}, p={p}")


class Recipe(NamedTuple):
    """How make_schedule builds one named schedule."""
    generate: Callable         # (p, m), or (p, m, v) when the chunks are a choice -> actions[rank]
    place: Callable            # (p, v) -> stage_to_rank
    chunks: int = 1            # v, stages per rank: the default, or the only value
    least_chunks: int = 0      # 0: v is always `chunks`; else any v >= least_chunks may be asked
    backward: str = "B"        # "B", "I+W" (split: zero bubble), or "B or I+W" (some of each)
    replicas: int = 1          # 2: two copies of the model, one per direction
    needs: str = "any p, m"    # said when a size does not fit, and by the list of names
    fits: Callable | None = None   # (p, m) -> None, or why these sizes cannot work


ONE_WAY, V = one_stage_per_rank, v_placement
SCHEDULES = {
    "naive":            Recipe(naive, ONE_WAY),
    "gpipe":            Recipe(gpipe, ONE_WAY),
    "1f1b":             Recipe(one_f_one_b, ONE_WAY),
    "interleaved-1f1b": Recipe(interleaved_1f1b, interleaved_placement, 2, least_chunks=2, needs="chunks v >= 2"),
    "zb-h1":            Recipe(zb_h1, ONE_WAY, backward="I+W"),
    "zb-v":             Recipe(zb_v, V, 2, backward="I+W", needs="any p, m; 2 chunks per rank, in a V"),
    "looped-bfs":       Recipe(looped_bfs, interleaved_placement, 2, least_chunks=1, needs="chunks v >= 1"),
    "interleaved-zb":   Recipe(interleaved_zero_bubble, interleaved_placement, 2, least_chunks=1, backward="I+W",
                               needs="chunks v >= 1; m split into max(1, m // p) equal rounds",
                               fits=_interleaved_zb_fits),
    "pipedream":        Recipe(one_f_one_b, ONE_WAY),   # 1F1B's order over a stream, never flushed:
    "pipedream-2bw":    Recipe(one_f_one_b, ONE_WAY),   # the weight versions are in asynchronous.py
    "chimera":          Recipe(chimera, bidirectional_placement, 2, replicas=2,
                               needs="p even, m a multiple of p", fits=_chimera_fits),
    "dualpipe":         Recipe(dualpipe, bidirectional_placement, 2, backward="B or I+W", replicas=2,
                               needs="p even, m even and >= 2p", fits=_dualpipe_fits),
    "dualpipev":        Recipe(dualpipe_v, V, 2, backward="B or I+W", needs="m >= 2p; 2p stages in a V",
                               fits=_dualpipev_fits),
}


def known_schedules() -> str:
    """Every name, with what it needs of p, m and chunks: said when a name is unknown."""
    width = max(map(len, SCHEDULES))
    return "\n".join(f"  {name:<{width}}  {recipe.needs}" for name, recipe in SCHEDULES.items())


def schedules_for(p: int, m: int) -> list[str]:
    """The names whose needs p ranks and m micro-batches meet (with their default chunks)."""
    return [name for name, recipe in SCHEDULES.items() if recipe.fits is None or not recipe.fits(p, m)]


# ----------------------------------------------------------------------------------
# make_schedule: name -> validated Schedule.

# A schedule is a list of Action objects that validate, simulate and the executor walk one
# by one: building, validating and simulating take about 1.5 us and 150 bytes per action
# (benchmarks/simulator.py), so a million actions take a second or two and ~150 MB; beyond
# that the lesson is better told by the formulas.
MAX_ACTIONS = 1_000_000


def _size_check(key, recipe, p, m, v):
    per_pair = 2 if recipe.backward == "B" else 3                             # F B, or F I W
    actions = p * v * (m // recipe.replicas) * per_pair        # each copy runs its half of the m
    built = p * 2 * max(2 * p - 1, m) * 3 if key == "zb-v" else actions   # zb-v orders >= 2p-1 first
    if max(actions, built) > MAX_ACTIONS:
        why = (f" (zb-v builds each rank's order for at least 2p-1 = {2 * p - 1} micro-batches, "
               f"{built:,} actions, before dropping the extra ones)" if built > actions else "")
        up_to = "up to " if "or" in recipe.backward else ""
        raise ScheduleError(
            f"{key} with p={p} ranks, m={m} micro-batches, v={v} chunks is {up_to}{actions:,} actions{why}: more "
            f"than the {MAX_ACTIONS:,} pplab builds. Every action is an object that validate, simulate and "
            f"the executor walk one by one (a million take seconds and ~150 MB). Use fewer ranks or "
            f"micro-batches; bubble_fraction and the memory formulas give the trend for larger ones.")


def _positive_int(value, what):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ScheduleError(f"{what} must be a positive integer, got {value!r}")


def make_schedule(name: str, num_stages: int, num_microbatches: int, chunks: int | None = None) -> Schedule:
    """Build and validate a named schedule: any name of SCHEDULES (known_schedules() lists them).

    num_stages: p, the pipeline depth = number of ranks (the lecture's p).
    num_microbatches: m, micro-batches per training step. For "naive" they run one after
        another, never overlapping (gradient accumulation without pipelining).
    chunks: v, stages per rank: 1, except "interleaved-1f1b" (any v >= 2, default 2),
        "looped-bfs" and "interleaved-zb" (any v >= 1, default 2; looped.py), and 2 for "zb-v",
        "dualpipev" (2p stages in a V), "chimera" and "dualpipe" (two copies of a p-piece model,
        schedule.replicas = 2). The model is then cut into p * v stages (schedule.num_stages).
    """
    key = str(name).lower().replace("_", "-")
    if key not in SCHEDULES:
        raise ScheduleError(f"unknown schedule {name!r}; known schedules: {', '.join(SCHEDULES)}. "
                            f"What each needs:\n{known_schedules()}")
    recipe = SCHEDULES[key]
    _positive_int(num_stages, "num_stages (p, the number of pipeline ranks)")
    _positive_int(num_microbatches, "num_microbatches (m)")
    p, m, v = num_stages, num_microbatches, recipe.chunks if chunks is None else chunks
    _positive_int(v, "chunks (v, stages per rank)")
    if key == "interleaved-1f1b" and v < 2:
        raise ScheduleError("interleaved-1f1b needs chunks >= 2 (with one chunk per rank, use '1f1b')")
    if not recipe.least_chunks and v != recipe.chunks:
        hint = " (for several chunks per rank use 'interleaved-1f1b' or 'zb-v')" if recipe.chunks == 1 else ""
        raise ScheduleError(f"{key} puts {recipe.chunks} chunk(s) on each rank, got chunks={v}{hint}")
    if recipe.fits is not None and (why := recipe.fits(p, m)):
        raise ScheduleError(f"{why}. With p={p}, m={m} pplab can build: {', '.join(schedules_for(p, m))}")
    _size_check(key, recipe, p, m, v)
    with gc_paused():                                   # up to a million new Actions: see gc_paused
        actions = recipe.generate(p, m, v) if recipe.least_chunks else recipe.generate(p, m)
        return validate(Schedule(key, p, m, v, actions, recipe.place(p, v), replicas=recipe.replicas))
