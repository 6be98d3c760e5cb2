"""Per-turn credit for multi-turn episodes (`advantages.turn_advantages`): hand values, and
GSPO-token on per-turn advantages against GSPO on the episode reward: equal where the
advantages do not vary by turn, different exactly where they do."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gspo_jax.objectives import losses
from gspo_jax.objectives.advantages import group_advantages, turn_advantages

# One group of 3 episodes, 2 turns, 5 slots; -1 = not a model token (observation, padding).
TURN_1x3x5 = np.array([[[0, 0, -1, 1, 1],      # two turns, one observation token between
                        [0, 0, 0, -1, -1],     # one turn, then padding
                        [0, -1, 1, 1, -1]]])
REWARDS_1x3x2 = np.array([[[0.5, 1.0], [0.0, 0.0], [1.0, 0.0]]])


def test_hand_values(dtype, tol):
  # Returns to go: (1.5, 1), (0, -), (1, 0); episode 1 never reached turn 1.
  # Turn 0 over all three: mean 5/6, std (ddof 1) = sqrt(((2/3)^2 + (5/6)^2 + (1/6)^2) / 2)
  # = sqrt(7/12). Turn 1 over episodes 0 and 2: (1, 0), mean 1/2, std sqrt(1/2).
  s0, s1 = math.sqrt(7 / 12) + 1e-6, math.sqrt(1 / 2) + 1e-6
  a = lambda to_go: (to_go - 5 / 6) / s0
  b = 0.5 / s1
  want = [[[a(1.5), a(1.5), 0, b, b],
           [a(0.0), a(0.0), a(0.0), 0, 0],
           [a(1.0), 0, -b, -b, 0]]]
  got = turn_advantages(jnp.asarray(REWARDS_1x3x2, dtype), jnp.asarray(TURN_1x3x5))
  np.testing.assert_allclose(got, want, **tol)
  # Without std scaling: each turn's returns minus their mean over the episodes that took it.
  got = turn_advantages(jnp.asarray(REWARDS_1x3x2, dtype), jnp.asarray(TURN_1x3x5),
                        scale_by_std=False)
  np.testing.assert_allclose(got[0, 0], [2 / 3, 2 / 3, 0, 1 / 2, 1 / 2], **tol)


def test_a_turn_with_equal_returns_or_one_episode_gets_zero():
  # Turn 0: returns (1, 1), equal -> 0 exactly. Turn 1: (0, 1) -> -+1/sqrt(1/2).
  r = jnp.asarray([[[1.0, 0.0], [0.0, 1.0]]])
  turn = jnp.asarray([[[0, 1], [0, 1]]])
  b = 0.5 / (math.sqrt(0.5) + 1e-6)
  np.testing.assert_allclose(turn_advantages(r, turn), [[[0.0, -b], [0.0, b]]], rtol=1e-6)
  assert turn_advantages(r, turn)[0, 0, 0] == 0.0
  # Only episode 0 reached turn 1: no baseline there, 0.
  turn = jnp.asarray([[[0, 1], [0, -1]]])
  assert turn_advantages(r, turn)[0, 0, 1] == 0.0


def random_episodes(rng, B=3, G=4, K=3, T=12, same_turns=False):
  """Turns of each model token (observations and padding -1) and the turns taken."""
  turns = np.full((B, G), K) if same_turns else rng.integers(1, K + 1, (B, G))
  turn = np.full((B, G, T), -1)
  for b in range(B):
    for g in range(G):
      t = 0
      for k in range(turns[b, g]):   # 1-3 model tokens per turn (as sampled: never 0)
        n = rng.integers(1, 4)
        turn[b, g, t:t + n] = k
        t += n + 1                   # then one observation token (-1)
  return turns, turn


def final_turn_rewards(rng, turns, K=3):
  r = np.zeros(turns.shape + (K,))
  r[np.arange(turns.shape[0])[:, None], np.arange(turns.shape[1]), turns - 1] = \
      rng.integers(0, 3, turns.shape)
  return r


def flat(x):
  return jnp.asarray(x).reshape(-1, x.shape[-1])


def test_reward_only_at_the_end_gives_the_episode_advantage_exactly(dtype, tol):
  # Every episode takes all K turns and is rewarded on the last: every turn's return is R_i.
  rng = np.random.default_rng(0)
  turns, turn = random_episodes(rng, same_turns=True)
  r = jnp.asarray(final_turn_rewards(rng, turns), dtype)
  adv_BxGxT = turn_advantages(r, jnp.asarray(turn))
  R = jnp.sum(r, -1)
  exact = group_advantages(R, valid_BxG=jnp.ones(R.shape, bool))
  np.testing.assert_array_equal(adv_BxGxT, np.where(turn >= 0, np.asarray(exact)[..., None], 0))
  np.testing.assert_allclose(adv_BxGxT, np.where(turn >= 0, np.asarray(group_advantages(R))[
      ..., None], 0), **tol)


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
  turns, turn = random_episodes(rng, same_turns=True)
  r = final_turn_rewards(rng, turns)
  adv_seq = group_advantages(jnp.sum(jnp.asarray(r, jnp.float32), -1))
  # Off-policy enough that some sequences are clipped (about 40% of them: the clip range is
  # 3e-4 / 4e-4).
  (lt, gt), (ls, gs), _ = losses_and_grads(turn_advantages(r, turn), adv_seq, turn, rng)
  np.testing.assert_allclose(lt, ls, rtol=1e-5, atol=1e-8)   # advantages: float rounding apart
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
