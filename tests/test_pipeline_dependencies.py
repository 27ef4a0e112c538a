"""Who waits for what (pipeline/dependencies.py), and the one registry (make_schedule builds every name).

The rule is checked against waits written out by hand for a small 1F1B and a small DualPipeV, and
validate, simulate and the executors' message order against a reference written here from the
lecture's rule, independently of pplab's numbered wiring.
"""
from collections import deque
from itertools import product

import pytest

from pplab.pipeline import Schedule, ScheduleError, make_schedule, simulate, validate
from pplab.pipeline.dependencies import messages, needs, waiting_for
from pplab.pipeline.schedules import SCHEDULES, known_schedules, schedules_for


# ----------------------------------------------------------------------------------
# The reference: the lecture's rule, written out again here.

def reference_waits(kind, stage, mb, depth):
    """What (result, stage, micro-batch) an action waits for: a stage's output ("out"), its input's
    gradient ("grad", made by B or I), or the I of a split backward ("I", which its W follows)."""
    first, last = stage % depth == 0, stage % depth == depth - 1
    if kind == "F":
        return [] if first else [("out", stage - 1, mb)]
    if kind == "W":
        return [("I", stage, mb)]
    return [("out", stage, mb)] + ([] if last else [("grad", stage + 1, mb)])


def reference_made(a):
    return {"F": [("out", a.stage, a.microbatch)], "B": [("grad", a.stage, a.microbatch)],
            "I": [("grad", a.stage, a.microbatch), ("I", a.stage, a.microbatch)], "W": []}[a.kind]


def reference_runs(s):
    """True if the ranks can run to their ends: sweep the ranks, each going on while what its next
    action (or F&B pair) waits for is made; no rank moving means a deadlock. Also checks the counts."""
    depth = s.num_stages // s.replicas
    done, nxt = set(), [0] * s.num_ranks
    moved = True
    while moved:
        moved = False
        for r, acts in enumerate(s.actions):
            while nxt[r] < len(acts):
                a = acts[nxt[r]]
                block = acts[nxt[r]:nxt[r] + 2] if a.overlap else [a]
                if not all(w in done for b in block for w in reference_waits(b.kind, b.stage, b.microbatch, depth)):
                    break
                for b in block:
                    done.update(reference_made(b))
                nxt[r] += len(block)
                moved = True
    ran = [a for acts in s.actions for a in acts]
    per_copy = s.num_microbatches // s.replicas
    whole = (sum(a.kind == "F" for a in ran) == s.num_stages * per_copy
             and sum(a.kind in "BI" for a in ran) == s.num_stages * per_copy
             and sum(a.kind == "I" for a in ran) == sum(a.kind == "W" for a in ran)
             and all(s.stage_to_rank[a.stage] == r for r, acts in enumerate(s.actions) for a in acts))
    return whole and all(k == len(acts) for k, acts in zip(nxt, s.actions))


# ----------------------------------------------------------------------------------
# needs and waiting_for, against waits written out by hand

def test_needs_of_a_small_1f1b_written_out():
    # 1F1B, p = 2, m = 2: stage 0 on rank 0, stage 1 (the last, the loss) on rank 1
    s = make_schedule("1f1b", 2, 2)
    depth = s.stages_per_replica
    hand = {("F", 0): (), ("F", 1): (("F", 0),),
            ("B", 1): (("F", 1),),                     # the last stage starts from the loss
            ("B", 0): (("F", 0), ("B", 1))}
    for acts in s.actions:
        for a in acts:
            assert needs(a.kind, a.stage, depth) == hand[(a.kind, a.stage)], a
    # split backwards: I as B, W after the I of its own stage
    assert needs("I", 0, 2) == (("F", 0), ("B", 1)) and needs("I", 1, 2) == (("F", 1),)
    assert needs("W", 0, 2) == (("B", 0),) and needs("W", 1, 2) == (("B", 1),)
    # read backwards: the output of stage 0 is waited for by its own backward and by stage 1's forward
    assert waiting_for("F", 0, 2, 2) == (("B", 0), ("I", 0), ("F", 1))
    assert waiting_for("B", 1, 2, 2) == (("B", 0), ("I", 0), ("W", 1))
    assert waiting_for("F", 1, 2, 2) == (("B", 1), ("I", 1))      # nobody downstream of the loss
    assert waiting_for("B", 0, 2, 2) == (("W", 0),)                 # the model's input needs no gradient
    # the messages: rank 0 sends its two outputs, rank 1 its two input gradients, in 1F1B's order
    assert messages(s, 1) == {0: deque([("act", 0, 0), ("act", 0, 1)])}
    assert messages(s, 0) == {1: deque([("grad", 1, 0), ("grad", 1, 1)])}


