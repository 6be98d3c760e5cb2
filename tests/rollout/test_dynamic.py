"""Dynamic sampling (gspo_jax/rollout/dynamic_sampling.py, `rollout.oversample`): informative groups first in
sampling order, a shortfall filled with degenerate groups and counted, the update equal to
one on the kept groups alone, one compile whatever the rewards, config and resume rules."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gspo_jax import config as C
from gspo_jax.models import transformer
from gspo_jax.parallel import sharding
from gspo_jax.rollout import dynamic_sampling
from gspo_jax.train import loop as T
from gspo_jax.train import optim, rundir, step
from gspo_jax.train import run as R
from gspo_jax.train.collect import rollout_step
from gspo_jax.train.programs import step_config
from gspo_jax.utils import configlib
from tests.helpers import TINY_MODEL, correction_cfg, hand_rollout, leaves, prompts_of
from tests.helpers import hand_cfg as cfg_of


def test_informative_groups_come_first_in_sampling_order():
  rewards = jnp.asarray([[1, 1, 1], [0, 1, 0], [0, 0, 1], [2, 2, 2], [1, 0, 0], [.5, .5, .2]])
  order, m = dynamic_sampling.select_groups(rewards, None, 4)
  np.testing.assert_array_equal(order, [1, 2, 4, 5])        # only informative ones
  assert float(m["dynamic_fill"]) == 0 and float(m["degenerate_groups_frac"]) == pytest.approx(2 / 6)
  order, _ = dynamic_sampling.select_groups(rewards, None, 3)
  np.testing.assert_array_equal(order, [1, 2, 4])           # the surplus is dropped


def test_a_shortfall_is_filled_with_degenerate_groups_and_counted():
  rewards = jnp.asarray([[1, 1, 1], [0, 1, 0], [3, 3, 3], [0, 0, 0], [2, 2, 2], [1, 0, 1]])
  order, m = dynamic_sampling.select_groups(rewards, None, 4)
  np.testing.assert_array_equal(order, [1, 5, 0, 2])        # informative, then the first fill
  assert float(m["dynamic_fill"]) == 0.5 and float(m["degenerate_groups_frac"]) == pytest.approx(4 / 6)
  # With valid responses (truncation="mask"): group 1 keeps one valid response (no baseline),
  # group 5 two with equal rewards; both are degenerate now.
  valid = np.ones((6, 3), bool)
  valid[1] = [True, False, False]
  valid[5] = [True, False, True]
  assert not np.any(dynamic_sampling.informative_groups(rewards, valid))
  adv = step.group_advantages(rewards[order], valid_BxG=valid[np.asarray(order)])
  assert not np.any(np.asarray(adv))
  with pytest.raises(ValueError, match="keep must be in"):
    dynamic_sampling.select_groups(rewards, None, 7)


@pytest.fixture(scope="module")
def policy():
  return nnx.split(transformer.create(TINY_MODEL, seed=1), nnx.Param)


@functools.cache
def update_program(cfg: C.TrainConfig, graphdef):
  tx = optim.make_optimizer(cfg.optim)
  return tx, jax.jit(functools.partial(step.update, graphdef=graphdef, tx=tx,
                                       cfg=step_config(cfg)))


def train(cfg, policy, batch, rewards):
  graphdef, params = policy
  tx, update = update_program(cfg, graphdef)
  state = step.TrainState(params, tx.init(params), jnp.zeros((), jnp.int32), jax.random.key(0))
  new, m = update(jax.tree.map(jnp.copy, state), batch, jnp.asarray(rewards, jnp.float32))
  return leaves(new.params), jax.device_get(m)


def test_the_update_trains_on_the_kept_groups_alone_with_one_compile(policy):
  rollout = lambda B: C.RolloutConfig(prompts_per_iter=2, group_size=4, max_new_tokens=4,
                                      max_prompt_len=3, oversample=B - 2)
  dyn, plain = cfg_of(rollout=rollout(3), num_minibatches=2), cfg_of(rollout=rollout(2),
                                                                      num_minibatches=2)
  lengths = np.array([[2, 4, 1, 3], [4, 3, 2, 4], [1, 2, 3, 4]])
  truncated = np.zeros((3, 4), bool)
  prepare = jax.jit(functools.partial(step.prepare, graphdef=policy[0], cfg=step_config(dyn)))
  batch = prepare(policy[1], None, hand_rollout(lengths, truncated), *prompts_of(3))
  cases = [(np.array([[1, 1, 1, 1], [0, 1, 0, 2], [.5, 0, 0, 0]]), [1, 2], 0.0, 1 / 3),
           (np.array([[1, 1, 1, 1], [0, 1, 0, 2], [2, 2, 2, 2]]), [1, 0], 0.5, 2 / 3)]
  for rewards, kept, fill, degenerate in cases:
    params, m = train(dyn, policy, batch, rewards)
    want, m_want = train(plain, policy, dynamic_sampling.take_groups(batch, jnp.asarray(kept)),
                         rewards[kept])
    for a, b in zip(params, want):
      np.testing.assert_array_equal(a, b)
    assert m["dynamic_fill"] == fill and m["degenerate_groups_frac"] == pytest.approx(degenerate)
    assert all(m[k] == m_want[k] for k in m_want)
  # Different selections, the same shapes: the update program compiled once.
  assert update_program(dyn, policy[0])[1]._cache_size() == 1


def test_a_run_samples_the_extra_prompts_and_compiles_its_update_once(tmp_path):
  # With the rollout correction on too: its weights are the kept groups' (sampler log-probs
  # selected with their groups).
  cfg = correction_cfg(rollout=C.RolloutConfig(prompts_per_iter=2, group_size=4, max_new_tokens=4,
                                        max_prompt_len=8, oversample=2))
  assert cfg.rollout_correction.level == "token"
  run = R.setup(cfg, str(tmp_path))
  seen = []
  T.iterate(run, 0, 2, on_metrics=lambda s, m: seen.append(m))
  assert run.programs.update._cache_size() == 1 and len(seen) == 2
  # The untrained policy earns reward 0 on every response: every group is degenerate, the
  # batch is all fill (and trains on nothing: zero advantages).
  assert all(m["degenerate_groups_frac"] == 1.0 and m["dynamic_fill"] == 1.0 for m in seen)
  assert all(abs(m["rollout_corr_weight_mean"] - 1) < 1e-5 for m in seen)  # float32 sampler
  r = rollout_step(run, run.state.params, run.state.key, 2)
  assert r.batch.tokens_BxGxT.shape[0] == 4 and r.rewards_BxG.shape == (4, 4)   # B_s = 2 + 2


def test_config_and_resume_rules():
  base = cfg_of()
  assert base.rollout.sampled_prompts == base.rollout.prompts_per_iter
  for bad in ("-1", "1.5", "true"):
    with pytest.raises(configlib.ConfigError, match="rollout.oversample"):
      configlib.apply_overrides(base, [f"rollout.oversample={bad}"])
  more = configlib.apply_overrides(base, ["rollout.oversample=2"])
  assert more.rollout.sampled_prompts == base.rollout.prompts_per_iter + 2
  with pytest.raises(rundir.RunDirError, match="rollout.oversample.*data position"):
    rundir.check_resume(base, more, print)
  with pytest.raises(ValueError, match="prompts sampled"):
    from gspo_jax.train import programs
    cfg = configlib.apply_overrides(base, ["rollout.oversample=1"])
    programs.check_layout(cfg, sharding.make_mesh(sharding.MeshConfig(data=2, num_devices=2)))
