"""Skipping rows with zero gradient (gspo_jax/objectives/row_skip.py, `row_skip.enabled`).

The live-row predicate is checked against the gradient itself, for every loss: a row with
a nonzero gradient is never called dead, and for the hard-clip losses every row with a
zero gradient is found (clipped on its advantage's side, zero advantage, empty). The
skipping update is checked against the full one on a tiny model (loss, gradient norm,
parameters and Adam state; tests/adam_bounds.py), on batches with clipped, degenerate and
masked rows, with per-row and grouped (share_prompts) minibatches, and the settings that
would make it inexact are refused by name."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import tests.adam_bounds as adam_bounds
from gspo_jax import config as C
from gspo_jax.models import transformer
from gspo_jax.models.config import tiny
from gspo_jax.objectives import losses, row_skip
from gspo_jax.train import optim, step
from gspo_jax.train.programs import step_config

# -- the live-row predicate against the gradient ---------------------------------------------

R, T = 16, 6
HARD_CLIP = ("gspo", "gspo_token", "luspo", "grpo", "gmpo")


def predicate_batch(per_token_adv: bool):
  """R rows of T tokens. Rows 0-1: zero advantage; rows 2-3: empty; the others carry a
  log-ratio shift per row, of 0.01 (clips GSPO's s_i at eps 3e-4, not GRPO's or GMPO's
  token ratios) or 0.6 on every token (clips them all), on both sides, with advantages of
  both signs; rows 14-15 clip only some of their tokens. Small noise on every token keeps
  ratios off the clip bounds. With per_token_adv, row 12's advantages are zero on its
  first half."""
  rng = np.random.default_rng(0)
  old = rng.normal(-1.5, 0.3, (R, T)).astype(np.float32)
  lengths = np.array([6, 5, 0, 0, 6, 5, 4, 6, 3, 6, 6, 5, 6, 4, 6, 6])
  mask = (np.arange(T)[None] < lengths[:, None]).astype(np.float32)
  shift = np.array([0.01, -0.6, 0, 0, 0.01, -0.01, 0.01, -0.01, 0.6, -0.6, 0.6, -0.6,
                    0.0, 0.01, 0, 0], np.float32)
  adv = np.array([0, 0, 1, -1, 1, -1, -1, 1, 1, -1, -1, 1, 0.5, -0.7, 1, -1], np.float32)
  delta = np.broadcast_to(shift[:, None], (R, T)).copy()
  delta[14, ::2], delta[15, ::2] = 0.6, -0.6        # half of their tokens clip under GRPO
  logp = old + delta + rng.normal(0, 1e-5, (R, T)).astype(np.float32)
  if per_token_adv:
    adv = np.broadcast_to(adv[:, None], (R, T)).copy()
    adv[12, :3] = 0.0
  return jnp.asarray(logp), jnp.asarray(old), jnp.asarray(adv), jnp.asarray(mask)


def rows_with_gradient(name, logp, old, adv, mask):
  kwargs = dict(losses.LOSS_DEFAULTS[name])
  g = jax.grad(lambda lp: losses.LOSSES[name](lp, old, adv, mask, **kwargs)[0])(logp)
  return np.any(np.asarray(g) != 0, axis=-1)


def predicted_live(name, logp, old, adv, mask):
  kwargs = {k: v for k, v in losses.LOSS_DEFAULTS[name].items() if k != "aggregation"}
  return np.asarray(row_skip.live_rows(name, logp, old, adv, mask, **kwargs))


@pytest.mark.parametrize("name", sorted(losses.LOSSES))
def test_no_row_with_a_gradient_is_called_dead(name):
  """Every row whose loss term has a nonzero gradient is live; under the hard-clip losses
  the live rows are exactly those, under SAPO and CISPO (whose clipped tokens keep a
  gradient) exactly the non-empty rows with a nonzero advantage."""
  batch = predicate_batch(per_token_adv=False)
  grad_R = rows_with_gradient(name, *batch)
  live_R = predicted_live(name, *batch)
  assert not np.any(grad_R & ~live_R), f"rows {np.flatnonzero(grad_R & ~live_R)} skipped"
  if name in HARD_CLIP:
    np.testing.assert_array_equal(live_R, grad_R)
  else:
    _, _, adv, mask = batch
    np.testing.assert_array_equal(live_R, (np.asarray(adv) != 0) & (np.sum(mask, -1) > 0))
  assert grad_R.sum() >= 6 and (~grad_R).sum() >= 4   # both kinds are exercised


def test_each_kind_of_dead_row_is_found_under_gspo():
  """Under GSPO: zero advantage (rows 0-1), empty (2-3), s_i clipped above with A > 0
  (4, 6 with A < 0 is live: the clip is on the other side) and below with A < 0 (5)."""
  live = predicted_live("gspo", *predicate_batch(per_token_adv=False))
  assert not live[[0, 1, 2, 3, 4, 5, 8, 9]].any()
  assert live[[6, 7, 10, 11, 12]].all()


@pytest.mark.parametrize("name", ["gspo_token", "grpo", "sapo", "cispo"])
def test_per_token_advantages(name):
  """Per-token advantages (turn credit): a row is live through any counted token with a
  nonzero advantage that its clip leaves a gradient."""
  batch = predicate_batch(per_token_adv=True)
  grad_R, live_R = rows_with_gradient(name, *batch), predicted_live(name, *batch)
  assert not np.any(grad_R & ~live_R)
  if name in HARD_CLIP:
    np.testing.assert_array_equal(live_R, grad_R)


def test_denominator_counts_rows_or_tokens_and_dead_rows_count():
  mask = jnp.asarray([[1, 1, 0], [0, 0, 0], [1, 0, 0]], jnp.float32)
  assert float(row_skip.denominator(mask, "seq-mean-token-mean")) == 2
  assert float(row_skip.denominator(mask, "seq-mean-token-sum-norm")) == 2
  assert float(row_skip.denominator(mask, "token-mean")) == 3
  assert float(row_skip.denominator(jnp.zeros((2, 3)), "token-mean")) == 1
  w = jnp.asarray([[1, 0, 0], [1, 1, 1], [0, 0, 0]], jnp.float32)   # weights drop tokens
  assert float(row_skip.denominator(mask, "seq-mean-token-mean", w)) == 1
  assert row_skip.bucket_sizes(8, 4) == (8, 6, 4, 2)
  assert row_skip.bucket_sizes(64, 8) == (64, 56, 48, 40, 32, 24, 16, 8)
  assert row_skip.bucket_sizes(3, 4) == (3, 2, 1)


# -- the skipping update equals the full one -------------------------------------------------

MODEL = tiny(vocab_size=24, hidden=32, mlp_dim=64, num_heads=2, num_kv_heads=1, head_dim=16,
             num_layers=1)
NB, NG, NT, NP = 4, 4, 5, 3
LR = 1e-2


def update_cfg(**kw) -> C.TrainConfig:
  return C.TrainConfig(**{**dict(
      model=MODEL, rollout=C.RolloutConfig(prompts_per_iter=NB, group_size=NG,
                                           max_new_tokens=NT, max_prompt_len=NP),
      sft=C.SFTConfig(steps=0), optim=C.OptimConfig(learning_rate=LR), num_minibatches=1),
      **kw})


@pytest.fixture(scope="module")
def model():
  return nnx.split(transformer.create(MODEL, seed=3), nnx.Param)


def skip_batch(model, empty=((1, 2), (3, 0)), degenerate=(0,), sampler_noise=0.0):
  """A batch of NB groups whose pi_old is the trainer's own log-probs shifted per row, so
  that at the first minibatch some sequence ratios are clipped: the groups in `degenerate`
  have equal rewards (zero advantages), the rows in `empty` no counted token. With
  `sampler_noise`, the sampler's log-probs are pi_old's plus N(0, sampler_noise) per token."""
  graphdef, params = model
  rng = np.random.default_rng(5)
  prompts = jnp.asarray(rng.integers(2, MODEL.vocab_size, (NB, NP)), jnp.int32)
  lens = jnp.asarray([NP, 2, NP, 1], jnp.int32)
  tokens = jnp.asarray(rng.integers(2, MODEL.vocab_size, (NB, NG, NT)), jnp.int32)
  lengths = rng.integers(1, NT + 1, (NB, NG))
  for b, g in empty:
    lengths[b, g] = 0
  mask = jnp.asarray(np.arange(NT)[None, None] < lengths[..., None], jnp.float32)
  rows = step.Batch(prompts, lens, tokens, mask, jnp.zeros_like(mask))
  logp = step.policy_logprobs(params, graphdef, rows, step_config(update_cfg()))[0]
  shift = rng.choice([-0.02, 0.02, 0.0], (NB, NG)).astype(np.float32)
  old = (logp + shift[..., None] + rng.normal(0, 1e-4, logp.shape)) * mask
  rewards = rng.normal(size=(NB, NG)).astype(np.float32)
  rewards[list(degenerate)] = 1.0
  rows = rows.replace(old_logp_BxGxT=old.astype(jnp.float32))
  if sampler_noise:
    noise = rng.normal(0, sampler_noise, old.shape).astype(np.float32)
    rows = rows.replace(sampler_logp_BxGxT=(rows.old_logp_BxGxT + noise) * mask)
  return rows, jnp.asarray(rewards)


def run_update(model, cfg, batch, rewards):
  graphdef, params = model
  tx = optim.make_optimizer(cfg.optim)
  state = step.TrainState(params=params, opt_state=tx.init(params),
                          step=jnp.zeros((), jnp.int32), key=jax.random.key(0))
  fn = jax.jit(functools.partial(step.update, graphdef=graphdef, tx=tx,
                                 cfg=step_config(cfg)))
  return jax.device_get(fn(state, batch, rewards))


# name: (config fields, skip_batch arguments). CISPO skips only zero-advantage and empty
# rows: two degenerate groups make room for a smaller bucket.
CASES = {
    "gspo": (dict(), {}),
    "gspo_shared_prompts": (dict(share_prompts=True), {}),
    # every group keeps a live row: the full-size branch (the first pass's own backward)
    "gspo_shared_prompts_all_live": (dict(share_prompts=True), dict(degenerate=())),
    "grpo_token_mean": (dict(loss=C.LossConfig(name="grpo", eps_low=0.01, eps_high=0.01,
                                               aggregation="token-mean")), {}),
    "cispo": (dict(loss=C.LossConfig(name="cispo")), dict(degenerate=(0, 2))),
    "gspo_two_minibatches": (dict(num_minibatches=2), {}),
    # masked importance weights: about a third of the tokens weigh 0 (denominators change)
    "gspo_correction_mask": (dict(rollout_correction=C.RolloutCorrectionConfig(
        level="token", mode="mask", threshold=1.1)), dict(sampler_noise=0.1)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_skipping_update_equals_the_full_update(model, case):
  """Same loss and metrics (pass 1 is the full forward), the same gradient norm, and the
  same parameters and Adam state up to float32 summation order; and the backward pass
  really ran on fewer rows (row_skip_saved_frac > 0) where rows were dead."""
  fields, batch_args = CASES[case]
  batch, rewards = skip_batch(model, **batch_args)
  base = update_cfg(**fields)
  skip = dataclasses.replace(base, row_skip=C.RowSkipConfig(enabled=True, buckets=4))
  full_state, full_m = run_update(model, base, batch, rewards)
  skip_state, skip_m = run_update(model, skip, batch, rewards)
  for k in full_m:
    np.testing.assert_allclose(skip_m[k], full_m[k], rtol=1e-5, atol=1e-7, err_msg=k)
  assert skip_m["row_skip_dead_frac"] > 0.25
  if case == "gspo_shared_prompts_all_live":
    assert skip_m["row_skip_saved_frac"] == 0
  else:
    assert skip_m["row_skip_saved_frac"] > 0
  if base.num_minibatches == 1:
    adam_bounds.assert_first_step_states_close(skip_state, full_state, LR)
  else:
    adam_bounds.assert_steps_close(jax.tree.leaves(skip_state.params),
                                   jax.tree.leaves(full_state.params), LR,
                                   base.num_minibatches, rtol=1e-4, atol=1e-6)


def test_a_minibatch_with_no_live_row_takes_a_zero_gradient_step(model):
  """Every row dead (all rewards equal): the gradient is exactly zero, as in the full
  update, and AdamW still applies its weight decay; nothing was run backward."""
  batch, rewards = skip_batch(model)
  base = update_cfg()
  skip = dataclasses.replace(base, row_skip=C.RowSkipConfig(enabled=True))
  flat = jnp.ones_like(rewards)
  full_state, full_m = run_update(model, base, batch, flat)
  skip_state, skip_m = run_update(model, skip, batch, flat)
  assert full_m["grad_norm"] == skip_m["grad_norm"] == 0
  assert skip_m["row_skip_dead_frac"] == skip_m["row_skip_saved_frac"] == 1
  for a, b in zip(jax.tree.leaves(skip_state), jax.tree.leaves(full_state)):
    if not jnp.issubdtype(jnp.asarray(a).dtype, jax.dtypes.prng_key):
      np.testing.assert_array_equal(a, b)


# -- settings that cannot be exact are refused -----------------------------------------------

@pytest.mark.parametrize("kw, field", [
    (dict(loss=C.LossConfig(kl_coef=0.01)), "loss.kl_coef"),
    (dict(rollout_correction=C.RolloutCorrectionConfig(off_policy_threshold=0.5)),
     "rollout_correction.off_policy_threshold"),
])
def test_settings_that_give_dead_rows_a_gradient_are_refused(kw, field):
  update_cfg(**kw)   # valid without the skip
  with pytest.raises(ValueError, match=field.replace(".", r"\.")):
    update_cfg(row_skip=C.RowSkipConfig(enabled=True), **kw)


def test_bad_bucket_counts_are_refused():
  with pytest.raises(ValueError, match="row_skip.buckets"):
    C.RowSkipConfig(enabled=True, buckets=1)


# -- on 8 devices -----------------------------------------------------------------------------

def test_the_skipping_update_equals_the_full_update_on_8_devices(tmp_path):
  """The run's own update program on a data-parallel mesh of 8 devices, where a bucket
  (4 of a minibatch's 16 rows) does not divide over the devices: the same update."""
  from gspo_jax.parallel import sharding
  from gspo_jax.train import run as R
  from gspo_jax.train.collect import rollout_step
  from tests.helpers import small_cfg
  cfg = dataclasses.replace(small_cfg(sharding.MeshConfig(data=8)), loss=C.LossConfig())
  run = R.setup(cfg, str(tmp_path))
  r = rollout_step(run, run.state.params, run.state.key, 0)
  rewards_BxG = np.random.default_rng(0).normal(size=r.rewards_BxG.shape).astype(np.float32)
  rewards_BxG[:6] = 1.0                                  # 6 of 8 groups degenerate
  rewards = sharding.feed(rewards_BxG, run.layout.mesh, rewards_BxG.shape[0])
  skip_run = run.reconfigure(dataclasses.replace(cfg, row_skip=C.RowSkipConfig(enabled=True)))
  full_state, full_m = run.programs.update(jax.tree.map(jnp.copy, run.state), r.batch, rewards)
  skip_state, skip_m = skip_run.programs.update(jax.tree.map(jnp.copy, run.state), r.batch,
                                                rewards)
  full_m, skip_m = jax.device_get(full_m), jax.device_get(skip_m)
  for k in full_m:
    np.testing.assert_allclose(skip_m[k], full_m[k], rtol=1e-5, atol=1e-7, err_msg=k)
  assert skip_m["row_skip_saved_frac"] > 0
  adam_bounds.assert_steps_close(jax.device_get(jax.tree.leaves(skip_state.params)),
                                 jax.device_get(jax.tree.leaves(full_state.params)),
                                 cfg.optim.learning_rate, cfg.num_minibatches, rtol=1e-4,
                                 atol=1e-6)
