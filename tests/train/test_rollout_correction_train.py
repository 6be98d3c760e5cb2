"""Rollout correction in the train step (`rollout_correction.*`, gspo_jax/objectives/rollout_correction.py wired
through step.prepare / step.update): the batch keeps the sampler's log-probs next to the
recomputed pi_old, weights exactly 1 change nothing, mask mode removes tokens from
numerators and denominators (by hand, through the minibatch loss and the update), a
bfloat16 sampler gives weights != 1, config errors name the field, resume."""

import dataclasses
import json
import math
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gspo_jax import config as C
from gspo_jax.train import loop as T
from gspo_jax.train import run as R
from gspo_jax.train import rundir, step
from gspo_jax.train.collect import rollout_step
from gspo_jax.train.programs import step_config
from gspo_jax.utils import configlib
from tests import adam_bounds
from tests.helpers import correction_cfg as cfg_of
from tests.helpers import leaves

RC = C.RolloutCorrectionConfig


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  return R.setup(cfg_of(), str(tmp_path_factory.mktemp("mismatch")))


def flat(x):
  return np.asarray(x).reshape(-1, np.shape(x)[-1])


def rollout(run, seed=0):
  """(batch, random rewards): an untrained model earns reward 0 everywhere."""
  r = rollout_step(run, run.state.params, run.state.key, 0)
  rewards = np.random.default_rng(seed).normal(size=r.rewards_BxG.shape)
  return r.batch, jnp.asarray(rewards, jnp.float32)


def update(run, batch, rewards):
  new, m = run.programs.update(jax.tree.map(jnp.copy, run.state), batch, rewards)
  return leaves(new.params), jax.device_get(m)


def test_the_batch_keeps_the_sampler_log_probs_only_when_asked(run):
  batch, _ = rollout(run)
  assert batch.sampler_logp_BxGxT is not None
  off = run.reconfigure(cfg_of(rollout_correction=RC()))
  assert rollout(off)[0].sampler_logp_BxGxT is None
  # A float32 sampler is the trainer's policy: its log-probs equal the recomputed pi_old up
  # to the rounding of a decode step against a teacher-forced forward.
  mask = flat(batch.mask_BxGxT) > 0
  gap = np.abs(flat(batch.sampler_logp_BxGxT) - flat(batch.old_logp_BxGxT))[mask]
  assert gap.max() < 1e-5
  w, m = step.correction_weights(batch, step_config(run.cfg))
  np.testing.assert_allclose(np.asarray(w)[np.asarray(batch.mask_BxGxT) > 0], 1.0, atol=1e-5)
  assert float(m["rollout_corr_frac"]) == 0.0


def test_weights_of_exactly_one_leave_the_step_unchanged(run):
  batch, rewards = rollout(run)
  # sampler = pi_old exactly: every weight is 1.0 and the update is the one without
  # correction, bit for bit (x * 1.0 is exact).
  exact = batch.replace(sampler_logp_BxGxT=batch.old_logp_BxGxT)
  w, _ = step.correction_weights(exact, step_config(run.cfg))
  assert set(np.unique(np.asarray(w)[np.asarray(batch.mask_BxGxT) > 0])) == {1.0}
  on, m_on = update(run, exact, rewards)
  off_run = run.reconfigure(cfg_of(rollout_correction=RC()))
  off, m_off = update(off_run, exact.replace(sampler_logp_BxGxT=None), rewards)
  for a, b in zip(on, off):
    np.testing.assert_array_equal(a, b)
  assert all(m_on[k] == m_off[k] for k in m_off)
  assert (m_on["rollout_corr_weight_mean"], m_on["rollout_corr_weight_max"],
          m_on["rollout_corr_frac"], m_on["rollout_corr_kl"]) == (1.0, 1.0, 0.0, 0.0)
  # The float32 sampler's own log-probs (weights 1 to ~1e-6): the same steps to float32
  # rounding, which Adam's g / sqrt(v) turns into up to ~2 lr where a gradient is ~0.
  near, _ = update(run, batch, rewards)
  adam_bounds.assert_steps_close(near, off, run.cfg.optim.learning_rate,
                                 steps=run.cfg.num_minibatches, rtol=1e-5,
                                 atol=1e-3 * run.cfg.optim.learning_rate)


