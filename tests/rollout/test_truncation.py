"""Truncated responses and long-response metrics (gspo_jax/rollout/lengths.py, `truncation`):
masked rows give exactly zero gradient and train the rest as if dropped, DAPO's overlong
penalty by hand, "count" unchanged, length metrics equal hand counts, config errors."""

import functools
import os
import typing

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from gspo_jax import config as C
from gspo_jax.models import transformer
from gspo_jax.objectives import losses
from gspo_jax.objectives.advantages import group_advantages
from gspo_jax.rollout import lengths, sampling
from gspo_jax.train import optim, step
from gspo_jax.train.programs import step_config
from gspo_jax.utils import configlib, rng
from tests import adam_bounds
from tests.helpers import HAND_EOS, HAND_T, TINY_MODEL, hand_rollout, leaves, prompts_of
from tests.helpers import hand_cfg as cfg_of

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
T, EOS = HAND_T, HAND_EOS
# Two groups of four; (0, 1) and (1, 3) are truncated (T tokens, no EOS). (1, 0) also has T
# tokens but ends with EOS: it is not truncated.
LENGTHS = np.array([[2, 4, 1, 3], [4, 3, 2, 4]])
TRUNCATED = np.array([[False, True, False, False], [False, False, False, True]])
REWARDS = np.array([[1.0, 0.0, 0.5, -1.0], [0.2, 2.0, -0.7, 0.0]], np.float32)


@pytest.fixture(scope="module")
def policy():
  graphdef, params = nnx.split(transformer.create(TINY_MODEL, seed=1), nnx.Param)
  return graphdef, params


@functools.cache
def programs(cfg: C.TrainConfig, graphdef):
  """Compiled once per config for the whole module (equal configs share them)."""
  tx = optim.make_optimizer(cfg.optim)
  prepare = jax.jit(functools.partial(step.prepare, graphdef=graphdef, cfg=step_config(cfg)))
  update = jax.jit(functools.partial(step.update, graphdef=graphdef, tx=tx,
                                     cfg=step_config(cfg)))
  return tx, prepare, update


@functools.cache
def minibatch_grad(cfg: C.TrainConfig, graphdef):
  """jax.grad of `step.minibatch_loss` (params, Minibatch) -> (grads, metrics), jitted:
  run eagerly, every op of the model's backward pass would compile on its own."""
  grad = jax.grad(step.minibatch_loss, has_aux=True)
  return jax.jit(lambda params, mb: grad(params, graphdef, mb, step_config(cfg)))


def train_once(cfg, policy, rollout, rewards_BxG):
  """prepare + update from a fresh optimiser state: (batch, new params, metrics)."""
  graphdef, params = policy
  tx, prepare, update = programs(cfg, graphdef)
  state = step.TrainState(params, tx.init(params), jnp.zeros((), jnp.int32), jax.random.key(0))
  batch = prepare(params, None, rollout, *prompts_of(rollout.tokens_BxGxT.shape[0]))
  new, metrics = update(jax.tree.map(jnp.copy, state), batch, jnp.asarray(rewards_BxG))
  return batch, new.params, jax.device_get(metrics)


# -- mask ---------------------------------------------------------------------------------

def drop(x_BxG, keep_BxG):
  """The kept rows of each group (every group keeps the same number)."""
  B = x_BxG.shape[0]
  return np.asarray(x_BxG)[keep_BxG].reshape(B, -1, *np.shape(x_BxG)[2:])


