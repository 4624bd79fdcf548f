"""Mutation check: plausible bugs planted one at a time in a copy of the repository; each must make
the tests named for it fail ("killed"). A survivor is a missing test, not a mutant to delete.

    .venv/bin/python scripts/mutants.py            # all mutants (about 7 minutes on 2 cores)
    .venv/bin/python scripts/mutants.py --list     # names, layers and the tests each runs
    .venv/bin/python scripts/mutants.py --only key-drops-step cpu-inf-is-nan

The copy holds the repository's tracked and untracked (not ignored) files, so work in progress
is checked as it is. First the unmutated copy must pass every selected test (a mutant "killed"
by a test that fails anyway would prove nothing); then each mutant is applied, its tests run with
``-x``, and the file restored. Exit status 0 only when the baseline passes and every mutant is
killed; a mutant whose ``old`` text no longer occurs exactly once is an error (update it with the
code it tracks).

Adding one: append a ``Mutant`` to ``MUTANTS`` with a short name, the layer, the file, the exact
text to replace (it must occur once), the buggy text, and the node ids of the tests that should
catch it (the fewest and fastest that do). Run ``--only NAME`` on it, then on the unmutated tree
make sure the named tests pass.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Mutant:
    name: str
    layer: str
    path: str
    old: str
    new: str
    tests: tuple[str, ...]


T_ROUND = "tests/numerics/test_rounding.py"
T_DS = "tests/engines/test_deepspeed.py"
T_FSDP2 = "tests/engines/test_fsdp2.py"
T_AUTH = "tests/weightsync/test_auth.py"
T_EXPORT = "tests/weightsync/test_export.py"
T_CMP = "tests/rl/test_compare.py"
T_SNAP = "tests/weightsync/test_snapshot.py"
T_CTRL = "tests/rollout/test_vllm_control.py"

MUTANTS = [
    Mutant(
        "key-drops-step",
        "numerics: rounding key",
        "dist_sr/numerics/key.py",
        'struct.pack("<QQ", seed, step)',
        'struct.pack("<QQ", seed, 0)',
        (
            "tests/numerics/test_key.py::test_stream_keys_match_the_vectors",
            "tests/numerics/test_key.py::test_dither_ignores_step_and_stochastic_does_not",
        ),
    ),
    Mutant(
        "reference-counter-from-zero",
        "numerics: reference backend",
        "dist_sr/numerics/reference.py",
        "((index >> 2) + 1) * _GAMMA",
        "(index >> 2) * _GAMMA",
        (f"{T_ROUND}::test_backends_match_the_test_vectors[reference]",),
    ),
    Mutant(
        "cpu-inf-is-nan",
        "numerics: C++ CPU backend",
        "dist_sr/numerics/csrc/sr_cpu.cpp",
        "(b & 0x7FFFFFFFu) > 0x7F800000u",
        "(b & 0x7FFFFFFFu) >= 0x7F800000u",
        (f"{T_ROUND}::test_inf_and_signed_zero_are_exact[cpu-stochastic]",),
    ),
    Mutant(
        "triton-misaligned-shift-ignored",
        "numerics: Triton backend",
        "dist_sr/numerics/backends/triton/kernels.py",
        "return u - shift, (g0 - shift) // 4 + blk * R + rows",
        "return u, g0 // 4 + blk * R + rows",
        (
            "tests/numerics/test_triton.py::test_many_tensors_in_one_call_equal_the_reference[misaligned-stochastic-cpu]",
        ),
    ),
    Mutant(
        "triton-device-keys-one-step-late",
        "numerics: backend contract (KeyStep)",
        "dist_sr/numerics/backends/base.py",
        "before = (self.step - 1) % (1 << 64)",
        "before = self.step % (1 << 64)",
        (
            "tests/numerics/test_triton.py::test_fused_keys_derived_on_the_device_at_the_steps_range_ends[stochastic-cpu]",
        ),
    ),
    Mutant(
        "triton-direct-launch-drops-offset",
        "numerics: Triton backend",
        "dist_sr/numerics/backends/triton/sr_launch.py",
        "(xp, op, n, offset, k, keyed, aligned, block)",
        "(xp, op, n, 0, k, keyed, aligned, block)",
        ("tests/numerics/test_triton.py::test_each_specialization_compiles_once",),
    ),
    Mutant(
        "digest-ignores-piece-start",
        "numerics: layout-free digest",
        "dist_sr/numerics/digest.py",
        "signed64(((start + s) * GAMMA) & MASK64)",
        "signed64((s * GAMMA) & MASK64)",
        ("tests/numerics/test_digest.py",),
    ),
    Mutant(
        "adamw-bias-correction-off-by-one",
        "numerics: fused AdamW",
        "dist_sr/numerics/adamw.py",
        "-(self.lr / (1.0 - powi(self.beta1, self.step)))",
        "-(self.lr / (1.0 - powi(self.beta1, self.step + 1)))",
        (
            "tests/optim/test_adamw_sr.py::test_one_step_is_adamw_arithmetic_then_rounded",
            "tests/numerics/test_fused.py::test_shadow_adamw_tracks_shadow_optimizer_and_shares_its_checkpoints",
        ),
    ),
    Mutant(
        "adamw-sr-moments-use-the-weight-key",
        "optim: AdamWSR",
        "dist_sr/numerics/adamw.py",
        'return f"{param}#{moment}"',
        "return param",
        ("tests/optim/test_adamw_sr.py::test_a_step_equals_the_fused_reference_and_moments_use_their_own_keys[bf16]",),
    ),
    Mutant(
        "shadow-adamw-clip-never-scales",
        "optim: ShadowAdamW",
        "dist_sr/optim/shadow.py",
        "self._grad_scale = torch.clamp(float(max_norm) / (norm + 1e-6), max=1.0).reshape(1)",
        "torch.clamp(float(max_norm) / (norm + 1e-6), max=1.0).reshape(1)",
        (
            "tests/numerics/test_fused.py::test_shadow_adamw_clipping_scales_the_update_like_clipping_the_shadow_gradients",
        ),
    ),
    Mutant(
        "shadow-rounds-with-the-previous-step",
        "optim: ShadowOptimizer",
        "dist_sr/optim/shadow.py",
        "            self.step_count += 1\n            self.write_working()",
        "            self.write_working()\n            self.step_count += 1",
        ("tests/optim/test_shadow.py::test_working_weights_are_the_keyed_rounding_of_the_shadows[stochastic]",),
    ),
    Mutant(
        "precision-sr-builds-nearest",
        "precision switch",
        "dist_sr/precision.py",
        "            seed=config.seed,\n            mode=config.rounding,",
        '            seed=config.seed,\n            mode="nearest",',
        (
            "tests/test_precision.py::test_the_switch_builds_the_named_rounding_and_keeps_working_equal_to_the_keyed_shadow[bf16-sr-stochastic]",
        ),
    ),
    Mutant(
        "precision-drops-the-seed",
        "precision switch",
        "dist_sr/precision.py",
        "            seed=config.seed,\n            mode=config.rounding,",
        "            mode=config.rounding,",
        (
            "tests/test_precision.py::test_the_switch_builds_the_named_rounding_and_keeps_working_equal_to_the_keyed_shadow[bf16-sr-stochastic]",
        ),
    ),
    Mutant(
        "deepspeed-fragment-offset-zero",
        "engines: DeepSpeed offsets",
        "dist_sr/engines/deepspeed/layouts.py",
        "p, lp.start, hp.numel, hp.start)",
        "p, 0, hp.numel, hp.start)",
        (f"{T_DS}::test_every_bf16_element_is_the_keyed_rounding_of_the_full_master[zero2]",),
    ),
    Mutant(
        "deepspeed-zero3-flat-offset",
        "engines: DeepSpeed offsets",
        "dist_sr/engines/deepspeed/layouts.py",
        "param, rank * n, n, at)",
        "param, at, n, at)",
        (f"{T_DS}::test_every_bf16_element_is_the_keyed_rounding_of_the_full_master[zero3]",),
    ),
    Mutant(
        "deepspeed-reload-keeps-rtn-copies",
        "engines: DeepSpeed reload",
        "dist_sr/engines/deepspeed/hook.py",
        "            self.resync()  # the loaders copy RTN",
        "            pass  # the loaders copy RTN",
        (
            f"{T_DS}::test_checkpoint_reload_re_derives_identical_bits[zero1-bf16-optimizer]",
            f"{T_DS}::test_checkpoint_reload_re_derives_identical_bits[zero3]",
            f"{T_DS}::test_universal_checkpoint_reloads_at_another_world_size_with_identical_bits[zero2-1]",
        ),
    ),
    Mutant(
        "deepspeed-checkpoint-guard-compares-itself",
        "engines: checkpoint digests",
        "dist_sr/engines/deepspeed/engine.py",
        'if digest != client["dist_sr_digest"] or expected != client["dist_sr_digest"]:',
        "if digest != expected:",
        (f"{T_DS}::test_our_deepspeed_checkpoints_are_verified_on_save_and_on_load",),
    ),
    Mutant(
        "single-checkpoint-loads-weights-over-shadows",
        "engines: checkpoint digests",
        "dist_sr/engines/single.py",
        '        self.module.load_state_dict(state["model"])\n'
        '        self.precision.load_state_dict(state["precision"])  # re-derives the working weights',
        '        self.precision.load_state_dict(state["precision"])  # re-derives the working weights\n'
        '        self.module.load_state_dict(state["model"])',
        ("tests/engines/test_single.py::test_shadows_that_do_not_round_to_the_saved_weights_are_refused",),
    ),
    Mutant(
        "fsdp2-shard-offset-in-rows",
        "engines: FSDP2 offsets",
        "dist_sr/numerics/shards.py",
        "return coord * chunk * inner, rows, padded",
        "return coord * chunk, rows, padded",
        (f"{T_FSDP2}::test_working_weights_are_the_keyed_rounding_of_the_full_master[2]",),
    ),
    Mutant(
        "fsdp2-cache-ignores-master-writes",
        "engines: FSDP2 reload",
        "dist_sr/engines/fsdp2/gather.py",
        "return at is None or at[0] != ctx.step or at[1] != ctx.version",
        "return at is None or at[0] != ctx.step",
        (f"{T_FSDP2}::test_the_gathered_bits_and_the_masters_rounding_are_two_independent_digests",),
    ),
    Mutant(
        "plan-accepts-overlapping-spans",
        "weightsync: plan",
        "dist_sr/weightsync/plan.py",
        "if p.start != covered or",
        "if p.start > covered or",
        ("tests/weightsync/test_plan.py",),
    ),
    Mutant(
        "sync-verifies-names-not-bits",
        "weightsync: verification",
        "dist_sr/weightsync/sync.py",
        'if r.get("digests", {}).get(n) != expected.get(n)\n',
        'if n not in r.get("digests", {}) or n not in expected\n',
        (
            "tests/weightsync/test_receiver_fleet.py::"
            "test_a_receiver_holding_other_bits_is_named_with_its_tensor_and_gets_no_rollouts",
        ),
    ),
    Mutant(
        "trainer-skips-the-rollout-digest",
        "rl: trainer verification",
        "dist_sr/rl/trainer.py",
        "if ro.weight_digest != trainer_digest:",
        "if ro.weight_digest is None:",
        ("tests/rl/test_trainer.py::test_rollouts_from_other_weights_are_caught",),
    ),
    Mutant(
        "resume-relabels-prompts",
        "rl: resume",
        "dist_sr/rl/trainer.py",
        'random.Random(step_seed(cfg.seed, step, self.stream("prompts")))',
        'random.Random(step_seed(cfg.seed, step - self.start, self.stream("prompts")))',
        ("tests/rl/test_trainer.py::test_resuming_continues_the_same_metric_curve",),
    ),
    Mutant(
        "checkpoint-manifest-not-compared",
        "engines: checkpoint files",
        "dist_sr/engines/checkpoints.py",
        "bad = sorted(set(want) ^ have) + sorted(n for n in set(want) & have if _sha256(directory / n) != want[n])",
        "bad = sorted(set(want) ^ have)",
        (f"{T_FSDP2}::test_a_corrupted_latest_fsdp2_checkpoint_is_refused_and_the_previous_one_resumes",),
    ),
    Mutant(
        "single-content-digest-not-checked",
        "engines: checkpoint files",
        "dist_sr/engines/single.py",
        "if recorded is None or state_digest(state) != recorded:",
        "if recorded is None:",
        ("tests/engines/test_single.py::test_a_flipped_bit_anywhere_in_the_state_is_refused",),
    ),
    Mutant(
        "nonfinite-loss-trained-on",
        "rl: non-finite steps",
        "dist_sr/rl/trainer.py",
        "nonfinite = _all_sum([0.0 if bool(torch.isfinite(loss.detach())) else 1.0], self.world)[0] > 0",
        "nonfinite = False",
        ("tests/rl/test_distributed_trainer.py::test_deepspeed_bf16_never_steps_on_a_non_finite_loss",),
    ),
    Mutant(
        "run-directory-overwritten-unasked",
        "rl: run directories",
        "dist_sr/rl/rundir.py",
        '        if not overwrite:\n            raise ConfigError(\n                f"{out_dir} already holds a run',
        '        if overwrite:\n            raise ConfigError(\n                f"{out_dir} already holds a run',
        ("tests/rl/test_run_safety.py::test_a_run_directory_holding_a_run_is_not_reused_without_being_told",),
    ),
    Mutant(
        "planner-rank-from-local-rank",
        "launch: planner",
        "dist_sr/launch/planner.py",
        'rank = _int_env(env, "RANK") or 0',
        'rank = _int_env(env, "LOCAL_RANK") or 0',
        (
            "tests/launch/test_entry_point.py::test_the_launchers_environment_and_deepspeeds_local_rank_argument_are_read",
        ),
    ),
    Mutant(
        "receiver-accepts-unsigned-requests",
        "weightsync: authentication",
        "dist_sr/weightsync/receiver.py",
        "self.receiver.verifier.request(self.command, self.path, body, self.headers)",
        "pass",
        (f"{T_AUTH}::test_without_the_secret_nobody_can_push_weights_and_what_the_receiver_holds_is_unchanged",),
    ),
    Mutant(
        "worker-trusts-unsigned-init-info",
        "weightsync: authentication",
        "dist_sr/weightsync/receiver.py",
        'self.verifier.payload("init_info", info.fields(), info.auth)',
        "pass",
        (f"{T_AUTH}::test_without_the_secret_nobody_can_push_weights_and_what_the_receiver_holds_is_unchanged",),
    ),
    Mutant(
        "nonces-may-repeat",
        "weightsync: authentication",
        "dist_sr/weightsync/auth.py",
        "if nonce in self._seen:",
        "if False:",
        (f"{T_AUTH}::test_a_signed_request_verifies_once_and_any_change_is_refused",),
    ),
    Mutant(
        "middleware-guards-only-weight-routes",
        "rollout: vLLM control routes",
        "dist_sr/rollout/vllm/auth.py",
        "return path in PUBLIC_PATHS or path.startswith(PUBLIC_PREFIXES)",
        'return path in PUBLIC_PATHS or path.startswith(PUBLIC_PREFIXES) or "weight" not in path',
        (
            "tests/rollout/test_vllm_auth.py::test_control_routes_need_a_signature_and_the_app_never_sees_an_unsigned_one",
        ),
    ),
    Mutant(
        "store-listens-on-every-interface",
        "weightsync: store",
        "dist_sr/weightsync/transport.py",
        "fd = listen_socket(host, port).detach() if is_master else None",
        'fd = listen_socket("0.0.0.0", port).detach() if is_master else None',
        (f"{T_AUTH}::test_the_weight_group_store_listens_on_the_configured_host_only",),
    ),
    Mutant(
        "failed-init-drops-the-groups",
        "weightsync: receiver",
        "dist_sr/weightsync/receiver.py",
        '        self.verifier.payload("init_info", info.fields(), info.auth)\n        info.check()',
        '        self.shutdown()\n        self.verifier.payload("init_info", info.fields(), info.auth)\n'
        "        info.check()",
        (f"{T_AUTH}::test_bad_requests_get_a_4xx_naming_the_problem_and_change_nothing",),
    ),
    Mutant(
        "plan-size-unchecked",
        "weightsync: receiver",
        "dist_sr/weightsync/receiver.py",
        "if self.max_bytes is not None and total > self.max_bytes:",
        "if False:",
        (f"{T_AUTH}::test_bad_requests_get_a_4xx_naming_the_problem_and_change_nothing",),
    ),
    Mutant(
        "shadow-optimizer-trains-on-nan",
        "optim: non-finite gradients",
        "dist_sr/optim/shadow.py",
        "if self.loss_scaler is None and self.skip_nonfinite and self._nonfinite():",
        "if False:",
        (
            "tests/optim/test_shadow.py::test_a_nonfinite_gradient_without_a_loss_scaler_skips_the_step_and_training"
            "_goes_on_as_if_it_never_came",
        ),
    ),
    Mutant(
        "deepspeed-json-disagreement-ignored",
        "engines: DeepSpeed config",
        "dist_sr/engines/deepspeed/config.py",
        "        if mine != v:\n",
        "        if False:\n",
        (
            "tests/launch/test_entry_point.py::test_the_deepspeed_json_and_the_experiment_have_one_set_of_hyperparameters",
        ),
    ),
    Mutant(
        "hook-attaches-to-reference-models",
        "engines: DeepSpeed hook",
        "dist_sr/engines/deepspeed/hook.py",
        "        reason = untrained(engine)\n",
        "        reason = None\n",
        (
            "tests/engines/test_deepspeed_hook.py::"
            "test_reference_models_built_from_the_training_config_are_left_alone_and_logged",
        ),
    ),
    Mutant(
        "engine-events-not-compared",
        "weightsync: verification",
        "dist_sr/weightsync/sync.py",
        'return sorted(([r.get("rank"), r.get("boot"), r.get("events")] for r in reports), key=repr)',
        'return sorted(([r.get("rank"), r.get("boot")] for r in reports), key=repr)',
        (f"{T_AUTH}::test_the_trainer_sees_an_engine_that_changed_after_it_was_verified",),
    ),
    Mutant(
        "export-rounds-to-nearest",
        "weightsync: export",
        "dist_sr/weightsync/export.py",
        "offset=offset, mode=owner.mode\n",
        'offset=offset, mode="nearest"\n',
        (f"{T_EXPORT}::test_export_refuses_what_it_cannot_round_faithfully",),
    ),
    Mutant(
        "export-ignores-offset",
        "weightsync: export",
        "dist_sr/weightsync/export.py",
        "param=owner.key_name(name), offset=offset,",
        "param=owner.key_name(name), offset=0,",
        (f"{T_EXPORT}::test_export_refuses_what_it_cannot_round_faithfully",),
    ),
    Mutant(
        "sparse-pairs-ignore-the-shard-offset",
        "weightsync: peers' pairs",
        "dist_sr/weightsync/sparse.py",
        "SparsePatch(name, (local + start).to(torch.int32),",
        "SparsePatch(name, local.to(torch.int32),",
        (
            "tests/weightsync/test_sparse.py::"
            "test_pairs_reproduce_sr_steps_and_special_values_bit_for_bit_from_two_shard_layouts",
        ),
    ),
    Mutant(
        "snapshot-chain-digest-unchecked",
        "weightsync: snapshots",
        "dist_sr/weightsync/snapshot.py",
        'if digest != info["digest"]:',
        "if False:",
        (
            "tests/weightsync/test_snapshot.py::"
            "test_a_damaged_delta_stops_the_catch_up_at_the_last_version_that_verifies",
        ),
    ),
    Mutant(
        "triton-delta-sign-inverted",
        "numerics: delta codec (Triton)",
        "dist_sr/numerics/backends/triton/delta_kernels.py",
        "code = (code + 1 - 2 * sign) & 0xFFFF",
        "code = (code - 1 + 2 * sign) & 0xFFFF",
        ("tests/numerics/test_delta.py::test_adversarial_codes_roundtrip_and_count_as_specified",),
    ),
    Mutant(
        "trl-push-not-routed",
        "integrations: TRL",
        "dist_sr/integrations/trl.py",
        "yield name, export_bf16(name, tensor, key=callback.ctx)",
        "yield name, tensor",
        ("tests/integrations/test_trl.py::test_fsdp2_trl_export_pushes_the_keyed_bits_not_the_masters",),
    ),
    Mutant(
        "trl-resume-restarts-the-key",
        "integrations: TRL",
        "dist_sr/integrations/trl.py",
        "self.ctx.step = int(state.global_step)",
        "self.ctx.step = self.ctx.step",
        ("tests/integrations/test_trl.py::test_fsdp2_trl_export_pushes_the_keyed_bits_not_the_masters",),
    ),
    Mutant(
        "fsdp2-wrapper-lost-on-device-move",
        "engines: FSDP2 hook",
        "dist_sr/engines/fsdp2/hook.py",
        "    aten._to_copy.default,\n    aten.empty_like.default,\n",
        "",
        (
            "tests/engines/test_fsdp2.py::"
            "test_a_model_materialised_after_wrapping_keeps_rounding_with_the_key_on_every_rank",
        ),
    ),
    Mutant(
        "deepspeed-environment-switch-ignored",
        "engines: DeepSpeed config",
        "dist_sr/engines/deepspeed/config.py",
        "    if not block_present:\n        return from_env",
        "    if not block_present:\n        return None",
        ("tests/engines/test_deepspeed_hook.py::test_the_jobs_environment_turns_sr_on_for_a_config_without_the_block",),
    ),
    Mutant(
        "async-grpo-stream-not-routed",
        "integrations: TRL",
        "dist_sr/integrations/trl.py",
        "yield name, export_bf16(name, full, key=callback.ctx).to(wire.get(name, full.dtype))",
        "yield name, full",
        ("tests/integrations/test_trl.py::test_fsdp2_trl_export_pushes_the_keyed_bits_not_the_masters",),
    ),
    Mutant(
        "single-load-catches-few-errors",
        "engines: checkpoint fallback",
        "dist_sr/engines/single.py",
        "            except Exception as exc:  # any failure to read or verify",
        "            except (CheckpointCorrupt, RuntimeError) as exc:  # any failure to read or verify",
        (
            "tests/engines/test_checkpoint_fuzz.py::"
            "test_any_damage_to_the_newest_single_checkpoint_resumes_from_one_that_verifies",
        ),
    ),
    Mutant(
        "refused-checkpoint-left-in-rotation",
        "engines: checkpoint fallback",
        "dist_sr/engines/single.py",
        "                quarantine(bad, path, reason)",
        "                pass",
        (
            "tests/engines/test_checkpoint_fuzz.py::"
            "test_any_damage_to_the_newest_single_checkpoint_resumes_from_one_that_verifies",
        ),
    ),
    Mutant(
        "latest-keeps-naming-the-refused-step",
        "engines: checkpoint fallback",
        "dist_sr/engines/checkpoints.py",
        '                write_atomic(root / "latest", choice[0])',
        "                pass",
        (
            "tests/engines/test_checkpoint_fuzz.py::"
            "test_any_damage_to_the_newest_sharded_checkpoint_resumes_from_one_that_verifies[fsdp2]",
        ),
    ),
    Mutant(
        "preflight-skipped",
        "rl: checks before compute",
        "dist_sr/rl/trainer.py",
        "        preflight(cfg, out_dir)  # secrets",
        "        pass  # secrets",
        ("tests/rl/test_run_safety.py::test_refusals_that_can_come_before_compute_do",),
    ),
    Mutant(
        "skipped-share-unchecked",
        "rl: skipped steps",
        "dist_sr/rl/trainer.py",
        "        if self.skipped > g.max_skipped_fraction * g.steps:",
        "        if False:",
        ("tests/rl/test_run_safety.py::test_a_run_that_skips_its_steps_stops_instead_of_finishing_untrained",),
    ),
    Mutant(
        "held-record-skips-the-cast",
        "rollout: vLLM held weights",
        "dist_sr/rollout/vllm/held.py",
        "stored = stored.to(self.dtype)",
        "stored = stored",
        (
            "tests/rollout/test_held_record.py::test_the_record_digests_what_the_engine_stores_and_passes_the_tensors_on",
        ),
    ),
    Mutant(
        "checkpoint-manifest-signature-optional",
        "engines: checkpoints",
        "dist_sr/engines/checkpoints.py",
        "    if key is not None and mac is None:",
        "    if False and mac is None:",
        ("tests/engines/test_checkpoints.py::test_files_planted_with_matching_unsigned_hashes_are_refused",),
    ),
    Mutant(
        "shadow-adamw-steps-not-advanced",
        "optim: ShadowAdamW",
        "dist_sr/optim/shadow.py",
        "            self._step_buffer.add_(1.0)",
        "            pass",
        ("tests/numerics/test_fused.py::test_shadow_adamw_tracks_shadow_optimizer_and_shares_its_checkpoints",),
    ),
    Mutant(
        "fused-steps-share-the-latest-adam-step",
        "optim: fused AdamW steps",
        "dist_sr/optim/fused_step.py",
        'group["weight_decay"], step))',
        'group["weight_decay"], int(s.max())))',
        (
            "tests/numerics/test_triton.py::test_irregular_steps_through_the_array_host_path_equal_the_reference[AdamWSR-fp32-cpu]",
        ),
    ),
    Mutant(
        "fused-plan-skips-the-contiguous-copy",
        "numerics: fused AdamW",
        "dist_sr/numerics/fused.py",
        "        if all(map(torch.Tensor.is_contiguous, grads)):\n            return grads",
        "        if True:\n            return grads",
        (
            "tests/numerics/test_triton.py::test_irregular_steps_through_the_array_host_path_equal_the_reference[AdamWSR-fp32-cpu]",
        ),
    ),
    Mutant(
        "launcher-ignores-constexprs",
        "numerics: Triton backend",
        "dist_sr/numerics/backends/triton/launcher.py",
        "key = (spec, device, num_warps, kws)",
        "key = (spec, device, num_warps)",
        ("tests/numerics/test_triton.py::test_a_direct_launch_passes_the_arguments_the_jit_launch_passed",),
    ),
    Mutant(
        "dead-zone-full-spacing",
        "optim: sticking metrics",
        "dist_sr/optim/metrics.py",
        "half = bf16_spacing(before.float()).view(-1) / 2",
        "half = bf16_spacing(before.float()).view(-1)",
        ("tests/optim/test_metrics.py::test_dead_zone_fraction_counts_updates_below_half_a_bf16_spacing",),
    ),
    Mutant(
        "claim-holds-at-any-checkpoint",
        "rl: comparison report",
        "dist_sr/rl/compare/summary.py",
        "return (what + at, len(held) == len(starts),",
        "return (what + at, len(held) > 0,",
        (f"{T_CMP}::test_spreads_and_checks_are_over_start_checkpoints",),
    ),
    Mutant(
        "seed-spread-over-all-runs",
        "rl: comparison report",
        "dist_sr/rl/compare/summary.py",
        "seeds = mean([std(vals) for vals in per_start]) if len(per_start[0]) > 1 else None",
        "seeds = std(flat) if len(per_start[0]) > 1 else None",
        (f"{T_CMP}::test_spreads_and_checks_are_over_start_checkpoints",),
    ),
    Mutant(
        "compare-workers-unpinned",
        "rl: comparison runner",
        "dist_sr/rl/compare/runner.py",
        "pinned(cfg.cpu_isa),",
        "pinned(None),",
        ("tests/rl/test_cpu_math.py::test_the_workers_compute_with_the_pinned_isa",),
    ),
    Mutant(
        "warmup-cache-ignores-the-pin",
        "rl: warm-up cache",
        "dist_sr/rl/warmup.py",
        'parts.append(f"cpu-isa-{isa}")',
        "pass",
        ("tests/rl/test_cpu_math.py::test_warmup_cache_tells_pinned_from_unpinned",),
    ),
    Mutant(
        "ipc-sender-ignores-refusals",
        "weightsync: colocated transfer",
        "dist_sr/weightsync/ipc.py",
        "        if refusals:\n",
        "        if refusals and False:\n",
        (
            "tests/weightsync/test_ipc.py::"
            "test_a_receiver_that_cannot_take_the_buffer_fails_the_sender_at_once_with_its_reason",
        ),
    ),
    Mutant(
        "ipc-receiver-takes-any-size",
        "weightsync: colocated transfer",
        "dist_sr/weightsync/ipc.py",
        'if msg.get("nbytes") != n or not isinstance(at, int)',
        "if not isinstance(at, int)",
        ("tests/weightsync/test_ipc.py",),
    ),
    Mutant(
        "native-verifies-names-not-bits",
        "rollout: vLLM's own transfer engines",
        "dist_sr/rollout/vllm/native.py",
        "differ = sorted(n for n in sent if entries.get(n) != sent[n])",
        "differ = sorted(n for n in sent if n not in entries)",
        ("tests/rollout/test_vllm_native.py::test_check_held_names_the_tensors_that_differ",),
    ),
    Mutant(
        "delta-codes-across-dtypes",
        "numerics: delta codec",
        "dist_sr/numerics/delta.py",
        "if old.dtype != new.dtype:",
        "if False:",
        ("tests/numerics/test_delta.py::test_versions_of_two_16_bit_dtypes_are_refused_naming_both",),
    ),
    Mutant(
        "materialize-writes-inside-the-snapshots",
        "weightsync: snapshots",
        "dist_sr/weightsync/snapshot.py",
        "if target == src or src in target.parents or _same_as_any(src, target):",
        "if False:",
        (
            f"{T_SNAP}::test_an_out_that_is_the_snapshots_inside_them_or_holding_them_is_refused_before_"
            "anything_is_touched[DIR/new]",
        ),
    ),
    Mutant(
        "materialize-replaces-what-it-did-not-write",
        "weightsync: snapshots",
        "dist_sr/weightsync/snapshot.py",
        "        foreign = _not_ours(target)\n",
        "        foreign = []\n",
        (f"{T_SNAP}::test_an_out_holding_what_materialize_did_not_write_is_refused_and_left_as_it_was",),
    ),
    Mutant(
        "materialize-runs-do-not-take-turns",
        "weightsync: snapshots",
        "dist_sr/weightsync/snapshot.py",
        "fcntl.flock(self.fd, fcntl.LOCK_EX)",
        "fcntl.LOCK_EX",
        (f"{T_SNAP}::test_runs_into_one_out_take_turns_and_each_ends_in_a_verified_checkpoint",),
    ),
    Mutant(
        "materialize-os-error-is-a-traceback",
        "weightsync: snapshots",
        "dist_sr/weightsync/snapshot.py",
        "        shutil.rmtree(tmp, ignore_errors=True)\n        raise _os_refusal(exc, out) from None",
        "        raise",
        (f"{T_SNAP}::test_a_read_only_parent_is_one_line_and_the_checkpoint_there_is_kept",),
    ),
    Mutant(
        "snapshot-version-not-compared-with-its-name",
        "weightsync: snapshots",
        "dist_sr/weightsync/snapshot.py",
        "if not isinstance(signed, int) or isinstance(signed, bool) or signed != named:",
        "if not isinstance(signed, int) or isinstance(signed, bool):",
        (f"{T_SNAP}::test_a_renamed_or_copied_entry_is_refused_naming_its_signed_version_and_its_name",),
    ),
    Mutant(
        "materialize-skips-the-kernels",
        "weightsync: snapshots",
        "dist_sr/weightsync/snapshot.py",
        "for why in cpu.warm_up():",
        "for why in []:",
        (f"{T_SNAP}::test_materialize_takes_the_kernels_and_writes_the_bytes_the_torch_paths_write",),
    ),
    Mutant(
        "sparse-refusal-keeps-the-held-copies",
        "weightsync: sparse export",
        "dist_sr/weightsync/sparse.py",
        "            self.reset()  # the peer takes this version dense: so does the next export",
        "            pass",
        (
            "tests/weightsync/test_sparse.py::"
            "test_a_refused_export_changes_no_held_copy_and_the_peer_stays_right_without_a_reset",
        ),
    ),
    Mutant(
        "sparse-held-moves-before-delivery",
        "weightsync: sparse export",
        "dist_sr/weightsync/sparse.py",
        "        self._pending = pending, dense\n",
        "        self._pending = pending, dense\n        self.delivered()\n        self._pending = pending, dense\n",
        ("tests/weightsync/test_sparse.py::test_pairs_not_delivered_leave_the_next_pairs_against_what_the_peer_holds",),
    ),
    Mutant(
        "sparse-digest-compares-names-not-bits",
        "weightsync: sparse export",
        "dist_sr/weightsync/sparse.py",
        "return sorted(n for n in want if held.get(n) != want[n])",
        "return sorted(n for n in want if n not in held)",
        ("tests/weightsync/test_sparse.py::test_the_digest_beside_the_pairs_names_the_tensor_a_peer_holds_otherwise",),
    ),
    Mutant(
        "ipc-size-claim-unchecked",
        "weightsync: colocated transfer",
        "dist_sr/weightsync/ipc.py",
        'if not stat.S_ISREG(st.st_mode) or st.st_size != h["size"]:',
        "if not stat.S_ISREG(st.st_mode):",
        (
            "tests/weightsync/test_ipc.py::"
            "test_a_handle_claiming_another_size_than_the_segment_is_refused_and_the_segment_stays_usable",
        ),
    ),
    Mutant(
        "ipc-maps-any-name",
        "weightsync: colocated transfer",
        "dist_sr/weightsync/ipc.py",
        "if m is None or m.group(1) != tag:\n            raise IpcError(",
        "if False:\n            raise IpcError(",
        ("tests/weightsync/test_ipc.py::test_a_handle_naming_anything_but_a_segment_of_this_group_is_refused",),
    ),
    Mutant(
        "ipc-segment-kept-after-every-engine-mapped-it",
        "weightsync: colocated transfer",
        "dist_sr/weightsync/ipc.py",
        "            self.segment.unlink()",
        "            pass",
        ("tests/weightsync/test_ipc.py::test_a_segment_is_unlinked_once_every_receiver_has_mapped_it",),
    ),
    Mutant(
        "ipc-engine-keeps-a-dead-trainers-buffer",
        "weightsync: colocated transfer",
        "dist_sr/weightsync/ipc.py",
        "group._mapped.pop(key, None)",
        "pass",
        (
            "tests/weightsync/test_ipc.py::"
            "test_a_killed_trainer_leaves_nothing_in_shm_and_the_engine_drops_its_buffer_at_once",
        ),
    ),
    Mutant(
        "http-returns-a-non-json-answer-as-text",
        "rollout: vLLM control routes",
        "dist_sr/rollout/vllm/control.py",
        'raise MalformedReply(f"{where}: the answer is not JSON ({exc.msg}): {text[:200]!r}") from None',
        'return {"text": text}',
        (f"{T_CTRL}::test_every_reply_that_is_not_an_answer_names_the_engine_and_what_was_wrong[not-json]",),
    ),
    Mutant(
        "http-lets-protocol-errors-through",
        "rollout: vLLM control routes",
        "dist_sr/rollout/vllm/control.py",
        "except (HTTPException, ValueError) as exc:",
        "except (KeyError,) as exc:",
        (
            f"{T_CTRL}::test_every_reply_that_is_not_an_answer_names_the_engine_and_what_was_wrong[banner]",
            f"{T_CTRL}::test_every_reply_that_is_not_an_answer_names_the_engine_and_what_was_wrong[cut-short]",
        ),
    ),
    Mutant(
        "sync-retries-engines-that-do-not-answer",
        "weightsync: fleet sync",
        "dist_sr/weightsync/sync.py",
        "if e.url in self.unanswered:",
        "if False:",
        (
            "tests/weightsync/test_receiver_fleet.py::"
            "test_engines_that_answer_badly_are_marked_down_with_url_and_reason_and_the_sync_goes_on",
        ),
    ),
    Mutant(
        "fan-out-keeps-engines-that-answer-badly",
        "rollout: vLLM's own transfer engines",
        "dist_sr/rollout/vllm/native.py",
        "            self.down[url] = why",
        "            pass",
        (
            "tests/rollout/test_vllm_native.py::"
            "test_a_fan_out_client_marks_engines_that_answer_badly_down_and_goes_on_with_the_others",
        ),
    ),
    Mutant(
        "placement-staged-bits-never-copied",
        "engines: device-aware rounding plan",
        "dist_sr/engines/placement.py",
        "            dest.copy_(staging, non_blocking=asynchronous)",
        "            pass",
        ("tests/engines/test_placement.py::test_a_staged_plan_delivers_the_bits_of_rounding_in_place",),
    ),
    Mutant(
        "column-shard-rows-taken-as-contiguous",
        "numerics: shard offsets",
        "dist_sr/numerics/shards.py",
        "rows = None if b.row_stride == b.row_len or r1 - r0 == 1 else (b.row_len, b.row_stride)",
        "rows = None",
        (
            "tests/engines/test_placement.py::"
            "test_any_fragment_of_a_column_shard_is_keyed_by_its_index_in_the_full_parameter[0-15]",
        ),
    ),
    Mutant(
        "deepspeed-offload-copies-rtn",
        "engines: DeepSpeed offload",
        "dist_sr/engines/deepspeed/layouts.py",
        "            masters[group_no] = self.buffers()[group_no]",
        "            pass",
        (
            "tests/engines/test_deepspeed_offload.py::"
            "test_offload_layouts_hold_the_keyed_rounding_of_the_full_master[zero2-offload-optimizer-pinned]",
        ),
    ),
    Mutant(
        "deepspeed-offload-states-keeps-partitions",
        "engines: DeepSpeed offload",
        "dist_sr/engines/deepspeed/hook.py",
        "                self.release()\n",
        "                pass\n",
        ("tests/engines/test_deepspeed_offload.py::test_offload_states_frees_the_partitions_dist_sr_rounded[with-sr]",),
    ),
    Mutant(
        "deepspeed-quantized-weights-accepted",
        "engines: DeepSpeed refusals",
        "dist_sr/engines/deepspeed/layouts.py",
        "        if zero.get(field):",
        "        if False:",
        ("tests/engines/test_deepspeed_offload.py::test_zero_plus_plus_quantized_weights_are_refused_by_name",),
    ),
    Mutant(
        "autotp-keyed-by-local-offset",
        "engines: DeepSpeed tensor parallelism",
        "dist_sr/engines/deepspeed/layouts.py",
        "self.blocks = tp_blocks(sr.engine, sr.engine.module)",
        "self.blocks = {}",
        ("tests/engines/test_deepspeed_tp.py::test_tensor_parallel_shards_hold_the_single_rank_bits[tp2]",),
    ),
    Mutant(
        "autotp-scaled-shard-accepted",
        "engines: DeepSpeed tensor parallelism",
        "dist_sr/engines/deepspeed/tp.py",
        "        if piece.scale != 1.0:",
        "        if False:",
        ("tests/engines/test_deepspeed_tp.py::test_a_shard_holding_a_scaled_copy_is_refused_by_name",),
    ),
    Mutant(
        "fsdp2-device-move-keeps-storage",
        "engines: FSDP2 offload",
        "dist_sr/engines/fsdp2/hook.py",
        "                rounder.release()  # an offload",
        "                pass  # an offload",
        (
            "tests/engines/test_fsdp2_offload.py::"
            "test_moving_the_masters_to_another_device_leaves_dist_sr_holding_no_storage",
        ),
    ),
    Mutant(
        "fsdp2-offload-moves-the-fp32-master",
        "engines: FSDP2 offload",
        "dist_sr/engines/fsdp2/hook.py",
        "                if moved is not None:",
        "                if False:",
        ("tests/engines/test_fsdp2_offload.py::test_an_offloaded_shard_moves_to_the_device_as_its_bf16_bits",),
    ),
]


# Mutants whose tests took 12 s or more each in the full check of 2026-12-03 (several processes,
# a GRPO run, a kernel rebuild; 26 of 61, 561 s of its 792 s): CI's time limit leaves room for the
# others only (``--fast``); the full check (no flag) runs every one.
SLOW = frozenset(
    {
        "cpu-inf-is-nan",
        "adamw-bias-correction-off-by-one",
        "deepspeed-fragment-offset-zero",
        "deepspeed-zero3-flat-offset",
        "deepspeed-reload-keeps-rtn-copies",
        "deepspeed-checkpoint-guard-compares-itself",
        "fsdp2-shard-offset-in-rows",
        "fsdp2-cache-ignores-master-writes",
        "sync-verifies-names-not-bits",
        "trainer-skips-the-rollout-digest",
        "resume-relabels-prompts",
        "checkpoint-manifest-not-compared",
        "nonfinite-loss-trained-on",
        "run-directory-overwritten-unasked",
        "worker-trusts-unsigned-init-info",
        "failed-init-drops-the-groups",
        "plan-size-unchecked",
        "shadow-optimizer-trains-on-nan",
        "hook-attaches-to-reference-models",
        "engine-events-not-compared",
        "trl-push-not-routed",
        "trl-resume-restarts-the-key",
        "fsdp2-wrapper-lost-on-device-move",
        "async-grpo-stream-not-routed",
        "latest-keeps-naming-the-refused-step",
        "skipped-share-unchecked",
        "deepspeed-offload-copies-rtn",
        "deepspeed-offload-states-keeps-partitions",
        "deepspeed-quantized-weights-accepted",
        "autotp-keyed-by-local-offset",
        "fsdp2-device-move-keeps-storage",
        "fsdp2-offload-moves-the-fp32-master",
        # issue 43: a tiny model's snapshot chain, CLI processes, real receivers, a killed trainer
        "materialize-writes-inside-the-snapshots",
        "materialize-replaces-what-it-did-not-write",
        "materialize-runs-do-not-take-turns",
        "materialize-os-error-is-a-traceback",
        "snapshot-version-not-compared-with-its-name",
        "materialize-skips-the-kernels",
        "ipc-segment-kept-after-every-engine-mapped-it",
        "ipc-engine-keeps-a-dead-trainers-buffer",
        "sync-retries-engines-that-do-not-answer",
    }
)


def copy_repo(dest: Path) -> None:
    files = (
        subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=REPO,
            check=True,
            capture_output=True,
        )
        .stdout.decode()
        .split("\0")
    )
    for rel in filter(None, files):
        src = REPO / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)


def run_tests(copy: Path, tests: tuple[str, ...], timeout: int) -> tuple[int, float, str]:
    env = {k: v for k, v in os.environ.items() if k != "CI"}  # a skip is a pass here, never a kill
    env["PYTHONPATH"] = str(copy)
    t0 = time.perf_counter()
    try:
        r = subprocess.run(
            [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests],
            cwd=copy,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        rc, out = r.returncode, r.stdout + r.stderr
    except subprocess.TimeoutExpired:
        rc, out = -1, "timed out"
    return rc, time.perf_counter() - t0, out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", nargs="+", metavar="NAME", help="run these mutants only")
    ap.add_argument("--list", action="store_true", help="list the mutants and exit")
    ap.add_argument("--timeout", type=int, default=600, help="seconds per test run")
    ap.add_argument(
        "--no-baseline",
        action="store_true",
        help="skip the unmutated run: only where the whole suite has just passed on this tree (CI)",
    )
    ap.add_argument("--fast", action="store_true", help="leave out the SLOW mutants (CI)")
    args = ap.parse_args()
    if SLOW - {m.name for m in MUTANTS}:
        print(f"SLOW names no mutant: {sorted(SLOW - {m.name for m in MUTANTS})}", file=sys.stderr)
        return 2
    mutants = [m for m in MUTANTS if (not args.only or m.name in args.only) and not (args.fast and m.name in SLOW)]
    if args.only and len(mutants) != len(set(args.only)):
        print(f"unknown mutant(s): {sorted(set(args.only) - {m.name for m in MUTANTS})}", file=sys.stderr)
        return 2
    if args.list:
        for m in mutants:
            print(f"{m.name:48s} {m.layer:32s} {m.path}\n{'':48s} tests: {' '.join(m.tests)}")
        return 0
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="dist-sr-mutants-") as tmp:
        copy = Path(tmp)
        copy_repo(copy)
        for m in mutants:  # every mutant must still match the code it tracks
            if (copy / m.path).read_text().count(m.old) != 1:
                print(
                    f"error: mutant {m.name}: its text does not occur exactly once in {m.path}; update it",
                    file=sys.stderr,
                )
                return 2
        if args.no_baseline:
            print("baseline skipped: the suite has just passed on this tree", flush=True)
        else:
            baseline = tuple(dict.fromkeys(t for m in mutants for t in m.tests))
            rc, secs, out = run_tests(copy, baseline, args.timeout)
            print(
                f"baseline (unmutated, {len(baseline)} selections): {'pass' if rc == 0 else 'FAIL'} in {secs:.0f} s",
                flush=True,
            )
            if rc != 0:
                print(out[-4000:])
                return 1
        killed = 0
        for m in mutants:
            target = copy / m.path
            original = target.read_text()
            target.write_text(original.replace(m.old, m.new))
            try:
                rc, secs, out = run_tests(copy, m.tests, args.timeout)
            finally:
                target.write_text(original)
            # pytest: 1 = tests failed (killed); 0 = all passed (survived); else an error in the run
            status = {0: "SURVIVED", 1: "killed"}.get(rc, f"ERROR (pytest exit {rc})")
            killed += rc == 1
            print(f"{status:10s} {m.name:48s} {m.layer:32s} {secs:6.1f} s", flush=True)
            if rc not in (0, 1):
                print(out[-2000:])
    total = time.perf_counter() - t_start
    print(f"{killed}/{len(mutants)} mutants killed in {total:.0f} s")
    return 0 if killed == len(mutants) else 1


if __name__ == "__main__":
    sys.exit(main())
