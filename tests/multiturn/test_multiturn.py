"""Multi-turn episodes: the sampler's log-probs equal teacher forcing over the whole episode
(model tokens); observations fed onto the KV cache equal a full prefill; observation tokens
get no gradient and enter no metric; sharded episodes equal single-device ones; bad
environments fail loudly or end the episode, counted.

All tests share one episode configuration and prompt shape, so the two sampler programs
compile once per model (their compile is most of this file's time)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from gspo_jax.models import config, transformer
from gspo_jax.multiturn import envs
from gspo_jax.multiturn import sampler as S
from gspo_jax.multiturn.envs import EnvError, EnvStep, LoadedEnv
from gspo_jax.multiturn.episodes import run_episodes
from gspo_jax.objectives import losses
from gspo_jax.parallel import sharding
from gspo_jax.rollout.teacher_forcing import response_logprobs
from gspo_jax.tasks.base import Example
from gspo_jax.train import optim
from gspo_jax.train.programs import step_config
from tests.multiturn_helpers import EOS, TOK, ScriptedEnv, episode_cfg

CFG = episode_cfg()
B, G, T = 8, CFG.sampler.group_size, CFG.sampler.max_new_tokens
EXAMPLES = [Example(f"p{i}", "0") for i in range(B) for _ in range(G)]


def prompts():
  rng = np.random.default_rng(0)
  p = rng.integers(3, 20, (B, 5)).astype(np.int32)
  lens = rng.integers(1, 6, B).astype(np.int32)
  p[np.arange(5)[None] >= lens[:, None]] = 0
  return jnp.asarray(p), jnp.asarray(lens)


class Programs:
  """The compiled sampler with a model's parameters bound; keeps the final state."""

  def __init__(self, model):
    self.model = model
    self.gd, self.params = nnx.split(model)
    self.states = []

  def start(self, p, lens, key):
    return S.start_jit(self.params, p, lens, key, graphdef=self.gd, cfg=CFG)

  def resume(self, s, lens, obs, obs_len, go, key):
    return S.resume_jit(self.params, s, lens, obs, obs_len, go, key, graphdef=self.gd, cfg=CFG)

  def finish(self, s):
    self.states.append(s)
    return S.finish_jit(s, cfg=CFG)

  def run(self, env=ScriptedEnv, key=0, p=None):
    p = prompts() if p is None else p
    factory = env if isinstance(env, LoadedEnv) else LoadedEnv("scripted", env)
    return run_episodes(self.start, self.resume, self.finish, *p, jax.random.key(key),
                        EXAMPLES, factory, TOK, CFG)


@pytest.fixture(scope="module")
def programs():
  return Programs(transformer.create(config.tiny(), seed=3))


@pytest.fixture(scope="module")
def result(programs):
  return programs.run()


def test_episode_is_multi_turn_and_masks_are_disjoint(result):
  ep = jax.device_get(result.episodes)
  assert (ep.turns_BxG >= 2).sum() >= B, "the scripted env should give most episodes turns"
  assert ep.obs_mask_BxGxT.sum() > 0 and ep.mask_BxGxT.sum() > 0
  assert np.all(ep.mask_BxGxT * ep.obs_mask_BxGxT == 0)
  # Each observation segment is what the environment said after turn k: k+1 sevens and "?".
  for row_tokens, row_obs, row_turn in zip(ep.tokens_BxGxT.reshape(-1, T),
                                           ep.obs_mask_BxGxT.reshape(-1, T),
                                           ep.turn_BxGxT.reshape(-1, T)):
    segments = TOK.decode(np.where(row_obs > 0, row_tokens, 0)).replace("?", "? ").split()
    assert segments == ["7" * (k + 1) + "?" for k in range(len(segments))]
    assert np.all(np.diff(row_turn[row_turn >= 0]) >= 0)   # turns in order
  # Rewards: turn k earns k + 1, an episode's reward is their sum (ended by EOS or limit).
  np.testing.assert_array_equal(result.rewards_BxG, result.turn_rewards_BxGxK.sum(-1))
  assert result.counts["turns"] == ep.turns_BxG.sum()