def test_valid_group_advantages_equal_those_of_the_dropped_groups():
  keep = ~TRUNCATED
  adv = np.asarray(group_advantages(jnp.asarray(REWARDS), valid_BxG=jnp.asarray(keep)))
  assert np.all(adv[TRUNCATED] == 0)
  np.testing.assert_allclose(drop(adv, keep), group_advantages(jnp.asarray(drop(REWARDS, keep))),
                             rtol=1e-6)
  # Group {1, 0.5, -1} by hand: mean 1/6, deviations (5/6, 2/6, -7/6), std sqrt(78/36 / 2).
  std = np.sqrt((25 + 4 + 49) / 36 / 2)
  np.testing.assert_allclose(adv[0, [0, 2, 3]], np.array([5, 2, -7]) / 6 / (std + 1e-6),
                             rtol=1e-6)
  # Fewer than 2 valid responses, or equal valid rewards: no signal, exactly 0.
  one = group_advantages(jnp.asarray(REWARDS), valid_BxG=jnp.array([[1, 0, 0, 0], [1, 1, 0, 0]], bool))
  assert np.all(np.asarray(one)[0] == 0) and np.all(np.asarray(one)[1, 2:] == 0)
  equal = jnp.array([[3.0, 9.0, 3.0, 3.0]] * 2)
  assert np.all(np.asarray(group_advantages(equal, valid_BxG=jnp.asarray(~TRUNCATED)))[0] == 0)


@pytest.mark.parametrize("loss,aggregation", [("gspo", None), ("grpo", "token-mean")])
def test_masked_truncated_rows_train_the_rest_as_if_dropped(policy, loss, aggregation):
  cfg = cfg_of(loss=C.LossConfig(name=loss, aggregation=aggregation), truncation="mask")
  rollout = hand_rollout(LENGTHS, TRUNCATED)
  batch, params, m = train_once(cfg, policy, rollout, REWARDS)
  assert np.all(np.asarray(batch.mask_BxGxT)[TRUNCATED] == 0)
  np.testing.assert_array_equal(np.asarray(batch.mask_BxGxT)[~TRUNCATED],
                                np.asarray(rollout.mask_BxGxT)[~TRUNCATED])
  assert m["num_seqs"] == 6 and m["num_tokens"] == (LENGTHS * ~TRUNCATED).sum()
  # The same rows without the truncated ones: B = 2 groups of 3, nothing masked.
  keep = ~TRUNCATED
  dropped = hand_rollout(drop(LENGTHS, keep), drop(TRUNCATED, keep)).replace(
      tokens_BxGxT=jnp.asarray(drop(rollout.tokens_BxGxT, keep)))
  dcfg = cfg_of(loss=C.LossConfig(name=loss, aggregation=aggregation), truncation="mask",
                rollout=C.RolloutConfig(prompts_per_iter=2, group_size=3, max_new_tokens=T,
                                        max_prompt_len=3))
  dbatch, dparams, dm = train_once(dcfg, policy, dropped, drop(REWARDS, keep))
  # Equal up to summation order (the minibatch shuffle orders 8 and 6 rows differently).
  for key in ("loss", "num_seqs", "num_tokens", "grad_norm", "clip_frac_seq"):
    np.testing.assert_allclose(m[key], dm[key], rtol=1e-5, atol=1e-7, err_msg=key)
  # The gradients are what this test is about: equal to float32 rounding of their scale.
  graphdef, params0 = policy
  grad = lambda c, b, r, valid: minibatch_grad(c, graphdef)(
      params0, step.Minibatch(b, group_advantages(r, valid_BxG=valid)))[0]
  g = leaves(grad(cfg, batch, jnp.asarray(REWARDS), jnp.asarray(keep)))
  dg = leaves(grad(dcfg, dbatch, jnp.asarray(drop(REWARDS, keep)), None))
  scale = max(np.abs(x).max() for x in g)
  # (twice the rtol: the clip factor grad_clip / grad_norm agrees to 1e-5 as well)
  g_tol = lambda x: 2e-5 * np.abs(x) + 1e-6 * scale
  for a, b in zip(g, dg):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6 * scale)
  # Parameters after the one Adam step: its first step is g / (|g| + eps) per entry, so
  # where a gradient entry sits at rounding noise a flip moves it by up to 2 * lr on some
  # CPU. The bound follows from that tolerance on the (clipped) gradient and lr, and is as
  # tight as float32 wherever the gradient is resolved.
  clip = min(1.0, cfg.optim.grad_clip / float(m["grad_norm"]))
  for i, (a, b, x) in enumerate(zip(leaves(params), leaves(dparams), g)):
    adam_bounds.assert_first_step_close(a, b, clip * x, clip * g_tol(x),
                                        cfg.optim.learning_rate, err_msg=f"leaf {i}")
  assert any(np.any(a != b) for a, b in zip(leaves(params), leaves(policy[1])))


