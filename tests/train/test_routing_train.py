"""The training loop's MoE routing modes (free / track / Routing Replay) and the bfloat16
sampler (paper sections 5.3 and 5.4), on a tiny MoE."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gspo_jax import config as C
from gspo_jax.models.config import tiny, tiny_moe
from gspo_jax.objectives import losses
from gspo_jax.parallel import sharding
from gspo_jax.train import programs, step
from gspo_jax.train import run as R
from gspo_jax.train.collect import rollout_step
from gspo_jax.train.programs import step_config
from tests import adam_bounds


def moe_cfg(**kw) -> C.TrainConfig:
  base = dict(
      model=tiny_moe(vocab_size=24, hidden=32, num_heads=2, num_kv_heads=1, head_dim=16,
                     num_experts=4, experts_per_token=2, moe_mlp_dim=16),
      rollout=C.RolloutConfig(prompts_per_iter=4, group_size=4, max_new_tokens=4, max_prompt_len=8),
      sft=C.SFTConfig(steps=0), optim=C.OptimConfig(learning_rate=3e-2),
      iterations=1, eval_every=0, eval_size=8, num_minibatches=2,
      mesh=sharding.MeshConfig(num_devices=1))
  return C.TrainConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  return R.setup(moe_cfg(routing="track"), str(tmp_path_factory.mktemp("moe")))


def rollout(run):
  """(batch, random rewards): an untrained model earns reward 0 everywhere."""
  r = rollout_step(run, run.state.params, run.state.key, 0)
  rewards = np.random.default_rng(0).normal(size=r.rewards_BxG.shape)
  return r.batch, jnp.asarray(rewards, jnp.float32)


@pytest.fixture(scope="module")
def rolled(run):
  """`rollout(run)` of the module's run, shared by the tests that take one from it (the
  update does not donate the batch)."""
  return rollout(run)


def forward(run, params, batch, replay=None):
  """pi_theta's teacher-forced log-probs (rows B*G x T) and RouterInfo."""
  logp, router = step.policy_logprobs(params, run.graphdef, batch, step_config(run.cfg),
                                       replay=replay)
  return logp.reshape(-1, logp.shape[-1]), router


def flat(x):
  return x.reshape(-1, x.shape[-1])


def test_routing_changed_compares_sets_on_counted_tokens():
  # 2 rows, 1 prompt position + 2 response positions, top-2.
  old = jnp.array([[[0, 1], [2, 3], [0, 2]], [[1, 2], [0, 3], [1, 3]]])
  new = jnp.array([[[3, 3], [3, 2], [0, 1]], [[1, 2], [0, 3], [3, 1]]])
  # Row 0: position 1 same set reordered (unchanged), position 2 changed; row 1: none changed.
  # The prompt position (index 0) never counts.
  mask = jnp.array([[1.0, 1.0], [1.0, 1.0]])
  assert float(step.routing_changed((new,), (old,), mask)) == pytest.approx(1 / 4)
  mask = jnp.array([[1.0, 0.0], [1.0, 1.0]])          # the changed token is padding
  assert float(step.routing_changed((new,), (old,), mask)) == 0.0
  # Two layers average: a layer where everything changed.
  assert float(step.routing_changed((new, old + 1), (old, old), jnp.ones((2, 2)))) == \
      pytest.approx((1 / 4 + 1) / 2)


def test_prepare_records_the_old_policy_expert_choices(run, rolled):
  batch, _ = rolled
  assert len(batch.old_experts) == run.cfg.model.num_moe_layers
  _, router = forward(run, run.state.params, batch)
  for got, want in zip(batch.old_experts, router.indices):
    np.testing.assert_array_equal(got, want)


