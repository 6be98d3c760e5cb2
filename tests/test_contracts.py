"""Contracts the rest of the suite let slip: tools/mutation.py found a one-line bug in each
that every other test passed. Which log-probs become pi_old (dense and MoE with tracked
routing), the sign of the KL term, the direction of the cold start's loss, and the
distribution the sampler's log-probs describe.

Tiny models, pure functions under jit, no run directory.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gspo_jax import config as C
from gspo_jax import optim, sampling, step
from gspo_jax.models import transformer
from gspo_jax.models.config import tiny, tiny_moe
from gspo_jax.sampling import SamplerConfig, sample_groups
from gspo_jax.programs import step_config

MODEL = tiny(vocab_size=24, hidden=32, mlp_dim=64, num_heads=2, num_kv_heads=1, head_dim=16,
             num_layers=1)
B, G, T, P = 2, 4, 4, 3


def cfg_of(**kw) -> C.TrainConfig:
  return C.TrainConfig(**{**dict(model=MODEL, rollout=C.RolloutConfig(
      prompts_per_iter=B, group_size=G, max_new_tokens=T, max_prompt_len=P),
      sft=C.SFTConfig(steps=0), num_minibatches=1), **kw})


@pytest.fixture(scope="module")
def setting():
  graphdef, params = nnx.split(transformer.create(MODEL, seed=4), nnx.Param)
  rng = np.random.default_rng(1)
  prompts = jnp.asarray(rng.integers(2, MODEL.vocab_size, (B, P)), jnp.int32)
  lens = jnp.asarray([P, 2], jnp.int32)
  tokens = jnp.asarray(rng.integers(2, MODEL.vocab_size, (B, G, T)), jnp.int32)
  lengths = jnp.asarray(rng.integers(1, T + 1, (B, G)), jnp.int32)
  mask = (jnp.arange(T)[None, None, :] < lengths[..., None]).astype(jnp.float32)
  return graphdef, params, prompts, lens, tokens, mask


def trainer_logprobs(setting):
  graphdef, params, prompts, lens, tokens, mask = setting
  rows = step.Batch(prompts, lens, tokens, mask, jnp.zeros_like(mask))
  fn = jax.jit(functools.partial(step.policy_logprobs, graphdef=graphdef,
                                 cfg=step_config(cfg_of())))
  return np.asarray(fn(params, rows=rows)[0])


def sampler_rollout(tokens, mask):
  """A rollout whose log-probs are not the trainer's (as a bf16 inference engine's are
  not): a constant -1 on counted tokens."""
  return sampling.Rollout(tokens, mask, jnp.full(mask.shape, -1.0) * mask, jnp.zeros_like(mask),
                          jnp.sum(mask, -1).astype(jnp.int32), jnp.ones((B, G), bool),
                          jnp.zeros((B, G), bool), jnp.asarray(T, jnp.int32))


@pytest.mark.parametrize("old_logp", ["recompute", "sampler"])
def test_pi_old_is_the_trainers_recomputation_or_the_samplers_as_configured(setting, old_logp):
  """"recompute" makes pi_old the trainer's teacher-forced log-probs, "sampler" the
  sampler's; masked positions are 0 in both."""
  graphdef, params, prompts, lens, tokens, mask = setting
  rollout = sampler_rollout(tokens, mask)
  sampler_logp = rollout.logp_BxGxT
  prepare = jax.jit(functools.partial(step.prepare, graphdef=graphdef,
                                      cfg=step_config(cfg_of(old_logp=old_logp))))
  old = np.asarray(prepare(params, None, rollout, prompts, lens).old_logp_BxGxT)
  want = trainer_logprobs(setting) * np.asarray(mask) if old_logp == "recompute" else \
      np.asarray(sampler_logp)
  np.testing.assert_allclose(old, want, rtol=1e-5, atol=1e-6)
  assert not np.allclose(trainer_logprobs(setting) * np.asarray(mask), sampler_logp)