def test_masked_rows_contribute_exactly_zero_gradient(policy):
  cfg = cfg_of(truncation="mask")
  graphdef, params = policy
  rollout = hand_rollout(LENGTHS, TRUNCATED)
  _, prepare, _ = programs(cfg, graphdef)
  batch = prepare(params, None, rollout, *prompts_of(2))
  # A minibatch of only the truncated rows, (0, 1) and (1, 3), one per prompt (g = 1):
  # with advantages that would move them, every gradient entry is exactly 0.
  pick = lambda x_BxGxT: x_BxGxT[np.asarray(TRUNCATED)][:, None]
  rows = batch.replace(tokens_BxGxT=pick(batch.tokens_BxGxT), mask_BxGxT=pick(batch.mask_BxGxT),
                       old_logp_BxGxT=pick(batch.old_logp_BxGxT))
  mb = step.Minibatch(rows, jnp.ones((2, 1)))
  grads, metrics = minibatch_grad(cfg, graphdef)(params, mb)
  assert all(np.all(g == 0) for g in leaves(grads))
  assert float(metrics["num_seqs"]) == 0
  # Changing everything about the truncated rows (tokens, rewards) changes nothing.
  other = rollout.replace(tokens_BxGxT=jnp.where(jnp.asarray(TRUNCATED)[..., None],
                                                 (rollout.tokens_BxGxT + 5) % 20 + 2,
                                                 rollout.tokens_BxGxT))
  rewards = np.where(TRUNCATED, 100.0, REWARDS).astype(np.float32)
  _, p1, m1 = train_once(cfg, policy, rollout, REWARDS)
  _, p2, m2 = train_once(cfg, policy, other, rewards)
  for a, b in zip(leaves(p1), leaves(p2)):
    np.testing.assert_array_equal(a, b)
  assert m1["loss"] == m2["loss"] and m1["grad_norm"] == m2["grad_norm"]


def test_a_minibatch_of_masked_rows_takes_no_step(policy):
  # One minibatch, every row truncated (the config of the tests above: no compile of its own).
  cfg = cfg_of(truncation="mask")
  everything = np.ones_like(TRUNCATED)
  _, params, m = train_once(cfg, policy, hand_rollout(np.full_like(LENGTHS, T), everything),
                            REWARDS)
  assert m["skipped_updates"] == 1
  for a, b in zip(leaves(params), leaves(policy[1])):
    np.testing.assert_array_equal(a, b)


# -- count --------------------------------------------------------------------------------

def update_before(state, batch, rewards_BxG, *, graphdef, tx, cfg):
  """`step.update` as it was before `truncation` (its minibatch loss and optax step copied
  as they were; dense model, no reference)."""

  def minibatch_loss(params, graphdef, mb, cfg):
    logp, _ = step.policy_logprobs(params, graphdef, mb.rows, step_config(cfg))
    flat = lambda x: x.reshape(-1, x.shape[-1])
    mask = flat(mb.rows.mask_BxGxT)
    return losses.LOSSES[cfg.loss.name](flat(logp), flat(mb.rows.old_logp_BxGxT),
                                        mb.adv_bxg.reshape(-1), mask, **cfg.loss.kwargs())

  def apply_step(state_parts, mb):
    params, opt_state = state_parts
    (_, metrics), grads = jax.value_and_grad(minibatch_loss, has_aux=True)(params, graphdef,
                                                                           mb, cfg)
    grad_norm = optax.tree.norm(grads)
    finite = jnp.isfinite(grad_norm) & jnp.isfinite(metrics["loss"])
    updates, new_opt = tx.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)
    metrics = {**metrics, "grad_norm": grad_norm, "skipped_updates": 1.0 - finite,
               "learning_rate": optim.current_lr(opt_state)}
    return (keep(new_params, params), keep(new_opt, opt_state)), metrics

  adv_BxG = group_advantages(rewards_BxG)
  key = rng.device_key(state.key, state.step, "minibatch")
  minibatches = step.split_minibatches(key, batch, adv_BxG, step_config(cfg), None)
  (params, opt_state), metrics = jax.lax.scan(apply_step, (state.params, state.opt_state),
                                              minibatches)
  summary = {k: jnp.mean(v) for k, v in metrics.items()}
  summary["skipped_updates"] = jnp.sum(metrics["skipped_updates"])
  summary["ratio_max"] = jnp.max(metrics["ratio_max"])
  summary["ratio_min"] = jnp.min(metrics["ratio_min"])
  summary["approx_kl_first"] = metrics["approx_kl"][0]   # added since (docs/async.md)
  return state.replace(params=params, opt_state=opt_state, step=state.step + 1), summary


