"""Plausible wrong answers to chapter 9's clip_sharded, each a mistake a student could make, as in
wrong_solutions_ch00_broadcast.py: WRONG[exercise_id] lists (answer, regular expressions the check's message must
match, timeout or None). tests/test_checks.py checks that each fails with its message.

Each is `right` (a correct answer written apart from the solution notebook's) with one thing changed.
"""
import math

import torch

from pplab import comm


def _clip(shards, norm, max_norm):
    coef = min(1.0, max_norm / (norm + 1e-6))
    for s in shards:
        s["grad"][:s["valid"]] *= coef


def _local(shards, norm_type, tp_group, *, replicated_everywhere=False, padding=False):
    first = comm.rank(tp_group) == 0 or replicated_everywhere
    parts = [s["grad"] if padding else s["grad"][:s["valid"]] for s in shards if first or not s["replicated"]]
    if norm_type == math.inf:
        return max([g.abs().max().item() for g in parts if g.numel()] or [0.0])
    return sum(g.abs().pow(norm_type).sum().item() for g in parts)


def _total(local, norm_type, groups, op=None):
    t = torch.tensor([local], dtype=torch.float64)
    for g in groups:
        comm.all_reduce(t, op=op or ("max" if norm_type == math.inf else "sum"), group=g)
    return t.item()


def _root(x, norm_type):
    return x if norm_type == math.inf else x ** (1 / norm_type)


def right(shards, max_norm, norm_type, tp_group, dp_group):
    norm = _root(_total(_local(shards, norm_type, tp_group), norm_type, (tp_group, dp_group)), norm_type)
    _clip(shards, norm, max_norm)
    return norm


def local_norm_only(shards, max_norm, norm_type, tp_group, dp_group):
    """Each rank clips by the norm of what it holds: no all-reduce."""
    norm = _root(_local(shards, norm_type, tp_group, replicated_everywhere=True), norm_type)
    _clip(shards, norm, max_norm)
    return norm


def replicated_counted_per_rank(shards, max_norm, norm_type, tp_group, dp_group):
    """Every tp rank adds its copy of the replicated buckets."""
    local = _local(shards, norm_type, tp_group, replicated_everywhere=True)
    norm = _root(_total(local, norm_type, (tp_group, dp_group)), norm_type)
    _clip(shards, norm, max_norm)
    return norm


def forgot_the_root(shards, max_norm, norm_type, tp_group, dp_group):
    """The sum of squares, all-reduced, then used as the norm."""
    norm = _total(_local(shards, norm_type, tp_group), norm_type, (tp_group, dp_group))
    _clip(shards, norm, max_norm)
    return norm


def padding_counted(shards, max_norm, norm_type, tp_group, dp_group):
    """The whole shard, padding included."""
    local = _local(shards, norm_type, tp_group, padding=True)
    norm = _root(_total(local, norm_type, (tp_group, dp_group)), norm_type)
    _clip(shards, norm, max_norm)
    return norm


def clips_on_rank_0_only(shards, max_norm, norm_type, tp_group, dp_group):
    """The norm right everywhere, but only global rank 0 scales its gradients."""
    norm = _root(_total(_local(shards, norm_type, tp_group), norm_type, (tp_group, dp_group)), norm_type)
    if torch.distributed.get_rank() == 0:
        _clip(shards, norm, max_norm)
    return norm


def inf_norm_summed(shards, max_norm, norm_type, tp_group, dp_group):
    """The ranks' maxima added up (op sum) for norm_type=inf."""
    norm = _root(_total(_local(shards, norm_type, tp_group), norm_type, (tp_group, dp_group), op="sum"), norm_type)
    _clip(shards, norm, max_norm)
    return norm


def scales_up_too(shards, max_norm, norm_type, tp_group, dp_group):
    """The factor max_norm / norm without the min(1, ...): small gradients are scaled up."""
    norm = _root(_total(_local(shards, norm_type, tp_group), norm_type, (tp_group, dp_group)), norm_type)
    for s in shards:
        s["grad"][:s["valid"]] *= max_norm / (norm + 1e-6)
    return norm