def test_needs_of_a_small_dualpipev_written_out():
    # DualPipeV, p = 2, m = 4: stages 0 1 | 2 3 placed as a V, rank 0 holds 0 and 3, rank 1 holds 1 and 2
    s = make_schedule("dualpipev", 2, 4)
    assert s.stage_to_rank == [0, 1, 1, 0] and s.stages_per_replica == 4
    hand = {("F", 0): (), ("F", 1): (("F", 0),), ("F", 2): (("F", 1),), ("F", 3): (("F", 2),),
            ("B", 3): (("F", 3),), ("I", 3): (("F", 3),),
            ("B", 2): (("F", 2), ("B", 3)), ("I", 2): (("F", 2), ("B", 3)),
            ("B", 1): (("F", 1), ("B", 2)), ("I", 1): (("F", 1), ("B", 2)),
            ("B", 0): (("F", 0), ("B", 1)), ("I", 0): (("F", 0), ("B", 1)),
            ("W", 0): (("B", 0),), ("W", 1): (("B", 1),), ("W", 2): (("B", 2),), ("W", 3): (("B", 3),)}
    seen = set()
    for acts in s.actions:
        for a in acts:
            assert needs(a.kind, a.stage, 4) == hand[(a.kind, a.stage)], a
            seen.add((a.kind, a.stage))
    assert {"F", "B", "I", "W"} == {k for k, _ in seen}
    # Rank 0 runs F0.0 F1.0 F2.0 F0.1 I0.1 W0.1 F1.1 F3.0& B1.1 F2.1& B0.0 B2.1 F3.1& B1.0 B3.1 I2.0 W2.0 ...
    # (chunk 0 = stage 0, chunk 1 = stage 3): rank 1 gets stage 0's outputs and stage 3's input gradients;
    # stage 3's outputs (the loss) and stage 0's gradients go nowhere.
    assert list(messages(s, 1)[0]) == [("act", 0, 0), ("act", 0, 1), ("act", 0, 2), ("grad", 3, 0),
                                       ("act", 0, 3), ("grad", 3, 1), ("grad", 3, 2), ("grad", 3, 3)]
    # Rank 1 runs F0.0 F0.1 F1.0 F1.1 F2.0 B0.1 F2.1& B0.0 F3.0& B1.1 F3.1& B1.0 B2.1 B2.0 I3.1 I3.0 ...
    # (chunk 0 = stage 1, chunk 1 = stage 2): stage 1 -> 2 stays on rank 1 (the turn of the V)
    assert list(messages(s, 0)[1]) == [("act", 2, 0), ("act", 2, 1), ("act", 2, 2), ("grad", 1, 0),
                                       ("act", 2, 3), ("grad", 1, 1), ("grad", 1, 2), ("grad", 1, 3)]
    assert set(messages(s, 0)) == {1} and set(messages(s, 1)) == {0}


def test_two_replicas_end_each_copy():
    # Chimera on p = 2: stages 0 1 are the down copy, 2 3 the up copy; stage 2 starts the up copy
    assert needs("F", 2, 2) == () and needs("B", 1, 2) == (("F", 1),) and needs("B", 2, 2) == (("F", 2), ("B", 3))
    assert waiting_for("F", 1, 4, 2) == (("B", 1), ("I", 1))      # stage 1 ends the down copy


@pytest.mark.parametrize("name,p,m", [("1f1b", 3, 4), ("zb-v", 2, 3), ("dualpipev", 2, 5), ("chimera", 4, 4),
                                      ("dualpipe", 4, 8), ("interleaved-1f1b", 2, 3)])
def test_messages_are_what_the_receivers_wait_for(name, p, m):
    """Every message a rank gets is a result one of its actions waits for (reference rule), made on
    the sender, in the sender's order; and every such result made elsewhere comes as a message."""
    s = make_schedule(name, p, m)
    depth = s.stages_per_replica
    for rank in range(p):
        want = {}
        for a in s.actions[rank]:
            for res, stage, mb in reference_waits(a.kind, a.stage, a.microbatch, depth):
                src = s.stage_to_rank[stage]
                if res != "I" and src != rank:
                    want.setdefault(src, set()).add(("act" if res == "out" else "grad", stage, mb))
        got = messages(s, rank)
        assert {src: set(q) for src, q in got.items()} == want
        for src, q in got.items():                 # in the order the sender makes them
            made = [("act" if a.kind == "F" else "grad", a.stage, a.microbatch) for a in s.actions[src]
                    if a.kind != "W"]
            assert list(q) == [x for x in made if x in want[src]]


# ----------------------------------------------------------------------------------
# validate and simulate read the same rule

