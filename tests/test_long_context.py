"""Chapter 11c: packed documents under context parallelism, against independent references.

The work per rank and the document mask against counting a hand-built mask entry by entry; the
document-aware split against a brute force over every set of cut points; ring attention with a
document mask and Llama 3's all-gather attention (grouped-query too) against torch's
scaled_dot_product_attention on one process (float64, outputs and the gradients of q, k, v,
max |difference| <= 1e-10), at p = 2, 3, 4 on 13 tokens (which no p divides: the first ranks hold
one token more, and the all-gather pads the others' shards by one row); the work each rank's
ring spans report, the bytes each rank sent and the K/V it held, from the trace, against the
closed forms. One launch per world size runs every case.
"""
import itertools
import math
import random
import re

import pytest
import torch
import torch.nn.functional as F

import pplab
from pplab import trace
from pplab.sequence_parallel.allgather_cp import allgather_attention, kv_bytes_per_rank
from pplab.sequence_parallel.packed import (as_layout, balance, doc_split, document_ids, document_mask, range_work,
                                            tokens_per_rank, work_per_rank)
from pplab.sequence_parallel.ring_attention import pieces, ring_attention, shard_sequence, unshard_sequence
from pplab.split import ring_sends

TOL = 1e-10
B, H, D = 2, 4, 3
DOCS = [5, 1, 4, 3]                    # 13 tokens; a one-token document; boundaries inside every rank's shard


# ----------------------------------------------------------------------------------
# The mask and the work, by counting


def hand_mask(docs, causal):
    """Query i sees key j: written out position by position."""
    owner = [d for d, n in enumerate(docs) for _ in range(n)]
    S = len(owner)
    return torch.tensor([[owner[i] == owner[j] and (j <= i or not causal) for j in range(S)] for i in range(S)])


def test_document_mask_and_ids_by_hand():
    assert document_ids([2, 1, 3]).tolist() == [0, 0, 1, 2, 2, 2]
    assert document_mask([2, 1]).tolist() == [[True, False, False], [True, True, False], [False, False, True]]
    for causal in (True, False):
        assert torch.equal(document_mask(DOCS, causal), hand_mask(DOCS, causal))


@pytest.mark.parametrize("causal", [True, False])
def test_work_per_rank_counts_the_mask_rows_each_rank_holds(causal):
    rng = random.Random(3)
    for _ in range(20):
        docs = [rng.randint(1, 9) for _ in range(rng.randint(1, 5))]
        S, mask = sum(docs), hand_mask(docs, causal)
        for p in (1, 2, 3, 4):
            if S < 2 * p:
                continue
            cuts = sorted(rng.sample(range(1, S), p - 1))
            explicit = [[(a, b)] for a, b in zip([0] + cuts, cuts + [S])]
            for layout in ("contiguous", "zigzag", explicit):
                want = [sum(int(mask[a:b].sum()) for a, b in runs) for runs in pieces(S, p, layout)]
                assert work_per_rank(docs, p, layout, causal) == want, (docs, p, layout)
    # the closed form of one range: the 3rd..5th tokens of a 6-token document see 3 + 4 + 5 keys
    assert range_work([6], 2, 5) == 12 and range_work([2, 6], 4, 7) == 12 and range_work([6], 2, 5, causal=False) == 18


def brute_best(docs, p):
    """The least possible work of the busiest of p contiguous ranges, over every choice of cut points."""
    S = sum(docs)
    best = math.inf
    for cuts in itertools.combinations_with_replacement(range(S + 1), p - 1):
        bounds = [0, *cuts, S]
        best = min(best, max(range_work(docs, a, b) for a, b in zip(bounds, bounds[1:])))
    return best


def test_doc_split_is_the_best_contiguous_split():
    rng = random.Random(11)
    for trial in range(40):
        docs = [rng.randint(1, 8) for _ in range(rng.randint(1, 4))]
        p = rng.choice([2, 3, 4])
        ranges = doc_split(docs, p)
        bounds = [a for a, _ in ranges] + [ranges[-1][1]]
        assert len(ranges) == p and bounds[0] == 0 and bounds[-1] == sum(docs)
        assert all(b == a2 for (_, b), (a2, _) in zip(ranges, ranges[1:])) and all(a <= b for a, b in ranges)
        assert max(range_work(docs, a, b) for a, b in ranges) == brute_best(docs, p), (docs, p)


