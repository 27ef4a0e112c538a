"""What chapter 3's checkers of f_g, row_parallel_linear, vocab_parallel_ce, linear_traffic share.

Every check runs the answer on sealed ranks (sealed.py; 2 and 3, and 4 ranks split into two
sub-groups for f_g and the row layer), in float64, against the dense computation on one
process (tolerance 1e-10). The checker's router records every collective the answer makes
(pplab.comm's and torch.distributed's), with its size and the phase the job named (forward
or backward); the checker then compares values *and* that communication with Megatron's: f is the identity
forward and one all-reduce backward, g the reverse; the row layer all-reduces once forward and
never backward; the cross-entropy never moves a [tokens, vocab] tensor. linear_traffic needs no
ranks: the table of CMU 15-418's lecture 25 (model and pipeline parallelism) for random shapes
(its notebook measures the same numbers from a trace).

"""
from __future__ import annotations

import random
import torch

from .. import sealed
from ..core import Fail, first_difference


TOL = 1e-10


_SHORT = {"all_gather_into_tensor": "all_gather", "reduce_scatter_tensor": "reduce_scatter",
          "all_to_all_single": "all_to_all"}


def _data(seed, *shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _trials(seed, sizes, sub_groups=True):
    rng = random.Random(seed)
    trials = [(p, None, rng.randrange(2**31)) for p in sizes]
    if sub_groups:
        trials.append((4, [[0, 2], [1, 3]], rng.randrange(2**31)))
    return trials


def _where(t):
    p, members = t[0], t[1]
    return f"world_size={p}" + (f", sub-groups {members}" if members else "")


def _launch(job, fn, t, inputs, timeout, exercise_id, probe=None):
    """One trial on sealed ranks (inputs[rank]: that rank's only); each rank's observation, with
    "calls": [(phase, collective, elements)] from the router's record (the data is float64 and
    int64: 8 bytes an element)."""
    kept = {}

    def keep(p, i, observed, traffic):
        kept.update({r: {**o, "calls": [(c["phase"], _SHORT.get(c["kind"], c["kind"]), c["bytes"] // 8)
                                        for c in traffic[r]["collectives"]]}
                     for r, o in observed.items()})
    sealed.run_sealed(job, fn, [inputs], world_size=t[0], timeout=timeout, exercise=(exercise_id, ""), forbidden=(),
                      probe=probe, describe=lambda world_size, i: _where(t), check=keep)
    return [kept[r] for r in range(t[0])]


def _close(got, want, what, where, hint=""):
    if got is None:
        raise Fail(f"{where}: {what} is None.{hint}")
    if got.shape != want.shape:
        raise Fail(f"{where}: {what} has shape {list(got.shape)}, expected {list(want.shape)}.")
    diff = first_difference(got, want, atol=TOL, rtol=0)
    if diff is not None:
        raise Fail(f"{where}: {what} differs from the single-process value {diff}.{hint}")


def _comm(calls, phase):
    return [(name, n) for ph, name, n in calls if ph == phase]


def _split(n, p, r):
    sizes = [n // p + (k < n % p) for k in range(p)]
    return sum(sizes[:r]), sum(sizes[:r + 1])
