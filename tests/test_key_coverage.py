"""Every configuration key has a test that fails when the key is ignored.

``KEY_TESTS`` names, for each key of ``lightning_nanguard.config.iter_keys()``, the tests (node ids) that run
the key at two values and assert the difference it is documented to make. The tests below keep the registry
complete (every key, no other), and true (every named test exists in that file and sets the key).
"""

from __future__ import annotations

import ast
from pathlib import Path

from lightning_nanguard.config import iter_keys
from .test_suite import defined_tests, parsed

ROOT = Path(__file__).resolve().parents[1]

D, PV, PR, PC, RC, RP = ("tests/test_detection.py", "tests/test_prevention.py", "tests/test_precision.py",
                         "tests/test_recovery.py", "tests/test_reporting.py", "tests/test_diagnosis.py")
SY = "tests/test_sync_modes.py"
DV = "tests/test_divergence.py"

KEY_TESTS: dict[str, list[str]] = {
    "check.loss": [f"{D}::test_loss_and_gradient_checks_decide_what_catches_a_nan_loss"],
    "check.gradients": [f"{D}::test_gradient_check_catches_a_nan_gradient_before_it_reaches_the_weights",
                        f"{D}::test_loss_and_gradient_checks_decide_what_catches_a_nan_loss",
                        f"{D}::test_fixed_clip_acts_whether_or_not_gradients_are_checked"],
    "check.inputs": [f"{D}::test_inputs_always_flags_a_nan_in_a_field_the_model_never_reads",
                     f"{D}::test_inputs_off_does_not_attribute_an_incident_to_its_inputs"],
    "check.parameters": [f"{D}::test_parameter_check_finds_a_bad_weight_before_it_spoils_a_loss",
                         f"{D}::test_parameter_check_at_train_end_repairs_the_last_step"],
    "check.activations": [f"{D}::test_activation_flag_catches_unused_branch"],
    "check.spike_action": [f"{PV}::test_spike_action_off_turns_detection_off",
                           f"{PV}::test_skipped_spike_undoes_batchnorm_statistics_like_an_incident"],
    "check.spike_z": [f"{PV}::test_spike_z_is_the_detection_threshold"],
    "check.spike_warmup": [f"{PV}::test_spike_warmup_is_the_number_of_losses_before_detection"],
    "check.stall": ["tests/test_stall.py::test_stall_fires_on_a_stalled_lm_and_rescues_it",
                    "tests/test_stall.py::test_check_stall_off_never_probes"],
    "check.stall_window": ["tests/test_stall.py::test_stall_probe_on_a_healthy_run_changes_nothing"],
    "check.stall_progress": ["tests/test_stall.py::test_stall_probe_on_a_healthy_run_changes_nothing"],
    "check.stall_probe_steps": ["tests/test_stall.py::test_stall_probe_on_a_healthy_run_changes_nothing"],
    "check.stall_gain_ratio": ["tests/test_stall.py::test_stall_fires_on_a_stalled_lm_and_rescues_it"],
    "check.stall_remaining": ["tests/test_stall.py::test_a_stall_needs_the_loss_still_near_where_the_fit_began"],
    "check.divergence": [f"{DV}::test_check_divergence_off_warn_act",
                         "tests/test_causes.py::test_tiny_gpt2_with_sgd_at_lr_100_is_learning_rate_not_precision"],
    "check.divergence_growth": [f"{DV}::test_check_divergence_growth_is_the_per_step_factor"],
    "check.divergence_steps": [f"{DV}::test_check_divergence_steps_is_the_length_of_the_growth_streak"],
    "check.divergence_factor": [f"{DV}::test_check_divergence_factor_is_how_far_above_the_first_loss"],
    "check.amp_overflow_patience": [f"{PR}::test_amp_overflow_patience_is_the_streak_that_becomes_an_incident",
                                    f"{PR}::test_persistent_overflow_is_an_incident"],
    "check.amp_min_scale": [f"{PR}::test_amp_min_scale_turns_an_overflow_below_it_into_an_incident",
                            f"{PR}::test_persistent_overflow_is_an_incident"],
    "check.replicas": [
        "tests/test_replicas.py::test_replicas_that_drift_apart_are_rolled_back_at_the_next_snapshot",
        "tests/test_replicas.py::test_a_healthy_ddp_run_is_untouched_for_one_all_reduce_and_one_host_read_per_step"],
    "check.replica_compare": [
        "tests/test_replicas.py::test_replicas_that_drift_apart_are_rolled_back_at_the_next_snapshot",
        "tests/test_replicas.py::test_one_changed_element_of_one_rank_gradient_copy_is_caught_at_its_step_in_both_sync_modes"],
    "check.replica_tolerance": [
        "tests/test_replicas.py::test_replicas_that_drift_apart_are_rolled_back_at_the_next_snapshot"],
    "check.sync": [f"{SY}::test_the_flags_are_read_once_per_step_and_lagged_one_step_late",
                   f"{SY}::test_16_mixed_guard_skip_joins_the_scaler_found_inf"],
    "clip.max_norm": [f"{PV}::test_fixed_max_norm_bounds_every_step_the_optimizer_applies"],
    "clip.norm_type": [f"{PV}::test_norm_type_is_the_norm_that_is_clipped"],
    "clip.adaptive": [f"{PV}::test_adaptive_on_incident_arms_after_an_incident_and_off_never"],
    "clip.z_threshold": [f"{PV}::test_smaller_of_fixed_and_adaptive_limit_wins"],
    "clip.ema_alpha": [f"{PV}::test_smaller_of_fixed_and_adaptive_limit_wins"],
    "clip.warmup_steps": [f"{PV}::test_smaller_of_fixed_and_adaptive_limit_wins"],
    "clip.agc_clip_factor": [f"{PV}::test_agc_in_a_trainer_bounds_every_unit"],
    "anomaly.mode": [f"{RP}::test_replay_does_not_change_training",
                     f"{RP}::test_anomaly_always_stops_at_the_op_and_cleans_up_on_exception"],
    "anomaly.max_replays": [f"{RP}::test_max_replays_bounds_the_replays_and_reuses_the_last_diagnosis"],
    "anomaly.float64_check": [f"{RP}::test_float64_check_tells_overflow_from_a_real_nan"],
    "anomaly.frames": [f"{RP}::test_frames_is_the_number_of_module_frames_in_the_report"],
    "anomaly.replay_timeout": [f"{RP}::test_replay_timeout_ends_the_replay_and_says_so_never_as_transient"],
    "recovery.max_skips": [f"{PC}::test_ladder_skips_then_rolls_back_then_gives_up",
                           f"{PC}::test_every_batch_poisoned_ends_bounded_with_the_last_good_weights"],
    "recovery.lr_factor": [f"{PC}::test_lr_cuts_stop_at_min_lr_scale"],
    "recovery.reduce_lr_after": [f"{PC}::test_ladder_lr_cuts_by_count_and_on_rollback_but_not_for_inputs"],
    "recovery.incident_window": [f"{PC}::test_incident_window_boundary_in_the_ladder",
                                 f"{PC}::test_incident_window_boundary_in_a_trainer"],
    "recovery.reduce_lr_on_rollback": [f"{PC}::test_reduce_lr_on_rollback_off_rolls_back_without_a_cut"],
    "recovery.divergence_lr_factor": [
        f"{DV}::test_recovery_divergence_lr_factor_is_the_cut_unless_the_diagnosis_asks_for_more"],
    "recovery.min_lr_scale": [f"{PC}::test_lr_cuts_stop_at_min_lr_scale"],
    "recovery.snapshot": [f"{PC}::test_snapshot_every_and_keep_snapshots_in_a_healthy_run",
                          f"{PC}::test_snapshot_off_takes_none_and_refuses_a_nonfinite_checkpoint"],
    "recovery.snapshot_every": [f"{PC}::test_snapshot_every_and_keep_snapshots_in_a_healthy_run"],
    "recovery.keep_snapshots": [f"{PC}::test_snapshot_every_and_keep_snapshots_in_a_healthy_run"],
    "recovery.snapshot_dir": [f"{PC}::test_snapshot_every_and_keep_snapshots_in_a_healthy_run"],
    "recovery.stall_anchors": [
        "tests/test_stall.py::test_the_fit_start_snapshot_is_kept_for_twenty_windows_then_freed"],
    "recovery.max_rollbacks": [f"{PC}::test_ladder_skips_then_rolls_back_then_gives_up"],
    "recovery.confirm_after": [f"{PC}::test_confirm_after_takes_the_confirming_snapshot_sooner"],
    "recovery.skip_batches": [f"{PC}::test_skip_batches_after_rollback"],
    "recovery.transient_limit": ["tests/test_transient.py::test_repeated_transients_make_the_rank_suspect"],
    "recovery.transient_window": ["tests/test_transient.py::test_repeated_transients_make_the_rank_suspect"],
    "recovery.on_suspect_hardware": ["tests/test_transient.py::test_repeated_transients_make_the_rank_suspect",
                                     "tests/test_replicas.py::test_repeated_transients_on_one_rank_stop_every_rank_"
                                     "naming_it"],
    "recovery.on_give_up": [f"{PC}::test_every_batch_poisoned_ends_bounded_with_the_last_good_weights"],
    "recovery.restore_at_end": [
        "tests/test_train_end.py::test_restore_at_end_decides_whether_the_broken_final_weights_are_kept"],
    "logging.events_file": [f"{RC}::test_events_file_switch"],
    "logging.loggers": [f"{RC}::test_loggers_switch"],
    "logging.reports": [f"{RC}::test_reports_switch"],
    "logging.max_reports": [f"{RC}::test_max_reports_keeps_the_first_and_the_newest_report_files"],
    "logging.progress_bar": [f"{RC}::test_progress_bar_status_can_be_turned_off"],
    "logging.verbose": [f"{RC}::test_verbose_switch"],
    "logging.flow_window": ["tests/test_pictures.py::test_a_window_of_zero_keeps_nothing_and_draws_no_flow"],
}


def _source_with_decorators(node_id: str) -> str:
    path, name = node_id.split("::")
    lines = (ROOT / path).read_text().splitlines()
    node = next(n for n in parsed(ROOT / path).body if isinstance(n, ast.FunctionDef) and n.name == name)
    return "\n".join(lines[min([node.lineno] + [d.lineno for d in node.decorator_list]) - 1:node.end_lineno])


def test_every_key_and_no_other_is_in_the_registry():
    keys = [key for key, _, _ in iter_keys()]
    assert len(keys) == len(set(keys)) > 30
    assert sorted(KEY_TESTS) == sorted(keys)
    assert all(KEY_TESTS[key] for key in keys)


def test_every_registered_test_exists_and_sets_its_key():
    found = defined_tests()
    missing = [(key, node) for key, nodes in KEY_TESTS.items() for node in nodes
               if node.split("::")[0] not in [where.split(":")[0] for where in found.get(node.split("::")[1], [])]]
    assert missing == []
    unset = [(key, node) for key, nodes in KEY_TESTS.items() for node in nodes
             if key.split(".")[1] not in _source_with_decorators(node)]
    assert unset == []