def test_track_reports_changed_routing_and_replay_removes_it(run, configured, rolled):
  state = run.state
  batch, rewards = rolled
  new, m = run.programs.update(jax.tree.map(jnp.copy, state), batch, rewards)
  # lr 3e-2: the second minibatch's forward routes some tokens differently from pi_old.
  assert 0.0 < float(m["routing_changed"]) < 1.0

  # Routing Replay: pi_theta's forward uses the recorded choices -- its log-probs equal a
  # forward with those indices forced, and differ from free routing under the new params.
  mask = flat(batch.mask_BxGxT)
  replayed, router_free = forward(run, new.params, batch)
  assert float(step.routing_changed(router_free.indices, batch.old_experts, mask)) > 0
  forced, router_forced = forward(run, new.params, batch, replay=batch.old_experts)
  for got, want in zip(router_forced.indices, batch.old_experts):
    np.testing.assert_array_equal(got, want)
  assert float(jnp.max(jnp.abs(forced - replayed) * mask)) > 0

  replay = configured(dataclasses.replace(run.cfg, routing="replay"))
  from gspo_jax.objectives.advantages import group_advantages
  mb = step.Minibatch(batch, group_advantages(rewards))
  loss, metrics = step.minibatch_loss(new.params, run.graphdef, mb, step_config(replay.cfg))
  loss_free, _ = step.minibatch_loss(new.params, run.graphdef, mb,
                                     step_config(dataclasses.replace(run.cfg, routing="free")))
  want, _ = losses.LOSSES[run.cfg.loss.name](forced, flat(batch.old_logp_BxGxT),
                                             mb.adv_bxg.reshape(-1), mask,
                                             **run.cfg.loss.kwargs())
  np.testing.assert_allclose(float(loss), float(want), rtol=1e-6)
  assert float(loss) != float(loss_free)
  # A full replayed update runs and moves the parameters.
  new2, m2 = replay.programs.update(jax.tree.map(jnp.copy, state), batch, rewards)
  assert float(m2["skipped_updates"]) == 0 and np.isfinite(float(m2["loss"]))


def test_replay_at_theta_old_changes_nothing(run, configured, rolled):
  # One minibatch, theta = theta_old: free and replayed routing give the same update.
  batch, rewards = rolled
  outs = []
  for mode in ("free", "replay"):
    cfg = dataclasses.replace(run.cfg, routing=mode, num_minibatches=1)
    r = configured(cfg)
    b = batch if mode == "replay" else batch.replace(old_experts=None)
    new, m = r.programs.update(jax.tree.map(jnp.copy, run.state), b, rewards)
    outs.append((jax.device_get(new), float(m["loss"]), float(m["ratio_max"])))
  assert outs[0][1] == outs[1][1] and outs[0][2] == outs[1][2] == 1.0
  # The replayed forward is another compiled program (gates gathered at the recorded
  # experts instead of top-k): the same gradients to float32 rounding, and parameters
  # within what that rounding can make of one Adam step (up to 2 * lr where g is ~0).
  adam_bounds.assert_first_step_states_close(outs[0][0], outs[1][0], cfg.optim.learning_rate)


def test_routing_on_a_dense_model_is_a_clear_error():
  with pytest.raises(ValueError, match="routing='replay' needs a Mixture-of-Experts"):
    moe_cfg(routing="replay", model=tiny(vocab_size=24))
  with pytest.raises(ValueError, match="routing"):
    moe_cfg(routing="sometimes")


def test_bfloat16_sampler_feeds_its_own_log_probs_as_pi_old(run):
  cfg = dataclasses.replace(run.cfg, routing="free", old_logp="sampler",
                            rollout=dataclasses.replace(run.cfg.rollout, sampler_dtype="bfloat16"))
  r = run.reconfigure(cfg)
  # The sampler program casts inside: its compiled computation runs in bfloat16, the
  # trainer's parameters stay float32.
  rollout_cfg, _ = programs.sampler_configs(r.tok, cfg)
  sampler = programs.sampler_program(r.graphdef, rollout_cfg, r.layout, model_cfg=cfg.model,
                                     dtype="bfloat16")
  prompts, lens = jnp.ones((4, 8), jnp.int32), jnp.full((4,), 3, jnp.int32)
  hlo = sampler.lower(r.state.params, prompts, lens, jax.random.key(0)).as_text()
  assert "bf16" in hlo
  assert {str(x.dtype) for x in jax.tree.leaves(r.state.params)} == {"float32"}
  batch, _ = rollout(r)
  recomputed = flat(step.policy_logprobs(r.state.params, r.graphdef, batch, step_config(cfg))[0])
  mask = flat(batch.mask_BxGxT)
  gap = np.abs(np.asarray(flat(batch.old_logp_BxGxT) - recomputed * mask))[np.asarray(mask) > 0]
  # pi_old is the bf16 sampler's: close to the float32 trainer's, but not equal.
  assert 0 < gap.max() < 0.2
  with pytest.raises(ValueError, match="sampler_dtype"):
    C.RolloutConfig(sampler_dtype="float16")