def test_sampler_logprobs_equal_teacher_forced_on_model_tokens(programs, result):
  ep = result.episodes
  lp, _ = nnx.jit(response_logprobs)(programs.model, *prompts(), ep.tokens_BxGxT)
  mask = np.asarray(ep.mask_BxGxT)
  np.testing.assert_allclose(np.asarray(lp) * mask, ep.logp_BxGxT, rtol=1e-5, atol=1e-5)
  assert np.all(np.asarray(ep.logp_BxGxT)[np.asarray(ep.obs_mask_BxGxT) > 0] == 0)


def full_forward(model, prompts_BxP, lens_B, tokens_BxGxT, n_BxG):
  """The plain causal forward over [prompt, first n_BxG episode tokens] of every row."""
  P_ = prompts_BxP.shape[1]
  rows = lambda x: jnp.repeat(x, G, axis=0)
  lens = rows(lens_B)
  seq = jnp.concatenate([rows(prompts_BxP), tokens_BxGxT.reshape(B * G, T)], 1)
  pos = jnp.concatenate([jnp.broadcast_to(jnp.arange(P_), (B * G, P_)),
                         lens[:, None] + jnp.arange(T)[None]], 1)
  valid = jnp.concatenate([jnp.arange(P_)[None] < lens[:, None],
                           jnp.arange(T)[None] < n_BxG.reshape(-1, 1)], 1)
  return model(seq, pos, valid)


def test_observations_on_the_cache_equal_a_full_prefill(programs, result):
  state = programs.states[-1]
  model, (p, lens) = programs.model, prompts()
  index_BxG = np.asarray(state.cache.index)
  out = nnx.jit(full_forward)(model, p, lens, state.tokens_BxGxT, jnp.asarray(index_BxG + 1))
  written = (np.arange(T) < index_BxG[..., None])[:, :, None, None, :]   # slots in the cache
  for layer in range(model.cfg.num_layers):
    k_full = np.asarray(out.k[layer][:, p.shape[1]:]).reshape(B, G, T, *out.k[layer].shape[2:])
    k_full = np.moveaxis(k_full, 2, -1)                                 # (B, G, C, H, T)
    np.testing.assert_allclose(np.where(written, state.cache.k[layer], 0),
                               np.where(written, k_full, 0), rtol=1e-5, atol=1e-5)
  # The next logits from the cache (feeding each row's newest token) = the full forward's.
  next_logits = nnx.jit(lambda m, s: m.logits(m.decode(s.last_BxG, lens[:, None] + s.cache.index,
                                                         s.cache)[0]))
  want = model.logits(out.hidden_BxSxD[jnp.arange(B * G), p.shape[1] + index_BxG.reshape(-1)])
  np.testing.assert_allclose(next_logits(model, state).reshape(B * G, -1), want, rtol=1e-4,
                             atol=1e-4)
  assert np.asarray(state.obs_mask_BxGxT).sum() > 0


@pytest.mark.parametrize("loss", ["gspo_token", "gspo", "grpo"])
def test_observation_tokens_get_zero_gradient_and_no_metric(result, loss):
  ep = jax.device_get(result.episodes)
  flat = lambda x: jnp.asarray(x).reshape(B * G, T)
  mask, obs = flat(ep.mask_BxGxT), flat(ep.obs_mask_BxGxT) > 0
  rng = np.random.default_rng(1)
  old = flat(ep.logp_BxGxT)
  logp = old + 0.01 * mask * rng.standard_normal(old.shape)
  adv = jnp.asarray(rng.standard_normal((B * G, T)) if loss == "gspo_token"
                    else rng.standard_normal(B * G), jnp.float32)
  fn = lambda lp, o: losses.LOSSES[loss](lp, o, adv, mask)
  grad = jax.grad(lambda lp: fn(lp, old)[0])(logp)
  assert np.all(np.asarray(grad)[np.asarray(obs)] == 0.0)
  assert np.abs(np.asarray(grad)[np.asarray(mask) > 0]).max() > 0
  # Junk log-probs at observation tokens change neither the loss nor any metric.
  junk = jnp.asarray(rng.standard_normal(old.shape) * 5, jnp.float32)
  (loss_a, metrics_a), (loss_b, metrics_b) = fn(logp, old), fn(jnp.where(obs, junk, logp),
                                                               jnp.where(obs, -junk, old))
  assert np.array_equal(loss_a, loss_b) and metrics_a.keys() == metrics_b.keys()
  for name in metrics_a:
    assert np.array_equal(metrics_a[name], metrics_b[name]), name


