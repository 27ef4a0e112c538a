"""The capstone of chapter 5, `ring_attention` (causal, forward and backward, zigzag layout):
registered, its layout and traffic counts against hand values, another correct answer passing
(the check asks for values and traffic, not for one way of writing it), and the traffic
mistakes worded from hand-made records. The solution passing, the stub failing and every wrong
answer of wrong_solutions_ch05_ring_attention.py failing with its message are run from tests/test_checks.py."""
import re

import pytest

from pplab import checks
from pplab.checks.ch05_sequence_parallel.ring_attention import _traffic_problem, traffic_blocks, zigzag_index
from wrong_solutions_ch05_ring_attention import WRONG, ring_by_positions

pytestmark = pytest.mark.usefixtures("no_leftover_processes")


def test_the_capstone_registers_with_its_wrong_answers():
    ids = [i for i, ex in checks.EXERCISES.items()
           if ex.checker.__module__ == "pplab.checks.ch05_sequence_parallel.ring_attention"]
    assert ids == ["ring_attention"] and set(WRONG) == set(ids)
    ex = checks.get_exercise("ring_attention")
    assert ex.notebook == "05_ring_attention" and ex.points == 4 and ex.sealed
    assert any("rank 0 only" in (fn.__doc__ or "") for fn, _, _ in WRONG["ring_attention"])


def test_zigzag_index_by_hand():
    # p = 3, chunks of 2: rank 0 holds chunks 0 and 5, rank 1 chunks 1 and 4, rank 2 chunks 2 and 3
    assert [zigzag_index(3, 2, r).tolist() for r in range(3)] == [[0, 1, 10, 11], [2, 3, 8, 9], [4, 5, 6, 7]]


def test_traffic_counts_by_hand():
    # p = 3: forward K and V twice each (4 blocks); backward K, V twice and dK, dV twice (8 blocks)
    assert traffic_blocks(3) == {"forward": 4, "backward": 8}
    assert traffic_blocks(2) == {"forward": 2, "backward": 4}


def test_another_correct_answer_passes_with_every_part():
    result = checks.run_check("ring_attention", ring_by_positions)
    assert result, result.message
    assert "Parts: forward ✔ · backward dQ ✔ · backward dK/dV ✔ · traffic ✔ (4 of 4)" in result.message


def test_an_answer_within_the_tolerance_passes():
    """The merge normalised with an epsilon of 1e-12 (wrong_solutions_ch05_ring_attention's near miss has
    1e-8): far inside the tolerance 1e-9, so it passes with every part."""
    from wrong_solutions_ch05_ring_attention import _ring
    result = checks.run_check("ring_attention", _ring(eps=1e-12))
    assert result, result.message


# -- each traffic mistake gets its own words (the record made by hand: no ranks needed) ----------

N = 96                                                      # bytes of one rank's K block


def _record(forward, backward, received=None, collectives=()):
    return {"sends_in": {"forward": forward, "backward": backward}, "collectives": list(collectives),
            "received": received if received is not None else [(2, n) for _, n in forward + backward]}


@pytest.mark.parametrize("change, words", [
    (None, None),
    ("kv together", None),                                  # K and V in one message of 2N: as good
    ("left ring", None),                                    # round the other way: as good
    ("to every rank", r"^in forward this rank sent to ranks 0 and 2: a ring passes blocks one way, to one "
                      r"neighbour"),
    ("big message", r"^this rank received a message of 576 bytes; one block's K and V together are 192"),
    ("no dK/dV", r"^in backward this rank sent 384 bytes, 4 blocks .*; a ring sends 8 .*: .* this rank sent no dK/dV"),
    ("p hops", r"one dK/dV hop too many"),
    ("forward twice", r"^in forward this rank sent 768 bytes, 8 blocks .*; a ring sends 4 \(384 bytes\): K and V"),
    ("all-reduce", r"^backward made a collective call, all_reduce \(96 bytes in\): ring attention needs no collective"),
])
def test_traffic_mistakes_are_named(change, words):
    p, rank = 3, 1                                          # neighbours: 2 on the right, 0 on the left
    forward, backward = [(2, N)] * 4, [(2, N)] * 8
    received, collectives = None, ()
    if change == "kv together":
        forward, backward = [(2, 2 * N)] * 2, [(2, 2 * N)] * 4
    elif change == "left ring":
        forward, backward = [(0, N)] * 4, [(0, N)] * 8
    elif change == "to every rank":                         # its block to both other ranks: an all-gather
        forward = [(2, N), (2, N), (0, N), (0, N)]
    elif change == "big message":
        received = [(0, 6 * N)]
    elif change == "no dK/dV":
        backward = [(2, N)] * 4
    elif change == "p hops":
        backward = [(2, N)] * 10
    elif change == "forward twice":
        forward = [(2, N)] * 8
    elif change == "all-reduce":
        collectives = [{"kind": "all_reduce", "bytes": N, "phase": "backward"}]
    problem = _traffic_problem(_record(forward, backward, received, collectives), p, N, rank)
    assert (problem is None) if words is None else re.search(words, problem), problem