def test_mask_mode_removes_tokens_from_numerators_and_denominators(run):
  cfg = cfg_of(loss=C.LossConfig(name="grpo", aggregation="token-mean"), num_minibatches=1,
               rollout_correction=RC(level="token", mode="mask"))
  batch, rewards = rollout(run.reconfigure(cfg))
  mask = np.asarray(batch.mask_BxGxT)
  # Drop the first counted token of every row of group 0 and the second of row (1, 0):
  # log w = log 3 > log 2 there (masked), log w = 0 (weight 1, kept) elsewhere.
  drop = np.zeros_like(mask)
  drop[0, :, 0] = 1
  drop[1, 0, 1] = mask[1, 0, 1]
  sampler = batch.old_logp_BxGxT - math.log(3.0) * drop
  b_rc = batch.replace(sampler_logp_BxGxT=sampler)
  w, rc = step.correction_weights(b_rc, step_config(cfg))
  np.testing.assert_array_equal(np.asarray(w), mask * (1 - drop))
  assert float(rc["rollout_corr_frac"]) == pytest.approx(drop.sum() / mask.sum())
  # The minibatch loss at theta = theta_old (ratios 1): token-mean GRPO is
  # -(sum over kept tokens of A_i) / (kept tokens), the dropped tokens in neither sum.
  adv = np.asarray(step.group_advantages(rewards))
  kept = mask * (1 - drop)
  want = -np.sum(kept * adv[..., None]) / kept.sum()
  mb = step.Minibatch(b_rc, jnp.asarray(adv), w)
  loss, _ = step.minibatch_loss(run.state.params, run.graphdef, mb, step_config(cfg))
  assert float(loss) == pytest.approx(want, rel=1e-5)
  assert abs(want - (-np.sum(mask * adv[..., None]) / mask.sum())) > 1e-3   # dropping matters
  # The update equals the one where those tokens were never counted (mask zeroed there).
  masked, m = update(run.reconfigure(cfg), b_rc, rewards)
  plain_cfg = dataclasses.replace(cfg, rollout_correction=RC())
  plain, m_plain = update(run.reconfigure(plain_cfg),
                          batch.replace(mask_BxGxT=jnp.asarray(kept), sampler_logp_BxGxT=None),
                          rewards)
  assert m["loss"] == pytest.approx(m_plain["loss"], rel=1e-6)
  # To float32 rounding, up to ~2 lr per Adam step where a gradient is ~0 (adam_bounds).
  adam_bounds.assert_steps_close(masked, plain, cfg.optim.learning_rate,
                                 steps=cfg.num_minibatches, rtol=1e-6,
                                 atol=1e-3 * cfg.optim.learning_rate)


def test_a_bfloat16_sampler_gives_weights_away_from_one(run):
  cfg = cfg_of(rollout=dataclasses.replace(run.cfg.rollout, sampler_dtype="bfloat16"),
               rollout_correction=RC(level="token", mode="mask", threshold=1.02))
  bf16 = run.reconfigure(cfg)
  batch, rewards = rollout(bf16)
  w, rc = step.correction_weights(batch, step_config(cfg))
  w, mask = np.asarray(w), np.asarray(batch.mask_BxGxT) > 0
  # pi_old (float32 trainer) != pi_sampler (bfloat16): weights leave 1, and the tokens
  # outside [1/1.02, 1.02] get weight 0.
  assert float(rc["rollout_corr_kl"]) > 0 and 0 < float(rc["rollout_corr_frac"]) < 1
  assert np.any((w[mask] != 1) & (w[mask] != 0)) and np.any(w[mask] == 0)
  log_w = np.asarray(batch.old_logp_BxGxT - batch.sampler_logp_BxGxT)[mask]
  np.testing.assert_array_equal(w[mask] == 0, np.abs(log_w) > math.log(1.02))
  _, m = update(bf16, batch, rewards)
  assert float(m["skipped_updates"]) == 0 and np.isfinite(m["loss"])
  for k in ("rollout_corr_kl", "rollout_corr_frac", "rollout_corr_weight_mean",
            "rollout_corr_weight_max"):
    assert m[k] == pytest.approx(float(rc[k]), rel=1e-6)