def test_sharded_episodes_equal_single_device(programs, result):
  mesh = sharding.make_mesh(sharding.MeshConfig(data=8))
  rows = lambda x: jax.device_put(x, NamedSharding(mesh, P("data", *[None] * (x.ndim - 1))))
  p, lens = prompts()
  replicated = jax.device_put(programs.params, NamedSharding(mesh, P()))
  sharded = Programs(programs.model)
  sharded.params = replicated
  got = sharded.run(p=(rows(p), rows(lens)))
  assert got.episodes.tokens_BxGxT.sharding.spec[0] == "data"
  want = jax.device_get(result.episodes)
  np.testing.assert_array_equal(got.episodes.tokens_BxGxT, want.tokens_BxGxT)
  np.testing.assert_array_equal(got.episodes.obs_mask_BxGxT, want.obs_mask_BxGxT)
  np.testing.assert_allclose(got.episodes.logp_BxGxT, want.logp_BxGxT, rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(got.turn_rewards_BxGxK, result.turn_rewards_BxGxK)


# ------------------------------------------------------------------------- bad environments


class Raises(ScriptedEnv):
  def step(self, turn_text, *, final):
    out = super().step(turn_text, final=final)
    if self.turn == 1:
      raise RuntimeError("tool crashed")
    return out


class NotAString(ScriptedEnv):
  def step(self, turn_text, *, final):
    return EnvStep(123, 0.0)


class NanReward(ScriptedEnv):
  def step(self, turn_text, *, final):
    return EnvStep("7?", float("nan"))


class TooLong(ScriptedEnv):
  def step(self, turn_text, *, final):
    return EnvStep(None if final else "77777?", 1.0)   # 6 tokens > max_obs_tokens = 4


@pytest.mark.parametrize("env,match", [
    (Raises, r"'scripted' raised RuntimeError: tool crashed on example 'p\d', turn 1"),
    (NotAString, r"observation of type int \(not str or None\) on example 'p\d', turn 0"),
    (NanReward, r"non-finite or non-numeric reward on example 'p\d', turn 0"),
    (lambda example: object(), r"has no step\(turn_text, \*, final\) method"),
])
def test_a_bad_environment_is_an_error_naming_it_the_example_and_turn(programs, env, match):
  with pytest.raises(EnvError, match=match):
    programs.run(env)


def test_an_observation_over_budget_ends_the_episode_counted(programs):
  got = programs.run(TooLong)
  ep = jax.device_get(got.episodes)
  paused_once = got.counts["obs_overflow"]
  assert paused_once > 0 and ep.obs_mask_BxGxT.sum() == 0     # never appended
  np.testing.assert_array_equal(ep.turns_BxG, 1)
  ended = ~ep.eos_BxG & ~ep.truncated_BxG                       # stopped at a tool call
  assert ended.sum() == paused_once
  np.testing.assert_array_equal(got.rewards_BxG[ended], 0.0)   # documented: reward 0
  np.testing.assert_array_equal(got.rewards_BxG[~ended], 1.0)


# ---------------------------------------------------------------------------- loading, tools


def test_load_env_by_builtin_module_and_file(tmp_path):
  assert envs.load_env("calculator").factory is envs.CalculatorEnv
  assert envs.load_env("tests.multiturn_helpers:ScriptedEnv").factory is ScriptedEnv
  f = tmp_path / "my_env.py"
  f.write_text("class E:\n  def __init__(self, ex): pass\n")
  assert envs.load_env(f"{f}:E").factory.__name__ == "E"
  with pytest.raises(ValueError, match="environment 'nope': not a built-in"):
    envs.load_env("nope")
  with pytest.raises(ValueError, match="environment 'no_such_mod:E': cannot import module"):
    envs.load_env("no_such_mod:E")
  with pytest.raises(ValueError, match=r"has no callable 'F'"):
    envs.load_env(f"{f}:F")


def test_calculator_env():
  env = envs.CalculatorEnv(Example("12*34=", "408"))
  assert env.step("[12*34]", final=False) == EnvStep("408;", 0.0, {"tool_calls": 1})
  assert env.step("x[(2+3)*-4]", final=False).observation == "-20;"
  for bad in ("[12/4]", "12*34]", "[__import__('os')]", "[]"):
    assert env.step(bad, final=False) == EnvStep("?;", 0.0, {"malformed_calls": 1})
  assert env.step(" 408 ", final=True) == EnvStep(None, 1.0)
  assert env.step("408", final=False) == EnvStep(None, 1.0)      # not a call: the answer
  assert env.step("so 408", final=True) == EnvStep(None, 0.0)
  assert env.step("[12*34]", final=True) == EnvStep(None, 0.0)   # out of turns mid-call
  with pytest.raises(ValueError, match="longer than 64"):
    envs.calculate("1+" * 40 + "1")
  shaped = envs.load_env("calculator_shaped").make(Example("2*3=", "6"))
  assert [shaped.step("[2*3]", final=False).reward for _ in range(2)] == [0.1, 0.0]


def test_episode_config_checks():
  with pytest.raises(ValueError, match="must not hold the EOS id"):
    episode_cfg(stop_ids=(EOS,))
  with pytest.raises(ValueError, match="stop_ids must be a non-empty tuple"):
    episode_cfg(stop_ids=())


def test_scanned_layers_episodes_equal_teacher_forcing_and_a_full_prefill():
  # Scanned layers write the new keys of all layers after the scan (`Transformer.decode`):
  # the per-row slot write has its own code path there.
  programs = Programs(transformer.create(config.tiny(scan_layers=True), seed=3))
  got = programs.run()
  test_sampler_logprobs_equal_teacher_forced_on_model_tokens(programs, got)
  test_observations_on_the_cache_equal_a_full_prefill(programs, got)


# ------------------------------------------------------------------ config, task, cold start


def test_multiturn_config_refuses_what_it_does_not_support():
  from gspo_jax import config as C
  on = C.MultiTurnConfig(env="calculator")
  C.TrainConfig(multiturn=on, loss=C.LossConfig("gspo_token"))
  C.TrainConfig(multiturn=dataclasses.replace(on, credit="episode"), loss=C.LossConfig("gspo"))
  with pytest.raises(ValueError, match="credit='turn' gives per-token advantages, which "
                                       "loss.name='gspo' cannot take"):
    C.TrainConfig(multiturn=on, loss=C.LossConfig("gspo"))
  with pytest.raises(ValueError, match=r"does not support rollout.oversample"):
    C.TrainConfig(multiturn=on, loss=C.LossConfig("gspo_token"),
                  rollout=C.RolloutConfig(oversample=8))
  with pytest.raises(ValueError, match=r"does not support truncation='mask'/'overlong'"):
    C.TrainConfig(multiturn=on, loss=C.LossConfig("gspo_token"), truncation="mask")
  with pytest.raises(ValueError, match=r"does not support rollout.compact_rows"):
    C.TrainConfig(multiturn=on, loss=C.LossConfig("gspo_token"),
                  rollout=C.RolloutConfig(compact_rows=6))
  with pytest.raises(ValueError, match="multiturn.\\* settings apply to multi-turn episodes"):
    C.TrainConfig(multiturn=C.MultiTurnConfig(max_turns=2))
  with pytest.raises(ValueError, match="multiturn.max_obs_tokens must be an int >= 1"):
    C.MultiTurnConfig(max_obs_tokens=0)


def test_stop_strings_must_be_single_tokens():
  from gspo_jax import config as C
  from gspo_jax.multiturn import programs
  cfg = C.TrainConfig(multiturn=C.MultiTurnConfig(env="calculator", stop_strings=("/", "<>")),
                      loss=C.LossConfig("gspo_token"))
  with pytest.raises(ValueError, match=r"multiturn.stop_strings: '<>' is 2 tokens of the run's "
                                       r"tokenizer \(task.name='addition'\)"):
    programs.episode_configs(TOK, cfg)
  rollout, greedy = programs.episode_configs(
      TOK, dataclasses.replace(cfg, multiturn=dataclasses.replace(cfg.multiturn,
                                                                  stop_strings=("/",))))
  assert rollout.stop_ids == greedy.stop_ids == (TOK.ids["/"],) and greedy.sampler.greedy


def test_tool_task_demonstrations_mask_the_observation():
  from gspo_jax.tasks import make_task, text
  task = make_task("tool_multiplication", digits=2)
  ex = task.example(12, 34)
  assert task.demonstration(ex) == "[12*34]408;408"
  assert task.is_correct(ex, "[12*34]408;408") and task.is_correct(ex, "408")
  assert not task.is_correct(ex, "[12*34]408;40") and not task.is_correct(ex, "[12*34]")
  ids, mask = text.encode_segments(TOK, [task.demonstration_segments(ex)], 18)
  assert TOK.decode(ids[0]) == "[12*34]408;408"
  # "[12*34]" 7 model tokens, "408;" 4 observation tokens, "408" + EOS 4 model tokens.
  np.testing.assert_array_equal(mask[0], [1] * 7 + [0] * 4 + [1] * 4 + [0] * 3)


class OneTurn(ScriptedEnv):
  """Ends every episode after its first turn; rewards 0, 1 or 2 by the turn's length."""
  def step(self, turn_text, *, final):
    return EnvStep(None, float(len(turn_text) % 3))


@pytest.mark.slow  # ~45 s on 2 cores, nearly all compiling three updates
def test_update_with_turn_credit_is_gspo_on_one_turn_and_differs_on_several(programs, result):
  # The training wiring: prepare on the episodes, then the update (2 minibatches, so the
  # second is off-policy and clips). One turn per episode: per-turn credit is the episode's,
  # and GSPO-token takes GSPO's step. Rewards on several turns: another step.
  from gspo_jax import config as C
  from gspo_jax.train import step
  base = C.TrainConfig(model=config.tiny(), rollout=C.RolloutConfig(
      prompts_per_iter=B, group_size=G, max_new_tokens=T, max_prompt_len=8),
      sft=C.SFTConfig(steps=0), optim=C.OptimConfig(learning_rate=1e-3), num_minibatches=2)
  tx = optim.make_optimizer(base.optim)

  def one_update(cfg, ep, rewards):
    state = step.TrainState(programs.params, tx.init(programs.params), jnp.zeros((), jnp.int32),
                            jax.random.key(0))
    batch = step.prepare(programs.params, None, ep.as_rollout(), *prompts(),
                         graphdef=programs.gd, cfg=step_config(cfg))
    batch = batch.replace(turn_BxGxT=ep.turn_BxGxT)
    update = jax.jit(lambda s, b, r: step.update(s, b, r, graphdef=programs.gd, tx=tx,
                                                    cfg=step_config(cfg)))
    return update(state, batch, jnp.asarray(rewards))[0].params

  turn_cfg = dataclasses.replace(base, loss=C.LossConfig("gspo_token"),
                                 multiturn=C.MultiTurnConfig(env="calculator"))
  gspo_cfg = dataclasses.replace(base, loss=C.LossConfig("gspo"))
  gap = lambda x, y: max(float(jnp.max(jnp.abs(a - b))) for a, b in
                         zip(jax.tree.leaves(x), jax.tree.leaves(y)))
  one = programs.run(OneTurn)
  np.testing.assert_array_equal(one.episodes.turns_BxG, 1)
  assert np.ptp(one.rewards_BxG) > 0
  want = one_update(gspo_cfg, one.episodes, one.rewards_BxG)
  # AdamW normalises each step, so float rounding of near-zero gradients shows in the
  # parameters (below 1e-4), where different credit moves them by about the learning rate.
  assert gap(one_update(turn_cfg, one.episodes, one.turn_rewards_BxGxK), want) < 1e-4
  want = one_update(gspo_cfg, result.episodes, result.rewards_BxG)
  got = one_update(turn_cfg, result.episodes, result.turn_rewards_BxGxK)  # turn k earns k + 1
  assert gap(got, want) > 1e-3


def test_an_environment_that_does_not_load_stops_setup_before_any_work(tmp_path, monkeypatch):
  from gspo_jax import config as C
  from gspo_jax.train import run as R
  monkeypatch.setattr(R, "make_task", lambda cfg: pytest.fail("setup went on"))
  cfg = C.TrainConfig(multiturn=C.MultiTurnConfig(env="nope.py:Env"), loss=C.LossConfig("gspo_token"))
  with pytest.raises(ValueError, match=r"multiturn.env='nope.py:Env'"):
    R.setup(cfg, str(tmp_path))
  assert list(tmp_path.iterdir()) == []
