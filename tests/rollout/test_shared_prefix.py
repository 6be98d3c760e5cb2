"""Prefix sharing in teacher forcing: each prompt computed once for its G responses
(`Transformer.extend` via `response_logprobs`) equals the plain forward over the B*G
concatenated rows — log-probs, gradients, expert choices and Routing Replay."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gspo_jax import config as C
from gspo_jax.models import config, transformer
from gspo_jax.rollout import teacher_forcing
from gspo_jax.train import run as R
from gspo_jax.train import step
from tests import adam_bounds

B, P, G, T = 3, 6, 4, 5


def rows(prompts, lens, tokens):
  """The same responses as B*G groups of one (the unshared path)."""
  return (jnp.repeat(prompts, G, 0), jnp.repeat(lens, G), tokens.reshape(B * G, 1, T))


@pytest.fixture(scope="module")
def batch():
  rng = np.random.default_rng(0)
  lens = np.array([6, 2, 4], np.int32)
  prompts = rng.integers(2, 64, (B, P)).astype(np.int32)
  prompts[np.arange(P)[None, :] >= lens[:, None]] = 0
  tokens = rng.integers(2, 64, (B, G, T)).astype(np.int32)
  return jnp.asarray(prompts), jnp.asarray(lens), jnp.asarray(tokens)


def test_unshared_flag_is_the_concatenated_rows(batch):
  model = transformer.create(config.tiny(vocab_size=64, hidden=32, mlp_dim=64, num_heads=2,
                                         num_kv_heads=1, head_dim=16), seed=0)
  # One compiled program (run eagerly, every op of both forwards compiles on its own).
  flag, plain = nnx.jit(lambda m, prompts, lens, tokens: (
      teacher_forcing.response_logprobs(m, prompts, lens, tokens, share_prompts=False)[0],
      teacher_forcing.response_logprobs(m, *rows(prompts, lens, tokens))[0]))(model, *batch)
  np.testing.assert_array_equal(np.asarray(flag).reshape(B * G, T), np.asarray(plain)[:, 0])


def both(model, batch, replay=None):
  """(shared, unshared) log-probs and router infos of one jitted program."""
  @nnx.jit
  def run(model, prompts, lens, tokens):
    shared = teacher_forcing.response_logprobs(model, prompts, lens, tokens, temperature=0.8,
                                               replay=replay)
    plain = teacher_forcing.response_logprobs(model, *rows(prompts, lens, tokens),
                                              temperature=0.8, replay=replay)
    return shared, plain
  return run(model, *batch)


@pytest.mark.parametrize("cfg", [config.tiny(), config.tiny(scan_layers=True), config.tiny_moe(),
                                 config.tiny_moe(scan_layers=True, remat="full")],
                         ids=["dense", "dense_scan", "moe", "moe_scan_remat"])
def test_shared_prefix_equals_repeated_rows(cfg, batch):
  model = transformer.create(cfg, seed=1)
  (logp, router), (ref_logp, ref_router) = both(model, batch)
  assert logp.shape == (B, G, T)
  np.testing.assert_allclose(logp, ref_logp.reshape(B, G, T), rtol=1e-5, atol=1e-5)
  assert len(router.indices) == cfg.num_moe_layers
  for got, want in zip(router.indices, ref_router.indices):
    assert got.shape == (B * G, P + T, cfg.experts_per_token)
    # Padding positions of a prompt route junk either way; compare where a row is valid.
    valid = np.concatenate([np.arange(P)[None] < np.repeat(np.asarray(batch[1]), G)[:, None],
                            np.ones((B * G, T), bool)], 1)
    np.testing.assert_array_equal(np.asarray(got)[valid], np.asarray(want)[valid])


def test_gradients_equal_and_replay_is_honoured(batch):
  model = transformer.create(config.tiny_moe(), seed=2)
  graphdef, params = nnx.split(model)
  rng = np.random.default_rng(1)
  E, K = model.cfg.num_experts, model.cfg.experts_per_token
  replay = tuple(jnp.asarray(np.argsort(rng.random((B * G, P + T, E)), -1)[..., :K], jnp.int32)
                 for _ in range(model.cfg.num_moe_layers))
  # Each group's rows share one prompt, so their forced prompt experts must agree.
  replay = tuple(jnp.repeat(r.reshape(B, G, P + T, K)[:, :1], G, 1).reshape(B * G, P + T, K)
                 for r in replay)
  weights = jnp.asarray(rng.normal(size=(B, G, T)), jnp.float32)

  def loss(params, shared):
    m = nnx.merge(graphdef, params)
    prompts, lens, tokens = batch if shared else rows(*batch)
    logp, router = teacher_forcing.response_logprobs(m, prompts, lens, tokens, replay=replay)
    return jnp.sum(logp.reshape(B, G, T) * weights), router

  (v1, r1), g1 = jax.jit(jax.value_and_grad(lambda p: loss(p, True), has_aux=True))(params)
  (v2, r2), g2 = jax.jit(jax.value_and_grad(lambda p: loss(p, False), has_aux=True))(params)
  np.testing.assert_allclose(v1, v2, rtol=1e-5)
  for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
    # Float32 sums in a different order (each prompt's gradient is accumulated once over
    # its G rows instead of per row): compare against the leaf's own scale.
    scale = float(np.max(np.abs(b)))
    print(f"{a.shape}: max |diff| / max |grad| = {float(np.max(np.abs(a - b))) / scale:.2e}")
    np.testing.assert_allclose(a, b, rtol=0, atol=2e-5 * scale)
  for got, forced in zip(r1.indices, replay):
    np.testing.assert_array_equal(got, forced)


def test_minibatch_order_keeps_groups_whole():
  order = np.asarray(step.minibatch_order(jax.random.key(0), 32, 4))
  assert sorted(order) == list(range(32))
  for mb in order.reshape(2, 16):
    assert sorted(set(mb // 4)) == sorted(mb[::4] // 4) and len(set(mb // 4)) == 4
  # group = 1 is the row shuffle the unshared update always used.
  np.testing.assert_array_equal(step.minibatch_order(jax.random.key(0), 32, 1),
                                jax.random.permutation(jax.random.key(0), 32))


def test_share_prompts_needs_whole_groups_per_minibatch():
  with pytest.raises(ValueError, match="share_prompts=True keeps groups whole"):
    C.TrainConfig(rollout=C.RolloutConfig(prompts_per_iter=3, group_size=4), num_minibatches=2,
                  share_prompts=True)


def test_training_step_with_shared_prompts_equals_unshared_and_sharded(tmp_path):
  """pi_old, pi_ref and one update with share_prompts: equal to the unshared step (one
  minibatch, so both see the same rows) on one device and on 8 (data=8: a group's rows
  span two devices)."""
  from gspo_jax.parallel import sharding
  from gspo_jax.train.collect import rollout_step
  from tests.helpers import host, random_rewards_BxG, small_cfg

  def one_step(mesh, share):
    cfg = dataclasses.replace(small_cfg(mesh), num_minibatches=1, share_prompts=share)
    run = R.setup(cfg, str(tmp_path))
    r = rollout_step(run, run.state.params, run.state.key, 0,
                     ref_params=jax.tree.map(jnp.copy, run.state.params))
    B, G = r.rewards_BxG.shape
    rewards = sharding.feed(random_rewards_BxG(B, G), run.layout.mesh, B)
    state, metrics = run.programs.update(jax.tree.map(jnp.copy, run.state), r.batch, rewards)
    return r.batch, state, metrics

  one = sharding.MeshConfig(num_devices=1)
  ref_batch, ref_state, ref_metrics = one_step(one, False)
  for mesh in (one, sharding.MeshConfig(data=8)):
    batch, state, metrics = one_step(mesh, True)
    np.testing.assert_array_equal(host(batch.tokens_BxGxT), host(ref_batch.tokens_BxGxT))
    for name in ("old_logp_BxGxT", "ref_logp_BxGxT"):
      np.testing.assert_allclose(host(getattr(batch, name)), host(getattr(ref_batch, name)),
                                 atol=2e-5, err_msg=name)
    for k in ("loss", "grad_norm", "kl", "clip_frac_token"):
      assert float(metrics[k]) == pytest.approx(float(ref_metrics[k]), rel=1e-5, abs=1e-6), k
    assert float(metrics["ratio_max"]) == float(metrics["ratio_min"]) == 1.0  # theta = theta_old
    # Gradients (Adam's first moment after one step is (1 - b1) * gradient) to float32
    # rounding of their scale; parameters within what that rounding can make of one Adam
    # step: Adam divides by sqrt(v), so where a gradient is ~0 it moves by up to 2 * lr.
    lr = small_cfg(one).optim.learning_rate
    adam_bounds.assert_first_step_states_close(jax.device_get(state), jax.device_get(ref_state),
                                               lr, rtol=0, atol=2e-5)
