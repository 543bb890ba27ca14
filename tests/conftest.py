"""Shared pytest plumbing: which of a module's parametrized cases this run selected.

A module that computes all its cases in one worker group (tests/distributed.py) asks :func:`selected` which of
them the run's ``-m`` / ``-k`` selection kept, and computes only those: ``bash run.sh test -m "not slow"``
(the edit-test loop, README) then pays for the rows it runs, not for the module's whole grid.
"""

from __future__ import annotations

import pytest


def selected(request: pytest.FixtureRequest, argname: str) -> list:
    """The values of the parametrize argument ``argname`` of the selected tests of the requesting module, in
    collection order, without repeats."""
    seen = []
    for item in request.session.items:
        if item.module is not request.module:
            continue
        params = getattr(getattr(item, "callspec", None), "params", {})
        if argname in params and params[argname] not in seen:
            seen.append(params[argname])
    return seen


def module_selected(request: pytest.FixtureRequest, name: str) -> bool:
    """Whether the run selected the test function ``name`` of the requesting module (any of its cases)."""
    return any(item.module is request.module and item.originalname == name for item in request.session.items)


# The edit-test loop (`bash run.sh test -m "not slow"`, README): these tests each cost ~10 s or more on 2 cores
# (whole recipe runs, launcher subprocesses, compile fixtures, multi-process benchmarks, memory measurements), so
# the loop leaves them to the full suite. Every test module keeps tests in the loop; parametrized grids mark
# their own rows (tests/test_library.py, tests/test_masks*.py) and compute only the selected ones.
SLOW = {
    "test_accelerate.py": ["test_accelerate_launch_runs_the_recipe"],
    "test_benchmarks.py": ["test_scale_memory_benchmark_measures_a_tiny_run", "test_uneven_overhead_benchmark",
                           "test_gpu_check_cpu_runs_every_cpu_step", "test_ring_memory_benchmark",
                           "test_dynamic_cp_benchmark", "test_scaling_benchmark_rows", "test_fsdp_memory_benchmark",
                           "test_gather_rule_benchmark", "test_max_sequence_brackets", "test_compile_speed_benchmark",
                           "test_diffusers_head_to_head"],
    "test_configs.py": ["test_every_consumer_combination", "test_consumer_preset_fits_its_architecture",
                        "test_consumer_preset_dry_run", "test_consumer_preset_is_the_planners_choice"],
    "test_compile.py": ["test_compiled_fullgraph_equals_eager", "test_lightning_", "test_accelerate_fsdp_compiles",
                        "test_lookups_under_compile"],
    "test_dynamic_cp.py": ["test_a_dynamic_recipe_run_resumed_mid_epoch"],
    "test_faults.py": ["test_faults_end_cleanly_and_resume"],
    "test_launchers.py": ["test_a_failing_rank_stops_every_process", "test_two_simulated_nodes"],
    "test_library.py": ["test_checker_passes_a_library_model_and_prints_its_table"],
    "test_planner.py": ["test_batch_size_auto_trains", "test_recipe_dry_run_plans_on_cpu"],
    "test_recipe_data.py": ["test_flux_trains_two_image_buckets", "test_wan_trains_two_video_buckets"],
    "test_recipe_hunyuan.py": ["test_the_tiny_hunyuan_recipe", "test_resume_from_a_light", "test_one_process_trains",
                               "test_the_exported_lora", "test_the_comfyui_layout", "test_the_tiny_vae"],
    "test_recipe_flux3.py": ["test_edit_pairs_of_two_aspect_ratios", "test_the_exported_loras", "test_one_process",
                             "test_a_cp_rendered_sample"],
    "test_recipe_kontext.py": ["test_resume_from_a_mid_run_checkpoint", "test_an_edit_rendered_with_cp"],
    "test_recipe_sample_images.py": ["test_the_dry_run_prints"],
    "test_recipe_qwenimage.py": ["test_the_tiny_qwenimage_recipe", "test_resume_from_a_light",
                                 "test_one_process_trains_like", "test_the_exported_lora", "test_the_tiny_vae"],
    "test_recipe_qwenimage_edit.py": ["test_pairs_with_two_references", "test_resume_from_a_light",
                                      "test_one_process_trains_like", "test_the_exported_lora",
                                      "test_an_edit_rendered_with_cp"],
    "test_recipe_qwenimage21.py": ["test_the_tiny_qwenimage21_recipe", "test_resume_from_a_light",
                                   "test_one_process_trains_like", "test_the_exported_lora"],
    "test_recipe_skyreels_df.py": ["test_the_tiny_skyreels_df_recipe", "test_resume_from_a_light", "test_a_cp_rendered",
                                   "test_the_exported_lora", "test_clips_that_do_not_fill"],
    "test_recipe_training.py": ["test_a_cp_rendered_sample", "test_samples_at_steps", "test_fsdp_resume",
                                "test_checkpoints_that_cannot_resume", "test_resume_from_last",
                                "test_the_comfyui_export_converts_back", "test_the_step0_sample"],
    "test_recipe_wan_i2v.py": ["test_clips_of_two_aspect_ratios"],
    "test_recipes.py": ["test_the_embedded_default", "test_cp1_and_cp2", "test_full_fine_tuning"],
    "test_strategy.py": ["test_a_failing_rank_raises_through_lightnings_launcher", "test_lightnings_spawn_launcher",
                         "test_fabric_strategy_matches_one_process"],
}  # fmt: skip


def pytest_collection_modifyitems(config, items):
    for item in items:
        names = SLOW.get(item.path.name, ())
        if any(item.originalname.startswith(name) for name in names):
            item.add_marker(pytest.mark.slow)
