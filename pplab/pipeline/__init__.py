"""Pipeline parallelism: schedules as data, checked and simulated before anything runs.

    from pplab.pipeline import make_schedule, simulate
    s = make_schedule("1f1b", num_stages=4, num_microbatches=8)
    print(s)                                  # rows = ranks, columns = the order of F/B
    r = simulate(s, t_f=1, t_b=2)             # when everything starts and ends
    r.makespan, r.utilization, r.peak_activations
    pplab.swimlane.draw(r.timeline())         # drawn like a measured run

actions.py:       Action, Schedule: a schedule as data.
dependencies.py:  who waits for what (needs): the one rule the modules below read.
validation.py:    validate: the whole step, on the right ranks, in an order free of deadlock.
schedules.py:     the one-way generators, and make_schedule: every schedule by name (SCHEDULES).
looped.py:        Looped BFS and interleaved zero bubble (v chunks per rank), orders as torch's.
bidirectional.py: Chimera, DualPipe, DualPipeV (two directions, or a V with overlapped F&B).
simulate.py:      simulate (when each action starts and ends), bubble_fraction.
torch_csv.py:     schedules to and from the CSV torch.distributed.pipelining reads; run_with_torch.
partition.py:     partition, layer_times: cutting the model into stages.
executor.py:      run_pipeline / PipelineExecutor: the same schedule on real ranks.
asynchronous.py:  AsyncPipeline: PipeDream (weight stashing) and PipeDream-2BW, never flushed.
explorer.py:      explore(), a widget: schedule, p, m, v, t_f, t_b, t_w -> swimlane + memory + bubble.
"""
from .executor import PipelineExecutor, run_pipeline
from .partition import PipelineError, layer_times, partition
from .explorer import explore, pipeline_timeline
from .actions import Action, Schedule, ScheduleError
from .schedules import SCHEDULES, make_schedule
from .validation import validate
from .simulate import SimResult, bubble_fraction, simulate
from .torch_csv import read_torch_csv, run_with_torch, write_torch_csv
from .asynchronous import AsyncPipeline

__all__ = ["Action", "Schedule", "ScheduleError", "SCHEDULES", "make_schedule",
           "validate", "simulate", "SimResult", "bubble_fraction", "explore", "pipeline_timeline",
           "PipelineExecutor", "PipelineError", "run_pipeline", "AsyncPipeline", "partition", "layer_times",
           "read_torch_csv", "write_torch_csv", "run_with_torch"]