# Near misses (issue 38): wrong on ranks other than 0 only, just outside the tolerance 1e-9.

def reduces_to_group_rank_0(shards, max_norm, norm_type, tp_group, dp_group):
    """dist.reduce to each group's first rank instead of an all-reduce: global rank 0 (first in both of its
    groups) ends with the whole total, the other ranks with part of it."""
    t = torch.tensor([_local(shards, norm_type, tp_group)], dtype=torch.float64)
    op = torch.distributed.ReduceOp.MAX if norm_type == math.inf else torch.distributed.ReduceOp.SUM
    for g in (tp_group, dp_group):
        torch.distributed.reduce(t, dst=torch.distributed.get_global_rank(g, 0), op=op, group=g)
    norm = _root(t.item(), norm_type)
    _clip(shards, norm, max_norm)
    return norm


def all_reduces_a_float32_total(shards, max_norm, norm_type, tp_group, dp_group):
    """The partial sum put in torch.tensor([local]), float32 by default: the total is rounded to 24 bits,
    a norm off by up to 6e-8 relative (and the clip factor with it)."""
    t = torch.tensor([float(_local(shards, norm_type, tp_group))])
    for g in (tp_group, dp_group):
        comm.all_reduce(t, op="max" if norm_type == math.inf else "sum", group=g)
    norm = _root(t.item(), norm_type)
    _clip(shards, norm, max_norm)
    return norm


def norm_by_vector_norm(shards, max_norm, norm_type, tp_group, dp_group):
    """Right, with torch.linalg.vector_norm per shard (a different rounding, ~1e-16): must pass."""
    first = comm.rank(tp_group) == 0
    parts = [s["grad"][:s["valid"]] for s in shards if first or not s["replicated"]]
    norms = [torch.linalg.vector_norm(g, norm_type).item() for g in parts if g.numel()]
    local = max(norms or [0.0]) if norm_type == math.inf else sum(n ** norm_type for n in norms)
    norm = _root(_total(local, norm_type, (tp_group, dp_group)), norm_type)
    _clip(shards, norm, max_norm)
    return norm


CLOSE_BUT_RIGHT = {"clip_sharded": [norm_by_vector_norm]}


def parts(norm="✔", clip="✔", inf="✔"):
    marks = [norm, clip, inf]
    return (rf"Parts: norm {norm} · clipped gradients {clip} · norm_type=inf {inf} "
            rf"\({marks.count('✔')} of 3\)")


WRONG = {"clip_sharded": [
    (local_norm_only, [parts("✘", "✘", "✘"), r"rank 0 returned the norm [\d.e+-]+, expected",
                       r"it is the norm of this rank's own shards only: add \|g\|\^p over what the rank holds, then "
                       r"all-reduce"], None),
    (replicated_counted_per_rank, [parts("✘", "✘", "✔"),          # a max does not change with copies r"tp=3 × dp=2, norm_type=2.0.*rank 0 returned the norm",
                                   r"it counts each replicated bucket once per tp rank"], None),
    (forgot_the_root, [parts("✘", "✘", "✔"), r"the norm to the power p: take the p-th root"], None),
    (padding_counted, [parts("✘", "✘", "✘"), r"it counts the padding: only the first `valid` elements"], None),
    (clips_on_rank_0_only, [parts("✔", "✘", "✘"), r"rank 1's shard 0 \((replicated|split) bucket\) at \[0\]",
                            r"It was not scaled at all on rank 1"], None),
    (inf_norm_summed, [parts("✔", "✔", "✘"), r"norm_type=inf.*it is the sum of the ranks' maxima",
                       r"all-reduce with op max"], None),
    (scales_up_too, [parts("✔", "✘", "✔"), r"tp=2 × dp=3.*is below max_norm.*never scaled up"], None),
    (reduces_to_group_rank_0, [parts("✘", "✘", "✘"), r"rank [1-5] returned the norm [\d.e+-]+, expected [\d.e+-]+"],
     None),
    (all_reduces_a_float32_total, [parts("✘", "✘", "✘"), r"rank \d returned the norm [\d.e+-]+, expected [\d.e+-]+"],
     None),
]}
