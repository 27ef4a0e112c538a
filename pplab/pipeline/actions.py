"""Pipeline schedules as data: for every rank, the ordered list of what it computes.

A schedule says nothing about time. Rank r runs `schedule.actions[r]` in order, and an
action starts as soon as its rank is free and its inputs have arrived. The simulator
(simulate.py) plays that out with durations; an executor plays it out on real processes.

    Action("F", 3, stage=1)   forward of micro-batch 3 through stage 1
    Action("B", 3, stage=1)   its backward: input gradient and weight gradient together
    Action("I", 3, stage=1)   or the backward split in two (zero-bubble schedules):
    Action("W", 3, stage=1)   I = gradient of the stage's input, which stage 0 is waiting
                              for; W = gradient of the weights, wanted only by the optimizer
                              step, so it can wait and fill a bubble.

Stages and ranks. The model is cut into `num_stages = num_ranks * chunks` stages, run in
order 0, 1, ..., num_stages - 1. With one chunk per rank, stage r lives on rank r.
Interleaved 1F1B (Megatron) deals each rank v chunks round-robin: stage = chunk * p + rank.
The V shape (ZB-V) goes down the ranks and back up: chunk 0 of rank r is stage r, chunk 1
is stage 2p-1-r, so the last rank holds the two middle stages. `schedule.stage_to_rank`
records the placement; `schedule.neighbour_ranks(stage)` says who to receive from and
send to. The `chunk` of an action is the index of its stage among its rank's stages.

Who waits for what (an F for the previous stage's F, a backward for the next stage's) is
the rule of dependencies.py, which validation, the simulator and the executors read.

Two replicas (bidirectional pipelines: Chimera, DualPipe). `schedule.replicas = 2` says the
stages are two copies of the model: stages 0..d-1 are replica 0, stages d..2d-1 replica 1
(d = num_stages // replicas), each run in model order 0..d-1 from its own first stage. Replica
0 takes the first half of the micro-batches, replica 1 the second, and after the flush the two
copies of each piece add their gradients (schedule.replica_microbatches, model_stage).

Overlapped pairs (DualPipe's F&B). `Action(..., overlap=True)` on an F says: this F and the
rank's next action (a B or I of another micro-batch) run as one block, the forward's compute
hiding the backward's communication. The block starts when both have their inputs; its
length is simulate's t_fb.
"""
from __future__ import annotations

import contextlib
import gc
from dataclasses import dataclass
from typing import NamedTuple

from ..trace import action_label

KINDS = ("F", "B", "I", "W")


class ScheduleError(ValueError):
    """A schedule, or the arguments asked of a generator, cannot work; the message says why."""


@contextlib.contextmanager
def gc_paused():
    """Pause Python's cycle collector while a schedule is built, checked or played out.

    It runs each time the number of new container objects (tuples included) passes a
    threshold, and the oldest generation's pass walks every object in the process, torch's
    among them. Half a million new Actions set it off again and again, which made building
    and checking a large schedule several times slower. Actions and the lists holding them
    refer to nothing that points back, so there are no cycles to collect meanwhile.
    """
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()


class Action(NamedTuple):
    """One step of one rank. A NamedTuple: immutable, compared and hashed by value, and more
    than twice as quick to create as a frozen dataclass, which counts when a schedule holds a
    million of them (1F1B at p = 64, m = 4096 is half a million). Being a tuple, it also
    unpacks (kind, i, stage, chunk, overlap = action) and equals the plain tuple of its fields."""
    kind: str          # "F", "B", "I" (input gradient) or "W" (weight gradient)
    microbatch: int
    stage: int         # which piece of the model, 0 .. num_stages-1
    chunk: int = 0     # which of its rank's stages that is (0 unless chunks > 1)
    overlap: bool = False   # an F run as one block with the rank's next action (a B or I)

    def label(self, chunked: bool = False) -> str:
        """Its name in grids and swimlanes: F3, or F3.1 (chunk 1) when ranks hold several chunks."""
        return action_label(self.kind, self.microbatch, self.chunk if chunked else None)


