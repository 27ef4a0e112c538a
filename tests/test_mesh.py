"""pplab.mesh: every rank's groups equal the layout the pure functions describe, torch's
DeviceMesh lays ranks out the same way, and bad sizes are refused clearly."""
import pytest
import torch
import torch.distributed as dist

import pplab
from pplab import mesh

pytestmark = pytest.mark.usefixtures("no_leftover_processes")


def test_groups_are_lines_of_the_grid():
    assert mesh.groups("tp", dp=2, tp=2) == [[0, 1], [2, 3]]
    assert mesh.groups("dp", dp=2, tp=2) == [[0, 2], [1, 3]]
    assert mesh.groups("pp", pp=2, dp=2, tp=2) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert mesh.groups("dp", "ep", dp=2, ep=2) == [[0, 1, 2, 3]]
    assert mesh.groups("tp", dp=3) == [[0], [1], [2]]          # a dimension of size 1: groups of one
    for sizes in ({"dp": 2, "tp": 3}, {"pp": 3, "dp": 2, "cp": 2}, {"ep": 4, "dp": 2}):
        world = 1
        for n in sizes.values():
            world *= n
        for dim in mesh.DIMS:                                   # each dim's groups partition the world
            flat = sorted(r for g in mesh.groups(dim, **sizes) for r in g)
            assert flat == list(range(world))
            assert all(len(g) == sizes.get(dim, 1) for g in mesh.groups(dim, **sizes))


def test_an_order_numbers_the_ranks_along_it():
    # order (tp, dp, pp): pp fastest, so rank = 4·tp + 2·dp + pp, by hand
    order, sizes = ("tp", "dp", "pp"), {"pp": 2, "dp": 2, "tp": 2}
    g = mesh.grid(order, **sizes)
    for pp in range(2):
        for dp in range(2):
            for tp in range(2):
                assert g[pp, dp, 0, 0, tp].item() == 4 * tp + 2 * dp + pp
    assert mesh.groups("tp", order=order, **sizes) == [[0, 4], [2, 6], [1, 5], [3, 7]]
    assert mesh.groups("pp", order=order, **sizes) == [[0, 1], [4, 5], [2, 3], [6, 7]]   # rows by (dp, tp)
    assert mesh.groups("tp", dp=2, tp=2, order=("tp", "dp")) == [[0, 2], [1, 3]]


def test_describe_names_every_rank_and_group():
    text = mesh.describe(pp=2, dp=2, tp=2)
    assert "pp=2 × dp=2 × tp=2" in text and "tp groups: [0, 1]  [2, 3]  [4, 5]  [6, 7]" in text
    assert "pp groups: [0, 4]  [1, 5]  [2, 6]  [3, 7]" in text
    assert len([l for l in text.splitlines() if l.strip()[:1].isdigit()]) == 8


def _mesh_on_rank(sizes, extra, order=None):
    m = mesh.Mesh(order, **sizes)
    groups = {d: dist.get_process_group_ranks(m.group(d)) for d in mesh.DIMS}
    for dims in extra:
        groups["+".join(dims)] = dist.get_process_group_ranks(m.group(*dims))
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t, group=m.tp_group)                           # the groups work for collectives
    dm = m.device_mesh()
    torch_groups = {n: dist.get_process_group_ranks(dm.get_group(n)) for n in dm.mesh_dim_names}
    same = mesh.Mesh.from_device_mesh(dm).coords == m.coords
    return m.coords, groups, t.item(), torch_groups, (m.pp_prev, m.pp_next), same


@pytest.mark.parametrize("sizes, extra, order", [
    ({"dp": 2, "tp": 2}, [], None), ({"dp": 2, "ep": 2}, [("dp", "ep")], None),
    ({"pp": 2, "dp": 2, "tp": 2}, [("dp", "tp")], None), ({"pp": 3}, [], None),
    ({"dp": 2, "tp": 2}, [], ("tp", "dp"))])                      # dp fastest: tp groups [0, 2], [1, 3]
def test_every_rank_gets_its_groups(sizes, extra, order):
    world = 1
    for n in sizes.values():
        world *= n
    results = pplab.launch(_mesh_on_rank, sizes, extra, order, world_size=world)
    g = mesh.grid(order, **sizes)
    for rank, (coords, groups, tp_sum, torch_groups, (prev, nxt), same) in enumerate(results):
        assert g[tuple(coords[d] for d in mesh.DIMS)].item() == rank
        for dim in mesh.DIMS:
            assert [gr for gr in mesh.groups(dim, order=order, **sizes) if rank in gr] == [groups[dim]]
        for dims in extra:
            assert [gr for gr in mesh.groups(*dims, order=order, **sizes) if rank in gr] == [groups["+".join(dims)]]
        assert tp_sum == sum(groups["tp"])
        for name, ranks in torch_groups.items():
            assert sorted(ranks) == sorted(groups[name])
        stages = groups["pp"]
        i = stages.index(rank)
        assert prev == (stages[i - 1] if i else None) and nxt == (stages[i + 1] if i + 1 < len(stages) else None)
        assert same


def _bad(sizes):
    mesh.Mesh(**sizes)


@pytest.mark.parametrize("sizes, message", [
    ({"dp": 2, "tp": 2, "pp": 2}, r"dp·tp·pp|pp·dp·tp"),
    ({"dp": 3}, "the world has 4 ranks: choose sizes whose product is 4"),
    ({"dp": 0, "tp": 4}, "dp must be a whole number ≥ 1"),
    ({"xp": 4}, "unknown mesh dimension"),
])
def test_bad_mesh_is_refused_clearly(sizes, message):
    with pytest.raises(pplab.LaunchError, match=message):
        pplab.launch(_bad, sizes, world_size=4)


def test_mesh_outside_a_rank_says_where_to_call_it():
    with pytest.raises(RuntimeError, match="inside a rank"):
        mesh.Mesh(dp=1)
