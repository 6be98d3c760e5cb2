"""Per-turn credit for multi-turn episodes (`advantages.turn_advantages`): hand values, and
GSPO-token on per-turn advantages against GSPO on the episode reward: equal where the
advantages do not vary by turn, different exactly where they do."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gspo_jax import losses
from gspo_jax.advantages import group_advantages, turn_advantages

# One group of 3 episodes, 2 turns, 5 slots; -1 = not a model token (observation, padding).
TURN_1x3x5 = np.array([[[0, 0, -1, 1, 1],      # two turns, one observation token between
                        [0, 0, 0, -1, -1],     # one turn, then padding
                        [0, -1, 1, 1, -1]]])
REWARDS_1x3x2 = np.array([[[0.5, 1.0], [0.0, 0.0], [1.0, 0.0]]])


def test_hand_values(dtype, tol):
  # Episode returns R = (1.5, 0, 1), mean 5/6, std (ddof 1) = sqrt(((2/3)^2 + (5/6)^2 +
  # (1/6)^2) / 2) = sqrt(7/12). Returns to go: (1.5, 1), (0, 0), (1, 0).
  s = math.sqrt(7 / 12) + 1e-6
  a = lambda to_go: (to_go - 5 / 6) / s
  want = [[[a(1.5), a(1.5), 0, a(1.0), a(1.0)],
           [a(0.0), a(0.0), a(0.0), 0, 0],
           [a(1.0), 0, a(0.0), a(0.0), 0]]]
  got = turn_advantages(jnp.asarray(REWARDS_1x3x2, dtype), jnp.asarray(TURN_1x3x5))
  np.testing.assert_allclose(got, want, **tol)
  # Without std scaling: returns to go minus the mean episode return.
  got = turn_advantages(jnp.asarray(REWARDS_1x3x2, dtype), jnp.asarray(TURN_1x3x5),
                        scale_by_std=False)
  np.testing.assert_allclose(got[0, 0], [2 / 3, 2 / 3, 0, 1 / 6, 1 / 6], **tol)


def test_equal_episode_returns_keep_the_turn_signal_unscaled():
  # R = (1, 1): no scale. Episode 0 earned its reward on turn 0, episode 1 on turn 1, so
  # episode 0's second turn has 0 still to come: 0 - R_1 = -1; everything else 0 exactly.
  r = jnp.asarray([[[1.0, 0.0], [0.0, 1.0]]])
  turn = jnp.asarray([[[0, 1], [0, 1]]])
  np.testing.assert_array_equal(turn_advantages(r, turn), [[[0.0, -1.0], [0.0, 0.0]]])


def random_episodes(rng, B=3, G=4, K=3, T=12):
  """Turns of each model token (observations and padding -1) and a per-turn reward table."""
  turns = rng.integers(1, K + 1, (B, G))
  turn = np.full((B, G, T), -1)
  for b in range(B):
    for g in range(G):
      bounds = np.sort(rng.choice(np.arange(1, T), turns[b, g], replace=False))
      for k in range(turns[b, g]):
        turn[b, g, (bounds[k - 1] + 1 if k else 0):bounds[k]] = k   # the slot at a bound: obs
  return turns, turn


def final_turn_rewards(rng, turns, K=3):
  r = np.zeros(turns.shape + (K,))
  r[np.arange(turns.shape[0])[:, None], np.arange(turns.shape[1]), turns - 1] = \
      rng.integers(0, 3, turns.shape)
  return r


def flat(x):
  return jnp.asarray(x).reshape(-1, x.shape[-1])


def test_reward_only_at_the_end_gives_the_episode_advantage_exactly(dtype):
  rng = np.random.default_rng(0)
  turns, turn = random_episodes(rng)
  r = jnp.asarray(final_turn_rewards(rng, turns), dtype)
  adv_BxGxT = turn_advantages(r, jnp.asarray(turn))
  adv_BxG = group_advantages(jnp.sum(r, -1))
  want = np.where(turn >= 0, np.asarray(adv_BxG)[..., None], 0)
  np.testing.assert_array_equal(adv_BxGxT, want)


def losses_and_grads(adv_tok, adv_seq, turn, rng, scale=0.02):
  mask = flat((turn >= 0).astype(np.float32))
  old = flat(-rng.uniform(0.5, 3.0, turn.shape).astype(np.float32)) * mask
  logp = old + scale * flat(rng.standard_normal(turn.shape).astype(np.float32)) * mask
  tok = lambda lp: losses.gspo_token_loss(lp, old, flat(adv_tok), mask)[0]
  seq = lambda lp: losses.gspo_loss(lp, old, jnp.asarray(adv_seq).reshape(-1), mask)[0]
  both = jax.jit(lambda lp: (jax.value_and_grad(tok)(lp), jax.value_and_grad(seq)(lp)))
  return *both(logp), (logp, old, mask)


def test_gspo_token_equals_gspo_when_credit_does_not_vary_by_turn():
  rng = np.random.default_rng(1)
  turns, turn = random_episodes(rng)
  r = final_turn_rewards(rng, turns)
  adv_seq = group_advantages(jnp.sum(jnp.asarray(r, jnp.float32), -1))
  # Off-policy enough that some sequences are clipped (about 40% of them: the clip range is
  # 3e-4 / 4e-4).
  (lt, gt), (ls, gs), _ = losses_and_grads(turn_advantages(r, turn), adv_seq, turn, rng)
  np.testing.assert_allclose(lt, ls, rtol=1e-6)
  np.testing.assert_allclose(gt, gs, rtol=1e-5, atol=1e-8)
  assert np.abs(np.asarray(gs)).max() > 0


def test_gspo_token_differs_from_gspo_exactly_where_credit_varies_by_turn():
  rng = np.random.default_rng(2)
  turns, turn = random_episodes(rng)
  r = rng.integers(0, 2, turns.shape + (3,)).astype(np.float32)
  r *= np.arange(3)[None, None] < turns[..., None]     # no reward for turns not taken
  adv_tok = np.asarray(turn_advantages(r, turn))
  adv_seq = np.asarray(group_advantages(jnp.sum(jnp.asarray(r), -1)))
  # Near on-policy (|log s_i| << 3e-4): nothing is clipped, so the gradients are
  # -m s_i A / (N n_i) with A_it for GSPO-token and A_i for GSPO.
  (_, gt), (_, gs), (logp, old, mask) = losses_and_grads(adv_tok, adv_seq, turn, rng,
                                                         scale=1e-6)
  n = np.asarray(mask).sum(-1, keepdims=True)
  log_s = (np.asarray(logp - old) * np.asarray(mask)).sum(-1, keepdims=True) / n
  diff = flat(adv_tok) - adv_seq.reshape(-1, 1)
  varies = (np.abs(np.asarray(diff)) > 1e-6) & (np.asarray(mask) > 0)
  assert 0 < varies.sum() < np.asarray(mask).sum()
  N = mask.shape[0]
  np.testing.assert_allclose(np.asarray(gt - gs), -np.exp(log_s) * np.asarray(diff) *
                             np.asarray(mask) / (N * n), rtol=1e-4, atol=1e-9)
  # Elsewhere the two agree to float rounding (the same value by different operations).
  differs = np.abs(np.asarray(gt - gs)) > 1e-4 * np.abs(np.asarray(gs)).max()
  np.testing.assert_array_equal(differs, varies)


@pytest.mark.parametrize("rewards,turn,match", [
    (np.zeros((2, 3)), np.zeros((2, 3, 4), int), "turn_rewards_BxGxK"),
    (np.zeros((2, 1, 3)), np.zeros((2, 1, 4), int), "needs G >= 2"),
    (np.array([[[np.nan], [0.0]]]), np.zeros((1, 2, 4), int), "NaN"),
])
def test_bad_input(rewards, turn, match):
  with pytest.raises(ValueError, match=match):
    turn_advantages(rewards, turn)
