# The checkers of tensor, sequence and expert parallelism and of recomputation, loosened the three
# ways a near miss slips through (issue 38): a world size dropped (the one a near-miss answer needs:
# 3, where halves and powers of two stop working), only rank 0 compared, the tolerance widened 100x;
# and the blind spots of each concept. Each must be caught by a registered wrong answer's assertion.
_FG = CHK("f_g", "f_g_ or f_backward or g_backward or f_and_g")
_ROW, _CE = CHK("row_parallel_linear", "row_"), CHK("vocab_parallel_ce", "ce_")
_L3D = CHK("linear_3d", "l3d_ or forward_not or weight_grad_not or reduce_scatter_along or off_on_rank_5 or "
                        "gathers_everything")
_OSM = CHK("online_softmax_merge", "blockwise_ or attention_all")
_A2A, _STEP = CHK("ulysses_all_to_all", "a2a_"), CHK("ring_attention_step", "ring_step_")
_MSP, _RA = CHK("megatron_sp_block", "sp_"), CHK("ring_attention", "ring_ and not ring_step_")
_DISP = CHK("moe_dispatch", "dispatch_")
_MB = CHK("moe_bytes", "traffic_ and not (traffic_counts or traffic_dp or traffic_column or traffic_as_text)")
_CKPT = CHK("checkpointed_block", "recomputes_ or forgets_the or keeps_the or uses_the or ckpt_")

