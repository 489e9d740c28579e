"""Which suite a long test runs in, kept here in one place so that CI keeps to its time.

Three suites, measured on a 2-core machine (AMD EPYC, the kind CI runs on):

* the default suite (``pytest``): every module, each feature end to end at least once; under
  8 minutes;
* ``-m "slow and not extended"``: what CI runs after it (more models, devices, seeds and
  failure cases; the examples as a user runs them);
* ``-m extended``: beyond CI's time: the breadth sweep's other architectures, inductor on every
  zoo model, the long multi-process scenarios, the other parametrizations. Run it before a
  release and after changing capture, planning, the runtime or the distributed code (about 30
  minutes on 2 cores).

A test marked ``slow`` in its own file is in the second suite unless ``EXTENDED`` names it. Each
entry is a test's node id, ``*`` matching any run of characters (the cases of a parametrized test:
``test_x[*-pp]``); an entry that matches no test of a file that was collected is an error, so a
renamed test cannot silently move back into the default suite.
"""
from __future__ import annotations

import re

__all__ = ["SLOW", "EXTENDED", "tier_of"]

# from the default suite into CI's second run: a lighter case of each stays in the default suite
SLOW = (
    # one run of each combination stays: inline and under chaos, two and three devices, dp and pp
    "tests/test_parallel.py::test_pp_trains_like_eager[chaos0-tiny_gpt-2]",
    "tests/test_parallel.py::test_pp_trains_like_eager[chaos0-residual_mlp-*]",
    "tests/test_parallel.py::test_dp_trains_like_eager[chaos0-tiny_gpt-2]",
    "tests/test_parallel.py::test_dp_trains_like_eager[inline-mlp_chain-3]",
    "tests/test_parallel.py::test_dp_trains_like_eager[chaos0-residual_mlp-3]",
    "tests/test_parallel.py::test_pp_handing_on_through_the_host_trains_like_peer_and_frees_per_microbatch[residual_mlp-3-None]",
    "tests/test_parallel.py::test_pp_with_a_weight_tied_across_devices_trains_like_eager[3]",
    # Hugging Face: GPT-2 and Mixtral (refused with transformers 5.17: CI's oldest pair) stay
    "tests/test_hf_models.py::test_three_sgd_steps_match_eager_at_a_quarter_of_the_memory[bert]",
    "tests/test_hf_models.py::test_three_sgd_steps_match_eager_at_a_quarter_of_the_memory[gpt_neox]",
    "tests/test_hf_models.py::test_three_sgd_steps_match_eager_at_a_quarter_of_the_memory[vit]",
    "tests/test_hf_models.py::test_padded_batches_through_the_trainer_train_like_eager[llama]",
    "tests/integrations/test_huggingface.py::test_bf16_is_autocast_as_in_transformers_trainer",
    "tests/integrations/test_huggingface.py::test_harmonys_own_bf16_trains_llama_from_fp32_masters",
    "tests/integrations/test_huggingface.py::test_lora_over_a_bf16_base_keeps_and_moves_the_frozen_weights_in_bf16",
    "tests/test_precision.py::test_bf16_loss_curve_tracks_eager_autocast",
    "tests/frontend/test_guards.py::test_new_sequence_lengths_reuse_the_plan_that_fits",
    "tests/analysis/test_requires_grad.py::test_calls_alike_take_the_flags_every_node_run_gives[hugging face]",
    # microbatch sizes, the Trainer, the planner: the small GPT's case of each stays
    "tests/test_microbatch_sizes.py::test_adamw_steps_equal_one_microbatch_size[residual_mlp-*]",
    "tests/training/test_trainer.py::test_one_set_of_host_gradients_serves_every_step[False]",
    "tests/training/test_trainer.py::test_trainer_steps_equal_eager[residual_mlp-*-100%]",
    "tests/training/test_trainer.py::test_trainer_steps_equal_eager[mlp_chain-*-100%]",
    "tests/test_memory_cap.py::test_zoo_stays_within_the_budget_by_an_independent_count[*-1.0-*]",
    "tests/compiler/test_packing.py::test_the_bound_never_passes_the_peak_of_any_candidate[gpt_two_microbatches]",
    "tests/compiler/test_packing.py::test_the_bound_never_passes_the_peak_of_any_candidate[trainer]",
    "tests/test_parallel.py::test_*_trains_like_eager[inline-residual_mlp-3]",
    "tests/test_parallel.py::test_pp_handing_on_through_the_host_trains_like_peer_and_frees_per_microbatch[residual_mlp-2-0]",
    "tests/test_api.py::test_measured_peak_within_budget[*-1.0]",
    "tests/test_memory_cap.py::test_zoo_stays_within_the_budget_by_an_independent_count[*-0.5-*]",
    "tests/test_microbatch_sizes.py::test_one_step_equals_eager[tiny_gpt-one]",
    "tests/training/test_trainer.py::test_trainer_steps_equal_eager[residual_mlp-*-noclip-25%]",
    "tests/training/test_trainer.py::test_trainer_steps_equal_eager[mlp_chain-*-noclip-25%]",
    "tests/planner/test_module.py::test_simulation_is_consistent_with_the_planning_run[*-0.5]",
    "tests/test_errors.py::test_an_error_in_any_task_leaves_the_step_undone[sgd]",
    "tests/test_parallel.py::test_dp_trains_like_eager[chaos0-mlp_chain-3]",
    "tests/test_memory_cap.py::test_zoo_stays_within_the_budget_by_an_independent_count[*-0.25-pp]",
    "tests/test_memory_cap.py::test_zoo_stays_within_the_budget_by_an_independent_count[*-tightest-dp]",
    "tests/test_memory_cap.py::test_lstm_and_attention_stacks_at_their_tightest_budget[*-dp]",
    "tests/test_microbatch_sizes.py::test_adamw_steps_equal_one_microbatch_size[mlp_chain-dp]",
    "tests/test_microbatch_sizes.py::test_adamw_steps_equal_one_microbatch_size[mlp_chain-pp]",
    "tests/test_microbatch_sizes.py::test_one_step_equals_eager[residual_mlp-dp]",
    "tests/test_microbatch_sizes.py::test_one_step_equals_eager[residual_mlp-pp]",
    "tests/training/test_trainer_tier_masters.py::test_a_failed_write_undoes_the_step_masters_and_copies_included[False]",
    "tests/training/test_trainer_tier_masters.py::test_two_devices_hold_the_weight_copies_the_plan_counts[dp]",
    "tests/test_errors.py::test_an_error_on_one_of_several_devices_leaves_the_step_undone[dp]",
    "tests/test_calibrate.py::test_measuring_gives_every_figure_and_leaves_the_callers_random_numbers_and_grad_mode_alone",
    "tests/planner/test_memory_estimate.py::test_the_planners_peak_is_at_least_the_exact_one_and_within_25_percent[gpt]",
    "tests/passes/test_forward_groups.py::test_pipeline_groups_match_eager_and_continue_the_wrap[tiny_gpt]",
    "tests/compiler/test_packing.py::test_the_bound_counts_what_earlier_microbatches_leave[gpt]",
    "tests/test_hf_models.py::test_three_sgd_steps_match_eager_at_a_quarter_of_the_memory[llama]",
    "tests/test_calibrate.py::test_a_copys_fixed_cost_is_read_from_the_recorded_copies",
    "tests/compiler/test_packing.py::test_the_bound_is_the_peak_where_a_pack_is_a_layer[gpt]",
    "tests/test_api.py::test_training_step_matches_eager[*-0.5]",
    "tests/test_api.py::test_measured_peak_within_budget[*-0.5]",
    "tests/test_parallel.py::test_pp_trains_like_eager[*-mlp_chain-3]",
    # PyTorch's own modules: MultiheadAttention, LSTM, the norms, convolutions and pools stay
    "tests/test_module_db.py::test_first_sample_trains_like_eager[nn.Transformer*]",
    "tests/test_module_db.py::test_first_sample_trains_like_eager[nn.GRU]",
    "tests/test_module_db.py::test_first_sample_trains_like_eager[nn.RNN]",
    "tests/test_module_db.py::test_first_sample_trains_like_eager[nn.*Cell]",
    "tests/test_module_db.py::test_first_sample_trains_like_eager[nn.CircularPad*]",
    "tests/test_module_db.py::test_first_sample_trains_like_eager[nn.LPPool*]",
    "tests/test_module_db.py::test_first_sample_trains_like_eager[nn.*Loss]",
    # several processes: two ranks bitwise, with and without the tier, stay
    "tests/distributed/test_updates.py::test_clipping_by_the_global_norm_across_ranks[True]",
    "tests/distributed/test_cluster.py::test_a_trainer_left_open_has_its_groups_ended_before_the_interpreter_finalizes",
    "tests/distributed/test_cluster.py::test_close_destroys_the_groups_the_trainer_made",
)