def test_replayed_update_sharded_equals_single_device(run, configured, rolled, tmp_path):
  # The recorded expert choices travel row-split with the batch: a replayed update on a
  # data=2 x fsdp=2 mesh equals the single-device one.
  batch, rewards = rolled
  single = configured(dataclasses.replace(run.cfg, routing="replay"))
  want_state, want_m = single.programs.update(jax.tree.map(jnp.copy, run.state), batch, rewards)
  cfg = dataclasses.replace(single.cfg, mesh=sharding.MeshConfig(data=2, fsdp=2, num_devices=4))
  sharded = R.setup(cfg, str(tmp_path))
  sharded.state = jax.device_put(jax.device_get(run.state), sharded.layout.state)
  split_batch = jax.device_put(jax.device_get(batch), sharded.layout.batch)
  got_state, got_m = sharded.programs.update(sharded.state, split_batch,
                                             jax.device_put(rewards, sharded.layout.rows(2)))
  for k in ("loss", "ratio_max", "clip_frac_token"):
    np.testing.assert_allclose(float(got_m[k]), float(want_m[k]), rtol=1e-5, atol=1e-7)
  # Parameters after two Adam steps (two minibatches): where a gradient is tiny, Adam's
  # g/sqrt(v) turns f32 reduction-order noise into up to ~2 lr per step on some CPU; all
  # but 1% of entries within 1% of lr, every one within the steps' reach.
  adam_bounds.assert_steps_close(jax.tree.leaves(jax.device_get(got_state.params)),
                                 jax.tree.leaves(jax.device_get(want_state.params)),
                                 cfg.optim.learning_rate, steps=cfg.num_minibatches, rtol=0,
                                 atol=0.01 * cfg.optim.learning_rate)
  assert got_state.params is not None
  assert split_batch.old_experts[0].sharding.spec[0] == ("data", "fsdp", "expert")


# -- Rollout Routing Replay (R3): the sampler's own expert choices -------------------------

def r3_run(run, **rollout):
  cfg = dataclasses.replace(run.cfg, routing="rollout_replay",
                            rollout=dataclasses.replace(run.cfg.rollout, **rollout))
  return run.reconfigure(cfg)


def fed_positions(batch, steps):
  """(rows, P+T) bool: the positions whose expert choice can reach a counted log-prob and
  that the sampler fed through its model: valid prompt tokens, and response slots
  0..steps-2 (slot t is fed at decode step t + 1)."""
  P, T = batch.prompts_BxP.shape[1], batch.tokens_BxGxT.shape[-1]
  G = batch.tokens_BxGxT.shape[1]
  lens = np.repeat(np.asarray(batch.prompt_lens_B), G)
  prompt = np.arange(P)[None] < lens[:, None]
  response = np.broadcast_to(np.arange(T)[None] < steps - 1, (len(lens), T))
  return np.concatenate([prompt, response], axis=1)


def changed(a, b):
  return np.any(np.sort(np.asarray(a), -1) != np.sort(np.asarray(b), -1), -1)


