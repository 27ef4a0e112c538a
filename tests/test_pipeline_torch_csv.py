"""DualPipeV's overlapped F&B pairs in the CSV torch reads (pipeline/torch_csv.py), both ways.

torch writes a pair as one cell, "(0F3;3B1)OVERLAP_F_B", and lowers it as one action. pplab writes
its DualPipeV the same way; loaded by torch's `_load_csv`, it becomes the same program torch's own
`ScheduleDualPipeV` builds: the same compute order and, after lowering, the same sends and receives
in the same places. References: torch's ScheduleDualPipeV (its per-rank order), its loader,
validator, lowering pass and dumper. No process group: torch's objects are made without __init__
and given the numbers __init__ would set, as tests/test_pipeline_looped.py does.
"""
import pytest
from torch.distributed.pipelining import schedules as S

from pplab.pipeline import make_schedule, simulate
from pplab.pipeline.torch_csv import from_torch_rows, read_torch_csv, torch_rows, write_torch_csv


def _runtime(p, m, cls=S._PipelineScheduleRuntime):
    """torch's runtime for p ranks of 2 stages each, without stages or a process group."""
    rt = object.__new__(cls)
    rt.pp_group_size, rt._num_stages, rt._n_microbatches = p, 2 * p, m
    rt._stages, rt.pipeline_order, rt._defer_pp_recv = [], {}, False
    return rt


def _torchs_dualpipev(p, m):
    """torch's own ScheduleDualPipeV: its compute order (idle slots dropped) and its lowered program,
    as its __init__ makes them."""
    sched = _runtime(p, m, S.ScheduleDualPipeV)
    order = {r: sched._calculate_single_rank_operations(r) for r in range(p)}
    sched._prepare_schedule_with_comms(order)
    return ({r: [str(a) for a in acts if a is not None] for r, acts in order.items()},
            {r: [str(a) for a in acts] for r, acts in sched.pipeline_order_with_comms.items()})


@pytest.mark.parametrize("p", [2, 3, 4])
def test_pplabs_dualpipev_through_torchs_loader_is_torchs_own_program(tmp_path, p):
    m = 2 * p                                         # torch's DualPipeV needs m >= its 2p stages
    ours = make_schedule("dualpipev", p, m)
    write_torch_csv(ours, tmp_path / "ours.csv")
    rt = _runtime(p, m)
    rt._load_csv(str(tmp_path / "ours.csv"))          # torch validates, then lowers (SEND/RECV added)
    order, lowered = _torchs_dualpipev(p, m)
    pairs = [str(a) for a in rt.pipeline_order[0] if a.computation_type == S.OVERLAP_F_B]
    assert pairs and all(a.startswith("(") and a.endswith(")OVERLAP_F_B") for a in pairs)   # the overlap is kept
    assert {r: [str(a) for a in acts] for r, acts in rt.pipeline_order.items()} == order
    assert {r: [str(a) for a in acts] for r, acts in rt.pipeline_order_with_comms.items()} == lowered
    # and back: torch dumps it, pplab reads the same schedule, pairs included
    rt._dump_csv(str(tmp_path / "back.csv"), format="compute_only")
    back = read_torch_csv(tmp_path / "back.csv", name="dualpipev")
    assert (back.actions, back.stage_to_rank, back.chunks) == (ours.actions, ours.stage_to_rank, ours.chunks)
    assert simulate(back, t_fb=1.5).makespan == simulate(ours, t_fb=1.5).makespan


def test_a_pair_is_one_cell_and_the_rest_are_as_before():
    rows = torch_rows(make_schedule("dualpipev", 2, 4))
    assert rows[0] == ["0F0", "0F1", "0F2", "3F0", "3I0", "3W0", "3F1", "(0F3;3B1)OVERLAP_F_B",
                       "(3F2;0B0)OVERLAP_F_B", "3B2", "(3F3;0B1)OVERLAP_F_B", "3B3", "0I2", "0W2", "0I3", "0W3"]


def _split_pairs(rows):
    """The rows with each pair's full backward B split: the pair keeps the I, its W follows the pair."""
    out = []
    for row in rows:
        new = []
        for cell in row:
            if cell.endswith(")OVERLAP_F_B"):
                f, b = cell[1:-len(")OVERLAP_F_B")].split(";")
                new += [f"({f};{b.replace('B', 'I')})OVERLAP_F_B", b.replace("B", "W")]
            else:
                new.append(cell)
        out.append(new)
    return out


def test_an_overlapped_forward_and_input_gradient_pair_is_read_and_written_back(tmp_path):
    # torch's format pairs any forward with a backward: "(0F3;3I1)OVERLAP_F_B" is what str() of its
    # _Action with those two sub-actions gives, what its loader accepts and its dumper writes
    pair = S._Action(-1, S.OVERLAP_F_B, None, (S._Action(0, S.FORWARD, 3), S._Action(3, S.BACKWARD_INPUT, 1)))
    assert str(pair) == "(0F3;3I1)OVERLAP_F_B"
    rows = _split_pairs(torch_rows(make_schedule("dualpipev", 2, 4)))
    (tmp_path / "fi.csv").write_text("\n".join(",".join(row) for row in rows) + "\n")
    rt = _runtime(2, 4)
    rt._load_csv(str(tmp_path / "fi.csv"))            # torch validates and lowers it
    rt._dump_csv(str(tmp_path / "fi_back.csv"), format="compute_only")
    sched = read_torch_csv(tmp_path / "fi_back.csv")
    paired = [(a, b) for acts in sched.actions for a, b in zip(acts, acts[1:]) if a.overlap]
    assert len(paired) == 6 and all(a.kind == "F" and b.kind == "I" for a, b in paired)
    assert torch_rows(sched) == rows and torch_rows(from_torch_rows(rows)) == rows

