"""What chapter 5's checkers of online_softmax_merge, ulysses_all_to_all, ring_attention_step share.

Every rank job returns what the answer produced and what the rank saw; every comparison
is made here, in the checker.

"""
from __future__ import annotations


TOL = 1e-9