@dataclass
class Schedule:
    name: str
    num_ranks: int                   # p, the pipeline depth
    num_microbatches: int            # m
    chunks: int                      # v, stages per rank
    actions: list[list[Action]]      # actions[rank]: what that rank computes, in order
    stage_to_rank: list[int]         # stage_to_rank[stage]: the rank holding that stage
    replicas: int = 1                # 2: the stages are two copies of the model (bidirectional)

    @property
    def num_stages(self) -> int:
        """Pieces the model is cut into: num_ranks * chunks."""
        return len(self.stage_to_rank)

    @property
    def stages_per_replica(self) -> int:
        """The model's depth d: the stages one copy of the model is cut into."""
        return self.num_stages // self.replicas

    def model_stage(self, stage: int) -> int:
        """Which piece of the model `stage` runs: stage itself, or stage - d in replica 1."""
        return stage % self.stages_per_replica

    def replica_microbatches(self, replica: int) -> range:
        """The micro-batches that replica runs: all of them, or its half of them."""
        m, k = self.num_microbatches, self.replicas
        return range(replica * m // k, (replica + 1) * m // k)

    @property
    def split_backward(self) -> bool:
        """True when backwards are split into I and W (zero-bubble schedules)."""
        return any(a.kind in ("I", "W") for acts in self.actions for a in acts)

    def stages_of(self, rank: int) -> list[int]:
        """The stages `rank` holds, in model order: its chunk 0, chunk 1, ..."""
        by_rank = self.__dict__.get("_stages_by_rank")
        if by_rank is None or by_rank[0] is not self.stage_to_rank:   # built once: O(stages), not per rank
            table = {}
            for s, r in enumerate(self.stage_to_rank):
                table.setdefault(r, []).append(s)
            by_rank = self.__dict__["_stages_by_rank"] = (self.stage_to_rank, table)
        return list(by_rank[1].get(rank, []))

    def __getstate__(self):
        """Pickled (sent to ranks, copied) without the caches of stages_of and validate: the
        one validate keeps is as large as the schedule, and each is rebuilt when needed."""
        return {k: v for k, v in self.__dict__.items() if not k.startswith("_")}

    def neighbour_ranks(self, stage: int) -> tuple[int | None, int | None]:
        """(rank holding stage-1, rank holding stage+1); None at either end of the model.

        An F of `stage` receives its input from the first and sends its output to the
        second; a B or I receives the gradient from the second and sends one to the
        first. Where the neighbour is the same rank (the turn of a V) nothing is sent.
        """
        if not 0 <= stage < self.num_stages:
            raise ScheduleError(f"stage {stage} does not exist: this schedule has stages 0..{self.num_stages - 1}")
        d = self.stages_per_replica                       # a replica's first and last stage end it
        prev = self.stage_to_rank[stage - 1] if stage % d > 0 else None
        nxt = self.stage_to_rank[stage + 1] if (stage + 1) % d else None
        return prev, nxt

    # -- printing ----------------------------------------------------------------------
    def grid(self, max_columns: int | None = 48) -> str:
        """Rows = ranks, columns = the order each rank runs its actions in (not time)."""
        chunked = self.chunks > 1
        cells = [[a.label(chunked) + ("&" if a.overlap else "") for a in acts] for acts in self.actions]
        width = max((len(c) for row in cells for c in row), default=2)
        head = f"{self.name}: {self.num_ranks} ranks, {self.num_microbatches} micro-batches"
        if chunked:
            head += f", {self.chunks} chunks per rank ({self.num_stages} stages)"
        lines = [head]
        for r, row in enumerate(cells):
            shown = row if max_columns is None else row[:max_columns]
            more = f" ... (+{len(row) - len(shown)})" if len(shown) < len(row) else ""
            lines.append(f"rank {r:<{len(str(self.num_ranks - 1))}} | "
                         + " ".join(c.ljust(width) for c in shown).rstrip() + more)
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.grid()

    def __repr__(self) -> str:
        return (f"Schedule({self.name!r}, ranks={self.num_ranks}, microbatches={self.num_microbatches}, "
                f"chunks={self.chunks}, actions={sum(map(len, self.actions))})")
