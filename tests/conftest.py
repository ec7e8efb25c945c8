"""Shared fixtures: small problems built from presets."""

from __future__ import annotations

import pytest

from lynx.api import make_problem
from lynx.models import load_model
from lynx.problem import PlanOptions, PlanProblem
from lynx.spec import ParallelSpec, load_hardware


def problem_for(model: str = "gpt-7b", hardware: str = "a100-40g-nvlink", tp: int = 4, pp: int = 4, mb: int = 8,
                gb: int = 128, seq: int = 1024, sp: bool = False, **opts: object) -> PlanProblem:
    par = ParallelSpec(tp=tp, pp=pp, micro_batch_size=mb, global_batch_size=gb, seq_length=seq, sequence_parallel=sp)
    return make_problem(load_model(model), load_hardware(hardware), par, PlanOptions(**opts))  # type: ignore[arg-type]


@pytest.fixture
def gpt7b_problem() -> PlanProblem:
    return problem_for()


@pytest.fixture
def one_torch_thread():  # type: ignore[no-untyped-def]
    """Tiny shapes: one intra-op thread is fastest, and OpenMP threads spinning against other jobs on a
    2-core machine made the runtime tests 50x slower."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# The default run stays under 8 minutes on 2 cores (README, "Tests"): these cases are marked `slow`, each with
# the case of its kind that stays in the default run. `python -m pytest -m ""` runs them all.
SLOW_CASES: dict[str, str] = {
    **{f"integration/test_runtime_moe.py::{t}":
       "test_runtime_moe.py::test_ep2_bitwise_and_the_all_to_alls_host_the_mlp_windows (the MoE layer, EP 2, windows)"
       for t in ("test_ep2_tp2_sequence_parallel_bitwise",
                 "test_pp2_ep2_bitwise_and_a_forward_all_to_all_hosts_phase_2",
                 "test_lynx_train_ep2_trains_as_the_single_process_run")},
    **{f"integration/test_runtime_fsdp.py::test_fsdp2_plans_bitwise_and_restored_in_the_all_gathers[{m}]":
       "test_runtime_fsdp.py::test_fsdp2_selective_bitwise_and_restored_in_the_all_gathers (FSDP2, bitwise, windows)"
       for m in ("full", "lynx")},
    "integration/test_runtime_fsdp.py::test_fsdp2_uniform_chunks_replay_the_layer_below_unsharded_by_lynx":
        "test_runtime_fsdp.py::test_fsdp2_selective_bitwise_and_restored_in_the_all_gathers (FSDP2, bitwise, windows)",
    "integration/test_runtime_fsdp.py::test_fsdp2_without_resharding_after_forward":
        "test_runtime_fsdp.py::test_fsdp2_selective_bitwise_and_restored_in_the_all_gathers (FSDP2, bitwise, windows)",
    "integration/test_runtime_fsdp.py::test_negative_control_a_window_before_fsdps_pre_backward_finds_the_layer_sharded":
        "test_runtime_fsdp.py::test_fsdp2_selective_bitwise_and_restored_in_the_all_gathers (its unshards check)",
    "integration/test_runtime_fsdp.py::test_lynx_train_fsdp2_reports_the_fsdp_windows":
        "test_runtime_fsdp.py::test_fsdp2_selective_bitwise_and_restored_in_the_all_gathers (the same run, in process)",
    "integration/test_runtime_fsdp.py::test_lynx_train_refuses_an_fsdp_plan_it_cannot_run":
        "unit/test_runtime_fsdp_checks.py (every refusal, without a process)",
    "integration/test_window_control_torchtitan.py::test_smoke_runs_torchtitans_model_with_the_plan_and_its_control":
        "test_window_control_torchtitan.py::test_bad_options_are_one_clear_line_and_exit_2 and "
        "unit/test_window_control_bench.py (the analysis)",
    **{f"integration/test_torchtitan_fsdp.py::test_fsdp2_loss_and_grads_equal_torchtitans_own[{c}]":
       "test_torchtitan_fsdp.py::test_fsdp2_loss_and_grads_equal_torchtitans_own[uniform] (FSDP, bitwise, unshard)"
       for c in ("none", "full", "lynx", "trainer")},
    **{f"integration/test_torchtitan_fsdp_tp.py::test_tp2_fsdp2_loss_and_grads_equal_torchtitans_own[{c}]":
       "test_torchtitan_fsdp.py::test_fsdp2_loss_and_grads_equal_torchtitans_own[uniform] (FSDP) and "
       "test_torchtitan_tp.py::test_tp2_every_window_restores_what_the_plan_put_there (TP windows)"
       for c in ("none", "full", "lynx")},
    "integration/test_torchtitan_fsdp_tp.py::test_tp2_fsdp2_windows_bitwise_and_where_planned":
        "test_torchtitan_fsdp.py::test_fsdp2_loss_and_grads_equal_torchtitans_own[uniform] (FSDP) and "
        "test_torchtitan_tp.py::test_tp2_every_window_restores_what_the_plan_put_there (TP windows)",
    **{f"integration/test_torchtitan_example.py::{t}":
       "test_torchtitan_checks_tp.py::test_tp_and_sp_that_differ_from_the_plan_are_refused (the SP override through "
       "torchtitan's parser) and the TP parity tests (the engine bitwise)"
       for t in ("test_the_example_trains_as_torchtitan_does", "test_the_example_refuses_an_sp_override")},
    "integration/test_torchtitan_plan_file.py::test_a_plan_file_runs_torchtitans_model_bitwise":
        "test_torchtitan_tp.py::test_tp2_every_window_restores_what_the_plan_put_there (the integration, bitwise)",
    "integration/test_runtime_pipeline_train.py::test_pp2_dp2_reports_stages_and_writes_a_trace_beside_the_simulator":
        "test_the_runtime_executes_the_given_action_list (lynx train on a pipeline plan)",
    **{f"unit/test_search_parallel.py::{t}":
       "test_search_parallel.py::test_workers_search_the_tree_beside_and_give_the_same_table[3] and "
       "test_workers_planning_ahead_give_the_same_search[wait-for-every-worker] (workers give the one-process "
       "search's answer)"
       for t in ("test_an_exhaustive_search_with_workers_is_the_one_process_one",
                 "test_workers_planning_ahead_give_the_same_search[take-back-queued]",
                 "test_workers_search_the_tree_beside_and_give_the_same_table[6]",
                 "test_a_killed_worker_does_not_stop_the_search[planning-ahead]",
                 "test_finalists_priced_for_the_target_over_the_workers_rank_as_in_one_process")},
    "unit/test_refine_plain.py::test_the_refinements_plain_test_changes_no_answer_and_spares_stage_problems":
        "test_search.py::test_pruned_search_equals_exhaustive[gpt-tiny-tight] (no answer changed) and "
        "test_refine_plain.py::test_the_offloading_models_stop_within_their_gap_of_the_optimum",
    "integration/test_runtime_moe.py::test_ep2_dense_first_layer_then_moe_bitwise":
        "test_runtime_moe.py::test_ep2_deepseek_moe_layer_bitwise (DeepSeek's MoE layer, EP 2, bitwise)",
    "integration/test_runtime_moe.py::test_ep2_without_a_shared_expert_bitwise":
        "test_runtime_moe.py::test_ep2_qwen3_layer_bitwise (Qwen3's layer has no shared expert)",
    "integration/test_runtime_pipeline.py::test_pp2_host_staged_bitwise":
        "test_runtime_pipeline.py::test_interleaved_pp2_vpp2_cross_chunk_hosts_bitwise (hosted restorations, PP 2)",
    "integration/test_runtime_pipeline.py::test_wrong_masks_in_restorations_break_equality":
        "test_runtime_llama.py::test_a_wrong_recompute_breaks_equality (the negative control)",
    # grids whose other cases stay in the default run (the CI default run read 7:52 of its 8 minutes)
    "unit/test_search.py::test_policy_bound_holds_for_every_planned_stock_candidate[llama-tiny-cp-searched]":
        "test_search.py::test_policy_bound_holds_for_every_planned_stock_candidate[gpt-tiny-tight]",
    **{f"unit/test_opt_vs_heu.py::test_opt_is_never_worse_than_heu[{c}]":
       "test_opt_vs_heu.py::test_opt_is_never_worse_than_heu[3-1-0.5]"
       for c in ("1-1-0.3", "0-1-0.1", "1-1-0.8")},
    **{f"integration/test_adapipe_grid.py::test_adapipe_fits_and_is_never_slower_than_full[{c}]":
       "test_adapipe_grid.py::test_adapipe_fits_and_is_never_slower_than_full[gpt-1.3b-a100-40g-nvlink-4] and "
       "[gpt-1.3b-a100-40g-pcie-2]"
       for c in ("gpt-23b-a100-40g-nvlink-4", "gpt-23b-a100-40g-pcie-2", "gpt-13b-a100-40g-pcie-2",
                 "gpt-7b-a100-40g-pcie-2")},
    "unit/test_opt.py::test_one_layer_is_proved_optimal_and_valid[0.1]":
        "test_opt.py::test_one_layer_is_proved_optimal_and_valid[0.5]",
    **{f"unit/test_heu_bruteforce.py::test_heu_matches_brute_force[{c}]":
       "test_heu_bruteforce.py::test_heu_matches_brute_force[False-0] and the [True-*] cases"
       for c in ("False-1", "False-2")},
    "integration/test_cli.py::test_compare_json_orders_methods":
        "test_cli.py::test_readme_compare_command (the comparison) and test_json_stdout.py (JSON on stdout)",
    "unit/test_search.py::test_a_refined_finalist_is_not_pruned_by_its_screens_bound":
        "test_search.py::test_pruned_search_equals_exhaustive[gpt-tiny-tight] (pruned and exhaustive pick the same "
        "plan; this case, Mist's GPT-1.3B on 2 L4, takes 15 s)",
    "integration/test_interleaved.py::test_cli_schedule_plan_and_simulate":
        "test_every_fast_method_plans_interleaved and test_runtime_pipeline.py's interleaved case",
    "integration/test_cli.py::test_compare_prices_stock_megatron_on_its_balancing_flags":
        "unit/test_megatron_baselines.py (Megatron's split from its balancing flags)",
    "integration/test_cli_llama.py::test_compare_shows_the_module_baselines_beside_lynx":
        "test_cli.py::test_readme_compare_command (the baselines beside lynx)",
    "integration/test_torchtitan_pp_tp.py::test_pp2_tp2_loss_and_grads_equal_torchtitans_own":
        "test_pp2_loss_and_grads_equal_torchtitans_own[windows-1f1b] (PP) and the TP window test",
    "integration/test_torchtitan_pp.py::test_pp2_loss_and_grads_equal_torchtitans_own[windows-gpipe]":
        "test_torchtitan_tp.py::test_tp2_every_window_restores_what_the_plan_put_there (the integration's windows) "
        "and test_runtime_pipeline.py (PP 2 bitwise)",
    "integration/test_torchtitan_pp.py::test_pp2_loss_and_grads_equal_torchtitans_own[full-1f1b]":
        "test_torchtitan_tp.py::test_tp2_every_window_restores_what_the_plan_put_there (the integration's windows) "
        "and test_runtime_pipeline.py (PP 2 bitwise)",
    "integration/test_torchtitan_pp.py::test_pp2_loss_and_grads_equal_torchtitans_own[none-1f1b]":
        "test_torchtitan_tp.py::test_tp2_every_window_restores_what_the_plan_put_there (the integration's windows) "
        "and test_runtime_pipeline.py (PP 2 bitwise)",
    "integration/test_torchtitan_tp.py::test_tp2_loss_and_grads_equal_torchtitans_own[none]":
        "test_torchtitan_tp.py::test_tp2_every_window_restores_what_the_plan_put_there (bitwise too)",
    "integration/test_torchtitan_tp.py::test_tp2_loss_and_grads_equal_torchtitans_own[full]":
        "test_torchtitan_tp.py::test_tp2_every_window_restores_what_the_plan_put_there (bitwise too)",
    "integration/test_torchtitan_tp.py::test_tp2_loss_and_grads_equal_torchtitans_own[selective]":
        "test_torchtitan_tp.py::test_tp2_every_window_restores_what_the_plan_put_there (bitwise too)",
    "integration/test_torchtitan_tp.py::test_tp2_loss_and_grads_equal_torchtitans_own[windows]":
        "test_torchtitan_tp.py::test_tp2_every_window_restores_what_the_plan_put_there (bitwise too)",
    "integration/test_torchtitan_tp.py::test_tp2_loss_and_grads_equal_torchtitans_own[lynx]":
        "test_torchtitan_tp.py::test_tp2_every_window_restores_what_the_plan_put_there (bitwise too)",
    **{f"integration/test_torchtitan_tp.py::test_tp2_sp_loss_and_grads_equal_torchtitans_own[{c}]":
       "test_torchtitan_tp.py::test_tp2_every_window_restores_what_the_plan_put_there (TP windows, bitwise; SP is "
       "checked at apply time by test_torchtitan_checks_tp.py)"
       for c in ("none", "full", "lynx")},

    "unit/test_offload.py::test_heu_with_offload_matches_brute_force[True-1]":
        "test_offload.py::test_heu_with_offload_matches_brute_force[True-0]",
    "unit/test_offload.py::test_heu_with_offload_matches_brute_force[False-0]":
        "test_offload.py::test_heu_with_offload_matches_brute_force[True-0]",
    "unit/test_offload.py::test_heu_with_offload_matches_brute_force[False-1]":
        "test_offload.py::test_heu_with_offload_matches_brute_force[True-0]",
    "unit/test_offload.py::test_heu_with_offload_matches_brute_force_interleaved[False]":
        "test_offload.py::test_heu_with_offload_matches_brute_force_interleaved[True]",
    "unit/test_search.py::test_pruned_search_equals_exhaustive_with_offloading[gpt-tiny-tight]":
        "test_search.py::test_pruned_search_equals_exhaustive_with_offloading[llama-tiny-16k]",

    "integration/test_runtime_offload_train.py::test_train_offload_plan_equals_keeping[tp2-pp2]":
        "test_runtime_offload.py (the engine's offloading, bitwise) and test_runtime_pipeline.py (lynx train's PP 2)",
    "integration/test_runtime_offload_train.py::test_train_interleaved_plan_offloading":
        "test_runtime_offload.py (the engine's offloading, bitwise)",
    "integration/test_runtime_offload_train.py::test_train_tp_plan_offloading_the_last_op":
        "test_runtime_offload_lastop.py::test_last_op_offloads_its_mask_not_its_output",
    "integration/test_runtime_llama_train.py::test_llama_pipeline_trains_as_the_single_process_run[1-2]":
        "test_runtime_moe.py::test_ep2_bitwise_and_the_all_to_alls_host_the_mlp_windows (a LLaMA-attention layer "
        "bitwise under the engine) and test_runtime_pipeline.py::test_pp2_host_staged_bitwise (the pipeline)",
    "integration/test_runtime_pipeline_train.py::test_host_staged_p2p_trains_as_the_direct_one":
        "test_runtime_pipeline.py::test_pp2_host_staged_bitwise",
    "integration/test_runtime_pipeline_train.py::test_a_frozen_rank_fails_the_other_within_the_timeout":
        "test_faults.py::test_a_dying_local_rank_is_one_line_per_rank_and_exit_1",
    "integration/test_runtime_pipeline_train.py::test_cut_pipeline_link_fails_both_stages_within_timeout":
        "test_faults.py::test_a_dying_local_rank_is_one_line_per_rank_and_exit_1 (a rank lost, within the timeout)",
    "integration/test_runtime_pipeline.py::test_pp2_tp2_lynx_bitwise":
        "test_llama_pp2_tp2_lynx_bitwise (the same layout, LLaMA)",
    "integration/test_runtime_train.py::test_dead_rank_fails_fast_with_rank_and_cause":
        "test_faults.py::test_a_dying_local_rank_is_one_line_per_rank_and_exit_1",
    "unit/test_adapipe.py::test_stage_dp_matches_brute_force[3-fracs1]": "the other brute-force cases",
    **{f"integration/test_runtime_pipeline_train.py::test_a_rank_dying_mid_iteration_fails_the_other_naming_it[{r}]":
       "test_faults.py::test_a_dying_local_rank_is_one_line_per_rank_and_exit_1 (a rank dies, the other names it)"
       for r in (0, 1)},
    "integration/test_runtime_llama.py::test_tp2_every_policy_bitwise_equal[True]": "the case without SP",
    "integration/test_runtime_engine.py::test_tp2_every_policy_bitwise_equal[True]": "the case without SP",
    "integration/test_runtime_memory.py::test_tp2_measured_peak_within_5_percent_below_predicted[gpt]":
        "test_tiny_presets_measured_peak_within_5_percent_below_predicted[llama]",
    "integration/test_profile_cli.py::test_unreachable_rendezvous_is_a_clear_error_not_a_hang":
        "test_faults.py::test_a_dying_local_rank_is_one_line_per_rank_and_exit_1 (a distributed fault, one line)",
    "integration/test_runtime_pipeline.py::test_pp4_full_bitwise": "the PP 2 bitwise cases (PP 4 in the slow grid)",
    "unit/test_opt_vs_heu.py::test_lynx_opt_method_stopped_early_is_no_slower_than_lynx_heu":
        "test_started_from_heu_a_time_limited_opt_is_no_worse (the same warm start, one stage)",
    "integration/test_profile_cli.py::test_tp2_two_gloo_processes": "the TP 1 profile cases",
    "integration/test_runtime_memory.py::test_tiny_presets_measured_peak_within_5_percent_below_predicted[gpt]":
        "the LLaMA case",
    "integration/test_runtime_pipeline.py::test_pp2_uneven_every_place_bitwise":
        "test_interleaved_pp2_vpp2_cross_chunk_hosts_bitwise (every place, interleaved)",
    "integration/test_runtime_engine.py::test_tp2_every_policy_bitwise_equal[False]":
        "test_runtime_llama.py::test_tp2_every_policy_bitwise_equal[False]",
    "integration/test_profile_cli.py::test_custom_shape_from_the_command_line": "the preset-shape profile cases",
    "integration/test_cp_ring_attention.py::test_ring_attention_matches_full_attention_and_lynx_bytes[2]":
        "test_ring_attention_in_threads_matches_full_attention_and_lynx_bytes (the same ring, ranks as threads)",

    "integration/test_runtime_vocab_parallel.py::test_tp2_sequence_parallel_ends":
        "test_tp2_embedding_and_logits_bytes_equal_the_planners[gpt]",
    "integration/test_runtime_vocab_parallel.py::test_tp2_embedding_and_logits_bytes_equal_the_planners[llama]":
        "test_tp2_embedding_and_logits_bytes_equal_the_planners[gpt]",
    "integration/test_runtime_precision.py::test_lynx_train_megatron_bf16_runs_and_keeps_fp32_master_weights":
        "test_bf16_autocast_recomputes_bitwise_with_fp32_master_weights (the same autocast, in the runner)",
    "unit/test_request_price.py::test_search_prices_what_plan_prices_many":
        "test_search_prices_what_plan_prices (the same property, 3 draws)",
    "unit/test_moe_search.py::test_bounds_hold_and_pruning_loses_nothing_on_a_stack[0.25]":
        "test_bounds_hold_and_pruning_loses_nothing_on_a_stack[2.5] (the same stack, every layout fits)",
    "integration/test_search_request.py::test_llama_405b_on_1024_gpus_with_tp_8_pp_16":
        "test_pinned_tp_pp_derive_dp_on_a_cluster_larger_than_the_preset (the same rule, gpt-tiny)",
    **{f"integration/test_megatron_core.py::test_layouts_bitwise_and_where_planned[{c}]":
       "test_megatron_core.py::test_tp2_gpt_with_dropout_bitwise_and_where_planned (Megatron-Core, TP windows)"
       for c in ("tp2-sp-llama", "tp2-llama", "pp2-gpt", "pp2-tp2-gpt", "pp2-tp2-sp-llama", "dp2-llama")},
    "integration/test_megatron_core.py::test_one_rank_gpt_with_dropout_bitwise_and_where_planned":
        "test_megatron_core.py::test_tp2_gpt_with_dropout_bitwise_and_where_planned (the same, at TP 2)",
    **{f"integration/test_megatron_ddp.py::test_overlap_grad_reduce_bitwise_and_where_planned[{c}]":
       "test_megatron_core.py::test_tp2_gpt_with_dropout_bitwise_and_where_planned (Megatron-Core, TP windows) and "
       "unit/test_export_megatron_engine.py::test_ddp_overlaps_price_as_lynxs_plan and "
       "integration/test_megatron_pre_hooks.py (the engine runs the linears' pre-hooks)"
       for c in ("dp2-gpt", "dp2-llama-distributed-optimizer", "dp2-tp2-sp-llama")},
    **{f"integration/test_megatron_core.py::test_flash_attention_layouts_bitwise_and_where_planned[{c}]":
       "test_megatron_core.py::test_flash_attention_tp2_llama_bitwise_and_where_planned (the flash core_attn op, "
       "TP windows)" for c in ("one-rank-gpt-dropout", "pp2-tp2-sp-llama")},
    "integration/test_megatron_core.py::test_interleaved_pp2_vpp2_tp2_sp_flash_bitwise_and_where_planned":
        "test_megatron_core.py::test_flash_attention_tp2_llama_bitwise_and_where_planned (flash, TP windows)",
    "integration/test_megatron_core.py::test_interleaved_pp2_vpp2_bitwise_and_where_planned":
        "test_megatron_core.py::test_tp2_gpt_with_dropout_bitwise_and_where_planned (Megatron-Core, TP windows)",
    "integration/test_window_control_megatron.py::test_smoke_runs_megatrons_model_with_the_plan_and_its_control":
        "test_window_control_megatron.py::test_bad_options_are_one_clear_line_and_exit_2 and "
        "unit/test_window_control_bench.py (the analysis)",
    "integration/test_megatron_core.py::test_offloading_plan_bitwise_and_where_planned":
        "test_megatron_core.py::test_tp2_gpt_with_dropout_bitwise_and_where_planned (Megatron-Core, TP windows) "
        "and test_runtime_offload.py (the engine's offloading, bitwise)",
    "integration/test_megatron_core.py::test_the_lynx_method_plan_bitwise":
        "test_megatron_core.py::test_tp2_gpt_with_dropout_bitwise_and_where_planned (Megatron-Core, TP windows)",
    # Trimmed to keep the default run under 8 minutes after issues 32-34 added their suites (2026-11-28):
    "integration/test_torchtitan_tp.py::test_tp2_sp_every_window_restores_what_the_plan_put_there":
        "test_torchtitan_tp.py::test_tp2_every_window_restores_what_the_plan_put_there (the same windows without SP)",
    "integration/test_runtime_testbed.py::test_cut_link_fails_both_ranks_within_timeout":
        "test_faults.py::test_a_dying_local_rank_is_one_line_per_rank_and_exit_1 (a rank lost, within the timeout)",
    "integration/test_runtime_testbed.py::test_p2p_probe_moves_the_message_at_the_shaped_rate_at_most":
        "test_runtime_testbed.py::test_compute_overlaps_a_shaped_allreduce (the shaped link)",
    **{f"integration/test_adapipe_grid.py::test_adapipe_fits_and_is_never_slower_than_full[{c}]":
       "test_adapipe_grid.py's gpt-1.3b and gpt-23b cases" for c in (
           "gpt-4.7b-a100-40g-nvlink-4", "gpt-7b-a100-40g-nvlink-4", "gpt-4.7b-a100-40g-pcie-2",
           "gpt-13b-a100-40g-nvlink-4")},
    **{f"integration/test_heu_grid.py::test_grid_plans_fit[{c}]": "test_heu_grid.py's other grid cases"
       for c in ("gpt-4.7b-a100-40g-pcie-2", "gpt-7b-a100-40g-pcie-2")},
    **{f"unit/test_opt_vs_heu.py::test_opt_is_never_worse_than_heu[{c}]": "test_opt_is_never_worse_than_heu[1-1-0.3]"
       for c in ("1-2-0.8", "3-2-0.5")},
    "unit/test_search.py::test_bounds_hold_for_every_planned_candidate[llama-tiny-cp-searched]":
        "test_bounds_hold_for_every_planned_candidate[llama-tiny-cp2] (CP in the space)",
    "unit/test_search.py::test_pruned_search_equals_exhaustive[llama-tiny-cp2]":
        "test_pruned_search_equals_exhaustive[llama-tiny-cp-searched] (CP in the space)",
    "integration/test_torchtitan_pp.py::test_pp2_loss_and_grads_equal_torchtitans_own[windows-1f1b]":
        "test_torchtitan_tp.py::test_tp2_every_window_restores_what_the_plan_put_there (the integration's windows) "
        "and test_runtime_pipeline.py (PP 2 bitwise)",
    "integration/test_runtime_offload_train.py::test_train_offload_plan_equals_keeping[pp2]":
        "test_runtime_offload.py (the engine's offloading, bitwise) and test_runtime_pipeline.py (lynx train's PP 2)",
    "unit/test_offload.py::test_heu_with_offload_matches_brute_force_interleaved[True]":
        "test_heu_with_offload_matches_brute_force_interleaved[False]",
    "unit/test_heu_bruteforce.py::test_linear_rows_bound_the_exact_peak_for_every_policy[True]":
        "test_linear_rows_bound_the_exact_peak_for_every_policy[False]",
    "integration/test_json_stdout.py::test_stdout_is_json[compare]":
        "test_cli.py::test_compare_json_orders_methods (the same command's JSON)",
    "unit/test_breakdown.py::test_breakdown_sums_to_the_closed_form_peak[hardware=a100-40g-pcie,tp=2,mb=16]":
        "the other test_breakdown_sums_to_the_closed_form_peak cases",
    "unit/test_search.py::test_bounds_hold_for_every_planned_candidate[gpt-tiny-tight]":
        "test_bounds_hold_for_every_planned_candidate[llama-tiny-cp2]",
    **{f"integration/test_export_cli.py::{t}[{c}]": f"test_export_cli.py::{t}[mb16]"
       for t in ("test_megatron_export_round_trips_through_from_megatron", "test_megatron_table_and_torchtitan_files")
       for c in ("llama3-8b", "readme-mb8")},
    **{f"integration/test_runtime_engine_leak.py::{t}": "test_runtime_engine_leak.py's [full] cases"
       for t in ("test_nothing_held_between_steps[none]", "test_no_tensor_outlives_its_iteration[overlapped]",
                 "test_no_tensor_outlives_its_iteration[selective]")},
    "integration/test_faults.py::test_unreachable_rendezvous_fails_with_one_line":
        "test_faults.py::test_a_dying_local_rank_is_one_line_per_rank_and_exit_1 (a distributed fault, one line)",
    # moved when the MoE and FSDP2 runtime cases joined the default run (2026-11-28), to stay under 8 minutes
    "integration/test_runtime_pipeline.py::test_llama_pp2_tp2_lynx_bitwise":
        "test_runtime_llama.py::test_tp2_every_policy_bitwise_equal (LLaMA at TP 2) and "
        "test_runtime_pipeline.py::test_pp2_host_staged_bitwise (PP 2)",
    "integration/test_titan_fsdp_bytes.py::test_fsdp_bytes_per_rank_match_the_plan":
        "test_runtime_fsdp.py::test_fsdp2_selective_bitwise_and_restored_in_the_all_gathers (FSDP2 under the engine, "
        "held bytes against the plan) and unit/test_titan_fsdp.py (torchtitan's FSDP bytes as priced)",
    "unit/test_search.py::test_pruned_search_equals_exhaustive_with_offloading[llama-tiny-16k]":
        "test_pruned_search_equals_exhaustive_with_offloading[gpt-tiny-tight]",
    "integration/test_runtime_memory.py::test_tp2_measured_peak_within_5_percent_below_predicted[llama]":
        "test_runtime_memory.py::test_tiny_presets_measured_peak_within_5_percent_below_predicted[llama]",
    # moved when torchtitan's Float8 and compile tests joined the default run (2026-12-07), to stay under 8 minutes
    "integration/test_megatron_core.py::test_tp2_gpt_with_dropout_bitwise_and_where_planned":
        "test_megatron_core.py::test_flash_attention_tp2_llama_bitwise_and_where_planned (Megatron-Core at TP 2, "
        "bitwise, windows where planned)",
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        rel = item.nodeid.split("tests/", 1)[-1]
        if rel in SLOW_CASES:
            item.add_marker(pytest.mark.slow)