def test_validate_agrees_with_the_reference_on_every_swap():
    """Every swap of two actions of one rank of 1F1B and ZB-H1 (p = 3, m = 3): validate passes exactly
    the orders the reference can run."""
    passed = failed = 0
    for name in ("1f1b", "zb-h1"):
        base = make_schedule(name, 3, 3)
        for r in range(3):
            n = len(base.actions[r])
            for i, j in product(range(n), range(n)):
                if i >= j:
                    continue
                acts = [list(a) for a in base.actions]
                acts[r][i], acts[r][j] = acts[r][j], acts[r][i]
                s = Schedule(name, 3, 3, 1, acts, list(range(3)))
                ok = reference_runs(s)
                if ok:
                    validate(s)
                    passed += 1
                else:
                    with pytest.raises(ScheduleError, match="deadlock"):
                        validate(s)
                    failed += 1
    assert passed > 20 and failed > 100            # both kinds of swap were tried


@pytest.mark.parametrize("name,p,m", [("dualpipev", 3, 7), ("chimera", 4, 8), ("zb-v", 3, 4),
                                      ("interleaved-zb", 3, 6)])
def test_simulated_starts_wait_for_what_the_rule_says(name, p, m):
    s = make_schedule(name, p, m)
    r = simulate(s, t_f=1.0, t_b=2.0, t_w=0.7, t_fb=2.5, p2p_latency=0.25)
    end = {}
    for rank, acts in enumerate(s.actions):
        for a, e in zip(acts, r.end[rank]):
            for res in reference_made(a):
                end[res] = (e, rank)
    for rank, acts in enumerate(s.actions):
        for k, a in enumerate(acts):
            start = r.start[rank][k - 1] if k and acts[k - 1].overlap else r.start[rank][k]   # a pair starts as one
            for w in reference_waits(a.kind, a.stage, a.microbatch, s.stages_per_replica):
                made, src = end[w]
                assert start >= made + (0.25 if src != rank else 0.0) - 1e-9, (a, w)


# ----------------------------------------------------------------------------------
# One registry: make_schedule builds every name

SIZES = [(p, m) for p in (1, 2, 3, 4) for m in (1, 2, 3, 4, 5, 6, 8, 9, 10, 12)]


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_make_schedule_builds_every_name_where_it_fits(name):
    recipe = SCHEDULES[name]
    built = []
    for p, m in SIZES:
        for v in ((1, 2, 3) if recipe.least_chunks == 1 else (2, 3) if recipe.least_chunks else (None,)):
            if name in schedules_for(p, m):
                s = make_schedule(name, p, m, v)
                assert reference_runs(s), (name, p, m, v)
                assert (s.num_ranks, s.num_microbatches, s.replicas) == (p, m, recipe.replicas)
                assert s.chunks == (recipe.chunks if v is None else v)
                built.append((p, m))
            else:
                with pytest.raises(ScheduleError, match=f"With p={p}, m={m} pplab can build") as err:
                    make_schedule(name, p, m, v)
                assert name.split("-")[0] in str(err.value)
    uneven = [(p, m) for p, m in built if p > 1 and m % p]
    assert len(set(built)) >= 3 and (uneven or name in ("chimera",)), (name, built)


def test_unknown_names_and_bad_sizes_say_what_each_needs():
    with pytest.raises(ScheduleError) as err:
        make_schedule("hanayo", 4, 8)
    text = str(err.value)
    for name, recipe in SCHEDULES.items():
        assert name in text and recipe.needs in text
    assert known_schedules() in text
    with pytest.raises(ScheduleError, match=r"dualpipev needs at least as many micro-batches as stages \(2p = 4\).*"
                                            r"got m=3, p=2\. With p=2, m=3 pplab can build: naive, gpipe"):
        make_schedule("dualpipev", 2, 3)
    assert "dualpipev" not in schedules_for(2, 3) and "chimera" not in schedules_for(3, 6)
    assert {"chimera", "dualpipe", "dualpipev"} <= set(schedules_for(2, 4))
    with pytest.raises(ScheduleError, match="dualpipev puts 2 chunk"):
        make_schedule("dualpipev", 2, 4, chunks=3)
    with pytest.raises(ScheduleError, match="is up to 1,200,000 actions: more than the 1,000,000"):
        make_schedule("dualpipe", 100, 4000)          # 100 ranks x 2 stages x 2000 each way x (F, I, W)


def test_make_schedule_keeps_the_names_it_is_given_as_the_lecture_writes_them():
    assert make_schedule("DualPipeV", 2, 4).name == "dualpipev"
    assert make_schedule("zb_h1", 2, 2).name == "zb-h1"