# out of CI (from either suite above)
EXTENDED = (
    "tests/test_parallel.py::test_pp_trains_like_eager[chaos0-tiny_gpt-3]",
    "tests/test_parallel.py::test_*_trains_like_eager[chaos2-*]",
    "tests/test_parallel.py::test_*_trains_like_eager[chaos1-tiny_gpt-*]",
    "tests/test_parallel.py::test_dp_trains_like_eager[*-tiny_gpt-3]",
    "tests/test_parallel.py::test_pp_handing_on_through_the_host_trains_like_peer_and_frees_per_microbatch[tiny_gpt-*]",
    "tests/test_hf_models.py::test_larger_forward_microbatches_train_like_one_size[bert]",
    "tests/test_hf_models.py::test_larger_forward_microbatches_train_like_one_size[llama]",
    "tests/test_hf_models.py::test_padded_batches_through_the_backend_train_like_eager[llama]",
    "tests/test_hf_models.py::test_three_sgd_steps_match_eager_at_a_quarter_of_the_memory[qwen2]",
    "tests/test_backend.py::test_hf_model_trains_like_eager_at_a_quarter_of_the_memory[gpt2]",
    "tests/test_examples.py::test_hf_example_fine_tunes_equal_to_transformers_trainer",
    "tests/runtime/test_inductor.py::test_compiled_packs_equal_torch_compile_of_the_whole_model[residual_mlp]",
    "tests/runtime/test_inductor.py::test_compiled_packs_equal_torch_compile_of_the_whole_model[small_cnn]",
    "tests/runtime/test_inductor.py::test_compiled_packs_equal_torch_compile_of_the_whole_model[tiny_gpt]",
    "tests/runtime/test_inductor.py::test_compiled_packs_on_two_devices_whose_threads_share_them[dp]",
    "tests/runtime/test_inductor.py::test_compiled_packs_train_like_eager_with_dropout_and_compile_identical_blocks_once",
    "tests/test_microbatch_sizes.py::test_adamw_steps_equal_one_microbatch_size[tiny_gpt-*]",
    "tests/test_microbatch_sizes.py::test_measured_peaks_and_bytes_equal_the_plan[dp]",
    "tests/training/test_trainer.py::test_small_gpt_learns_to_copy_the_previous_token_under_a_quarter_budget",
    "tests/planner/test_module.py::test_simulation_is_consistent_with_the_planning_run[tiny_gpt-*-0.5]",
    "tests/planner/test_module.py::test_simulation_is_consistent_with_the_planning_run[tiny_gpt-pp-0.25]",
    "tests/test_memory_cap.py::test_zoo_stays_within_the_budget_by_an_independent_count[tiny_gpt-*-pp]",
    "tests/test_memory_cap.py::test_zoo_stays_within_the_budget_by_an_independent_count[tiny_gpt-tightest-dp]",
    "tests/compiler/test_packing.py::test_the_bound_never_passes_the_peak_of_any_candidate[hf-*]",
    "tests/compiler/test_packing.py::test_the_bound_never_passes_the_peak_of_any_candidate[trainer_pipeline]",
    "tests/distributed/test_torchrun.py::test_a_restarted_run_ends_as_an_unbroken_one",
    "tests/distributed/test_cluster.py::test_a_hung_rank_is_named_after_the_timeout",
    "tests/distributed/test_tier.py::test_a_write_failing_on_one_rank_undoes_the_step_on_every_rank[last]",
    "tests/distributed/test_updates.py::test_a_step_failing_on_one_rank_is_undone_on_every_rank",
    "tests/distributed/test_updates.py::test_three_ranks_within_1e6_and_send_what_the_formula_says[*]",
    "tests/distributed/test_updates.py::test_uneven_shares_weigh_by_their_sizes",
    "tests/distributed/test_updates.py::test_two_ranks_keep_one_set_of_host_gradients",
    "tests/distributed/test_updates.py::test_clipping_by_the_global_norm_across_ranks[False]",
    "tests/training/test_checkpoint.py::test_a_killed_rank_is_named_by_the_other_within_the_timeout",
    "tests/training/test_checkpoint.py::test_resuming_at_two_ranks_gives_the_unbroken_losses_bitwise",
    "tests/training/test_checkpoint.py::test_resuming_at_three_ranks_and_in_one_process_within_1e6",
    "tests/test_parallel.py::test_pp_trains_like_eager[inline-tiny_gpt-3]",
    "tests/test_hf_models.py::test_three_sgd_steps_match_eager_at_a_quarter_of_the_memory[gemma2]",
    "tests/test_hf_models.py::test_padded_batches_through_the_backend_train_like_eager[gpt2]",
    "tests/test_hf_models.py::test_larger_forward_microbatches_train_like_one_size[gpt2]",
    "tests/test_hf_models.py::test_padded_batches_through_compile_train_like_eager[llama]",
    "tests/test_backend.py::test_hf_model_trains_like_eager_at_a_quarter_of_the_memory[llama]",
    "tests/test_precision.py::test_bf16_hugging_face_models_equal_the_model_in_bf16[gpt2]",
    "tests/test_microbatch_sizes.py::test_one_step_equals_eager[tiny_gpt-dp]",
    "tests/test_microbatch_sizes.py::test_one_step_equals_eager[tiny_gpt-pp]",
    "tests/planner/test_module.py::test_simulation_is_consistent_with_the_planning_run[tiny_gpt-*-1.0]",
    "tests/planner/test_module.py::test_simulation_of_larger_forward_microbatches[dp]",
    "tests/test_api.py::test_training_step_matches_eager[*-1.0]",
    "tests/distributed/test_updates.py::test_a_packs_gradients_travel_while_earlier_packs_run_their_backward",
    "tests/distributed/test_tier.py::test_resume_from_a_checkpoint_folder_is_bit_identical",
    "tests/distributed/test_tier.py::test_a_write_failing_on_one_rank_undoes_the_step_on_every_rank[first]",
    "tests/distributed/test_tier.py::test_what_it_refuses_across_processes_says_what_to_do",
    "tests/runtime/test_inductor.py::test_compiled_packs_on_two_devices_whose_threads_share_them[pp]",
    "tests/test_microbatch_sizes.py::test_measured_peaks_and_bytes_equal_the_plan[pp]",
    "tests/distributed/test_updates.py::test_two_ranks_equal_one_process_bitwise[False]",
    "tests/distributed/test_cluster.py::test_ranks_that_cut_the_model_differently_are_refused",
)


def _pattern(entry: str) -> re.Pattern:
    return re.compile(".*".join(re.escape(part) for part in entry.split("*")) + r"\Z")


_SLOW = [(entry, _pattern(entry)) for entry in SLOW]
_EXTENDED = [(entry, _pattern(entry)) for entry in EXTENDED]


def tier_of(nodeid: str) -> str | None:
    """``"extended"``, ``"slow"`` or ``None`` (as the test's own file says) for a test's node id."""
    if any(pattern.match(nodeid) for _, pattern in _EXTENDED):
        return "extended"
    if any(pattern.match(nodeid) for _, pattern in _SLOW):
        return "slow"
    return None


def unmatched(nodeids: list[str]) -> list[str]:
    """The entries that match none of ``nodeids`` although their file is among them."""
    files = {nodeid.split("::")[0] for nodeid in nodeids}
    return [entry for entry, pattern in _SLOW + _EXTENDED
            if entry.split("::")[0] in files and not any(pattern.match(nodeid) for nodeid in nodeids)]
