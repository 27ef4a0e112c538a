"""Which chapter each test belongs to: `make test CH=04` runs chapter 4's library tests, notebooks
and exercises (pytest -m ch04).

Notebooks (notebooks/, solutions/) belong to the chapter their name starts with (`04b_...` is
chapter 04, `appendix_a_...` is A). A test file names its chapters here, one line each: a new test
file adds its line (tests/test_packaging.py fails on a test file missing from the table). "course"
is what belongs to no one chapter: the graders, the set-up, the pages that cover every chapter.
A test run for one exercise (a parameter naming its id: `check("bubble_fraction", ...)`) belongs to
that exercise's chapter, whatever its file: read from solutions/, where NN_x.ipynb checks its id.
"""
from __future__ import annotations

import re
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

TEST_FILES = {
    "test_architecture": ["course"],
    "test_busy_load": ["course"],
    "test_checks": ["course"],
    "test_checks_capstone_fsdp": ["06"],
    "test_checks_capstone_hybrid": ["07"],
    "test_checks_capstone_ring": ["05"],
    "test_checks_capstone_sp": ["05"],
    "test_checks_capstone_zero": ["06"],
    "test_checks_chapters": ["01", "02", "04"],
    "test_checks_expert_parallel": ["08"],
    "test_checks_hard": ["02", "04"],
    "test_checks_near_miss": ["01", "02", "09"],
    "test_checks_near_miss_pipelines_and_layouts": ["04", "07", "10"],
    "test_checks_sealed": ["course"],
    "test_checks_sequence_parallel": ["05"],
    "test_checks_template": ["course"],
    "test_checks_tensor_parallel": ["03"],
    "test_checks_unreachable": ["course"],
    "test_checks_zero": ["06"],
    "test_checks_zero_near": ["06", "10"],
    "test_claims_page": ["course"],
    "test_cluster": ["10"],
    "test_collectives": ["01"],
    "test_compression": ["02"],
    "test_costfit": ["01", "A"],
    "test_costmodel": ["01"],
    "test_data_parallel": ["02"],
    "test_experts_at_scale": ["11"],
    "test_expert_parallel": ["08"],
    "test_explorer_in_jupyterlab": ["04"],
    "test_exercise_names": ["course"],
    "test_flops": ["10"],
    "test_fp8": ["11"],
    "test_fsdp_like_cs336": ["06"],
    "test_grad_clip": ["09"],
    "test_grading": ["course"],
    "test_grading_reading": ["course"],
    "test_grading_units": ["course"],
    "test_grading_formats": ["course"],
    "test_grading_hostile": ["course"],
    "test_hardware": ["10"],
    "test_hybrid": ["07"],
    "test_layout_generators": ["10"],
    "test_launch": ["00"],
    "test_launch_errors": ["00"],
    "test_launch_hostile": ["00"],
    "test_lone_notebook": ["00", "course"],
    "test_long_context": ["11"],
    "test_memory": ["09"],
    "test_mesh": ["07"],
    "test_mixed_precision": ["09"],
    "test_noise_scale": ["02"],
    "test_notebook_predictions": ["course"],
    "test_offload": ["09"],
    "test_overlap": ["02"],
    "test_overlap_measured": ["11"],
    "test_stand_in": ["02", "04"],
    "test_packaging": ["course"],
    "test_parameter_server": ["02"],
    "test_perfetto": ["10"],
    "test_perfetto_in_chromium": ["04", "10"],
    "test_pipeline_asynchronous": ["04"],
    "test_pipeline_bidirectional": ["04"],
    "test_pipeline_dependencies": ["04"],
    "test_pipeline_executor": ["04"],
    "test_pipeline_explorer": ["04"],
    "test_pipeline_looped": ["04"],
    "test_pipeline_partition": ["04"],
    "test_pipeline_schedules": ["04"],
    "test_pipeline_torch_csv": ["04"],
    "test_pipeline_simulate": ["04"],
    "test_placement": ["10"],
    "test_planner": ["07"],
    "test_planner_at_scale": ["10"],
    "test_recompute": ["09"],
    "test_rng": ["09"],
    "test_sandbox": ["course"],
    "test_sequence_parallel": ["05"],
    "test_swimlane": ["00"],
    "test_tensor_parallel": ["03"],
    "test_tensor_parallel_25d_3d": ["03"],
    "test_tensor_parallel_2d": ["03"],
    "test_tensor_parallel_cnn": ["03"],
    "test_tensor_parallel_transformer": ["03"],
    "test_tensor_parallel_wire": ["03"],
    "test_trace": ["00"],
    "test_zero": ["06"],
    "test_zero_plus_plus": ["10"],
}

CHAPTERS = [f"{n:02d}" for n in range(12)] + ["A", "course"]


@lru_cache(maxsize=1)
def exercise_chapters() -> dict[str, str]:
    """{exercise id: chapter}, from the pplab.check("id", ...) call of each solution notebook."""
    found = {}
    for path in sorted((ROOT / "solutions").glob("*.ipynb")):
        for exercise in re.findall(r'check\(\\"(\w+)\\"', path.read_text()):
            found[exercise] = chapters_of(path)[0]
    return found


@lru_cache(maxsize=None)
def _quoted(path: Path) -> frozenset:
    return frozenset(re.findall(r"[\"'](\w+)[\"']", path.read_text()))


def exercises_named(function, path: Path, params: dict | None = None) -> set[str]:
    """The exercise ids a test of the checkers is about: its parameter that names one, or the ids
    its function's body names in quotes, or else the one its file names (a file about one capstone)."""
    import inspect
    ids = set(exercise_chapters())
    named = {v for v in (params or {}).values() if isinstance(v, str) and v in ids}
    if named:
        return named
    try:
        body = inspect.getsource(function).partition("def ")[2] if function else ""
        named = set(re.findall(r"[\"'](\w+)[\"']", body)) & ids
    except (OSError, TypeError):
        named = set()
    if not named:
        in_file = _quoted(path) & ids
        named = in_file if len(in_file) == 1 else set()
    return named


def chapters_of(path: Path, params: dict | None = None) -> list[str]:
    """The chapters of the test file or notebook at `path` ([] for one the table does not know);
    `params`: a test's parameters, where one may name an exercise."""
    for value in (params or {}).values():
        if isinstance(value, str) and value in exercise_chapters():
            return [exercise_chapters()[value]]
    if path.suffix == ".ipynb":
        if path.stem.startswith("appendix_a"):
            return ["A"]
        m = re.match(r"(\d\d)", path.stem)
        return [m[1]] if m else []
    return TEST_FILES.get(path.stem, [])