def test_float32_sampler_records_the_trainers_own_choices(run, configured):
  r3 = r3_run(run)
  r = rollout_step(r3, r3.state.params, r3.state.key, 0)
  batch, steps = r.batch, int(r.device_stats["decode_steps"])
  K = r3.cfg.model.experts_per_token
  _, router = forward(run, run.state.params, batch)
  fed = fed_positions(batch, steps)
  assert len(batch.old_experts) == r3.cfg.model.num_moe_layers
  for got, want in zip(batch.old_experts, router.indices):
    assert got.shape == want.shape and not np.any(changed(got, want)[fed])
    # The last response slot predicts nothing and is never fed: it holds experts 0..K-1.
    np.testing.assert_array_equal(np.asarray(got)[:, -1], np.broadcast_to(np.arange(K), (len(got), K)))
  # So at theta = theta_old one minibatch step with R3 is free routing's step.
  rewards = jnp.asarray(np.random.default_rng(0).normal(size=r.rewards_BxG.shape), jnp.float32)
  outs = []
  for mode, b in (("rollout_replay", batch), ("free", batch.replace(old_experts=None))):
    one = configured(dataclasses.replace(r3.cfg, routing=mode, num_minibatches=1))
    new, m = one.programs.update(jax.tree.map(jnp.copy, run.state), b, rewards)
    outs.append((jax.device_get(new), float(m["loss"]), float(m["ratio_max"])))
  assert outs[0][1] == pytest.approx(outs[1][1], rel=1e-6) and outs[0][2] == pytest.approx(1.0)
  # Gradients to float32 rounding; parameters within what it makes of one Adam step.
  adam_bounds.assert_first_step_states_close(outs[0][0], outs[1][0],
                                             run.cfg.optim.learning_rate)


def near_tied_router(params):
  """Expert 1's router column = expert 0's + 1e-3 of its own: the two are a near-tie in
  float32 (decided by the 1e-3 part) and often an exact tie after the bfloat16 cast, so a
  bf16 sampler routes many tokens differently from the float32 trainer."""
  def tie(path, x):
    if "router" not in jax.tree_util.keystr(path):
      return x
    return x.at[:, 1].set(x[:, 0] + 1e-3 * x[:, 1])
  return jax.tree_util.tree_map_with_path(tie, params)


def test_bfloat16_sampler_choices_are_replayed_in_training(run):
  r3 = r3_run(run, sampler_dtype="bfloat16")
  params = near_tied_router(run.state.params)
  r = rollout_step(r3, params, r3.state.key, 0)
  batch, mask = r.batch, flat(r.batch.mask_BxGxT)
  fed = fed_positions(batch, int(r.device_stats["decode_steps"]))
  free_logp, free = forward(r3, params, batch)
  differs = [changed(s, f)[fed].mean() for s, f in zip(batch.old_experts, free.indices)]
  assert max(differs) > 0.05          # the sampler's experts are not the trainer's
  # pi_old and pi_theta forwards use the sampler's experts, not their own.
  forced, router = forward(r3, params, batch, replay=batch.old_experts)
  for used, recorded in zip(router.indices, batch.old_experts):
    np.testing.assert_array_equal(used, recorded)
  np.testing.assert_allclose(flat(batch.old_logp_BxGxT), np.asarray(forced) * mask, rtol=1e-5,
                             atol=1e-6)   # prepare's compiled forward against an eager one
  assert float(jnp.max(jnp.abs(forced - free_logp) * mask)) > 0
  rewards = jnp.asarray(np.random.default_rng(1).normal(size=r.rewards_BxG.shape), jnp.float32)
  from gspo_jax.objectives.advantages import group_advantages
  mb = step.Minibatch(batch, group_advantages(rewards))
  loss, _ = step.minibatch_loss(params, r3.graphdef, mb, step_config(r3.cfg))
  want, _ = losses.LOSSES[r3.cfg.loss.name](forced, flat(batch.old_logp_BxGxT),
                                            mb.adv_bxg.reshape(-1), mask, **r3.cfg.loss.kwargs())
  np.testing.assert_allclose(float(loss), float(want), rtol=1e-6)
  new, m = r3.programs.update(jax.tree.map(jnp.copy, r3.state.replace(params=params)), batch,
                              rewards)
  assert float(m["skipped_updates"]) == 0 and np.isfinite(float(m["loss"]))
