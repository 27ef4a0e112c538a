"""pplab schedules to and from the CSV that torch.distributed.pipelining reads and writes.

torch keeps a schedule as a dict rank -> list of actions; `PipelineScheduleMulti._dump_csv`
writes one row per rank, one cell per action, and `_load_csv` reads it back. A cell is
"{stage}{kind}{micro-batch}": "3F0" is the forward of micro-batch 0 through stage 3, "3B0"
its backward, "3I0" / "3W0" the two halves of a split backward; "(0F3;3B1)OVERLAP_F_B" is
DualPipeV's forward and backward run as one block (Action.overlap). An empty cell is an idle
slot (torch pads its own schedules with them so that ranks line up in time; pplab orders
carry no time, so they are dropped on import and never written).

    write_torch_csv(schedule, "s.csv")        # pplab -> torch: rt._load_csv("s.csv")
    read_torch_csv("t.csv")                   # torch's rt._dump_csv("t.csv") -> pplab Schedule

torch's own runtime (_PipelineScheduleRuntime) runs a compute-only CSV after *lowering*
it: `_load_csv` validates the order (`_validate_schedule`, which also infers which rank
holds which stage from who runs it), then `_add_send_recv` inserts a SEND_F after every
forward whose next stage lives on another rank and the matching RECV_F into that rank's
list, where its order first needs it (SEND_B / RECV_B likewise for backwards). pplab's
executor does the same implicitly: an F receives before it runs and sends after. A
"compute_comms" dump has those cells (and UNSHARD / RESHARD / REDUCE_GRAD, for FSDP and
data parallelism); `read_torch_csv` keeps only the computation, which is what pplab's
Schedule is. `run_with_torch` runs a pplab schedule with torch's runtime on this rank.
"""
from __future__ import annotations

import csv
import os
import re
import tempfile

from .actions import Action, Schedule, ScheduleError
from .partition import _as_layers, partition
from .validation import validate

_CELL = re.compile(r"^(\d+)(F|B|I|W)(\d+)$")
_NOT_COMPUTE = re.compile(r"^\d+(SEND_F|RECV_F|SEND_B|RECV_B|UNSHARD|RESHARD|REDUCE_GRAD)\d*$")


def _cell(a: Action) -> str:
    return f"{a.stage}{a.kind}{a.microbatch}"


def torch_rows(schedule: Schedule) -> list[list[str]]:
    """One row per rank, one cell "{stage}{kind}{micro-batch}" per action, in the rank's order.

    An overlapped pair (an F with Action.overlap, and the B or I after it) is one cell, as torch
    writes its own DualPipeV's: "(0F1;3B0)OVERLAP_F_B". Written as two cells it would be two
    actions to torch, run one after the other, and lowered (its sends and receives placed)
    differently from torch's ScheduleDualPipeV."""
    rows = []
    for acts in schedule.actions:
        row, k = [], 0
        while k < len(acts):
            if acts[k].overlap:                  # validate() has checked that a B or I follows
                row.append(f"({_cell(acts[k])};{_cell(acts[k + 1])})OVERLAP_F_B")
                k += 2
            else:
                row.append(_cell(acts[k]))
                k += 1
        rows.append(row)
    return rows


def write_torch_csv(schedule: Schedule, path) -> None:
    """Write `schedule` in the compute-only CSV format torch's `_load_csv` reads (an overlapped
    F&B pair as one cell, as torch writes it)."""
    with open(path, "w", newline="") as f:
        csv.writer(f).writerows(torch_rows(schedule))


def _cells(cell: str, rank: int, step: int) -> list[tuple[str, int, int, bool]]:
    """(kind, micro-batch, stage, overlap) of the computation in one cell; [] for an idle slot or a
    message. overlap is True on the F of an F&B pair, as Action.overlap says it."""
    cell = cell.strip()
    if not cell or _NOT_COMPUTE.match(cell):
        return []
    if cell.startswith("(") and cell.endswith(")OVERLAP_F_B"):      # F and B run together (DualPipeV)
        pair = [x for sub in cell[1:-len(")OVERLAP_F_B")].split(";") for x in _cells(sub, rank, step)]
        if [x[0] for x in pair] not in (["F", "B"], ["F", "I"]):
            raise ScheduleError(f"rank {rank}, cell {step}: {cell!r} overlaps {[x[0] for x in pair]}; expected "
                                f"a forward then a backward, like '(0F1;3B0)OVERLAP_F_B'")
        return [pair[0][:3] + (True,), pair[1]]
    found = _CELL.match(cell)
    if not found:
        raise ScheduleError(f"rank {rank}, cell {step}: {cell!r} is not an action torch writes; expected "
                            f"stage, kind and micro-batch like '3F0', '2I5', '0W1', or an empty cell")
    stage, kind, mb = found.groups()
    return [(kind, int(mb), int(stage), False)]