@pytest.mark.parametrize("loss", ["gspo", "grpo"])
def test_count_is_the_update_as_before(policy, loss):
  cfg = cfg_of(loss=C.LossConfig(name=loss), num_minibatches=2)
  assert C.TrainConfig().truncation == "count"
  graphdef, params = policy
  rollout = hand_rollout(LENGTHS, TRUNCATED)
  batch, new_params, m = train_once(cfg, policy, rollout, REWARDS)
  np.testing.assert_array_equal(batch.mask_BxGxT, rollout.mask_BxGxT)   # truncated rows count
  tx, _, _ = programs(cfg, graphdef)
  state = step.TrainState(params, tx.init(params), jnp.zeros((), jnp.int32), jax.random.key(0))
  before, m_before = jax.jit(functools.partial(update_before, graphdef=graphdef, tx=tx,
                                               cfg=cfg))(state, batch, jnp.asarray(REWARDS))
  for a, b in zip(leaves(new_params), leaves(before.params)):
    np.testing.assert_array_equal(a, b)
  assert set(m) == set(m_before) and all(m[k] == m_before[k] for k in m)


# -- overlong -----------------------------------------------------------------------------

def test_overlong_penalty_hand_values():
  # L_max 10, L_cache 4: 0 up to 6 tokens, then -1/4 per token, -1 at 10.
  got = lengths.overlong_penalty(jnp.array([1, 6, 7, 8, 9, 10]), max_new_tokens=10, cache=4)
  np.testing.assert_allclose(got, [0, 0, -0.25, -0.5, -0.75, -1.0])
  # DAPO's recipe: L_cache 4096 of L_max 20480.
  got = lengths.overlong_penalty(jnp.array([16384, 17408, 18432, 20480]), max_new_tokens=20480,
                                 cache=4096)
  np.testing.assert_allclose(got, [0, -0.25, -0.5, -1.0])
  for cache in (0, -1, 10, 11):
    with pytest.raises(ValueError, match="L_cache"):
      lengths.overlong_penalty(jnp.array([1]), max_new_tokens=10, cache=cache)


def test_overlong_shapes_the_rewards_in_the_update(policy):
  # T = 4, L_cache = 2: lengths 1, 2 -> 0; 3 -> -0.5; 4 -> -1 (EOS at the last slot too).
  penalty = np.select([LENGTHS <= 2, LENGTHS == 3], [0.0, -0.5], -1.0).astype(np.float32)
  rollout = hand_rollout(LENGTHS, TRUNCATED)
  # Two minibatches: `by_hand` is then the "count" update the tests above compiled.
  _, shaped, m = train_once(cfg_of(truncation="overlong", overlong_cache=2, num_minibatches=2),
                            policy, rollout, REWARDS)
  _, by_hand, _ = train_once(cfg_of(num_minibatches=2), policy, rollout, REWARDS + penalty)
  assert m["overlong_penalty"] == pytest.approx(penalty.mean())
  for a, b in zip(leaves(shaped), leaves(by_hand)):
    np.testing.assert_array_equal(a, b)


