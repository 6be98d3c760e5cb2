"""The update's guard (`step.apply_step`): a minibatch whose loss is finite but whose
gradient is not, or whose gradient is finite but whose loss is not, is skipped and
counted, and leaves the parameters and the optimiser state exactly as they were.

The gradient is poisoned in the backward pass only: a `jax.custom_vjp` identity on the
policy's log-probs whose cotangent is NaN (or inf). The forward values, hence the loss and
every metric computed from them, stay those of the clean step, so a guard that looks at
the loss alone lets the step through.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gspo_jax import config as C
from gspo_jax.models import transformer
from gspo_jax.models.config import tiny
from gspo_jax.train import optim, step
from gspo_jax.train.programs import step_config

MODEL = tiny(vocab_size=24, hidden=32, mlp_dim=64, num_heads=2, num_kv_heads=1, head_dim=16,
             num_layers=1)
B, G, T, P, M = 2, 4, 4, 3, 2
CFG = C.TrainConfig(model=MODEL, rollout=C.RolloutConfig(prompts_per_iter=B, group_size=G,
                                                         max_new_tokens=T, max_prompt_len=P),
                    sft=C.SFTConfig(steps=0), optim=C.OptimConfig(learning_rate=1e-2),
                    num_minibatches=M)


# A row whose prompt starts with one of these tokens gets that poison in its gradient.
POISON = {"nan": (22, np.nan), "inf": (23, np.inf)}


@jax.custom_vjp
def poisoned(logp_bxgxT, poison_b):
  """The identity on the log-probs; its backward pass adds `poison_b` (0, NaN or inf) to
  each row's cotangent."""
  return logp_bxgxT


poisoned.defvjp(lambda x, p: (x, p),
                lambda p, g: (g + p[:, None, None], jnp.zeros_like(p)))


def poisoned_policy_logprobs(params, graphdef, rows, cfg, **kwargs):
  logp, router = CLEAN_POLICY_LOGPROBS(params, graphdef, rows, cfg, **kwargs)
  first = rows.prompts_BxP[:, 0]
  poison_b = jnp.zeros(first.shape, logp.dtype)
  for token, value in POISON.values():
    poison_b = jnp.where(first == token, jnp.asarray(value, logp.dtype), poison_b)
  return poisoned(logp, poison_b), router


CLEAN_POLICY_LOGPROBS = step.policy_logprobs


@pytest.fixture(scope="module")
def setting():
  graphdef, params = nnx.split(transformer.create(MODEL, seed=2), nnx.Param)
  rng = np.random.default_rng(0)
  prompts = jnp.asarray(rng.integers(2, min(POISON.values())[0], (B, P)), jnp.int32)
  rows = step.Batch(prompts, jnp.full((B,), P, jnp.int32),
                    jnp.asarray(rng.integers(2, MODEL.vocab_size, (B, G, T)), jnp.int32),
                    jnp.ones((B, G, T), jnp.float32), jnp.zeros((B, G, T), jnp.float32))
  # pi_old = the current policy: on-policy ratios are 1, nothing is clipped, so the clean
  # step has a nonzero gradient everywhere.
  old, _ = jax.jit(functools.partial(step.policy_logprobs, graphdef=graphdef, cfg=step_config(CFG)))(
      params, rows=rows)
  batch = rows.replace(old_logp_BxGxT=old)
  rewards = jnp.asarray(rng.normal(size=(B, G)), jnp.float32)
  tx = optim.make_optimizer(CFG.optim)
  state = step.TrainState(params, tx.init(params), jnp.zeros((), jnp.int32), jax.random.key(0))
  return graphdef, tx, state, batch, rewards


@pytest.fixture(scope="module")
def program(setting):
  """`step.update` with the log-probs' gradient poisoned per row (one compile for every
  test: the poison is chosen by the data)."""
  graphdef, tx = setting[:2]
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(step, "policy_logprobs", poisoned_policy_logprobs)
    update = jax.jit(functools.partial(step.update, graphdef=graphdef, tx=tx,
                                         cfg=step_config(CFG)))
    # Traced and compiled while the patch holds.
    return update.lower(*setting[2:]).compile()