def test_off_policy_mask_drops_negative_far_rows(run):
  cfg = cfg_of(num_minibatches=1, rollout_correction=RC(off_policy_threshold=0.5))
  batch, rewards = rollout(run.reconfigure(cfg))
  # Row (0, g) drifted: the sampler gave each of its tokens log-prob 1 above pi_theta's
  # (d_i = 1 > 0.5); it is dropped where its advantage is negative.
  far = np.zeros(batch.mask_BxGxT.shape, np.float32)
  far[0] = 1.0
  sampler = batch.old_logp_BxGxT + far * np.asarray(batch.mask_BxGxT)
  rewards = jnp.asarray([[1.0, -1.0, 0.5, -0.5]] * 4, jnp.float32)
  mb = step.Minibatch(batch.replace(sampler_logp_BxGxT=sampler), step.group_advantages(rewards))
  _, m = step.minibatch_loss(run.state.params, run.graphdef, mb, step_config(cfg))
  assert float(m["off_policy_masked_frac"]) == pytest.approx(2 / 16)   # rows (0, 1), (0, 3)
  keep = np.ones((4, 4), np.float32)
  keep[0, [1, 3]] = 0
  plain = dataclasses.replace(cfg, rollout_correction=RC())
  dropped = batch.replace(mask_BxGxT=batch.mask_BxGxT * keep[..., None])
  want, _ = step.minibatch_loss(run.state.params, run.graphdef,
                                step.Minibatch(dropped, mb.adv_bxg), step_config(plain))
  loss, _ = step.minibatch_loss(run.state.params, run.graphdef, mb, step_config(cfg))
  assert float(loss) == pytest.approx(float(want), rel=1e-6)


def test_config_errors_name_the_field():
  base = cfg_of(rollout_correction=RC())
  bad = [("rollout_correction.level=token old_logp=sampler", "old_logp='recompute'"),
         ("rollout_correction.level=token rollout_correction.threshold=0",
          "rollout_correction.threshold must be > 0"),
         ("rollout_correction.level=token rollout_correction.threshold=-1",
          "rollout_correction.threshold must be > 0"),
         ("rollout_correction.level=token rollout_correction.mode=mask "
          "rollout_correction.threshold_low=2", "rollout_correction.threshold_low must be in"),
         ("rollout_correction.level=token rollout_correction.mode=mask "
          "rollout_correction.threshold_low=0", "rollout_correction.threshold_low must be in"),
         ("rollout_correction.level=token rollout_correction.threshold_low=0.5",
          "rollout_correction.threshold_low applies to rollout_correction.mode='mask'"),
         ("rollout_correction.level=tokens", "rollout_correction.level"),
         ("rollout_correction.level=token rollout_correction.mode=clip",
          "rollout_correction.mode"),
         ("rollout_correction.threshold=3", "rollout_correction.threshold applies when"),
         ("rollout_correction.off_policy_threshold=-0.1",
          "rollout_correction.off_policy_threshold must be >= 0")]
  for overrides, match in bad:
    with pytest.raises(configlib.ConfigError, match=match.replace("(", r"\(")):
      configlib.apply_overrides(base, overrides.split())
  # old_logp="sampler" with the off-policy mask alone is fine (it compares pi_theta).
  configlib.apply_overrides(base, ["old_logp=sampler", "rollout_correction.off_policy_threshold=1"])
  assert not base.rollout_correction.needs_sampler_logp


def test_resume_may_change_the_correction(tmp_path):
  # A config saved before `rollout_correction` existed loads with it off.
  saved = cfg_of(rollout_correction=RC())
  d = configlib.to_dict(saved)
  del d["rollout_correction"]
  assert configlib.from_dict(C.TrainConfig, d) == saved
  # Turning it on (or changing it) on resume is allowed: it changes what later steps
  # optimise, not the saved state's structure or meaning.
  logs = []
  on = configlib.apply_overrides(saved, ["rollout_correction.level=geometric"])
  assert set(rundir.check_resume(saved, on, logs.append)) == {"rollout_correction.level"}
  assert "changes the trajectory" in logs[0]
  # A real resume: one iteration without, then one more with the correction.
  T.train(dataclasses.replace(saved, iterations=1), str(tmp_path), checkpoint_every=1,
          progress=False)
  T.train(dataclasses.replace(on, iterations=2), str(tmp_path), resume=True,
          checkpoint_every=1, progress=False)
  records = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in records] == [1, 2]
  assert "rollout_corr_kl" not in records[0] and records[1]["rollout_corr_weight_max"] > 0
  assert json.loads(pathlib.Path(tmp_path, "config.json").read_text())[
      "rollout_correction"]["level"] == "geometric"