def test_config_errors_name_the_field():
  for kw, match in [(dict(truncation="overlong"), "overlong_cache < rollout.max_new_tokens"),
                    (dict(truncation="overlong", overlong_cache=-2), "overlong_cache=-2"),
                    (dict(truncation="overlong", overlong_cache=T), f"overlong_cache={T}"),
                    (dict(overlong_cache=2), "overlong_cache applies to truncation='overlong'"),
                    (dict(truncation="overlong", overlong_cache=1.5), "overlong_cache must be an int"),
                    (dict(truncation="drop"), "truncation must be one of")]:
    with pytest.raises(ValueError, match=match):
      cfg_of(**kw)
  with pytest.raises(configlib.ConfigError, match="truncation"):
    configlib.apply_overrides(cfg_of(), ["truncation=cut"])
  cfg = configlib.apply_overrides(cfg_of(), ["truncation=overlong", "overlong_cache=1"])
  assert (cfg.truncation, cfg.overlong_cache) == ("overlong", 1)
  hints = typing.get_type_hints(C.TrainConfig)
  assert typing.get_args(hints["truncation"]) == C.TRUNCATION_MODES


# -- length metrics -----------------------------------------------------------------------

def test_rollout_length_metrics_equal_hand_counts():
  # T = 8; lengths sorted 1 2 2 4 5 6 7 8; (0, 3) is truncated.
  lens = np.array([[1, 2, 2, 8], [7, 4, 5, 6]])
  trunc = np.array([[False, False, False, True], [False] * 4])
  rollout = hand_rollout(lens, trunc, T=8)
  stats = jax.device_get(jax.jit(sampling.rollout_stats)(rollout))
  # p90: position 0.9 * 7 = 6.3 of the sorted lengths, 7 + 0.3 * (8 - 7).
  want = {"response_length": 35 / 8, "response_length_p90": 7.3, "response_length_max": 8,
          "truncated_frac": 1 / 8, "response_tokens": 35, "entropy": 0.5, "decode_steps": 8,
          # bins of T = 8: (0, 2], (2, 4], (4, 6], (6, 8]
          "response_frac_len_q1": 3 / 8, "response_frac_len_q2": 1 / 8,
          "response_frac_len_q3": 2 / 8, "response_frac_len_q4": 2 / 8}
  assert set(stats) == set(want)
  for k, v in want.items():
    assert float(stats[k]) == pytest.approx(v, rel=1e-6), k


def test_length_bins_are_quartiles_of_max_new_tokens():
  np.testing.assert_array_equal(lengths.length_bins(jnp.arange(7), 6), [-1, 0, 1, 1, 2, 3, 3])
  np.testing.assert_array_equal(lengths.length_bins(jnp.arange(9), 8),
                                [-1, 0, 0, 1, 1, 2, 2, 3, 3])


def test_clip_fractions_by_length_bin_hand_counts():
  # Rows (T = 8) of lengths 2 (q1), 4 (q2), 6 (q3), 8 and 7 (q4); the log-ratio l of every
  # counted token of a row is its entry of `l_R` (GSPO: log s_i = l).
  n_R = np.array([2, 4, 6, 8, 7])
  mask = (np.arange(8) < n_R[:, None]).astype(np.float32)
  l_R = np.array([0.01, 0.0, -0.01, -0.01, 0.01])
  adv_R = np.array([1.0, 1.0, -1.0, 1.0, 1.0])
  logp = jnp.asarray(mask * l_R[:, None] - 1.0)
  old = jnp.asarray(mask * -1.0)
  # GSPO, eps 3e-4 / 4e-4: clipped rows 0 (high), 2 (low), 4 (high); row 3 has A > 0, s < 1.
  m = lengths.clip_by_length(losses.gspo_loss, logp, old, jnp.asarray(adv_R), jnp.asarray(mask))
  want = {"q1": (1, 1), "q2": (0, 0), "q3": (1, 1), "q4": (7 / 15, 1 / 2)}
  for q, (tok, seq) in want.items():
    assert float(m[f"clip_frac_token_len_{q}"]) == pytest.approx(tok), q
    assert float(m[f"clip_frac_seq_len_{q}"]) == pytest.approx(seq), q
  assert [float(m[f"num_seqs_len_q{k}"]) for k in range(1, 5)] == [1, 1, 1, 2]
  assert [float(m[f"num_tokens_len_q{k}"]) for k in range(1, 5)] == [2, 4, 6, 15]
  # GRPO (eps 0.2 / 0.27) clips tokens: in q4, row 3 (A > 0) has 2 tokens at l = 0.5 and
  # row 4 (A < 0 here) one at l = -0.5: 3 of 15 tokens, both rows.
  l = np.zeros((5, 8))
  l[3, [0, 4]], l[4, 2] = 0.5, -0.5
  l[0, 0] = 0.1                    # inside the band: not clipped
  adv_R = np.array([1.0, 1.0, 1.0, 1.0, -1.0])
  m = lengths.clip_by_length(losses.grpo_loss, jnp.asarray(mask * (l - 1.0)), old,
                             jnp.asarray(adv_R), jnp.asarray(mask), eps_low=0.2, eps_high=0.27)
  for q, (tok, seq) in {"q1": (0, 0), "q4": (3 / 15, 1)}.items():
    assert float(m[f"clip_frac_token_len_{q}"]) == pytest.approx(tok), q
    assert float(m[f"clip_frac_seq_len_{q}"]) == pytest.approx(seq), q