def test_tracked_routing_keeps_the_samplers_pi_old_when_configured(setting):
  """routing="track" needs the trainer's forward (for pi_old's expert choices) even when
  pi_old's log-probs are the sampler's: that forward's log-probs must not replace them."""
  _, _, prompts, lens, tokens, mask = setting
  moe = tiny_moe(vocab_size=24, hidden=32, mlp_dim=64, moe_mlp_dim=16, num_heads=2,
                 num_kv_heads=1, head_dim=16, num_layers=1)
  graphdef, params = nnx.split(transformer.create(moe, seed=5), nnx.Param)
  rollout = sampler_rollout(tokens, mask)
  cfg = cfg_of(model=moe, routing="track", old_logp="sampler")
  batch = jax.jit(functools.partial(step.prepare, graphdef=graphdef, cfg=step_config(cfg)))(
      params, None, rollout, prompts, lens)
  np.testing.assert_array_equal(batch.old_logp_BxGxT, rollout.logp_BxGxT)
  assert [e.shape for e in batch.old_experts] == [(B * G, P + T, moe.experts_per_token)]


def test_the_kl_term_is_added_to_the_policy_loss(setting):
  """loss = pg_loss + kl_coef * kl, with kl >= 0 (k3): the penalty pulls the policy toward
  the reference, it does not push it away."""
  graphdef, params, prompts, lens, tokens, mask = setting
  logp = trainer_logprobs(setting)
  rows = step.Batch(prompts, lens, tokens, mask, jnp.asarray(logp) * mask,
                    ref_logp_BxGxT=(jnp.asarray(logp) - 0.5) * mask)
  adv = jnp.asarray(np.random.default_rng(2).normal(size=(B, G)), jnp.float32)
  cfg = cfg_of(loss=C.LossConfig(kl_coef=0.25))
  loss, m = jax.jit(functools.partial(step.minibatch_loss, graphdef=graphdef,
                                      cfg=step_config(cfg)))(
      params, mb=step.Minibatch(rows, adv))
  # Every counted token has log pi_ref - log pi_theta = -0.5: k3 = e^-0.5 + 0.5 - 1.
  np.testing.assert_allclose(m["kl"], np.exp(-0.5) - 0.5, rtol=1e-5)
  np.testing.assert_allclose(loss, m["pg_loss"] + 0.25 * m["kl"], rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(m["loss"], loss, rtol=1e-6)


def test_a_cold_start_step_raises_the_demonstrations_likelihood(setting):
  """The SFT loss is the negative mean log-likelihood of the counted demonstration tokens,
  and a step on it makes them more likely."""
  graphdef, params, prompts, lens, tokens, mask = setting
  tokens_BxT, mask_BxT = tokens[:, 0], mask[:, 0]
  want = -np.sum(trainer_logprobs(setting)[:, 0] * np.asarray(mask_BxT)) / np.sum(mask_BxT)
  batch = (prompts, lens, tokens_BxT, mask_BxT)
  sft_loss = jax.jit(lambda p, *b: step.sft_loss(p, graphdef, *b))
  loss = sft_loss(params, *batch)
  np.testing.assert_allclose(loss, want, rtol=1e-5)
  assert loss > 0
  tx = optim.sft_optimizer(steps=10, learning_rate=1e-2)
  sft = jax.jit(functools.partial(step.sft_step, graphdef=graphdef, tx=tx))
  p, o = params, tx.init(params)
  for _ in range(3):  # the schedule warms up from 0: the first step does not move
    p, o, _ = sft(p, o, batch)
  assert sft_loss(p, *batch) < loss


def test_sampler_log_probs_are_of_the_unfiltered_distribution():
  """The sampler draws from the filtered distribution (here the first 8 of 64 ids) but
  records the log-probs and entropy of the tempered, unfiltered one, which is what teacher
  forcing recomputes. All logits 0: every counted token has log-prob -log 64 and entropy
  log 64 (the filtered distribution would give -log 8 and log 8)."""
  model = transformer.create(tiny(), seed=0)
  graphdef, state = nnx.split(model)
  model = nnx.merge(graphdef, jax.tree.map(jnp.zeros_like, state))
  V = model.cfg.vocab_size
  cfg = SamplerConfig(group_size=2, max_new_tokens=4, eos_id=1, max_prompt_len=4,
                      temperature=0.5, vocab_limit=8)
  out = sample_groups(model, jnp.full((2, 4), 5, jnp.int32), jnp.full((2,), 4, jnp.int32),
                      jax.random.key(0), cfg)
  m = np.asarray(out.mask_BxGxT) > 0
  assert np.asarray(out.tokens_BxGxT)[m].max() < 8
  np.testing.assert_allclose(np.asarray(out.logp_BxGxT)[m], -np.log(V), rtol=1e-6)
  np.testing.assert_allclose(np.asarray(out.entropy_BxGxT)[m], np.log(V), rtol=1e-6)
