"""Group-normalised advantages (GRPO / GSPO, paper Eq. 6), and their per-turn form for
multi-turn episodes (`turn_advantages`, per-token credit for GSPO-token, paper Eq. 13).

Shapes: the package legend (docs/shapes.md); U turns (`turn_rewards_BxGxK`, a
public name, keeps K for turns).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from gspo_jax.utils import checks

Array = jax.Array


def _raise_on_nan(fn: str, rewards) -> None:
  bad = np.argwhere(np.isnan(np.asarray(rewards)))
  if bad.size:
    rows = sorted({int(i) for i in bad[:, 0]})
    raise ValueError(
        f"{fn}: rewards_BxG contains {len(bad)} NaN value(s), first at index "
        f"{tuple(int(i) for i in bad[0])} (group rows {rows[:8]}{'...' if len(rows) > 8 else ''}). "
        "A NaN reward usually means a reward function failed; fix or drop those samples.")


def group_advantages(rewards_BxG: Array, *, eps: float = 1e-6, scale_by_std: bool = True,
                     valid_BxG: Array | None = None, check_nan: bool = True) -> Array:
  """A_ij = (r_ij - mean_j r_ij) / (std_j r_ij + eps), std with ddof = 1 (Bessel).

  With `valid_BxG`, each group's mean and std are over its valid responses only, and
  invalid ones get A = 0: the valid responses get the advantages they would have if the
  others had never been sampled (`truncation="mask"` drops truncated responses so). A
  group with fewer than 2 valid responses has no baseline and gets 0.

  Choices (docs/losses.md): ddof = 1 and eps = 1e-6 as verl, tunix and SkyRL
  (TRL uses eps = 1e-4). A group whose rewards are all equal gets exactly 0 (not the
  rounding residue of r - mean). `scale_by_std=False` is the Dr. GRPO variant r - mean.

  Args:
    rewards_BxG: one row per prompt, one column per response. G must be >= 2.
    eps: added to the std; must be > 0.
    scale_by_std: divide by the group std (GRPO / GSPO) or not (Dr. GRPO).
    valid_BxG: bool, the responses that take part (None: all).
    check_nan: refuse NaN rewards. False: a NaN reward gives its group NaN advantages
      instead; `step.update` passes False because the training loop has checked every
      reward on the host already (`rewards.score_batch`), and a host callback inside a
      program keeps that program out of JAX's persistent compilation cache.
  Returns:
    adv_BxG in at least float32.
  Raises:
    ValueError: on a wrong shape, G < 2, eps <= 0, or NaN rewards (with `check_nan`). NaN
      is detected on concrete input; under `jax.jit` a host callback raises it when the
      step runs.
  """
  fn = "group_advantages"
  checks.check_rank(fn, "rewards_BxG", rewards_BxG, 2, "B, G")
  if np.shape(rewards_BxG)[1] < 2:
    raise ValueError(f"{fn}: rewards_BxG has group size G = {np.shape(rewards_BxG)[1]}; "
                     "group normalisation needs G >= 2 responses per prompt")
  checks.check_positive(fn, "eps", eps)
  if check_nan and checks.is_concrete(rewards_BxG):
    _raise_on_nan(fn, rewards_BxG)
  elif check_nan:
    # partitioned: each device checks its own rows (no gather of a sharded batch to one host).
    jax.debug.callback(lambda r: _raise_on_nan(fn, r), rewards_BxG, partitioned=True)
  r = jnp.asarray(rewards_BxG)
  r = r.astype(jnp.promote_types(r.dtype, jnp.float32))
  if valid_BxG is not None:
    checks.check_shape(fn, "valid_BxG", valid_BxG, np.shape(rewards_BxG), "rewards_BxG")
    return _valid_group_advantages(r, jnp.asarray(valid_BxG, bool), eps, scale_by_std)
  centred = r - jnp.mean(r, axis=1, keepdims=True)
  if scale_by_std:
    centred = centred / (jnp.std(r, axis=1, ddof=1, keepdims=True) + eps)
  all_equal = jnp.all(r == r[:, :1], axis=1, keepdims=True)
  return jnp.where(all_equal, jnp.zeros((), r.dtype), centred)


def _valid_group_advantages(r_BxG: Array, valid_BxG: Array, eps: float, scale_by_std: bool
                            ) -> Array:
  """`group_advantages` over each group's valid responses (the others get 0)."""
  zero = jnp.zeros((), r_BxG.dtype)
  n_Bx1 = jnp.sum(valid_BxG, axis=1, keepdims=True, dtype=r_BxG.dtype)
  mean_Bx1 = jnp.sum(jnp.where(valid_BxG, r_BxG, zero), 1, keepdims=True) / jnp.maximum(n_Bx1, 1)
  centred = jnp.where(valid_BxG, r_BxG - mean_Bx1, zero)
  if scale_by_std:
    var_Bx1 = jnp.sum(centred * centred, 1, keepdims=True) / jnp.maximum(n_Bx1 - 1, 1)
    centred = centred / (jnp.sqrt(var_Bx1) + eps)
  # All valid rewards equal (one of them, picked as the max, matches the min): exactly 0.
  hi = jnp.max(jnp.where(valid_BxG, r_BxG, -jnp.inf), 1, keepdims=True)
  lo = jnp.min(jnp.where(valid_BxG, r_BxG, jnp.inf), 1, keepdims=True)
  no_signal = (hi == lo) | (n_Bx1 < 2)
  return jnp.where(no_signal | ~valid_BxG, zero, centred)


