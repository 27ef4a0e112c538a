"""What each exercise's answer runs without, when it is graded: the library modules that hold
the implementation the exercise asks for (public and private names alike).

When `pplab grade` checks an exercise listed here (the answer is a SourceAnswer), its ranks
are forked from a fresh interpreter that never imported these modules nor any checker
(fresh_zygote.py), an import of one raises "the library's X is not available while your
answer is checked" (library_view.py), and their files are hidden (pplab/isolation.py's `hide`,
run by isolate.py).
What an answer may use is what is left: pplab.comm, pplab.split, pplab.trace, torch, and
every other chapter.

An exercise whose checker runs a job in the ranks keeps that job in a `*_rank` module of
pplab/checks holding no reference (collectives_rank.py, ...): only those, and the sealed
machinery, are served to the ranks.
"""
from __future__ import annotations

# every schedule generator of pplab.pipeline (its package face keeps Action, Schedule, validate)
_SCHEDULES = ("pplab.pipeline.schedules", "pplab.pipeline.looped", "pplab.pipeline.bidirectional")

DENIED: dict[str, tuple[str, ...]] = {
    "broadcast": ("pplab.collectives",),
    "reduce_scatter": ("pplab.collectives",),
    "ring_all_reduce": ("pplab.collectives",),
    "predict_time": ("pplab.costfit", "pplab.costmodel"),
    "mesh_groups": ("pplab.mesh",),
    "pp_dp_train_step": ("pplab.hybrid", "pplab.pipeline.executor"),   # make_schedule stays: the order is given
    "pick_layout": ("pplab.planner",),
    "design_layout": ("pplab.planner",),
    "place_layout": ("pplab.cluster", "pplab.mesh"),
    "checkpointed_block": ("pplab.recompute",),
    "ddp_buckets": ("pplab.data_parallel.ddp",),
    "ddp_from_scratch": ("pplab.data_parallel.ddp",),
    "topk_error_feedback": ("pplab.data_parallel.compression",),
    "find_layout": ("pplab.zero", "pplab.memory", "pplab.planner.at_scale"),   # every formula of a GPU's bytes
    "moe_dispatch": ("pplab.expert_parallel",),
    "gpipe_order": _SCHEDULES,
    "one_f_one_b_order": _SCHEDULES,
    "bubble_fraction": ("pplab.pipeline.simulate",),   # Timeline's busy/bubble come with the answer's input: refused
    "pipeline_executor": ("pplab.pipeline.executor",),  # the answer may still build its order with make_schedule
    "zero_bubble": _SCHEDULES,
    "f_g": ("pplab.tensor_parallel.layers",),
    "vocab_parallel_ce": ("pplab.tensor_parallel.transformer",),
    "online_softmax_merge": ("pplab.sequence_parallel.ring_attention",),   # its merge; torch's SDPA: refused
    "ulysses_all_to_all": ("pplab.sequence_parallel.ulysses",),
    "ring_attention_step": ("pplab.sequence_parallel.ring_attention",),
    "megatron_sp_block": ("pplab.sequence_parallel.megatron", "pplab.tensor_parallel.layers"),
    "linear_traffic": ("pplab.tensor_parallel.tp3d",),   # its 1D bytes per rank: the nearest the library holds
    "linear_3d": ("pplab.tensor_parallel.tp3d",),
    "loss_scaler": ("pplab.mixed_precision",),
    "clip_sharded": ("pplab.grad_clip",),
    "ring_attention": ("pplab.sequence_parallel.ring_attention",),
    "zero1_step": ("pplab.zero",),
    "zero_bytes": ("pplab.zero",),
    "stage3_unit": ("pplab.zero",),
    "sharded_optimizer": ("pplab.zero",),
    "quantised_gather": ("pplab.zero",),
    "overlapped_step": ("pplab.overlap.dualpipe_pair",),
    "node_limited_routing": ("pplab.experts_at_scale",),
    "doc_split": ("pplab.sequence_parallel.packed",),
    "fsdp": ("pplab.zero.fully_sharded", "pplab.zero.flat", "pplab.zero.optimizer", "pplab.zero.plusplus"),
    "fp8_blocks": ("pplab.fp8", "pplab.zero.fp8_gather"),
}


# Graded exercises whose answer cannot be taken away whole, each with why (what stands instead):
EXEMPT: dict[str, str] = {
    "row_parallel_linear": "the answer needs reduce_from_parallel (the g operator) of pplab.tensor_parallel.layers, "
                           "the module that holds RowParallelLinear: the probe refuses RowParallelLinear by identity "
                           "and by name (splitting layers.py would let it be denied)",
    "moe_bytes": "the checker's job builds the measured layer from pplab.expert_parallel (MoE, steer), the module "
                 "that holds all_to_all_bytes: the probe refuses all_to_all_bytes (moving it to a module of its "
                 "own would let it be denied)",
}


def note(module: str) -> str:
    """What a student reads when their answer reaches for `module`."""
    return (f"the library's {module} is not available while your answer is checked: the exercise asks you to "
            f"write what it holds yourself (with pplab.comm, pplab.split, pplab.trace and torch)")


CHECKS_NOTE = ("is not available while your answer is checked: it is the checker's own module (its references "
               "and expected values stay in the checker's process)")
