# The loosenings of chapter 6's and 10c's checkers (issue 38): for each, a world size dropped, rank 0
# only, the tolerance widened 100 times, and the blind spots. Each is caught by a near-miss wrong
# answer in tests/wrong_solutions_ch06_zero.py, wrong_solutions_ch06_sharded_optimizer.py,
# wrong_solutions_ch06_fsdp.py or wrong_solutions_ch10_quantised_gather.py (named after each).
# Run with tools/mutate.py's names in scope (see tools/mutants/README.md).

ZERO1, BYTES, UNIT = CHK("zero1_step", "zero1_"), CHK("zero_bytes", "state_"), CHK("stage3_unit", "linear_")
SHARDED = CHK("sharded_optimizer", "ZeroGrad or MeanBy or OnlyRank0Takes or GlobalRank")
QGATHER = CHK("quantised_gather", "exchanges or sends_int8 or dequantises or in_arrival")
FSDP = CHK("fsdp", "Prefetches or HalfFor or GradMean or OnlyRank0Steps or LastShard")

MUTANTS += [
    # zero.py, zero1_step
    Mutant("pplab/checks/ch06_zero/zero1_step.py", "for p in (2, 3):                        # 3: no power of two",
           "for p in (2,):                        # 3: no power of two", ZERO1,
           "ZeRO-1 check: 2 ranks only (zero1_gathers_by_recursive_doubling)"),
    Mutant("pplab/checks/ch06_zero/zero1_step.py", "for s, (mine, ref) in enumerate(zip(observed[rank][\"history\"], want)):",
           "for s, (mine, ref) in enumerate(zip(observed[rank][\"history\"] if rank == 0 else [], want)):", ZERO1,
           "ZeRO-1 check: rank 0's parameters only (zero1_only_rank0_copies_back, ..._recursive_doubling)"),
    Mutant("pplab/checks/ch06_zero/zero1_step.py", "diff = first_difference(mine, ref, atol=TOL, rtol=TOL)",
           "diff = first_difference(mine, ref, atol=TOL * 100, rtol=TOL * 100)", ZERO1,
           "ZeRO-1 check: tolerance 1e-9 widened 100 times (zero1_gathers_in_float32)"),
    # zero.py, zero_bytes: exact values and bytes, no tolerance to widen
    Mutant("pplab/checks/ch06_zero/zero_bytes.py", "for p in (2, 3):                        # 3: padding of 1 and of 2 zeros",
           "for p in (2,):                        # 3: padding of 1 and of 2 zeros", BYTES,
           "ZeRO bytes check: 2 ranks only (state_pads_psi_mod_n)"),
    Mutant("pplab/checks/ch06_zero/zero_bytes.py", "extra = ((p - 1 if stage == 2 else 1) - sum(math.prod(sh) for sh in shapes)) % p",
           "extra = ((p - 1) - sum(math.prod(sh) for sh in shapes)) % p", BYTES,
           "ZeRO bytes check: one zero of padding on 3 ranks, never two (state_pads_psi_mod_n)"),
    Mutant("pplab/checks/ch06_zero/zero_bytes.py", "parts.note(kind, problem, where=f\"{describe(world_size, i)}: rank {rank}\")",
           "parts.note(kind, problem if rank == 0 else None, where=f\"{describe(world_size, i)}: rank {rank}\")",
           BYTES, "ZeRO bytes check: rank 0's state only (state_rank0_shard, state_chunks_without_padding)"),
    Mutant("pplab/checks/ch06_zero/zero_bytes.py", "wrong_dtype = [d for d in got[\"dtypes\"] if d != str(_DTYPE[kind])]",
           "wrong_dtype = [d for d in got[\"dtypes\"][:1] if d != str(_DTYPE[kind])]", BYTES,
           "ZeRO bytes check: the first tensor's dtype only (state_moments_in_bf16)"),
    # zero.py, stage3_unit
    Mutant("pplab/checks/ch06_zero/stage3_unit.py", "for p in (2, 3):                        # 3: a mean written as the sum / 2",
           "for p in (2,):                        # 3: a mean written as the sum / 2", UNIT,
           "ZeRO-3 layer check: 2 ranks only (linear_halves_the_sum)"),
    Mutant("pplab/checks/ch06_zero/stage3_unit.py", "for rank, r in sorted(got.items()):", "for rank, r in sorted(got.items())[:1]:",
           UNIT, "ZeRO-3 layer check: rank 0 only (linear_keeps_piece_zero)"),
    Mutant("pplab/checks/ch06_zero/stage3_unit.py", "diff = first_difference(value, want, atol=TOL, rtol=TOL)",
           "diff = first_difference(value, want, atol=TOL * 100, rtol=TOL * 100)", UNIT,
           "ZeRO-3 layer check: gradients' tolerance widened 100 times (linear_reduces_in_float32)"),
    # zero_capstone.py, sharded_optimizer. Its world sizes are fixed by the resume (saved at 3 ranks,
    # loaded at 2): the configuration dropped is the trial in two process groups instead.
    Mutant("pplab/checks/ch06_zero/sharded_optimizer.py", "_run(rng, rng.choice([\"AdamW\", \"SGD\"]), [[0, 2], [1]])]", "*[]]",
           SHARDED, "sharded optimizer check: no process groups (GlobalRankInAGroup)"),
    Mutant("pplab/checks/ch06_zero/sharded_optimizer.py", "left = [j for j in observed[rank][\"leftover\"][s] if j in params]",
           "left = [j for j in observed[rank][\"leftover\"][s] if j in params and rank == members[0]]", SHARDED,
           "sharded optimizer check: zero_grad on the first rank only (ZeroGradEverywhereOnRank0Only)"),
    Mutant("pplab/checks/ch06_zero/sharded_optimizer.py", "diff = first_difference(got, want, atol=ATOL, rtol=RTOL)",
           "diff = first_difference(got, want, atol=ATOL, rtol=RTOL) if rank == members[0] else None", SHARDED,
           "sharded optimizer check: the first rank's steps only (OnlyRank0TakesTheUpdates)"),
    Mutant("pplab/checks/ch06_zero/sharded_optimizer.py", "ATOL, RTOL = 1e-6, 1e-5", "ATOL, RTOL = 1e-4, 1e-3", SHARDED,
           "sharded optimizer check: tolerance widened 100 times (MeanByARoundedThird)"),
    # zero_plus_plus.py, quantised_gather
    Mutant("pplab/checks/ch10_at_scale/quantised_gather.py", "for p in (2, 3, 4):", "for p in (2, 4):", QGATHER,
           "quantised gather check: 3 ranks never tried (exchanges_with_xor_partners)"),
    Mutant("pplab/checks/ch10_at_scale/quantised_gather.py", "for rank in sorted(observed):", "for rank in sorted(observed)[:1]:",
           QGATHER, "quantised gather check: rank 0's output only (in_arrival_order, exchanges_with_xor_partners)"),
    Mutant("pplab/checks/ch10_at_scale/quantised_gather.py", "bad = ~(torch.isclose(mine, want, rtol=1e-5, atol=1e-30) | tie)",
           "bad = ~(torch.isclose(mine, want, rtol=1e-3, atol=1e-30) | tie)", QGATHER,
           "quantised gather check: tolerance widened 100 times (dequantises_with_a_margin)"),
    Mutant("pplab/checks/ch10_at_scale/quantised_gather.py", "wire = n + 4 * math.ceil(n / block)",
           "wire = 2 * n + 4 * math.ceil(n / block)", QGATHER,
           "quantised gather check: 2 bytes a number accepted on the wire (sends_int8_as_float16)"),
    # fsdp_capstone.py, fsdp
    Mutant("pplab/checks/ch06_zero/fsdp.py", "for p in (2, 3):", "for p in (2,):", FSDP,
           "FSDP check: 2 ranks only, so never bf16 (HalfForAnyLowPrecision, GradMeanByARoundedThird)"),
    Mutant("pplab/checks/ch06_zero/fsdp.py", "g, w = got[r][k], want[k][piece]",
           "g, w = (got[r][k], want[k][piece]) if r == 0 else (want[k][piece], want[k][piece])", FSDP,
           "FSDP check: rank 0's gradients and updates only (OnlyRank0Steps)"),
    Mutant("pplab/checks/ch06_zero/fsdp.py", "shards = obs[r][\"shards\"]", "shards = obs[0][\"shards\"]", FSDP,
           "FSDP check: rank 0's shard layout only (LastShardOneShort)"),
    Mutant("pplab/checks/ch06_zero/fsdp_reference.py", "TOL = {torch.float32: 1e-6, torch.float16: 2**-9,",
           "TOL = {torch.float32: 1e-4, torch.float16: 2**-9,",
           FSDP, "FSDP check: fp32 gradients' tolerance widened 100 times (GradMeanByARoundedThird)"),
    Mutant("pplab/checks/ch06_zero/fsdp.py", "if at[c[\"phase\"]] >= at[f\"{step}:F{k - 1}/\"] or not c[\"async\"]:",
           "if at[c[\"phase\"]] >= at[f\"{step}:F{k - 1}/\"]:", FSDP,
           "FSDP check: a forward prefetch without async_op accepted (PrefetchesSynchronously)"),
    Mutant("pplab/checks/ch06_zero/fsdp.py", "if at[c[\"phase\"]] >= at[f\"{step}:B{k + 1}/\"] or not c[\"async\"]:",
           "if at[c[\"phase\"]] >= at[f\"{step}:B{k + 1}/\"]:", FSDP,
           "FSDP check: a backward prefetch without async_op accepted (PrefetchesBackwardSynchronously)"),
]