def turn_advantages(turn_rewards_BxGxK: Array, turn_BxGxT: Array, *, eps: float = 1e-6,
                    scale_by_std: bool = True) -> Array:
  """Per-token advantages of multi-turn episodes from per-turn rewards (GSPO-token credit).

  Each turn's tokens get its group-normalised return: with the return to go of turn k
  G_ik = sum_{j >= k} r_ij and S_k the episodes of the group that reached turn k,

    A_it = (G_{i,k(t)} - mean_{j in S_k} G_jk) / (std_{j in S_k} G_jk + eps)   (ddof = 1)

  for token t of turn k(t): `group_advantages` of turn k's returns over the episodes that
  took it, so a turn is judged against the same turn of its group. (Normalising later turns
  by the episode returns instead gives their tokens a systematic -(rewards already earned)
  / std: measured, it drove tool-call answers down and training collapsed.) As in
  `group_advantages`, a turn whose returns are all equal, or that fewer than 2 episodes of
  the group reached, gets 0. With one turn per episode, or the same number of turns in
  every episode and all the reward at the end, A_it is `group_advantages(R, valid_BxG=all
  True)_i` exactly (the same operations) and `group_advantages(R)_i` to float rounding,
  R_i = G_i0 the episode reward: GSPO-token on it is GSPO.

  Args:
    turn_rewards_BxGxK: r_ik, the reward of model turn k (0 for turns not taken). G >= 2.
    turn_BxGxT: int turn of each counted token, < 0 where the token does not count
      (observations, padding): those get A = 0. An episode reached turn k when one of its
      tokens has turn k.
    eps, scale_by_std: as in `group_advantages`.
  Returns:
    adv_BxGxT in at least float32.
  """
  fn = "turn_advantages"
  checks.check_rank(fn, "turn_rewards_BxGxK", turn_rewards_BxGxK, 3, "B, G, K")
  checks.check_rank(fn, "turn_BxGxT", turn_BxGxT, 3, "B, G, T")
  if np.shape(turn_rewards_BxGxK)[1] < 2:
    raise ValueError(f"{fn}: group size G = {np.shape(turn_rewards_BxGxK)[1]}; group "
                     "normalisation needs G >= 2 episodes per prompt")
  checks.check_positive(fn, "eps", eps)
  if checks.is_concrete(turn_rewards_BxGxK):
    _raise_on_nan(fn, np.asarray(turn_rewards_BxGxK).sum(-1))
  r = jnp.asarray(turn_rewards_BxGxK)
  r = r.astype(jnp.promote_types(r.dtype, jnp.float32))
  B, G, U = r.shape
  turn = jnp.asarray(turn_BxGxT)
  # Return to go: a reversed cumulative sum over turns.
  to_go_BxGxU = jnp.flip(jnp.cumsum(jnp.flip(r, -1), -1), -1)
  reached_BxGxU = jnp.any(turn[:, :, None, :] == jnp.arange(U)[None, None, :, None], -1)
  per_turn = lambda x: jnp.swapaxes(x, 1, 2).reshape(B * U, G)    # (B*U, G): one row per turn
  adv_BUxG = _valid_group_advantages(per_turn(to_go_BxGxU), per_turn(reached_BxGxU), eps,
                                     scale_by_std)
  adv_BxGxU = jnp.swapaxes(adv_BUxG.reshape(B, U, G), 1, 2)
  adv_BxGxT = jnp.take_along_axis(adv_BxGxU, jnp.clip(turn, 0, U - 1), axis=-1)
  return jnp.where(turn >= 0, adv_BxGxT, jnp.zeros((), r.dtype))
