"""Checks of chapter 7's exercises: the groups of a device mesh.

    mesh_groups      mesh_groups(rank, pp, dp, tp) -> {"pp": [...], "dp": [...], "tp": [...]}

mesh_groups runs on sealed ranks (sealed.py), three launches of 4, 6 and 8 ranks whose
(pp, dp, tp) sizes are drawn from the seed (one dimension of size 1 among them, uneven sizes
such as 3). Each rank calls the answer with its own global rank; the job only returns what
it said. Here, every rank's three groups must equal pplab.mesh.groups' (global ranks, in
order along the dimension). A wrong answer is named when it matches a common
mistake: tp not the innermost dimension, dp and pp swapped, groups right only on rank 0.
"""
from __future__ import annotations

import random

from .. import sealed
from ..core import Fail, Forbidden, exercise, require_function
from .mesh_groups_rank import _LIBRARY, _mesh_rank, _refuse_mesh


DIMS = ("pp", "dp", "tp")


_SIZES = {4: [(1, 2, 2), (2, 2, 1), (2, 1, 2), (1, 1, 4), (4, 1, 1)],
          6: [(1, 3, 2), (1, 2, 3), (3, 1, 2), (2, 3, 1), (3, 2, 1)],
          8: [(2, 2, 2)]}


def _cases(seed: int) -> list[tuple[int, int, int]]:
    rng = random.Random(seed)
    return [rng.choice(_SIZES[4]), rng.choice(_SIZES[6]), (2, 2, 2)]


def _mesh(rank, pp, dp, tp) -> dict:
    """The reference, here: rank's group along each dimension, from pplab.mesh (no ranks needed)."""
    from ...mesh import groups
    return {d: next(g for g in groups(d, pp=pp, dp=dp, tp=tp) if rank in g) for d in DIMS}


def _diagnose(answers: dict, meshes: dict, sizes) -> str:
    """A hint when every rank's answer matches a known mistake."""
    pp, dp, tp = sizes
    def all_ranks(pred):
        return all(pred(answers[r], meshes[r]) for r in answers)
    if tp > 1 and dp > 1 and all_ranks(lambda a, m: a.get("tp") == m["dp"] and a.get("dp") == m["tp"]):
        return (" Your tp groups are the mesh's dp groups and the other way round: tp is the innermost "
                "dimension, so the ranks of a tp group are neighbours (rank = (pp·dp + dp_index)·tp + tp_index).")
    if pp > 1 and dp > 1 and all_ranks(lambda a, m: a.get("pp") == m["dp"] and a.get("dp") == m["pp"]):
        return (" Your dp and pp groups are swapped: pp is the outermost dimension (it varies slowest), dp "
                "sits between pp and tp.")
    if all_ranks(lambda a, m: a.get("tp") == m["tp"]) and \
            not all_ranks(lambda a, m: a.get("dp") == m["dp"]):
        return (" The tp groups are right: check the stride of dp (tp ranks apart) and of pp (dp·tp ranks "
                "apart).")
    return ""


@exercise("mesh_groups", "The dp, tp and pp groups of a device mesh", answer="mesh_groups",
          notebook="07_mesh_groups", sealed=True,
          preload=('pplab.mesh', 'torch.distributed.device_mesh'))
def check_mesh_groups(fn, seed: int, timeout: float) -> str:
    """mesh_groups(rank, pp, dp, tp) -> this rank's pp, dp and tp groups as lists of global ranks."""
    require_function(fn, "mesh_groups", "rank, pp, dp, tp", 0, 1, 2, 2)
    cases = _cases(seed)
    for sizes in cases:
        pp, dp, tp = sizes
        world = pp * dp * tp
        where = f"pp={pp}, dp={dp}, tp={tp} on {world} ranks: "
        observed = {}
        sealed.run_sealed(_mesh_rank, fn, [[sizes] * world], world_size=world, timeout=timeout,
                          exercise=("mesh_groups", "the groups"), forbidden=(), probe=_refuse_mesh,
                          describe=lambda w, i, where=where: where.rstrip(": "),
                          check=lambda p, i, seen, traffic: observed.update(seen))
        answers, meshes = {}, {}
        for rank in range(world):
            try:
                got, want = observed[rank]["answer"], _mesh(rank, pp, dp, tp)
            except (KeyError, TypeError, IndexError):
                raise Fail(f"{where}what rank {rank} returned could not be read.") from None
            if got == _LIBRARY:
                raise Forbidden("exercise 'mesh_groups' asks you to work out the groups of a mesh yourself; "
                                "you use pplab.mesh, the library's answer.")
            if not isinstance(got, dict) or set(got) != set(DIMS):
                raise Fail(f"{where}{fn.__name__} must return a dict with keys 'pp', 'dp', 'tp' (each a list of "
                           f"global ranks); rank {rank} got {got if isinstance(got, str) else sorted(got)}.",
                           seed_matters=False)
            answers[rank], meshes[rank] = got, want
        wrong = [r for r in range(world) if answers[r] != meshes[r]]
        if wrong:
            r = wrong[0]
            dim = next(d for d in DIMS if answers[r][d] != meshes[r][d])
            only0 = " (rank 0's groups are right: do the others depend on the rank?)" if 0 not in wrong else ""
            raise Fail(f"{where}rank {r}'s {dim} group is {answers[r][dim]}, expected {meshes[r][dim]}"
                       f"{only0}.{_diagnose(answers, meshes, sizes)}")
    shown = ", ".join(f"pp={a}×dp={b}×tp={c}" for a, b, c in cases)
    return f"on sealed ranks: {shown} (every rank's three groups equal pplab.mesh's)"