def test_pool_minibatches_weights_each_bin_by_its_rows():
  stacked = {"clip_frac_token_len_q1": jnp.array([0.5, 0.0]),
             "num_tokens_len_q1": jnp.array([2.0, 0.0]),
             "clip_frac_seq_len_q1": jnp.array([1.0, 0.25]),
             "num_seqs_len_q1": jnp.array([1.0, 4.0])}
  pooled = lengths.pool_minibatches(stacked)
  assert float(pooled["clip_frac_token_len_q1"]) == pytest.approx(0.5)
  assert float(pooled["clip_frac_seq_len_q1"]) == pytest.approx((1 + 1) / 5)
  assert lengths.is_bin_count("num_tokens_len_q1") and not lengths.is_bin_count("num_tokens")


def test_update_reports_the_binned_clip_fractions_when_asked(policy):
  rollout = hand_rollout(LENGTHS, TRUNCATED)
  _, _, m = train_once(cfg_of(num_minibatches=2, length_clip_metrics=True), policy, rollout,
                       REWARDS)
  names = [f"{name}_len_q{k}" for k in range(1, 5) for name in ("clip_frac_token", "clip_frac_seq")]
  assert all(0 <= m[n] <= 1 for n in names)
  assert not any(lengths.is_bin_count(k) for k in m)
  _, _, m = train_once(cfg_of(num_minibatches=2), policy, rollout, REWARDS)
  assert not set(names) & set(m)


def test_length_metrics_are_documented():
  doc = open(os.path.join(ROOT, "docs", "training.md")).read()
  names = ["response_length_p90", "response_frac_len_q1", "clip_frac_token_len_q1",
           "clip_frac_seq_len_q1", "overlong_penalty", "truncated_frac", "response_length_max"]
  assert [n for n in names if n not in doc] == []


def test_an_empty_minibatch_is_left_out_of_the_averages_and_counted(policy):
  """truncation="mask" with share_prompts: each of the 2 minibatches is one group. Every
  response of group 0 is truncated, so its minibatch has no row and is skipped; the
  iteration's averages are group 1's alone (not halved by the empty one), and
  `empty_minibatches` says so. With every response truncated, nothing trains."""
  cfg = cfg_of(truncation="mask", share_prompts=True, num_minibatches=2)
  lengths = np.array([[4, 4, 4, 4], [2, 4, 1, 3]])
  truncated = np.array([[True] * 4, [False] * 4])
  _, _, m = train_once(cfg, policy, hand_rollout(lengths, truncated), REWARDS)
  assert m["empty_minibatches"] == 1 and m["skipped_updates"] == 1
  assert m["num_seqs"] == 4 and m["num_tokens"] == 2 + 4 + 1 + 3
  _, params, m = train_once(cfg, policy, hand_rollout(np.full((2, 4), 4),
                                                       np.ones((2, 4), bool)), REWARDS)
  assert m["empty_minibatches"] == 2 and m["skipped_updates"] == 2 and m["num_seqs"] == 0
  assert m["ratio_max"] == m["ratio_min"] == 1.0
  assert all(np.array_equal(a, b) for a, b in zip(leaves(params), leaves(policy[1])))