def test_doc_split_beats_zigzag_on_packed_documents_and_costs_tokens():
    # one long document then short ones: zigzag's late chunks land in the long document
    docs, p = [40, 6, 6, 6, 6], 4
    zig, best = work_per_rank(docs, p, "zigzag"), work_per_rank(docs, p, as_layout(doc_split(docs, p)))
    assert sum(zig) == sum(best) == sum(n * (n + 1) // 2 for n in docs)
    assert balance(best) < balance(zig)
    assert max(tokens_per_rank(as_layout(doc_split(docs, p)), 64, p)) > 64 // p      # the price: uneven tokens
    assert balance([3, 1]) == 1.5 and balance(work_per_rank([16], 4, "zigzag")) == 1.0
    assert doc_split([1], 3) == [(0, 1), (1, 1), (1, 1)]                               # more ranks than tokens


def test_kv_bytes_per_rank_by_hand():
    # 13 tokens over 3 ranks: shards 5, 4, 4; 10 bytes a token
    assert kv_bytes_per_rank(13, 3, 10) == {"forward": 100, "backward": 100, "held": 200}
    assert kv_bytes_per_rank(13, 3, 10, rank=1)["held"] == 190                  # its own 4 rows and 3 of 5
    # 59 tokens over 3: contiguous 20, 20, 19; zigzag (chunks 10, 10, 10, 10, 10, 9) 19, 20, 20
    assert kv_bytes_per_rank(59, 3, 1, "ring", rank=1)["forward"] == 40
    assert kv_bytes_per_rank(59, 3, 1, "ring", rank=1, layout="zigzag")["forward"] == 39
    assert kv_bytes_per_rank(13, 3, 10, "ring", rank=0) == {"forward": 90, "backward": 220, "held": 150}
    assert kv_bytes_per_rank(13, 3, 10, "ring", rank=2)["forward"] == 80       # its right neighbour holds 5
    assert kv_bytes_per_rank(8, 2, 1, "ring")["held"] == 8                      # two ranks: one visitor


# ----------------------------------------------------------------------------------
# On real ranks: equal to one process, and the trace against the formulas


def tensors(seq, kv_heads=H, seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = [(B, H, seq, D), (B, kv_heads, seq, D), (B, kv_heads, seq, D), (B, H, seq, D)]
    return [torch.randn(*s, generator=g, dtype=torch.float64) for s in shapes]        # Q, K, V, dO


def one_process(docs, causal, kv_heads):
    Q, K, V, dO = tensors(sum(docs), kv_heads)
    Q, K, V = (t.requires_grad_() for t in (Q, K, V))
    mask = hand_mask(docs, causal)
    O = F.scaled_dot_product_attention(Q, K, V, attn_mask=mask, enable_gqa=kv_heads != H)
    O.backward(dO)
    return [O.detach(), Q.grad, K.grad, V.grad]


CASES = [  # (method, layout, causal, kv heads, documents: DOCS, or None for one plain sequence)
    ("ring", "zigzag", True, H, DOCS), ("ring", "contiguous", False, H, DOCS), ("ring", "split", True, H, DOCS),
    ("allgather", "zigzag", True, H, DOCS), ("allgather", "split", True, H, DOCS), ("allgather", "zigzag", True, 2, DOCS),
    ("allgather", "contiguous", False, 1, DOCS), ("allgather", "zigzag", True, H, None),   # padding, no document mask
]


def layout_of(name, p):
    return as_layout(doc_split(DOCS, p)) if name == "split" else name


def run_cases():
    """On each rank, every case: (outputs and gradients, visible pairs of the F spans, bytes sent
    forward and backward, peak K/V bytes held), counted from this rank's own trace."""
    p, results = pplab.comm.world_size(), []
    for method, name, causal, kv_heads, docs in CASES:
        layout = layout_of(name, p)
        Q, K, V, dO = tensors(sum(DOCS), kv_heads)
        q, k, v, do = (shard_sequence(t, None, layout).requires_grad_() for t in (Q, K, V, dO))
        fn = ring_attention if method == "ring" else allgather_attention
        first = len(trace.events())
        out = fn(q, k, v, causal=causal, layout=layout, documents=docs)
        middle = len(trace.events())
        out.backward(do)
        forward, backward = trace.events()[first:middle], trace.events()[middle:]
        results.append(([t.detach() for t in (out, q.grad, k.grad, v.grad)],
                        sum(e.meta.get("visible", 0) for e in forward if e.kind == "F"),
                        sent(forward, p), sent(backward, p),
                        max([e.value for e in forward if e.category == "memory"], default=0)))
    return results


def sent(events, p):
    """Bytes sent: point-to-point as traced; a collective's as a ring sends its payload (split.ring_sends)."""
    total = 0
    for e in events:
        if e.kind == "send":
            total += e.bytes_sent
        elif e.kind in ("all_gather", "reduce_scatter"):
            n = e.meta["payload"] * (p if e.kind == "all_gather" else 1)
            total += ring_sends(e.kind, n, p, pplab.comm.rank())
    return total


@pytest.mark.parametrize("p", [2, 3, 4])
def test_packed_documents_on_real_ranks_equal_one_process_and_the_formulas(p):
    res = pplab.launch(run_cases, world_size=p)
    S = sum(DOCS)
    for c, (method, name, causal, kv_heads, docs) in enumerate(CASES):
        layout = layout_of(name, p)
        docs = docs or [S]                                   # no mask but the causal one: one document
        want = one_process(docs, causal, kv_heads)
        for i in range(4):
            got = unshard_sequence([res[r][c][0][i] for r in range(p)], layout)
            err = (got - want[i]).abs().max().item()
            assert err <= TOL, (p, CASES[c], i, err)
        n = tokens_per_rank(layout, S, p)
        row = B * kv_heads * D * 8                           # one token of K (or of V), float64
        for r in range(p):
            _, visible, forward, backward, held = res[r][c]
            # the spans' visible pairs are the work formula
            assert visible == work_per_rank(docs, p, layout, causal)[r], (p, CASES[c], r)
            if method == "ring":
                # K/V of every block but the right neighbour's, the last one it receives
                assert (forward, backward) == (2 * (S - n[(r + 1) % p]) * row,
                                               2 * (S - n[(r + 1) % p]) * row + 2 * S * row), (p, CASES[c], r)
                formula = kv_bytes_per_rank(S, p, 2 * row, "ring", rank=r, layout=layout)
                assert (forward, backward) == (formula["forward"], formula["backward"]) and held <= formula["held"]
            else:
                # every shard padded to the longest, gathered, then the gradients reduce-scattered
                pad = max(n)
                assert forward == backward == (p - 1) * pad * 2 * row, (p, CASES[c], r)
                assert held == (n[r] + p * pad) * 2 * row, (p, CASES[c], r)
                formula = kv_bytes_per_rank(S, p, 2 * row, "allgather", rank=r, layout=layout)
                assert (forward, held) == (formula["forward"], formula["held"])


# ----------------------------------------------------------------------------------
# Bad input: a clear error, on every rank


def bad_call(what):
    q = torch.zeros(1, 4, 6 if pplab.comm.rank() == 0 else 5, 2)
    k = v = q if what != "heads" else torch.zeros(1, 3, q.shape[-2], 2)
    try:
        if what == "documents":
            ring_attention(q, k, v, causal=True, documents=[5, 5])
        elif what == "runs":
            ring_attention(q, k, v, layout=[[(0, 6)], [(5, 11)]])
        else:
            allgather_attention(q, k, v, layout="contiguous")
    except ValueError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("what, says", [("documents", r"add up to the sequence's 11 tokens"),
                                        ("runs", r"cover positions 0\.\.11 exactly once"),
                                        ("heads", r"multiple of theirs")])
def test_bad_input_is_a_clear_error_on_every_rank(what, says):
    for message in pplab.launch(bad_call, what, world_size=2, timeout=20):
        assert re.search(says, message), message


def test_bad_arguments_of_the_formulas():
    for call, says in ((lambda: doc_split([3, 0], 2), "positive whole lengths"),
                       (lambda: doc_split([3, 2], 0), "positive whole number of ranks"),
                       (lambda: work_per_rank([4], 2, "diagonal"), "unknown layout"),
                       (lambda: kv_bytes_per_rank(4, 2, 8, "tree"), "'allgather' or 'ring'"),
                       (lambda: kv_bytes_per_rank(2, 4, 8), "seq_len >= p")):
        with pytest.raises(ValueError, match=says):
            call()


# ----------------------------------------------------------------------------------
# The exercise's checker (pplab/checks/ch11_frontier/doc_split.py): its best against the brute force, its problems


def test_the_checkers_best_is_the_brute_force_best():
    from pplab.checks.ch11_frontier.doc_split import best_busiest
    rng = random.Random(5)
    for _ in range(30):
        docs, p = [rng.randint(1, 8) for _ in range(rng.randint(1, 4))], rng.choice([2, 3, 4])
        best, cuts = best_busiest(docs, p)
        assert best == brute_best(docs, p) == max(range_work(docs, a, b) for a, b in zip(cuts, cuts[1:]))


def test_the_checkers_problems_show_every_slip_on_every_seed():
    from pplab.checks.ch11_frontier import doc_split as check
    for seed in range(5):
        cases = [(docs, p, doc_split(docs, p)) for docs, p in check.problems(seed)]     # the library's best
        assert {p for _, p, _ in cases} == {2, 3, 4}
        shown = {slip for slip in check.SLIPS for docs, p, best in cases
                 if check.busiest(docs, check.slip_answer(docs, p, slip)) > check.busiest(docs, best)}
        assert shown == set(check.SLIPS), f"seed {seed}: {sorted(set(check.SLIPS) - shown)} never shows"
        for docs, p, best in cases:               # rounding one cut alone is the best cut: right at p = 2
            if p == 2:
                assert check.busiest(docs, check.slip_answer(docs, 2, "cuts_alone")) == check.busiest(docs, best)