def from_torch_rows(rows, name: str = "from-torch", num_microbatches: int | None = None) -> Schedule:
    """The Schedule for torch's per-rank rows of cells (row r = rank r); validated.

    Which rank holds which stage is read from who runs it; a rank's chunks are its stages
    in model order. num_microbatches: None = one more than the largest micro-batch seen."""
    found = [[x for k, cell in enumerate(row) for x in _cells(cell, r, k)] for r, row in enumerate(rows)]
    if not any(found):
        raise ScheduleError("the CSV has no computation in it: expected one row per rank of cells like '0F0'")
    owner = {}
    for r, acts in enumerate(found):
        for _, _, s, _ in acts:
            if owner.setdefault(s, r) != r:
                raise ScheduleError(f"stage {s} is run by ranks {owner[s]} and {r}: a stage lives on one rank")
    num_stages = max(owner) + 1
    missing = sorted(set(range(num_stages)) - set(owner))
    if missing:
        raise ScheduleError(f"no rank runs stage(s) {missing}, yet stage {num_stages - 1} exists: "
                            f"every stage from 0 to {num_stages - 1} needs its actions")
    p = len(found)
    stage_to_rank = [owner[s] for s in range(num_stages)]
    per_rank = {stage_to_rank.count(r) for r in range(p)}
    if len(per_rank) != 1:
        raise ScheduleError(f"ranks hold different numbers of stages ({[stage_to_rank.count(r) for r in range(p)]}): "
                            f"a pplab Schedule gives every rank the same number of chunks")
    m = num_microbatches if num_microbatches is not None else 1 + max(a[1] for acts in found for a in acts)
    chunk = {s: sorted(t for t in range(num_stages) if stage_to_rank[t] == stage_to_rank[s]).index(s)
             for s in range(num_stages)}
    actions = [[Action(k, i, s, chunk[s], overlap) for k, i, s, overlap in acts] for acts in found]
    return validate(Schedule(name, p, m, per_rank.pop(), actions, stage_to_rank))


def read_torch_csv(path, name: str = "from-torch", num_microbatches: int | None = None) -> Schedule:
    """Read a CSV torch's `_dump_csv` wrote (compute only, or with its messages) as a pplab Schedule."""
    with open(path, newline="") as f:
        return from_torch_rows(list(csv.reader(f)), name, num_microbatches)


def run_with_torch(schedule: Schedule, layers, inputs, targets, loss_fn, *, balance="params", steps: int = 1):
    """Train `steps` steps of `schedule` with torch's pipeline runtime on this rank (call on every rank).

    The layers are cut as pplab's executor cuts them (partition.py); each of this rank's
    stages becomes a torch PipelineStage; the schedule goes to torch as a compute-only CSV
    through `_load_csv`, which validates and lowers it (SEND/RECV added). torch divides the
    gradients by m (scale_grads): with loss_fn the mean over a micro-batch and equal
    micro-batches, that is the gradient of the batch's mean loss, as pplab's executor gives.
    Returns {"grads": {name: gradient}}, named as nn.Sequential(*layers) names them, and
    "lowered": this rank's actions after torch's lowering, as torch writes them ("0SEND_F1")."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime


    layers = _as_layers(layers)
    m = schedule.num_microbatches
    if len(inputs) % m:
        raise ScheduleError(f"torch's runtime cuts the batch into m = {m} equal micro-batches: give a batch "
                            f"size that m divides, not {len(inputs)}")
    rank = dist.get_rank()
    bounds = partition(layers, schedule, balance)
    mine = schedule.stages_of(rank)
    modules = {s: nn.Sequential(*layers[slice(*bounds[s])]) for s in mine}
    stages = [PipelineStage(modules[s], s, schedule.num_stages, torch.device("cpu")) for s in mine]
    runtime = _PipelineScheduleRuntime(stages, m, loss_fn=loss_fn)
    fd, path = tempfile.mkstemp(suffix=".csv")
    try:
        os.close(fd)
        write_torch_csv(schedule, path)
        runtime._load_csv(path)
    finally:
        os.unlink(path)
    first, last = 0 in mine, schedule.num_stages - 1 in mine
    for _ in range(steps):
        for mod in modules.values():
            mod.zero_grad(set_to_none=True)
        args = (inputs,) if first else ()
        runtime.step(*args, target=targets if last else None)
    grads = {f"{bounds[s][0] + int(n.split('.', 1)[0])}.{n.split('.', 1)[1]}": p.grad
             for s in mine for n, p in modules[s].named_parameters()}
    return {"grads": grads, "lowered": [str(a) for a in runtime.pipeline_order_with_comms[rank]]}
