"""Mutation testing of the core modules: curated one-line bugs, each applied alone to a copy
of the tree and run against the tests that should catch it.

    nice -n 10 python tools/mutation.py             # every mutant; writes the report
    python tools/mutation.py --list                 # the mutants and their tests
    python tools/mutation.py --only guard_loss_only --only rng_no_step
    python tools/mutation.py --check                # every snippet occurs exactly once

A mutant is (name, file, the exact original snippet, its replacement, the tests that cover
it, optionally "equivalent: why"). The script copies the repository to a temporary
directory once, runs the union of the mutants' tests there once unmutated (a test that
already fails would "kill" every mutant), then for each mutant patches one file, runs
`pytest -x -q` on that mutant's tests, records killed / survived and the time, and restores
the file. Every original snippet must occur exactly once in its file and every listed test
must exist (`check`; tests/test_mutation_list.py runs it in the normal suite), so a mutant
cannot silently stop applying when the code changes. Equivalent mutants (no test can tell
them from the real code) are listed with their reason and not run (`--run-equivalent`
runs them too). The report (counts, the command, its run time, one row per mutant) goes to
tools/mutation_report.md and tools/mutation_report.json.

Why a script and not mutmut or cosmic-ray: those generate every operator swap of every
line (thousands here, most in messages and argument checks, many equivalent) and run a
test command per mutant. In this project each pytest process pays the JAX import and cold
XLA compiles, seconds to tens of seconds, so a generated run would take days on the
2-core machine, and their test selection is the whole suite or coverage-based (coverage
does not see into jit-compiled code). A curated list with a narrow test selection per
mutant runs in minutes, and each mutant names the contract its tests must hold.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPORT_MD = os.path.join(ROOT, "tools", "mutation_report.md")
REPORT_JSON = os.path.join(ROOT, "tools", "mutation_report.json")


@dataclasses.dataclass(frozen=True)
class Mutant:
  name: str
  file: str                 # relative to the repository root
  original: str             # must occur exactly once in `file`
  replacement: str
  tests: tuple[str, ...]    # pytest node ids (or files) relative to the root
  what: str                 # the bug, in words
  equivalent: str = ""      # why no test can tell it apart ("" = it must be killed)


def M(name, file, original, replacement, tests, what, equivalent=""):
  tests = (tests,) if isinstance(tests, str) else tuple(tests)
  return Mutant(name, file, original, replacement, tests, what, equivalent)


S = "tests/train/test_streams.py::"
GUARD = "tests/objectives/test_guard.py::"
LOSSES = "tests/objectives/test_losses.py::"
VARIANTS = "tests/objectives/test_variant_losses.py::"
TRUNC = "tests/rollout/test_truncation.py::"
SAMPLING = "tests/rollout/test_sampling.py::"
SHARED = "tests/rollout/test_shared_prefix.py::"
TRAIN = "tests/train/test_train.py::"
STEP = "tests/train/test_step.py::"
BOUNDS = "tests/objectives/test_boundaries.py::"
RSKIP = "tests/objectives/test_row_skip.py::"

MUTANTS: list[Mutant] = [
    # -- rng ------------------------------------------------------------------------------
    M("rng_stride", "gspo_jax/utils/rng.py",
      "fold_in(key, len(DEVICE_STREAMS) * step + DEVICE_STREAMS[stream])",
      "fold_in(key, step + DEVICE_STREAMS[stream])",
      S + "test_device_streams_are_distinct_per_iteration_and_stream",
      "streams overlap: minibatch at step s = sample at step s + 1"),
    M("rng_no_step", "gspo_jax/utils/rng.py",
      "fold_in(key, len(DEVICE_STREAMS) * step + DEVICE_STREAMS[stream])",
      "fold_in(key, DEVICE_STREAMS[stream])",
      S + "test_device_streams_are_distinct_per_iteration_and_stream",
      "every iteration draws the same device keys"),
    M("host_rng_no_stream", "gspo_jax/utils/rng.py",
      "np.random.default_rng([seed, HOST_STREAMS[stream]])", "np.random.default_rng(seed)",
      S + "test_host_streams_are_distinct_and_repeatable",
      "every host stream is the same generator"),
    # -- the rollout's streams ------------------------------------------------------------
    M("programs_sample_key_fixed", "gspo_jax/train/programs.py",
      'rng.device_key(key, step_, "sample")', 'rng.device_key(key, 0, "sample")',
      S + "test_rollout_noise_differs_between_iterations_and_repeats_for_one",
      "the rollout's sampling key is the same every iteration"),
    M("rollout_sample_step_fixed", "gspo_jax/train/collect.py",
      "programs.sample(params, prompts, lens, key, step)",
      "programs.sample(params, prompts, lens, key, 0)",
      S + "test_rollout_noise_differs_between_iterations_and_repeats_for_one",
      "the rollout passes iteration 0 to the sampler every time"),
    M("rollout_data_step_fixed", "gspo_jax/train/collect.py",
      "run.task.train_batch(cfg.seed, step, B)", "run.task.train_batch(cfg.seed, 0, B)",
      S + "test_rollout_prompts_follow_the_iteration",
      "the same prompts every iteration"),
    M("sampler_prefill_key", "gspo_jax/rollout/sampling.py",
      "pick_token(logits_BxGxV, jax.random.fold_in(key, 0), cfg)",
      "pick_token(logits_BxGxV, jax.random.fold_in(key, 1), cfg)",
      S + "test_sampler_noise_differs_per_row_member_and_decode_step",
      "tokens 0 and 1 share their noise"),
    M("sampler_decode_key", "gspo_jax/rollout/sampling.py",
      "pick_token(model.logits(hidden_BxGxD), jax.random.fold_in(key, s.t), cfg)",
      "pick_token(model.logits(hidden_BxGxD), key, cfg)",
      S + "test_sampler_noise_differs_per_row_member_and_decode_step",
      "every decode step draws the same noise"),
    M("sampler_noise_per_row", "gspo_jax/rollout/sampling.py",
      "jax.random.gumbel(key, logits_BxGxV.shape, jnp.float32)",
      "jax.random.gumbel(key, logits_BxGxV.shape[-1:], jnp.float32)",
      S + "test_sampler_noise_differs_per_row_member_and_decode_step",
      "every row (prompt and group member) draws the same noise"),
    M("sampler_mask_drops_eos", "gspo_jax/rollout/sampling.py",
      "mask = (eos_before == 0).astype(jnp.float32)",
      "mask = ((eos_before == 0) & ~is_eos).astype(jnp.float32)",
      SAMPLING + "test_eos_ends_responses_and_nothing_after_counts",
      "the EOS token does not count (its log-prob never trained)"),
    M("sampler_top_p_excludes_boundary", "gspo_jax/rollout/sampling.py",
      "keep = (jnp.cumsum(probs, axis=-1) - probs) < cfg.top_p",
      "keep = jnp.cumsum(probs, axis=-1) < cfg.top_p",
      SAMPLING + "test_filters_hand_values",
      "top-p drops the token that crosses the mass"),
    M("sampler_logp_after_filter", "gspo_jax/rollout/sampling.py",
      "logp_all = jax.nn.log_softmax(scaled, axis=-1)",
      "logp_all = jax.nn.log_softmax(filter_logits(scaled, cfg), axis=-1)",
      SAMPLING + "test_sampler_log_probs_are_of_the_unfiltered_distribution",
      "sampler log-probs of the filtered distribution (not what the trainer recomputes)"),
    M("evaluate_chunk_key", "gspo_jax/train/evaluation.py",
      "key = jax.random.fold_in(jax.random.key(seed), start)", "key = jax.random.key(seed)",
      S + "test_evaluation_chunks_draw_their_own_noise",
      "every evaluation chunk draws the same noise"),
    # -- data order -----------------------------------------------------------------------
    M("task_batch_ignores_step", "gspo_jax/tasks/base.py",
      'np.random.default_rng([seed, step]), n, "train"',
      'np.random.default_rng([seed, 0]), n, "train"',
      S + "test_built_in_task_data_order_follows_seed_and_iteration",
      "a built-in task serves the same prompts every iteration"),
    M("dataset_batch_ignores_step", "gspo_jax/tasks/dataset.py",
      "for p in range(step * n, step * n + n)]", "for p in range(n)]",
      "tests/tasks/test_data.py::test_epochs_visit_every_record_once_and_cross_boundaries",
      "a dataset serves its first n records every iteration"),
    M("dataset_same_order_every_epoch", "gspo_jax/tasks/dataset.py",
      "default_rng([seed, 2_718_281, epoch])", "default_rng([seed, 2_718_281])",
      "tests/tasks/test_data.py::test_epochs_visit_every_record_once_and_cross_boundaries",
      "every epoch in the same order"),
    M("coldstart_batch_repeats", "gspo_jax/train/coldstart.py",
      'task.sample(draws, cfg.sft.batch_size, "train")',
      'task.sample(rng.host_rng(cfg.seed, "sft_batches"), cfg.sft.batch_size, "train")',
      S + "test_cold_start_batches_differ_per_step_and_repeat_per_seed",
      "the cold start trains on the same batch every step"),
    M("coldstart_batches_are_the_probe", "gspo_jax/train/coldstart.py",
      'draws = rng.host_rng(cfg.seed, "sft_batches")',
      'draws = rng.host_rng(cfg.seed, "sft_probe")',
      S + "test_cold_start_batches_differ_per_step_and_repeat_per_seed",
      "the cold start trains on its accuracy probe"),
    M("local_rows_first_rows", "gspo_jax/parallel/sharding.py",
      "lo, hi = starts[0], stops[-1]", "lo, hi = 0, stops[-1] - starts[0]",
      S + "test_each_process_keeps_its_own_rows_of_every_host_stream",
      "every process feeds the first rows of the global batch"),
    # -- step: the update -----------------------------------------------------------------
    M("minibatch_key_fixed", "gspo_jax/train/step.py",
      'rng.device_key(state.key, state.step, "minibatch")',
      'rng.device_key(state.key, 0, "minibatch")',
      S + "test_minibatch_order_differs_between_iterations_and_repeats_for_one",
      "the same minibatch order every iteration"),
    M("guard_loss_only", "gspo_jax/train/step.py",
      'ok = jnp.isfinite(grad_norm) & jnp.isfinite(metrics["loss"])',
      'ok = jnp.isfinite(metrics["loss"])',
      GUARD + "test_finite_loss_with_non_finite_gradient_is_skipped",
      "a finite loss with a non-finite gradient is applied"),
    M("guard_grad_only", "gspo_jax/train/step.py",
      'ok = jnp.isfinite(grad_norm) & jnp.isfinite(metrics["loss"])',
      "ok = jnp.isfinite(grad_norm)",
      GUARD + "test_infinite_loss_with_finite_gradient_is_skipped",
      "a non-finite loss with a finite gradient is applied (k3 against log pi_ref = -inf)"),
    M("guard_keeps_new_opt_state", "gspo_jax/train/step.py",
      "return (keep(new_params, params), keep(new_opt, opt_state)), metrics",
      "return (keep(new_params, params), new_opt), metrics",
      GUARD + "test_finite_loss_with_non_finite_gradient_is_skipped",
      "a skipped step still moves the optimiser state (NaN moments)"),
    M("guard_skip_count_mean", "gspo_jax/train/step.py",
      'summary["skipped_updates"] = jnp.sum(metrics["skipped_updates"])',
      'summary["skipped_updates"] = jnp.mean(metrics["skipped_updates"])',
      GUARD + "test_finite_loss_with_non_finite_gradient_is_skipped",
      "skipped minibatches reported as a fraction, not counted"),
    M("guard_empty_minibatch", "gspo_jax/train/step.py",
      "ok = ok & (jnp.sum(mb.rows.mask_BxGxT) > 0)", "ok = ok",
      TRUNC + "test_a_minibatch_of_masked_rows_takes_no_step",
      "a minibatch with no counted token still takes an AdamW step"),
    M("update_step_not_advanced", "gspo_jax/train/step.py",
      "opt_state=opt_state, step=state.step + 1)", "opt_state=opt_state, step=state.step)",
      GUARD + "test_finite_loss_with_non_finite_gradient_is_skipped",
      "the update does not advance the iteration counter"),
    M("update_advantages_ignore_valid", "gspo_jax/train/step.py",
      "group_advantages(rewards_BxG, valid_BxG=valid_BxG, check_nan=False)",
      "group_advantages(rewards_BxG, check_nan=False)",
      TRUNC + "test_masked_truncated_rows_train_the_rest_as_if_dropped",
      "truncation=mask normalises groups over the dropped rows too"),
    M("update_overlong_sign", "gspo_jax/train/step.py",
      "rewards_BxG = rewards_BxG + penalty_BxG", "rewards_BxG = rewards_BxG - penalty_BxG",
      TRUNC + "test_overlong_shapes_the_rewards_in_the_update",
      "the overlong penalty rewards long responses"),
    M("prepare_mask_ignores_truncation", "gspo_jax/train/step.py",
      "jnp.where(rollout.truncated_BxG[..., None], jnp.zeros((), mask.dtype), mask)",
      "jnp.where(rollout.truncated_BxG[..., None], mask, mask)",
      TRUNC + "test_masked_truncated_rows_train_the_rest_as_if_dropped",
      "truncation=mask keeps the truncated rows"),
    M("prepare_always_recomputes", "gspo_jax/train/step.py",
      'old = recomputed if cfg.old_logp == "recompute" else old', "old = recomputed",
      [STEP + "test_tracked_routing_keeps_the_samplers_pi_old_when_configured",
       "tests/train/test_routing_train.py::test_bfloat16_sampler_feeds_its_own_log_probs_as_pi_old"],
      'old_logp="sampler" ignored when routing is tracked or replayed'),
    M("prepare_never_recomputes", "gspo_jax/train/step.py",
      'old = recomputed if cfg.old_logp == "recompute" else old', "old = old",
      STEP + "test_pi_old_is_the_trainers_recomputation_or_the_samplers_as_configured",
      'old_logp="recompute" ignored: pi_old is the (bf16) sampler\'s'),
    M("minibatch_loss_kl_sign", "gspo_jax/train/step.py",
      "loss = loss + cfg.kl.coef * kl", "loss = loss - cfg.kl.coef * kl",
      STEP + "test_the_kl_term_is_added_to_the_policy_loss",
      "the KL term pushes the policy away from the reference"),
    M("split_adv_by_prompt", "gspo_jax/train/step.py",
      'if names[0] == "rows" else "group"', 'if names[0] == "rows" else "prompt"',
      (STEP + "test_every_batch_field_is_split_with_its_rows",
       SHARED + "test_training_step_with_shared_prompts_equals_unshared_and_sharded"),
      "the advantages and token weights are taken by their prompts, not with their rows"),
    M("split_prompt_of_row", "gspo_jax/train/step.py",
      "prompt_of = order // G", "prompt_of = order % G",
      SHARED + "test_training_step_with_shared_prompts_equals_unshared_and_sharded",
      "a shuffled row is teacher-forced after another row's prompt"),
    M("minibatch_order_splits_groups", "gspo_jax/train/step.py",
      "(perm[:, None] * group + jnp.arange(group)[None, :])",
      "(perm[:, None] + jnp.arange(group)[None, :])",
      SHARED + "test_minibatch_order_keeps_groups_whole",
      "the group-keeping order overlaps groups"),
    M("sft_loss_sign", "gspo_jax/train/coldstart.py",
      "return -jnp.sum(logp_Bx1xT[:, 0] * mask_BxT)", "return jnp.sum(logp_Bx1xT[:, 0] * mask_BxT)",
      STEP + "test_a_cold_start_step_raises_the_demonstrations_likelihood",
      "the cold start lowers the demonstrations' likelihood"),
    # -- row skip: a row with a gradient must never leave the backward pass ---------------
    M("row_skip_all_tokens_live", "gspo_jax/objectives/row_skip.py",
      "return jnp.any(live_RxT, axis=-1)", "return jnp.all(live_RxT, axis=-1)",
      [RSKIP + "test_no_row_with_a_gradient_is_called_dead",
       RSKIP + "test_the_skipping_update_equals_the_full_update"],
      "a row with some clipped tokens (GRPO) is skipped though the others have a gradient"),
    M("row_skip_positive_advantage_only", "gspo_jax/objectives/row_skip.py",
      "return m_RxT & (adv_RxT != 0) & ~(s.clipped_low | s.clipped_high)",
      "return m_RxT & (adv_RxT > 0) & ~(s.clipped_low | s.clipped_high)",
      [RSKIP + "test_no_row_with_a_gradient_is_called_dead",
       RSKIP + "test_the_skipping_update_equals_the_full_update"],
      "rows with a negative advantage are skipped"),
    M("row_skip_dead_rows_first", "gspo_jax/objectives/row_skip.py",
      "order_U = jnp.argsort(~live_U, stable=True)", "order_U = jnp.argsort(live_U, stable=True)",
      RSKIP + "test_the_skipping_update_equals_the_full_update",
      "the bucket takes the dead rows first, live ones fall out of the backward pass"),
    M("row_skip_no_rescale", "gspo_jax/objectives/row_skip.py",
      "aggregation, w) / d_full", "aggregation, w)",
      RSKIP + "test_the_skipping_update_equals_the_full_update",
      "the bucket's loss keeps its own denominator (dead rows no longer count)"),
    M("time_sample_with_update_tail", "gspo_jax/train/collect.py",
      "jax.block_until_ready(params)", "params",
      "tests/train/test_phase_times.py::test_time_sample_leaves_out_the_previous_updates_tail",
      "time_sample (and sample_tokens_per_s) include the previous update's tail"),
    # -- losses ---------------------------------------------------------------------------
    M("seq_ratio_not_length_normalised", "gspo_jax/objectives/blocks.py",
      "return jnp.sum(l_BxT, axis=-1) / jnp.maximum(n_B, 1)", "return jnp.sum(l_BxT, axis=-1)",
      LOSSES + "test_gspo_hand_values", "log s_i summed, not averaged over the tokens"),
    M("clip_high_ignores_sign", "gspo_jax/objectives/blocks.py",
      "clipped_high = (adv > 0) & (ratio > 1 + eps_high)", "clipped_high = ratio > 1 + eps_high",
      LOSSES + "test_clipped_surrogate_hand_values",
      "negative advantages clipped above 1 + eps_high"),
    M("clip_live_ratio", "gspo_jax/objectives/blocks.py",
      "objective = jnp.where(clipped, bound * adv, live_ratio * adv)",
      "objective = jnp.where(clipped, bound * adv, ratio * adv)",
      LOSSES + "test_overflowed_clipped_ratio_leaks_no_nan_into_the_gradient",
      "an overflowed clipped ratio leaks 0 * inf into the gradient"),
    M("old_logp_not_constant", "gspo_jax/objectives/blocks.py",
      "old = jax.lax.stop_gradient(old_logp_BxT)", "old = old_logp_BxT",
      LOSSES + "test_old_logp_is_a_constant", "gradient flows into pi_old"),
    M("token_mean_is_seq_mean", "gspo_jax/objectives/blocks.py",
      "return jnp.sum(sum_B) / jnp.maximum(jnp.sum(n_B), 1)", "return jnp.sum(mean_B) / num_seqs",
      LOSSES + "test_grpo_hand_values_each_aggregation", "token-mean aggregates per sequence"),
    M("seq_mean_counts_empty_rows", "gspo_jax/objectives/blocks.py",
      "num_seqs = jnp.maximum(jnp.sum(n_B > 0, dtype=dtype), 1)",
      "num_seqs = jnp.asarray(n_B.shape[0], dtype)",
      LOSSES + "test_gspo_hand_values",
      "empty rows counted in the mean over responses (TRL's B, not N)"),
    M("k3_estimator", "gspo_jax/objectives/blocks.py",
      "return jnp.exp(d) - d - 1", "return jnp.exp(d) - 1",
      LOSSES + "test_kl_estimators_hand_values", "k3 without its control variate"),
    M("approx_kl_direction", "gspo_jax/objectives/blocks.py",
      "jnp.exp(lr) - 1 - lr", "jnp.exp(-lr) - 1 + lr",
      LOSSES + "test_gspo_hand_values",
      "approx_kl estimates KL(pi_theta || pi_old) from pi_old's samples"),
    M("weights_keep_zero_tokens", "gspo_jax/objectives/blocks.py",
      "return m & (jax.lax.stop_gradient(jnp.asarray(token_weights_BxT)) != 0)", "return m",
      VARIANTS + "test_zero_weights_leave_numerators_and_denominators_alike",
      "a zero weight leaves its token in the denominators"),
    M("gspo_token_no_stop_gradient", "gspo_jax/objectives/losses.py",
      "log_s_BxT = (l_BxT - sg(l_BxT)) + sg(log_s_B)[:, None]",
      "log_s_BxT = (l_BxT - sg(l_BxT)) + log_s_B[:, None]",
      LOSSES + "test_gspo_token_equals_gspo_for_sequence_advantages",
      "GSPO-token's s_i not stop-gradiented"),
    M("gspo_empty_row_adv_kept", "gspo_jax/objectives/losses.py",
      "adv_B = jnp.where(n_B > 0, adv, 0)", "adv_B = adv",
      LOSSES + "test_padding_changes_nothing",
      "junk advantages of empty rows reach the gradient",
      equivalent="an empty row's objective is dropped by `aggregate` (value) and its tokens "
      "by `token_log_ratio`'s where (gradient): NaN, inf or 1e30 there leave GSPO's and "
      "LUSPO's loss, gradient and metrics unchanged (checked by hand)"),
    M("grpo_ignores_aggregation", "gspo_jax/objectives/losses.py",
      "pg_loss = -aggregate(surrogate.objective, mask_BxT, mode=aggregation,",
      'pg_loss = -aggregate(surrogate.objective, mask_BxT, mode="seq-mean-token-mean",',
      LOSSES + "test_grpo_hand_values_each_aggregation", "GRPO's aggregation setting ignored"),
    M("luspo_no_length_weight", "gspo_jax/objectives/losses.py",
      "objective_B = surrogate.objective * n_B if length_weighting else surrogate.objective",
      "objective_B = surrogate.objective",
      VARIANTS + "test_luspo_hand_values", "LUSPO is plain GSPO"),
    M("sapo_tau_swapped", "gspo_jax/objectives/blocks.py",
      "tau = jnp.where(adv > 0, tau_pos, tau_neg)", "tau = jnp.where(adv > 0, tau_neg, tau_pos)",
      VARIANTS + "test_sapo_token_hand_values", "SAPO's temperatures swapped"),
    M("cispo_weight_not_clipped", "gspo_jax/objectives/blocks.py",
      "weight = jnp.clip(ratio, 1 - eps_low, 1 + eps_high)", "weight = ratio",
      VARIANTS + "test_cispo_hand_values", "CISPO's importance weight not truncated"),
    M("gmpo_unclipped", "gspo_jax/objectives/variants.py",
      "rho_B = jnp.exp(jnp.sum(clipped_l_BxT, axis=-1)", "rho_B = jnp.exp(jnp.sum(l_BxT, axis=-1)",
      VARIANTS + "test_gmpo_hand_values", "GMPO's geometric mean of unclipped ratios"),
    # -- advantages -----------------------------------------------------------------------
    M("adv_std_ddof0", "gspo_jax/objectives/advantages.py",
      "jnp.std(r, axis=1, ddof=1, keepdims=True)", "jnp.std(r, axis=1, ddof=0, keepdims=True)",
      "tests/objectives/test_advantages.py::test_hand_values", "population std instead of Bessel's"),
    M("adv_equal_rewards_residue", "gspo_jax/objectives/advantages.py",
      "return jnp.where(all_equal, jnp.zeros((), r.dtype), centred)", "return centred",
      "tests/objectives/test_advantages.py::test_equal_rewards_give_exactly_zero",
      "equal rewards give the rounding residue of r - mean, not 0"),
    M("adv_valid_groups_of_one", "gspo_jax/objectives/advantages.py",
      "no_signal = (hi == lo) | (n_Bx1 < 2)", "no_signal = hi == lo",
      TRUNC + "test_valid_group_advantages_equal_those_of_the_dropped_groups",
      "a group with fewer than 2 valid responses not zeroed",
      equivalent="n < 2 valid responses means one (its max equals its min: hi == lo) or none "
      "(every entry zeroed by ~valid), so the n_Bx1 < 2 test never changes the result"),
    # -- log-probs and teacher forcing ----------------------------------------------------
    M("logprob_no_normaliser", "gspo_jax/models/logprobs.py",
      "return picked - lse", "return picked",
      "tests/models/test_logprobs.py::test_hand_values", "log-probs without the log-sum-exp"),
    M("lean_logprobs_ignore_temperature", "gspo_jax/models/logprobs.py",
      "      logits = logits / temperature", "      logits = logits",
      SAMPLING + "test_sampler_logprobs_equal_teacher_forced",
      "the trainer's lean log-probs ignore the sampling temperature"),
    M("teacher_forcing_off_by_one", "gspo_jax/rollout/teacher_forcing.py",
      "src = jnp.concatenate([lens[:, None] - 1,", "src = jnp.concatenate([lens[:, None],",
      SHARED + "test_shared_prefix_equals_repeated_rows[dense]",
      "unshared rows: token 0 predicted from itself"),
    M("shared_prefix_positions", "gspo_jax/rollout/teacher_forcing.py",
      "positions = prompt_lens_B[:, None, None] + jnp.arange(T)[None, None, :]",
      "positions = prompt_lens_B[:, None, None] + 1 + jnp.arange(T)[None, None, :]",
      SAMPLING + "test_sampler_logprobs_equal_teacher_forced",
      "shared-prefix responses at the wrong positions"),
    # -- rewards and evaluation -----------------------------------------------------------
    M("extract_first_answer", "gspo_jax/tasks/rewards.py",
      "return (found[-1] if found else completion).strip()",
      "return (found[0] if found else completion).strip()",
      "tests/tasks/test_rewards.py::test_builtins_by_hand", "the first <answer> tag read, not the last"),
    M("numeric_match_loose", "gspo_jax/tasks/rewards.py",
      "abs(x - y) <= 1e-6 * max(1.0, abs(y))", "abs(x - y) <= 1e-1 * max(1.0, abs(y))",
      "tests/tasks/test_rewards.py::test_builtins_by_hand", "numeric_match 10% tolerance"),
    M("reward_weights_ignored", "gspo_jax/tasks/rewards.py",
      "total += r.weight * parts[r.name]", "total += parts[r.name]",
      "tests/tasks/test_rewards.py::test_weighted_sum_and_components_by_path",
      "reward weights ignored"),
    M("pass_at_k_off_by_one", "gspo_jax/train/evaluation.py",
      "np.arange(n - ci + 1, n + 1)", "np.arange(n - ci, n + 1)",
      "tests/train/test_evaluate.py::test_pass_at_k_by_hand", "pass@k's product over one term too many"),
    # -- bounds: each moved by 10% or its comparison flipped (tests/objectives/test_boundaries.py) ----
    M("clip_high_bound_moved", "gspo_jax/objectives/blocks.py",
      "clipped_high = (adv > 0) & (ratio > 1 + eps_high)",
      "clipped_high = (adv > 0) & (ratio > 1 + 1.1 * eps_high)",
      BOUNDS + "test_clipped_surrogate_bounds_from_both_sides",
      "the upper clip sits 10% further out than 1 + eps_high"),
    M("clip_low_tie_clipped", "gspo_jax/objectives/blocks.py",
      "clipped_low = (adv < 0) & (ratio < 1 - eps_low)",
      "clipped_low = (adv < 0) & (ratio <= 1 - eps_low)",
      BOUNDS + "test_clipped_surrogate_tie_is_not_clipped",
      "a ratio exactly on 1 - eps_low counts as clipped"),
    M("gspo_default_eps_high_moved", "gspo_jax/objectives/losses.py",
      '"gspo": {"eps_low": 3e-4, "eps_high": 4e-4}',
      '"gspo": {"eps_low": 3e-4, "eps_high": 4.4e-4}',
      BOUNDS + "test_default_clip_ranges_from_both_sides",
      "GSPO's default eps_high 10% off the paper's 4e-4"),
    M("grpo_default_eps_low_moved", "gspo_jax/objectives/losses.py",
      '"grpo": {"eps_low": 0.2, "eps_high": 0.27,',
      '"grpo": {"eps_low": 0.18, "eps_high": 0.27,',
      BOUNDS + "test_default_clip_ranges_from_both_sides",
      "GRPO's default eps_low 10% off the paper's 0.2"),
    M("rollout_correction_threshold_moved", "gspo_jax/objectives/rollout_correction.py",
      "threshold: float = 2.0            # C", "threshold: float = 2.2            # C",
      BOUNDS + "test_truncate_at_the_default_threshold_from_both_sides",
      "the config's default truncation C 10% above 2"),
    M("rollout_correction_mask_drops_threshold", "gspo_jax/objectives/rollout_correction.py",
      "out = m & ((log_weight > log_high) |", "out = m & ((log_weight >= log_high) |",
      BOUNDS + "test_mask_keeps_the_closed_interval_from_both_sides",
      "mode=mask drops a weight exactly at the threshold (the interval is closed)"),
    M("off_policy_mask_drops_delta", "gspo_jax/objectives/rollout_correction.py",
      "(d_B > threshold)", "(d_B >= threshold)",
      BOUNDS + "test_off_policy_sequence_mask_delta_from_both_sides",
      "the off-policy mask drops a response whose drift equals delta"),
    M("overlong_cache_moved", "gspo_jax/rollout/lengths.py",
      "jnp.clip(-(n - (max_new_tokens - cache)) / cache, -1.0, 0.0)",
      "jnp.clip(-(n - (max_new_tokens - 1.1 * cache)) / cache, -1.0, 0.0)",
      BOUNDS + "test_overlong_penalty_starts_after_the_cache_and_reaches_minus_one_at_max",
      "the overlong penalty starts 10% of the cache early"),
    M("grad_clip_default_moved", "gspo_jax/config.py",
      "grad_clip: float = 1.0 ", "grad_clip: float = 1.1 ",
      BOUNDS + "test_grad_norm_clip_default_from_both_sides",
      "the default global-norm clip 10% above 1"),
    M("top_k_drops_ties", "gspo_jax/rollout/sampling.py",
      "jnp.where(logits_RxV >= kth, logits_RxV, neg)",
      "jnp.where(logits_RxV > kth, logits_RxV, neg)",
      BOUNDS + "test_top_k_keeps_ties_with_the_kth_and_vocab_limit_is_exclusive",
      "top-k drops the k-th token itself (and its ties)"),
    M("adv_eps_moved", "gspo_jax/objectives/advantages.py",
      "def group_advantages(rewards_BxG: Array, *, eps: float = 1e-6,",
      "def group_advantages(rewards_BxG: Array, *, eps: float = 1.1e-6,",
      BOUNDS + "test_std_epsilon_default",
      "the std epsilon 10% off verl's 1e-6"),
    M("informative_one_valid_response", "gspo_jax/rollout/dynamic_sampling.py",
      "(jnp.sum(valid, axis=1) >= 2)", "(jnp.sum(valid, axis=1) >= 1)",
      BOUNDS + "test_informative_needs_two_valid_responses_and_any_difference",
      "a group with one valid response counts as informative",
      equivalent="one valid response is its own max and min (hi == lo), none gives "
      "hi = -inf < lo = inf: hi > lo is already False for fewer than 2, so the count test "
      "never changes the result"),
    # -- checkpoint and resume ------------------------------------------------------------
    M("checkpoint_key_not_restored", "gspo_jax/train/checkpoint.py",
      "return jax.random.wrap_key_data(x)", "return jax.random.key(0)",
      S + "test_a_restored_state_draws_what_the_original_does",
      "a restored run's key is key(0), not the run's"),
    M("cut_metrics_drops_restored_step", "gspo_jax/train/rundir.py",
      'int(record["step"]) <= step', 'int(record["step"]) < step',
      "tests/train/test_run_dir.py::test_cut_metrics_repairs_a_half_written_line",
      "a resume drops the restored step's metrics"),
    M("resume_allows_seed_change", "gspo_jax/train/rundir.py",
      '"seed": "the data stream and the random keys",', "",
      "tests/train/test_run_dir.py::test_resume_diff_classifies_fields",
      "a resume may change the seed (every stream)"),
    M("resume_reference_is_fresh", "gspo_jax/train/loop.py",
      "reference_params(run, run_dir, fresh=start == 0)",
      "reference_params(run, run_dir, fresh=True)",
      TRAIN + "test_kl_reference_is_the_cold_start_policy_across_resume",
      "a resumed run becomes its own KL reference"),
]


# ------------------------------------------------------------------------------ checks


def _node_exists(root: str, node: str) -> str | None:
  """None when the test file (and function, for a node id) exists; else the problem."""
  path, _, func = node.partition("::")
  full = os.path.join(root, path)
  if not os.path.isfile(full):
    return f"test file {path} not found"
  if func:
    func = func.split("[")[0]
    with open(full, encoding="utf-8") as f:
      if not re.search(rf"^def {re.escape(func)}\(", f.read(), re.M):
        return f"test {node} not found"
  return None


def check(root: str = ROOT, mutants=MUTANTS) -> list[str]:
  """Problems with the list: duplicate names, missing files or tests, a snippet that does
  not occur exactly once, a replacement equal to its original."""
  problems, names = [], set()
  for m in mutants:
    if m.name in names:
      problems.append(f"{m.name}: duplicate name")
    names.add(m.name)
    path = os.path.join(root, m.file)
    if not os.path.isfile(path):
      problems.append(f"{m.name}: {m.file} not found")
      continue
    with open(path, encoding="utf-8") as f:
      n = f.read().count(m.original)
    if n != 1:
      problems.append(f"{m.name}: the original snippet occurs {n} times in {m.file} "
                      f"(must be exactly once): {m.original!r}")
    if m.original == m.replacement:
      problems.append(f"{m.name}: the replacement equals the original")
    if not m.tests:
      problems.append(f"{m.name}: no tests listed")
    problems += [f"{m.name}: {p}" for t in m.tests if (p := _node_exists(root, t))]
  return problems


# ------------------------------------------------------------------------------ running


def _copy_tree(dest: str) -> None:
  shutil.copytree(ROOT, dest, symlinks=True, ignore=shutil.ignore_patterns(
      ".git", "__pycache__", ".pytest_cache", "runs", "*.egg-info"))


def _pytest(tree: str, tests, timeout: float) -> tuple[int, float, str]:
  """(return code, seconds, output tail) of `pytest -x -q tests` in `tree`."""
  env = dict(os.environ, PYTHONPATH=tree)
  cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-o",
         "addopts=", *tests]
  t0 = time.perf_counter()
  try:
    p = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=timeout)
    rc, out = p.returncode, p.stdout + p.stderr
  except subprocess.TimeoutExpired as e:
    rc, out = -1, f"timeout after {timeout} s\n{(e.stdout or b'')[-2000:]!r}"
  return rc, time.perf_counter() - t0, out[-3000:]


def run_mutant(tree: str, m: Mutant, timeout: float) -> dict:
  path = os.path.join(tree, m.file)
  with open(path, encoding="utf-8") as f:
    source = f.read()
  try:
    with open(path, "w", encoding="utf-8") as f:
      f.write(source.replace(m.original, m.replacement, 1))
    rc, seconds, out = _pytest(tree, m.tests, timeout)
  finally:
    with open(path, "w", encoding="utf-8") as f:
      f.write(source)
  # pytest: 0 all passed, 1 a test failed, 2+ errors (collection, import): both kill.
  status = "survived" if rc == 0 else "killed" if rc > 0 else "killed (timeout)"
  return {"name": m.name, "file": m.file, "status": status, "seconds": round(seconds, 1),
          "rc": rc, "tests": list(m.tests), "what": m.what,
          "output": "" if rc != 0 or status == "killed" else out}


def _sanity(tree: str) -> None:
  env = dict(os.environ, PYTHONPATH=tree)
  where = subprocess.run([sys.executable, "-c", "import gspo_jax; print(gspo_jax.__file__)"],
                         cwd=tree, env=env, capture_output=True, text=True).stdout.strip()
  if not where.startswith(os.path.realpath(tree)) and not where.startswith(tree):
    raise SystemExit(f"the copy imports gspo_jax from {where!r}, not from {tree}")


def write_report(results, equivalent, *, command: str, seconds: float, baseline_s: float,
                 load: tuple[float, float]) -> None:
  killed = sum(r["status"].startswith("killed") for r in results)
  survived = [r for r in results if r["status"] == "survived"]
  summary = {"mutants": len(results) + len(equivalent), "run": len(results), "killed": killed,
             "survived": len(survived), "equivalent": len(equivalent), "command": command,
             "run_time_s": round(seconds, 1), "baseline_s": round(baseline_s, 1),
             "cpus": os.cpu_count(), "load_average_start_end": load,
             "date": time.strftime("%Y-%m-%d")}
  with open(REPORT_JSON, "w", encoding="utf-8") as f:
    json.dump({"summary": summary, "results": results, "equivalent": equivalent}, f, indent=1)
  lines = [
      "# Mutation report", "",
      f"`{command}` on {summary['date']}, {summary['cpus']} CPUs (load average "
      f"{load[0]:.1f} at the start, {load[1]:.1f} at the end; the machine is shared, times "
      "are noisy): "
      f"**{summary['mutants']} mutants: {killed} killed, {len(survived)} survived, "
      f"{len(equivalent)} equivalent (not run)**, in {seconds / 60:.1f} min "
      f"(of which {baseline_s / 60:.1f} min the unmutated baseline of the same tests).", "",
      "Each mutant is one edit of one file (`tools/mutation.py` lists the original and the "
      "replacement), run against the tests named, `pytest -x -q`. JSON: "
      "`tools/mutation_report.json`.", "",
      "| mutant | file | the bug | status | s | tests |", "|---|---|---|---|---|---|"]
  for r in results:
    tests = ", ".join(t.replace("tests/", "") for t in r["tests"])
    lines.append(f"| {r['name']} | {r['file']} | {r['what']} | {r['status']} | {r['seconds']} "
                 f"| {tests} |")
  for e in equivalent:
    lines.append(f"| {e['name']} | {e['file']} | {e['what']} | equivalent: {e['equivalent']} "
                 "| - | - |")
  with open(REPORT_MD, "w", encoding="utf-8") as f:
    f.write("\n".join(lines) + "\n")


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--list", action="store_true", help="print the mutants and exit")
  parser.add_argument("--check", action="store_true", help="check the list and exit")
  parser.add_argument("--only", action="append", default=[], metavar="NAME",
                      help="run only this mutant (repeatable); no report is written")
  parser.add_argument("--run-equivalent", action="store_true",
                      help="run the mutants marked equivalent too")
  parser.add_argument("--no-baseline", action="store_true",
                      help="skip the unmutated run of the selected tests")
  parser.add_argument("--timeout", type=float, default=600, help="seconds per mutant")
  args = parser.parse_args(argv)
  problems = check()
  if problems:
    print("the mutant list is out of date:\n  " + "\n  ".join(problems))
    return 2
  if args.check:
    print(f"{len(MUTANTS)} mutants, every snippet found exactly once")
    return 0
  if args.list:
    for m in MUTANTS:
      tag = f"  [equivalent: {m.equivalent}]" if m.equivalent else ""
      print(f"{m.name:36s} {m.file:28s} {m.what}{tag}\n{'':37s}{' '.join(m.tests)}")
    return 0
  unknown = set(args.only) - {m.name for m in MUTANTS}
  if unknown:
    print(f"unknown mutant(s): {sorted(unknown)}")
    return 2
  chosen = [m for m in MUTANTS if not args.only or m.name in args.only]
  to_run = [m for m in chosen if args.run_equivalent or args.only or not m.equivalent]
  equivalent = [{"name": m.name, "file": m.file, "what": m.what, "equivalent": m.equivalent,
                 "tests": list(m.tests)} for m in chosen if m not in to_run]
  command = " ".join(["nice -n 10 python tools/mutation.py", *sys.argv[1:]]) if argv is None \
      else "python tools/mutation.py " + " ".join(argv)
  load0 = os.getloadavg()[0]
  t0 = time.perf_counter()
  with tempfile.TemporaryDirectory(prefix="gspo_mutation_") as tmp:
    tree = os.path.join(tmp, "tree")
    _copy_tree(tree)
    _sanity(tree)
    baseline_s = 0.0
    if not args.no_baseline:
      tests = sorted({t for m in to_run for t in m.tests})
      print(f"baseline: {len(tests)} test selections, unmutated ...", flush=True)
      rc, baseline_s, out = _pytest(tree, tests, args.timeout * 4)
      if rc != 0:
        print(out)
        print("the unmutated tree fails these tests: fix that first")
        return 2
      print(f"baseline passed in {baseline_s:.0f} s", flush=True)
    results = []
    for i, m in enumerate(to_run, 1):
      r = run_mutant(tree, m, args.timeout)
      results.append(r)
      print(f"[{i}/{len(to_run)}] {m.name}: {r['status']} ({r['seconds']:.0f} s)", flush=True)
      if r["status"] == "survived":
        print("  " + r["output"][-600:].replace("\n", "\n  "))
  seconds = time.perf_counter() - t0
  survived = [r["name"] for r in results if r["status"] == "survived"]
  print(f"{len(results)} run: {len(results) - len(survived)} killed, {len(survived)} survived "
        f"{survived or ''}; {len(equivalent)} equivalent not run; {seconds / 60:.1f} min")
  if not args.only:
    write_report(results, equivalent, command=command, seconds=seconds, baseline_s=baseline_s,
                 load=(load0, os.getloadavg()[0]))
    print(f"report: {os.path.relpath(REPORT_MD, ROOT)}")
  return 1 if survived else 0


if __name__ == "__main__":
  sys.exit(main())
