# Checker loosenings (issue 38) of chapters 0-2's collectives and DDP checkers, the loss scaler
# (9b) and sharded gradient clipping (9c). For every checker: (a) a world size dropped, (b) only
# rank 0's result looked at, (c) the tolerance widened 100x, plus the concept's blind spots. Each
# must be caught by a registered near-miss wrong answer (tests/wrong_solutions_near_*.py and the
# subject files), not by a wide miss.
#
# Not applicable: broadcast compares exactly (a copy is exact; no tolerance to widen);
# topk_error_feedback runs in one process (no world size, no rank 0); predict_time runs in one
# sealed rank (its p is data, 3..64, not a world size; nothing to compare per rank).

_RANK0 = "sorted(observed.items())[:1]:"
_CLIP = CHK("clip_sharded", "local_norm_only or replicated_counted or forgot_the_root or padding_counted or clips_on "
                            "or inf_norm_summed or scales_up_too or reduces_to_group or float32_total")

MUTANTS += [
    # collectives.py: broadcast
    Mutant("pplab/checks/ch00_start_here/broadcast.py", "sizes = (2, 3, 4)                                    # 3: not a power",
           "sizes = (2, 4)                                    # 3: not a power", CHK("broadcast", "broadcast_"),
           "broadcast check: world size 3 (not a power of two) dropped"),
    Mutant("pplab/checks/ch00_start_here/broadcast.py", "sorted(observed.items()):   # every rank, src or not",
           _RANK0 + "   # every rank, src or not", CHK("broadcast", "broadcast_"),
           "broadcast check: rank 0's tensor only"),
    # reduce_scatter
    Mutant("pplab/checks/ch01_collectives/reduce_scatter.py", "sorted(observed.items()):   # every rank: each ends with its own chunk",
           _RANK0 + "   # every rank: each ends with its own chunk", CHK("reduce_scatter", "reduce_scatter_"),
           "reduce-scatter check: rank 0's output only"),
    Mutant("pplab/checks/ch01_collectives/ring_checks.py", "else {\"atol\": 1e-5, \"rtol\": 1e-5}",
           "else {\"atol\": 1e-3, \"rtol\": 1e-3}", CHK("reduce_scatter", "reduce_scatter_"),
           "reduce-scatter check: float32 tolerance widened 100x"),
    Mutant("pplab/checks/ch01_collectives/ring_checks.py", "trials = {p: _trials(seed, p, cases) for p in (2, 3, 4)}",
           "trials = {p: _trials(seed, p, cases) for p in (2, 4)}", CHK("reduce_scatter", "reduce_scatter_"),
           "reduce-scatter check: world size 3 dropped"),
    Mutant("pplab/checks/ch01_collectives/reduce_scatter.py", "_check_ring_traffic(traffic, rank, p, input, p - 1,",
           "_check_ring_traffic(traffic, rank, p, input, p * p,", CHK("reduce_scatter", "reduce_scatter_"),
           "reduce-scatter check: the whole input may travel (byte limit p·N)"),
    # ring_all_reduce
    Mutant("pplab/checks/ch01_collectives/ring_all_reduce.py", "sorted(observed.items()):   # every rank: a slip may show on one only",
           _RANK0 + "   # every rank: a slip may show on one only", CHK("ring_all_reduce", "all_reduce_"),
           "ring all-reduce check: rank 0's tensor only"),
    Mutant("pplab/checks/ch01_collectives/ring_checks.py", "else {\"atol\": 1e-5, \"rtol\": 1e-5}",
           "else {\"atol\": 1e-3, \"rtol\": 1e-3}", CHK("ring_all_reduce", "all_reduce_"),
           "ring all-reduce check: float32 tolerance widened 100x"),
    Mutant("pplab/checks/ch01_collectives/ring_checks.py", "trials = {p: _trials(seed, p, cases) for p in (2, 3, 4)}",
           "trials = {p: _trials(seed, p, cases) for p in (2, 4)}", CHK("ring_all_reduce", "all_reduce_"),
           "ring all-reduce check: world size 3 dropped"),
    # predict_time: (a) and (b) do not apply (see above); its tolerance
    Mutant("pplab/checks/ch01_collectives/predict_time.py", "if math.isclose(got, expected, rel_tol=1e-6, abs_tol=0.0):",
           "if math.isclose(got, expected, rel_tol=1e-4, abs_tol=0.0):", CHK("predict_time", "predict_"),
           "predict_time: the prediction's tolerance widened 100x"),

    # data_parallel.py: ddp_buckets
    Mutant("pplab/checks/ch02_data_parallel/ddp_buckets.py", "for rank, seen in sorted(observed.items()):",
           "for rank, seen in sorted(observed.items())[:1]:", CHK("ddp_buckets", "ddp_"),
           "DDP check: rank 0 only"),
    Mutant("pplab/checks/ch02_data_parallel/ddp_buckets.py", "diff = first_difference(grad, ref.grad, atol=1e-5, rtol=1e-4)",
           "diff = first_difference(grad, ref.grad, atol=1e-3, rtol=1e-2)", CHK("ddp_buckets", "ddp_"),
           "DDP check: gradient tolerance widened 100x"),
    # topk_error_feedback: no ranks (see above)
    Mutant("pplab/checks/ch02_data_parallel/topk_error_feedback.py", "diff = first_difference(sent_so_far + new_memory, grads_so_far, atol=1e-5, rtol=1e-5)",
           "diff = first_difference(sent_so_far + new_memory, grads_so_far, atol=1e-3, rtol=1e-3)",
           CHK("topk_error_feedback", "topk_"), "top-k check: sent + memory tolerance widened 100x"),
    Mutant("pplab/checks/ch02_data_parallel/topk_error_feedback.py", "diff = first_difference(values, a[indices], atol=1e-6, rtol=1e-6)",
           "diff = first_difference(values, a[indices], atol=1e-4, rtol=1e-4)",
           CHK("topk_error_feedback", "topk_"), "top-k check: values tolerance widened 100x"),

    # ddp_from_scratch.py
    Mutant("pplab/checks/ch02_data_parallel/ddp_from_scratch.py", "configs = {p: _configs(seed, p) for p in (2, 3, 4)}",
           "configs = {p: _configs(seed, p) for p in (2, 4)}", CHK("ddp_from_scratch", "ddp_ or bucketed_"),
           "DDP from scratch check: world size 3 dropped"),
    Mutant("pplab/checks/ch02_data_parallel/ddp_from_scratch.py", "for rank, seen in sorted(observed.items()):",
           "for rank, seen in sorted(observed.items())[:1]:", CHK("ddp_from_scratch", "ddp_ or bucketed_"),
           "DDP from scratch check: rank 0 only"),
    Mutant("pplab/checks/ch02_data_parallel/ddp_from_scratch.py", "_ATOL, _RTOL = 1e-12, 1e-9", "_ATOL, _RTOL = 1e-10, 1e-7",
           CHK("ddp_from_scratch", "ddp_ or bucketed_"), "DDP from scratch check: gradient tolerance widened 100x"),
    Mutant("pplab/checks/ch02_data_parallel/ddp_from_scratch.py", "groups = [[0, 2], [1, 3]] if p == 4 and not small_cap else",
           "groups = [[0, 2], [1, 3]] if False else", CHK("ddp_from_scratch", "ddp_ or bucketed_"),
           "DDP from scratch check: never on two data-parallel groups"),

    # mixed_precision.py: loss_scaler
    Mutant("pplab/checks/ch09_memory/loss_scaler.py", "    for p in (2, 3):", "    for p in (2,):",
           CHK("loss_scaler", "Scaler or Decides or Unscale or Grows or Rank0 or Skips"),
           "loss scaler check: world size 3 dropped"),
    Mutant("pplab/checks/ch09_memory/loss_scaler.py", "bad = [r for r in ranks if not _close(observed[r][\"shards\"][s], want_shards[s][r])]",
           "bad = [r for r in ranks[:1] if not _close(observed[r][\"shards\"][s], want_shards[s][r])]",
           CHK("loss_scaler", "Scaler or Decides or Unscale or Grows or Rank0 or Skips"),
           "loss scaler check: rank 0's shard only"),
    Mutant("pplab/checks/ch09_memory/loss_scaler.py", "RTOL = 1e-6", "RTOL = 1e-4",
           CHK("loss_scaler", "Scaler or Decides or Unscale or Grows or Rank0 or Skips"),
           "loss scaler check: shard tolerance widened 100x"),

    # grad_clip.py: clip_sharded
    Mutant("pplab/checks/ch09_memory/clip_sharded.py", "TRIALS = [(3, 2, 2.0, True), (2, 3, 2.0, False),",
           "TRIALS = [(3, 2, 2.0, True), (6, 1, 2.0, False),", _CLIP,
           "clip check: the tp=2 × dp=3 mesh dropped"),
    Mutant("pplab/checks/ch09_memory/clip_sharded.py", "for rank in sorted(observed):                  # every rank returns the norm",
           "for rank in sorted(observed)[:1]:                  # every rank returns the norm", _CLIP,
           "clip check: rank 0's norm only"),
    Mutant("pplab/checks/ch09_memory/clip_sharded.py", "for rank in sorted(observed):                  # every rank scales its own shards",
           "for rank in sorted(observed)[:1]:                  # every rank scales its own shards",
           _CLIP, "clip check: rank 0's shards only"),
    Mutant("pplab/checks/ch09_memory/clip_sharded.py", "RTOL = 1e-9", "RTOL = 1e-7", _CLIP,
           "clip check: tolerance widened 100x"),
]

# pplab/grad_clip.py with ZeRO-3 (issue 38's library bullet): group=None means every rank, whose
# shards' norms must be summed; a parameter FSDP keeps whole (replicate=) is counted on one dp rank.
MUTANTS += [
    Mutant("pplab/grad_clip.py", "zero_group = _world_if_none(m.group)", "zero_group = m.group",
           T("test_grad_clip", k="zero3"), "ZeRO-3 norm with group=None: the shards' norms never summed"),
    Mutant("pplab/grad_clip.py", "first_dp_rank = zero_group is None or comm.rank(zero_group) == 0",
           "first_dp_rank = True", T("test_grad_clip", k="zero3"),
           "ZeRO-3 norm: a replicated (whole) parameter counted once per dp rank"),
]
