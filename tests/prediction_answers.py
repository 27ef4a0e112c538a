"""Worked answers to the chapters' 'predict, then run' questions.

The notebooks hold `my_x = None  # your prediction: ...`: a learner running them top to bottom
predicts for real. Under the tests (nbval), tests/conftest.py writes these answers into those
lines before the cell runs and sets PPLAB_PREDICTIONS_MUST_MATCH=1, so each answer must match
what the notebook measures (within the tolerance its compare_* call states) or the run fails.
Each answer is an expression in the notebook's own names, as a learner would write it.
"""
import re

from pplab.checks.predictions import PREDICTION_LINE

ANSWERS = {
    "00_start_here": {
        "my_broadcast_bytes": "(p - 1) * n * 4",
        "my_wait": "3 * unit",
    },
    "01_collectives": {
        "my_prediction": "2 * (p - 1) * (4 * n) // p",
        "my_fastest_for_resnet": "'halving_doubling'",
    },
    "02_data_parallel": {
        "my_ring_bytes_sent": "2 * (3 - 1) / 3 * 12_000 * 8",
        "my_buckets": "8",
    },
    "03_tensor_parallel": {
        "my_block_bytes": "4 * 2 * (p - 1) / p * (s * b * h) * 4",
        "my_weight_bytes": "4 * ((4 * h * h + 2 * h * ffn + 3 * h + ffn) / p + 6 * h)",
    },
    "03b_tensor_parallel_2_5d_3d": {
        "my_3d_bytes": "2 * (2 - 1) * (B * C_IN + C_IN * C_OUT + B * C_OUT) / 2 ** 3 * 8",
        "my_25d_weight_bytes": "C_IN * C_OUT / 2 ** 2 * 8",
    },
    "04_pipeline": {
        "my_gpipe_peak": "m",
        "my_1f1b_peak": "p - 1",
        "my_bubble": "(p - 1) / m",
    },
    "04b_schedules_and_torch": {
        "my_bfs_bubble": "(p - 1) / (v * m)",
        "my_bfs_peak": "m",
        "my_zb_makespan": "m * (t_f + t_b) + (p - 1) * (t_f + t_b - 2 * t_w) / v",
    },
    "04c_bidirectional_pipelines": {
        "my_chimera_idle": "p - 2",
        "my_dualpipe_peak": "PP + 1",
    },
    "04d_asynchronous_pipelines": {
        "my_stage0_staleness": "p - 1",
        "my_2bw_versions": "2",
    },
    "05_sequence_parallel": {
        "my_kv_bytes": "(p - 1) * 2 * (B1 * H1 * (S1 // p) * D1 * 4)",
        "my_ulysses_bytes": "4 * (p - 1) / p * share",
    },
    "06_zero": {
        "my_stage2_bytes": "4 * BIG + (4 + 8) * BIG / N",
        "my_stage3_sent": "3 * (N - 1) / N * model_bytes",
        "my_peak": "layer_bytes * 6 / 3 + 2 * layer_bytes",
    },
    "07_hybrid": {
        "my_tp_all_reduces": "12",
        "my_send_bytes": "16 * 1 * 32 * 8",
    },
    "09b_mixed_precision": {
        "my_zero_fp32_bytes": "(N - 1) / N * PSI * (4 + 2)",
        "my_skipping_ranks": "3",
    },
    "08_expert_parallel": {
        "my_prediction": "3 * 2 * 8 + 2 * 64 * 2 * 3 / 4 * 16 * 4",
        "my_prediction_received": "3 * 24 * 8 * 4 + 8 * 8 * 4 + 3 * 8",
    },
    "09d_offload": {
        "my_read_bytes": "8 * PSI / N",
        "my_mixed_bytes": "12 * PSI / N",
        "my_param_read_bytes": "20 * PSI / N",
    },
    "10a_compute_and_mfu": {
        "my_backward_ratio": "2",
        "my_hfu_over_mfu": "4 / 3",
        "my_h100_ridge": "989.5e12 / 3.35e12",
    },
    "09c_clipping_and_rng": {
        "my_every_rank_sq": "total_sq + (t - 1) * replicated_sq",
        "my_clip_bytes": "3 * 8",
    },
    "09a_recomputation": {
        "my_full_bytes": "4 * 2 * s * b * h",
        "my_full_flops_ratio": "4 / 3",
    },
    "10_at_scale": {
        "my_in_flight": "4 + (4 - 1) / 2",
        "my_bubble_16k": "(16 - 1) / (8 * 16)",
    },
    "10b_two_tier_networks": {
        "my_flat_cross_bytes": "N_NODES * 2 * (P - 1) / P * NBYTES",
        "my_hsdp_cross_bytes": "P * 2 * (N_NODES - 1) / N_NODES * (90 / R) * 8",
    },
    "10d_placing_layouts": {
        "my_tp_cross_bytes": "P * ((4 * cfg.layers + 2) * act + 3 * (BATCH // 2) * cfg.seq * 8)",
        "my_best_order": "('pp', 'dp', 'tp')",
        "my_faster": "'inside'",
    },
    "10c_zero_plus_plus": {
        "my_zero3_cross_bytes": "3 * N_NODES * (P - 1) * sum(n // P for n in PADDED) * 2",
        "my_ratio": "sum(36 * (n // P) for n in PADDED) / sum(8 * (n // P) + 40 * math.ceil(n / P / BLOCK) for n in PADDED)",
    },
    "11a_overlap_measured": {
        "my_rank2_bytes": "(3 + 4 + 5 - 3) * 16 * 4",      # every chunk but rank 0's (its next rank's)
        "my_sequential_hidden": "0.0",                     # nothing runs between post and wait
    },
    "11b_fp8": {
        "my_largest_gap": "0.0015",       # e4m3 has 3 mantissa bits: a step of 1/16 relative, averaged away over a matmul
        "my_fp8_gather_bytes": "2 * sum(s + 4 * math.ceil(s / 128) for s in SHARDS)",
    },
    "11c_long_context": {
        "my_busiest_rank": "3",
        "my_allgather_bytes": "2 * math.ceil(S / 3) * 2 * ROW",
    },
    "11d_experts_at_scale": {
        "my_nodes_reached": "2 * (1 - math.comb(8, 4) / math.comb(16, 4))",
        "my_cross_bytes": "2 * ref[1][2] * (2 * 16 + 8) * 8 + 4 * (2 - 1) * 8",
    },
}


def fill_in(notebook: str, source: str) -> str:
    """`source` with every empty prediction line of `notebook` given its worked answer."""
    def answer(m):
        if m["value"] != "None":
            return m[0]
        try:
            worked = ANSWERS[notebook][m["name"]]
        except KeyError:
            raise KeyError(f"{notebook}: no worked answer for {m['name']} in tests/prediction_answers.py") from None
        return re.sub(r"=\s*None", f"= {worked}", m[0], count=1)
    return PREDICTION_LINE.sub(answer, source)