MUTANTS += [
    # f and g
    Mutant("pplab/checks/ch03_tensor_parallel/f_g.py", "trials = _trials(seed, (2, 3))                  # f and g", "trials = _trials(seed, (2,))  # f and g",
           _FG, "f_g check: world size 3 never tried"),
    Mutant("pplab/checks/ch03_tensor_parallel/f_g.py", "for r, res in enumerate(results):           # every rank of f and g",
           "for r, res in enumerate(results[:1]):", _FG, "f_g check: rank 0 only"),
    Mutant("pplab/checks/ch03_tensor_parallel/tp_trials.py", "TOL = 1e-10", "TOL = 1e-8", _FG, "f_g check: tolerance 1e-10 widened 100x"),
    # the row-parallel layer
    Mutant("pplab/checks/ch03_tensor_parallel/row_parallel_linear.py", "trials = _trials(seed, (2, 3))                  # the row layer",
           "trials = _trials(seed, (2,))  # the row layer", _ROW, "row-parallel check: world size 3 never tried"),
    Mutant("pplab/checks/ch03_tensor_parallel/row_parallel_linear.py", "for g_rank, res in enumerate(results):  # then the values, on every rank",
           "for g_rank, res in enumerate(results[:1]):", _ROW, "row-parallel check: values on rank 0 only"),
    Mutant("pplab/checks/ch03_tensor_parallel/tp_trials.py", "TOL = 1e-10", "TOL = 1e-8", _ROW, "row-parallel check: tolerance 1e-10 widened 100x"),
    # the vocabulary-parallel cross-entropy
    Mutant("pplab/checks/ch03_tensor_parallel/vocab_parallel_ce.py", "for p, big in ((2, False), (3, False), (3, True))", "for p, big in ((2, False), (2, False), (2, True))",
           _CE, "vocab-parallel CE check: world size 3 never tried"),
    Mutant("pplab/checks/ch03_tensor_parallel/vocab_parallel_ce.py", "for r, res in enumerate(results):           # every rank of the vocabulary split",
           "for r, res in enumerate(results[:1]):", _CE, "vocab-parallel CE check: rank 0 only"),
    Mutant("pplab/checks/ch03_tensor_parallel/tp_trials.py", "TOL = 1e-10", "TOL = 1e-8", _CE, "vocab-parallel CE check: tolerance 1e-10 widened 100x"),
    Mutant("pplab/checks/ch03_tensor_parallel/vocab_parallel_ce.py", "if numel > 3 * n:", "if numel > 3 * n * 100:", _CE,
           "vocab-parallel CE check: a collective of [tokens, vocab/p] accepted if it is not a gather"),
    # linear_traffic: none of the three applies. It runs no ranks (no world size, no rank 0), and its
    # numbers are exact integer counts: abs_tol=0.5 only absorbs a float answer's rounding, and any
    # count off by one is caught (rel_tol 1e-9 of at most ~1e6 is under 0.5, and would stay so x100).
    # 3D: one world (the 2x2x2 cube), so no world size to drop
    Mutant("pplab/checks/ch03_tensor_parallel/linear_3d.py", "for rank in sorted(observed):                   # every rank's values",
           "for rank in sorted(observed)[:1]:", _L3D, "3D check: values on rank 0 only"),
    Mutant("pplab/checks/ch03_tensor_parallel/linear_3d.py", "for rank in sorted(observed)]                   # every rank's bytes",
           "for rank in sorted(observed)[:1]]", _L3D, "3D check: bytes on rank 0 only"),
    Mutant("pplab/checks/ch03_tensor_parallel/linear_3d.py", "TOL = 1e-10", "TOL = 1e-8", _L3D, "3D check: tolerance 1e-10 widened 100x"),
    Mutant("pplab/checks/ch03_tensor_parallel/linear_3d.py", "return 2 * (g - 1) / g * nbytes", "return (g - 1) / g * nbytes", _L3D,
           "3D check: an all-reduce counted at a reduce-scatter's bytes"),
    # blockwise attention: one process (no ranks, no world size)
    Mutant("pplab/checks/ch05_sequence_parallel/tolerance.py", "TOL = 1e-9", "TOL = 1e-7", _OSM, "online-softmax check: tolerance 1e-9 widened 100x"),
    # Ulysses (exact labels: no tolerance)
    Mutant("pplab/checks/ch05_sequence_parallel/ulysses_all_to_all.py", "for p in (2, 3, 4):                             # Ulysses", "for p in (2, 4):  # Ulysses", _A2A,
           "Ulysses check: world size 3 never tried"),
    Mutant("pplab/checks/ch05_sequence_parallel/ulysses_all_to_all.py", "for rank, got in sorted(observed.items()):", "for rank, got in sorted(observed.items())[:1]:", _A2A,
           "Ulysses check: rank 0 only"),
    # one ring step
    Mutant("pplab/checks/ch05_sequence_parallel/ring_attention_step.py", "for p in (2, 3, 4):                             # rings", "for p in (2,):  # rings", _STEP,
           "ring-step check: two ranks only (a ring's left and right neighbour are one rank)"),
    Mutant("pplab/checks/ch05_sequence_parallel/ring_attention_step.py", "for rank, steps in sorted(observed.items()):", "for rank, steps in sorted(observed.items())[:1]:",
           _STEP, "ring-step check: rank 0 only"),
    Mutant("pplab/checks/ch05_sequence_parallel/tolerance.py", "TOL = 1e-9", "TOL = 1e-7", _STEP, "ring-step check: tolerance 1e-9 widened 100x"),
    # the Megatron-SP capstone
    Mutant("pplab/checks/ch05_sequence_parallel/megatron_sp_block.py", "for t, members in ((2, None), (3, None), (2, [[0, 2], [1, 3]])):",
           "for t, members in ((2, None), (2, [[0, 2], [1, 3]])):", _MSP, "Megatron-SP check: t = 3 never tried"),
    Mutant("pplab/checks/ch05_sequence_parallel/megatron_sp_block.py", "for rank in range(world):                           # every rank's parts",
           "for rank in range(1):", _MSP, "Megatron-SP check: rank 0 only"),
    Mutant("pplab/checks/ch05_sequence_parallel/megatron_sp_block.py", "ffn = t * rng.randint(2, 3) + (1 if t > 2 else rng.randint(0, 1))",
           "ffn = t * rng.randint(2, 3) + (2 if t > 2 else rng.randint(0, 1))", _MSP,
           "Megatron-SP check: ffn = 2 (mod 3) on 3 ranks, where chunks of ceil(ffn/t) split as tensor_split does"),
    Mutant("pplab/checks/ch05_sequence_parallel/megatron_sp_block.py", "RTOL, ATOL = 1e-4, 1e-4", "RTOL, ATOL = 1e-2, 1e-2", _MSP,
           "Megatron-SP check: float32 tolerance widened 100x"),
    # the ring-attention capstone
    Mutant("pplab/checks/ch05_sequence_parallel/ring_attention.py", "for p in (2, 3)]", "for p in (2,)]", _RA, "ring-attention check: p = 3 never tried"),
    Mutant("pplab/checks/ch05_sequence_parallel/ring_attention.py", "    for rank in range(p):", "    for rank in range(1):", _RA, "ring-attention check: rank 0 only"),
    Mutant("pplab/checks/ch05_sequence_parallel/ring_attention.py", "TOL = 1e-9", "TOL = 1e-7", _RA, "ring-attention check: tolerance 1e-9 widened 100x"),
    # the MoE dispatch (exact integers and labelled rows: no tolerance)
    Mutant("pplab/checks/ch08_expert_parallel/moe_dispatch.py", "for p in (2, 3, 4):                             # dispatch", "for p in (2,):  # dispatch", _DISP,
           "MoE dispatch check: two ranks only"),
    # (the rows received are a function of send_counts and order, checked exactly on every rank: looking at
    # rank 0's rows only loosens nothing, so that loosening is not listed)
    Mutant("pplab/checks/ch08_expert_parallel/moe_dispatch.py", "for rank in sorted(observed):                   # every rank's answer",
           "for rank in sorted(observed)[:1]:  # every rank's answer", _DISP, "MoE dispatch check: answers of rank 0 only"),
    # the MoE bytes (exact integers: the 1e-6 only absorbs a float's rounding)
    Mutant("pplab/checks/ch08_expert_parallel/moe_bytes.py", "sizes = (2, 3, 4)                               # moe_bytes", "sizes = (2,)  # moe_bytes", _MB,
           "MoE bytes check: two ranks only"),
    Mutant("pplab/checks/ch08_expert_parallel/moe_bytes.py", "for r in range(p):                      # every rank's three numbers", "for r in range(1):", _MB,
           "MoE bytes check: rank 0 only"),
    Mutant("pplab/checks/ch08_expert_parallel/moe_bytes.py", "\"element_size\": rng.choice([2, 8] if capacity_factor else [2, 4, 8])}",
           "\"element_size\": 4}", _MB, "MoE bytes check: float32 rows only (the bytes of an element never vary)"),
    # selective recomputation (bit-exact: no tolerance to widen; its budget is the tolerance)
    Mutant("pplab/checks/ch09_memory/checkpointed_block.py", "    for t in (2, 3):", "    for t in (2,):", _CKPT, "recompute check: t = 3 never tried"),
    Mutant("pplab/checks/ch09_memory/checkpointed_block.py", "            for rank in range(p):", "            for rank in range(1):", _CKPT,
           "recompute check: rank 0 only"),
    Mutant("pplab/checks/ch09_memory/checkpointed_block.py", "if got <= budget:", "if got <= budget * 1.1:", _CKPT, "recompute check: 10% over the budget accepted"),
    Mutant("pplab/checks/ch09_memory/checkpointed_block.py", "extra, limit = mine[\"flops\"] - plain[\"flops\"], 4 * b * s * s * h // t",
           "extra, limit = mine[\"flops\"] - plain[\"flops\"], 8 * b * s * s * h // t", _CKPT,
           "recompute check: twice attention's products recomputed accepted"),
]
