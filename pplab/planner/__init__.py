"""A layout planner: which dp × tp × pp (× micro-batches × ZeRO stage) to train a model on.

    times = measure(cfg)                           # per-layer forward/backward times on this machine
    best = plan(cfg, batch=8, world_size=4, memory_per_rank=2e9, fit=costfit.fit(), times=times)
    print(best)                                    # the layouts that fit, fastest first, and why others do not

Every number comes from an earlier chapter, put together:

* memory per rank (the most loaded pipeline rank): parameters, gradients and Adam's state of
  this rank's tensor-parallel shard of its stages (one, or v chunks for interleaved and ZB-V),
  divided by ZeRO as chapter 6's `pplab.zero.model_state_bytes` says; activations = one
  micro-batch's saved tensors per stage (measured per layer, scaled by micro-batch size; for
  tp > 1 the tensor-parallel layers' own, cut over tp (and SP) as `parallel_saved` counts them
  tensor by tensor), the most held at once as the rank walks its list of actions in chapter 4's
  schedule (F keeps a stage's, B or W frees them: GPipe m, 1F1B p−stage).
* step time: compute = measured per-layer time, fixed part + per-sample part × samples / tp
  (a tiny layer's time is mostly per-operation overhead, which splitting does not shrink);
  TP = 2 all-reduces of [s, b, h] per block forward and 2 backward (chapter 3; plus the
  vocabulary's), each `fit.predict("all_reduce", ..., tp, bytes)`; PP = chapter 4's `simulate`
  of the schedule with those per-micro-batch times and one message of an activation per hop:
  its makespan holds the bubble and the sends; DP = the gradient sync of the stage's shard over
  dp (all-reduce, or reduce-scatter + all-gather for ZeRO) after the last backward, not
  overlapped (ZeRO-2's reduce-scatter and ZeRO-3's gathers and reduce-scatter come once per
  micro-batch; DDP also all-gathers every replica's sample count each step); then the optimizer
  step on the elements this rank owns.

Measuring (times.py, calibrate.py): `measure`, `estimate`, `contention`, `calibrate`. On this CPU the ranks outnumber the cores: `calibrate` measures, with the ranks running at once,
how much slower compute gets and how long a message waits for its partner's time slice (added
to α). `compare(plan, measured)` puts predicted next to measured; `widget()` draws it all.

Placements (chapter 10d, placement.py): `time_placements` trains one layout under several
numberings of its mesh on the throttled two-tier network, to set beside what predict.py prices.

At scale (chapter 10, at_scale.py): the same questions for GPU clusters by closed forms, every layout of
16,384 GPUs at once; published.py holds the published runs it is checked against.
"""

from . import at_scale, published
from .at_scale import GPUCluster, Transformer
from .calibrate import calibrate
from .placement import time_placements
from .predict import Layout, Plan, PlanError, Prediction, compare, enumerate_layouts, plan, predict, stages, step_traffic
from .times import LayerTimes, contention, estimate, layer_params, measure, parallel_saved
from .widget import draw, widget

__all__ = ["Layout", "Plan", "PlanError", "Prediction", "LayerTimes", "plan", "predict", "compare",
           "enumerate_layouts", "stages", "measure", "estimate", "contention", "calibrate", "layer_params",
           "parallel_saved", "draw", "widget", "step_traffic", "at_scale", "published", "Transformer",
           "GPUCluster", "time_placements"]