def update(setting, program, poison=None):
  """One update of the setting's state; with `poison`, every row's gradient poisoned."""
  _, _, state, batch, rewards = setting
  if poison is not None:
    token = POISON[poison][0]
    batch = batch.replace(prompts_BxP=batch.prompts_BxP.at[:, 0].set(token))
  new, metrics = program(jax.tree.map(jnp.copy, state), batch, rewards)
  return state, new, jax.device_get(metrics)


def leaves(tree):
  return [np.asarray(x) for x in jax.tree.leaves(tree)]


@pytest.fixture(scope="module")
def clean(setting, program):
  return update(setting, program)


def test_a_clean_step_updates(clean):
  state, new, m = clean
  assert m["skipped_updates"] == 0 and np.isfinite(m["grad_norm"]) and m["grad_norm"] > 0
  assert any(np.any(a != b) for a, b in zip(leaves(state.params), leaves(new.params)))


@pytest.mark.parametrize("poison", list(POISON))
def test_finite_loss_with_non_finite_gradient_is_skipped(setting, program, clean, poison):
  """Both minibatches poisoned (the second starts from the skipped first: on-policy)."""
  state, new, m = update(setting, program, poison)
  # The step fed really is one with a finite loss and a non-finite gradient.
  assert np.isfinite(m["loss"]) and np.isfinite(clean[2]["loss"])
  assert not np.isfinite(m["grad_norm"])
  assert m["skipped_updates"] == M  # every minibatch skipped, and each one counted
  for a, b in zip(leaves(state.params), leaves(new.params)):
    np.testing.assert_array_equal(a, b)
  for a, b in zip(leaves(state.opt_state), leaves(new.opt_state)):
    np.testing.assert_array_equal(a, b)
  assert int(new.step) == 1  # the iteration itself still counts


def test_infinite_loss_with_finite_gradient_is_skipped(setting):
  """A reference policy that gives a sampled token probability 0 (log pi_ref = -inf, e.g.
  a bf16 reference underflowing): k3 = e^d - d - 1 with d = log pi_ref - log pi_theta is
  +inf, but its gradient e^d - 1 = -1 is finite. The loss is not a number to step on."""
  graphdef, tx, state, batch, rewards = setting
  cfg = dataclasses.replace(CFG, loss=C.LossConfig(kl_coef=0.1))
  ref = batch.old_logp_BxGxT.at[:, :, 0].set(-jnp.inf)  # every row: each minibatch
  batch = batch.replace(ref_logp_BxGxT=ref)
  program = jax.jit(functools.partial(step.update, graphdef=graphdef, tx=tx,
                                      cfg=step_config(cfg)))
  new, m = program(jax.tree.map(jnp.copy, state), batch, rewards)
  m = jax.device_get(m)
  assert m["loss"] == np.inf and np.isfinite(m["grad_norm"]) and m["grad_norm"] > 0
  assert m["skipped_updates"] == M
  for a, b in zip(leaves(state.params), leaves(new.params)):
    np.testing.assert_array_equal(a, b)
  for a, b in zip(leaves(state.opt_state), leaves(new.opt_state)):
    np.testing.assert_array_equal(a, b)


def test_nan_rewards_skip_their_minibatches_and_are_counted(setting, program):
  """`update` has no host callback for NaN rewards (the loop checks them on the host; a
  callback would keep the program out of the persistent compile cache): a NaN reward in
  every group makes every row's advantage NaN, so every minibatch is skipped and counted."""
  _, _, state, batch, rewards = setting
  assert "callback" not in program.as_text()
  new, m = program(jax.tree.map(jnp.copy, state), batch, rewards.at[:, 0].set(jnp.nan))
  m = jax.device_get(m)
  assert m["skipped_updates"] == M
  for a, b in zip(leaves(state.params), leaves(new.params)):
    np.testing.assert_array_equal(a, b)
