"""Every threshold, cap and clip bound of the package, pinned from both sides.

Elsewhere the bounds are mostly tested far from where they sit (a ratio of 1.5 against a
clip at 1.2), so moving one by 10%, or flipping a strict comparison, passed the suite. Here
each bound is probed with a value just inside and just outside it, a relative distance
`NEAR` of the bound's own scale (2%: well inside a 10% move, well outside float32 rounding
for the paper's eps = 3e-4, spec section 11), and, where the convention matters, exactly on
it. Expectations are derived by hand from the paper's and GSPO_SPEC.md's conventions, stated
next to each case. Organised by module.
"""

import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gspo_jax.objectives import advantages
from gspo_jax.objectives import losses as L
from gspo_jax.objectives import rollout_correction as RC
from gspo_jax.rollout import dynamic_sampling, lengths, sampling
from gspo_jax.tasks import rewards as R
from gspo_jax.train import coldstart, optim

NEAR = 0.02  # "just inside / just outside": 2% of the bound's distance from 1 (or of it)


def _rows(log_ratios, adv):
  """One counted token per row: logp = log r, old = 0, so every ratio (token, sequence,
  GSPO-token) of row i is r_i."""
  logp = jnp.asarray(np.asarray(log_ratios, np.float32)[:, None])
  return logp, jnp.zeros_like(logp), jnp.asarray(adv, jnp.float32), jnp.ones_like(logp)


def _live(loss_fn, log_ratios, adv, **kw):
  """Which rows still carry a gradient (were not clipped) under `loss_fn`."""
  logp, old, a, m = _rows(log_ratios, adv)
  g = jax.grad(lambda lp: loss_fn(lp, old, a, m, **kw)[0])(logp)
  return np.asarray(g[:, 0] != 0)


def _probe(eps_low, eps_high):
  """Ratios just inside / just outside each bound of [1 - eps_low, 1 + eps_high], with the
  advantage sign that the bound applies to (A > 0 clips above, A < 0 below), and the same
  just-outside ratios with the other sign (never clipped there). Expected: live rows."""
  r = [1 + eps_high * (1 - NEAR), 1 + eps_high * (1 + NEAR),
       1 - eps_low * (1 - NEAR), 1 - eps_low * (1 + NEAR),
       1 + eps_high * (1 + NEAR), 1 - eps_low * (1 + NEAR)]
  adv = [1.0, 1.0, -1.0, -1.0, -1.0, 1.0]
  live = [True, False, True, False, True, True]
  return np.log(r), adv, live


# ------------------------------------------------------------------------------ loss_blocks


@pytest.mark.parametrize("eps_low,eps_high", [(3e-4, 4e-4), (0.2, 0.27)])
def test_clipped_surrogate_bounds_from_both_sides(eps_low, eps_high):
  log_r, adv, _ = _probe(eps_low, eps_high)
  s = L.clipped_surrogate(jnp.asarray(log_r, jnp.float32), jnp.asarray(adv, jnp.float32),
                          eps_low=eps_low, eps_high=eps_high)
  np.testing.assert_array_equal(s.clipped_high, [0, 1, 0, 0, 0, 0])
  np.testing.assert_array_equal(s.clipped_low, [0, 0, 0, 1, 0, 0])
  # A clipped element is the bound times A: (1 + eps_high) and -(1 - eps_low).
  obj = np.asarray(s.objective)
  np.testing.assert_allclose(obj[1], 1 + eps_high, rtol=1e-6)
  np.testing.assert_allclose(obj[3], -(1 - eps_low), rtol=1e-6)
  np.testing.assert_allclose(obj[[0, 2]], np.exp(log_r[[0, 2]]) * [1, -1], rtol=1e-6)


def test_clipped_surrogate_tie_is_not_clipped():
  # r exactly on a bound (exp(log 2) = 2 and exp(log 0.5) = 0.5 are exact in float32):
  # the docstring's convention, a tie counts as not clipped (strict > and <).
  s = L.clipped_surrogate(jnp.log(jnp.asarray([2.0, 0.5])), jnp.asarray([1.0, -1.0]),
                          eps_low=0.5, eps_high=1.0)
  np.testing.assert_array_equal(s.clipped_high, [False, False])
  np.testing.assert_array_equal(s.clipped_low, [False, False])


def test_clipped_surrogate_zero_advantage_is_never_clipped():
  # A = 0 is on the boundary of both sign conditions (A > 0 clips above, A < 0 below): it is
  # neither, so the clip fractions do not count it whatever its ratio.
  s = L.clipped_surrogate(jnp.log(jnp.asarray([3.0, 0.25])), jnp.zeros(2), eps_low=0.2,
                          eps_high=0.2)
  np.testing.assert_array_equal(s.clipped_high, [False, False])
  np.testing.assert_array_equal(s.clipped_low, [False, False])
  np.testing.assert_array_equal(s.objective, [0.0, 0.0])


def test_truncated_weight_surrogate_bounds_from_both_sides():
  # CISPO's weight clip(r, 1 - eps_low, 1 + eps_high) = clip(r, 0.8, 1.2): flagged and
  # truncated just outside, untouched just inside, whatever the sign of A.
  r = np.array([1.2 * (1 - NEAR / 10), 1.2 * (1 + NEAR / 10), 0.8 * (1 + NEAR / 10),
                0.8 * (1 - NEAR / 10)])
  s = L.truncated_weight_surrogate(jnp.log(jnp.asarray(r, jnp.float32)), jnp.ones(4),
                                   jnp.asarray([1.0, -1.0, 1.0, -1.0]), eps_low=0.2,
                                   eps_high=0.2)
  np.testing.assert_array_equal(s.clipped_high, [0, 1, 0, 0])
  np.testing.assert_array_equal(s.clipped_low, [0, 0, 0, 1])
  np.testing.assert_allclose(s.objective, [r[0], -1.2, r[2], -0.8], rtol=1e-6)


def test_sign_aware_log_clip_bounds_from_both_sides():
  # GMPO clips l itself: A > 0 above eps_high, A < 0 below -eps_low (eps 0.3 / 0.5 here).
  l = np.array([0.5 * (1 - NEAR), 0.5 * (1 + NEAR), -0.3 * (1 - NEAR), -0.3 * (1 + NEAR)])
  out, low, high = L.sign_aware_log_clip(jnp.asarray(l, jnp.float32),
                                         jnp.asarray([1.0, 1.0, -1.0, -1.0]),
                                         eps_low=0.3, eps_high=0.5)
  np.testing.assert_array_equal(high, [0, 1, 0, 0])
  np.testing.assert_array_equal(low, [0, 0, 0, 1])
  np.testing.assert_allclose(out, [l[0], 0.5, l[2], -0.3], rtol=1e-6)


# ------------------------------------------------------------------------------ losses
# The losses' default clip ranges (LOSS_DEFAULTS, the paper's): each loss called with its
# keyword defaults, so a moved default fails here.


@pytest.mark.parametrize("name,eps_low,eps_high", [("gspo", 3e-4, 4e-4),
                                                   ("gspo_token", 3e-4, 4e-4),
                                                   ("luspo", 3e-4, 4e-4),
                                                   ("grpo", 0.2, 0.27)])
def test_default_clip_ranges_from_both_sides(name, eps_low, eps_high):
  log_r, adv, live = _probe(eps_low, eps_high)
  np.testing.assert_array_equal(_live(L.LOSSES[name], log_r, adv), live)


def test_grpo_clips_each_token_at_its_own_ratio():
  # One row, A > 0, two tokens: GRPO decides per token (w_it), so the token just past the
  # default 1 + 0.27 loses its gradient and the other (below 1 - 0.2, which A > 0 ignores)
  # keeps it.
  logp = jnp.log(jnp.asarray([[1.27 * (1 + NEAR), 1 / 1.27]], jnp.float32))
  old, adv, m = jnp.zeros_like(logp), jnp.ones(1), jnp.ones_like(logp)
  g = jax.grad(lambda lp: L.grpo_loss(lp, old, adv, m)[0])(logp)
  np.testing.assert_array_equal(np.asarray(g[0]) != 0, [False, True])


def test_cispo_default_cap_and_no_floor():
  # CISPO defaults eps_low 1.0, eps_high 4.0: weights clipped to [0, 5]. One token per row,
  # token-mean over 4 tokens: dL/dlogp_i = -w_i A_i / 4 (the weight has no gradient).
  r = np.array([5 * (1 - NEAR), 5 * (1 + NEAR), 0.05, 1.0])
  logp, old, adv, m = _rows(np.log(r), [1.0, 1.0, 1.0, -1.0])
  g = jax.grad(lambda lp: L.cispo_loss(lp, old, adv, m)[0])(logp)
  np.testing.assert_allclose(-4 * np.asarray(g[:, 0]), [r[0], 5.0, 0.05, -1.0], rtol=1e-5)


def test_gmpo_default_log_clip_from_both_sides():
  # GMPO defaults 0.4 / 0.4 in log space; one token per row, so a clipped row has no gradient.
  l = [0.4 * (1 - NEAR), 0.4 * (1 + NEAR), -0.4 * (1 - NEAR), -0.4 * (1 + NEAR)]
  np.testing.assert_array_equal(_live(L.gmpo_loss, l, [1.0, 1.0, -1.0, -1.0]),
                                [True, False, True, False])


# ------------------------------------------------------------------------------ rollout_correction


def _weights(log_w, **kw):
  """rollout_correction weights of one-token rows with log(pi_old / pi_sampler) = log_w."""
  old = jnp.asarray(np.asarray(log_w, np.float32)[:, None])
  w, metrics = RC.rollout_correction(old, jnp.zeros_like(old), jnp.ones_like(old), **kw)
  return np.asarray(w[:, 0]), metrics


def test_truncate_at_the_default_threshold_from_both_sides():
  # The config's default C = 2 (what step.py passes), truncation: min(w, C).
  cfg = RC.RolloutCorrectionConfig(level="token")
  w_in, w_out = 2 * (1 - NEAR), 2 * (1 + NEAR)
  w, m = _weights(np.log([w_in, w_out]), level=cfg.level, mode=cfg.mode,
                  threshold=cfg.threshold, threshold_low=cfg.threshold_low)
  np.testing.assert_allclose(w, [w_in, 2.0], rtol=1e-6)
  assert float(m["rollout_corr_frac"]) == 0.5
  # rollout_correction's own default threshold is the same C.
  np.testing.assert_allclose(_weights(np.log([w_in, w_out]))[0], [w_in, 2.0], rtol=1e-6)


def test_mask_keeps_the_closed_interval_from_both_sides():
  # mode="mask": w kept inside [threshold_low, threshold] (default low = 1 / threshold),
  # 0 outside. Default C = 2: [0.5, 2]. Both ends inclusive (exact ties: log 2, log 0.5).
  w = [2 * (1 - NEAR), 2 * (1 + NEAR), 0.5 * (1 + NEAR), 0.5 * (1 - NEAR)]
  got, _ = _weights(np.log(w), mode="mask")
  np.testing.assert_allclose(got, [w[0], 0, w[2], 0], rtol=1e-6)
  ties, m = _weights(jnp.log(jnp.asarray([2.0, 0.5])), mode="mask")
  np.testing.assert_allclose(ties, [2.0, 0.5])
  assert float(m["rollout_corr_frac"]) == 0
  # An explicit threshold_low = 0.3.
  w = [0.3 * (1 + NEAR), 0.3 * (1 - NEAR)]
  np.testing.assert_allclose(_weights(np.log(w), mode="mask", threshold=3.0,
                                      threshold_low=0.3)[0], [w[0], 0], rtol=1e-6)


def test_sequence_and_geometric_levels_compare_the_row_weight():
  # Two tokens of log w = a each: the sequence level's row weight is e^{2a}, the geometric
  # level's e^a; C = 2. a just under log(2) / 2: the sequence weight is just under 2.
  a_in, a_out = np.log(2 * (1 - NEAR)) / 2, np.log(2 * (1 + NEAR)) / 2
  old = jnp.asarray([[a_in, a_in], [a_out, a_out]], jnp.float32)
  w, _ = RC.rollout_correction(old, jnp.zeros_like(old), jnp.ones_like(old), level="sequence")
  np.testing.assert_allclose(w, [[2 * (1 - NEAR)] * 2, [2.0, 2.0]], rtol=1e-5)
  old = 2 * old  # geometric: the row mean of log w, 2a
  w, _ = RC.rollout_correction(old, jnp.zeros_like(old), jnp.ones_like(old), level="geometric")
  np.testing.assert_allclose(w, [[2 * (1 - NEAR)] * 2, [2.0, 2.0]], rtol=1e-5)


def test_off_policy_sequence_mask_delta_from_both_sides():
  # d_i = mean log(pi_sampler / pi_theta); drop iff A_i < 0 and d_i > delta (delta = 0.25).
  # Rows: just under, just over, exactly on delta (kept: TRL's keep rule is d <= delta),
  # over with A = 0 (kept: the rule is A < 0), over with A > 0 (kept).
  delta = 0.25
  d = np.array([delta * (1 - NEAR), delta * (1 + NEAR), delta, delta * 2, delta * 2])
  sampler = jnp.asarray(d[:, None] + 0.25, jnp.float32)  # exact: 0.25 + 0.25 - 0.25
  logp = jnp.full_like(sampler, 0.25)
  adv = jnp.asarray([-1.0, -1.0, -1.0, 0.0, 1.0])
  w, m = RC.off_policy_sequence_mask(logp, sampler, adv, jnp.ones_like(logp), threshold=delta)
  np.testing.assert_array_equal(w[:, 0], [1, 0, 1, 1, 1])
  assert float(m["off_policy_masked_frac"]) == pytest.approx(1 / 5)


# ------------------------------------------------------------------------------ lengths


def test_overlong_penalty_starts_after_the_cache_and_reaches_minus_one_at_max():
  # L_max = 100, L_cache = 20: 0 up to 80 tokens, -(n - 80) / 20 after, -1 from 100 on.
  n = jnp.asarray([79, 80, 81, 99, 100, 101])
  np.testing.assert_allclose(lengths.overlong_penalty(n, max_new_tokens=100, cache=20),
                             [0, 0, -0.05, -0.95, -1, -1], rtol=1e-6)


def test_length_bins_edges_from_both_sides():
  # T = 100: bin k holds (25 k, 25 (k + 1)]; an empty row is -1.
  n = jnp.asarray([0, 1, 25, 26, 50, 51, 75, 76, 100])
  np.testing.assert_array_equal(lengths.length_bins(n, 100), [-1, 0, 0, 1, 1, 2, 2, 3, 3])


# ------------------------------------------------------------------------------ optim


def _clipped_first_moment(tx, g, state_path):
  """Adam's first moment after one update: (1 - b1) times the clipped gradient."""
  params = {"w": jnp.zeros(2)}
  _, state = tx.update({"w": g}, tx.init(params), params)
  return np.asarray(state_path(state).mu["w"])


@pytest.mark.parametrize("scale,clipped", [(1 - NEAR, False), (1 + NEAR, True)])
def test_grad_norm_clip_default_from_both_sides(scale, clipped):
  # The RL optimiser's default global-norm clip (1.0) and the cold start's (1.0): a gradient
  # of norm 1 * (1 -+ NEAR) passes unchanged / is rescaled to norm 1.
  g = jnp.asarray([0.6, 0.8]) * scale
  want = 0.1 * (np.asarray(g) / scale if clipped else np.asarray(g))  # b1 = 0.9
  rl = optim.make_optimizer(optim.OptimConfig())
  np.testing.assert_allclose(_clipped_first_moment(rl, g, lambda s: s[1].inner_state[0]), want,
                             rtol=1e-6)
  sft = optim.sft_optimizer(10, 1e-3)
  np.testing.assert_allclose(_clipped_first_moment(sft, g, lambda s: s[1][0]), want, rtol=1e-6)


def test_grad_clip_zero_is_off():
  g = jnp.asarray([6.0, 8.0])
  rl = optim.make_optimizer(optim.OptimConfig(grad_clip=0.0))
  np.testing.assert_allclose(_clipped_first_moment(rl, g, lambda s: s[0].inner_state[0]),
                             0.1 * np.asarray(g), rtol=1e-6)


# ------------------------------------------------------------------------------ sampling


BASE = sampling.SamplerConfig(group_size=1, max_new_tokens=4, eos_id=1)


def _kept(probs, **kw):
  logits = jnp.log(jnp.asarray([probs], jnp.float32))
  out = sampling.filter_logits(logits, dataclasses.replace(BASE, **kw))[0]
  return np.asarray(out > jnp.finfo(jnp.float32).min).astype(int).tolist()


def test_top_p_keeps_the_token_that_crosses_the_mass():
  # Masses before each token: 0, .5, .75, .9. A token stays iff the mass before it is
  # < top_p: top_p just above .75 keeps the third token, just below drops it.
  probs = [0.5, 0.25, 0.15, 0.1]
  assert _kept(probs, top_p=0.75 * (1 + NEAR)) == [1, 1, 1, 0]
  assert _kept(probs, top_p=0.75 * (1 - NEAR)) == [1, 1, 0, 0]
  assert _kept(probs, top_p=0.5 * (1 + NEAR)) == [1, 1, 0, 0]
  assert _kept(probs, top_p=0.5 * (1 - NEAR)) == [1, 0, 0, 0]
  assert _kept(probs, top_p=1.0) == [1, 1, 1, 1]


def test_top_k_keeps_ties_with_the_kth_and_vocab_limit_is_exclusive():
  probs = [0.4, 0.2, 0.2, 0.1, 0.1]
  assert _kept(probs, top_k=2) == [1, 1, 1, 0, 0]   # the kth's tie stays
  assert _kept(probs, top_k=1) == [1, 0, 0, 0, 0]
  assert _kept(probs, top_k=4) == [1, 1, 1, 1, 1]
  assert _kept(probs, vocab_limit=4) == [1, 1, 1, 1, 0]   # ids >= vocab_limit masked
  assert _kept(probs, vocab_limit=5) == [1, 1, 1, 1, 1]


# ------------------------------------------------------------------------------ dynamic


def test_informative_needs_two_valid_responses_and_any_difference():
  rewards = jnp.asarray([[0.0, 1e-6, 0.0], [0.0, 0.0, 0.0], [0.0, 1.0, 1.0], [0.0, 1.0, 2.0]])
  valid = jnp.asarray([[1, 1, 1], [1, 1, 1], [1, 1, 0], [1, 0, 0]], bool)
  # Row 2: exactly 2 valid with different rewards; row 3: 1 valid.
  np.testing.assert_array_equal(dynamic_sampling.informative_groups(rewards, valid), [1, 0, 1, 0])


def test_select_groups_keep_bounds():
  rewards = jnp.asarray([[0.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
  order, m = dynamic_sampling.select_groups(rewards, None, 3)       # keep = B_s: allowed
  np.testing.assert_array_equal(order, [1, 0, 2])
  assert float(m["dynamic_fill"]) == pytest.approx(2 / 3)
  for keep in (0, 4):
    with pytest.raises(ValueError, match="keep must be in"):
      dynamic_sampling.select_groups(rewards, None, keep)


# ------------------------------------------------------------------------------ advantages


def test_std_epsilon_default():
  # rewards {0, 2e-6}: std (ddof 1) = sqrt(2) 1e-6, centred +-1e-6, so the default eps = 1e-6
  # is a third of the denominator: A = +-1 / (sqrt 2 + 1) = +-0.41421 (1.1e-6: 0.3978).
  adv = advantages.group_advantages(jnp.asarray([[0.0, 2e-6]]))
  np.testing.assert_allclose(adv, [[-1 / (np.sqrt(2) + 1), 1 / (np.sqrt(2) + 1)]], rtol=1e-4)
  valid = advantages.group_advantages(jnp.asarray([[0.0, 2e-6]]), valid_BxG=jnp.ones((1, 2), bool))
  np.testing.assert_allclose(valid, adv, rtol=1e-4)


def test_group_size_two_is_the_smallest_group():
  np.testing.assert_allclose(advantages.group_advantages(jnp.asarray([[0.0, 1.0]])),
                             [[-1 / (np.sqrt(0.5) + 1e-6) / 2, 1 / (np.sqrt(0.5) + 1e-6) / 2]],
                             rtol=1e-6)
  with pytest.raises(ValueError, match="G >= 2"):
    advantages.group_advantages(jnp.asarray([[1.0]]))


# ------------------------------------------------------------------------------ rewards


def test_numeric_match_tolerance_from_both_sides():
  # |x - y| <= 1e-6 max(1, |y|): absolute 1e-6 for |y| <= 1, relative above; x 5% inside
  # or outside the tolerance.
  for y in (0.5, 1024.0):
    tol = 1e-6 * max(1.0, y)
    for factor, want in ((1 - 5 * NEAR / 2, 1.0), (1 + 5 * NEAR / 2, 0.0)):
      for x in (y + factor * tol, y - factor * tol):
        assert R.numeric_match(None, [repr(x)], [repr(y)]) == [want], (x, y)


# ------------------------------------------------------------------------------ coldstart


@pytest.mark.parametrize("accuracies,target,stop_at", [
    ([0.5, 0.8, 0.9], 0.8, 4),              # a tie reaches the target (>=)
    ([0.5, 0.8 * (1 - NEAR), 0.9], 0.8, 6),  # just below: one more check
    ([], 0.0, 8),                           # 0 = no target: every step, no probe
])
def test_cold_start_stops_once_the_probe_accuracy_reaches_the_target(monkeypatch, accuracies,
                                                                     target, stop_at):
  steps = []
  checks = iter(accuracies)
  monkeypatch.setattr(coldstart, "supervised_batch", lambda run, examples: None)
  sft = types.SimpleNamespace(steps=8, target_accuracy=target, check_every=2, probe_size=1,
                              batch_size=1)
  run = types.SimpleNamespace(
      cfg=types.SimpleNamespace(sft=sft, seed=0),
      task=types.SimpleNamespace(sample=lambda rng, n, split: [None] * n),
      state=types.SimpleNamespace(params={"w": jnp.zeros(())}),
      programs=types.SimpleNamespace(
          sft_init=lambda p: None,
          sft=lambda p, o, b: (steps.append(1) or p, o, jnp.zeros(()))))
  coldstart.cold_start(run, probe_accuracy=lambda params, probe: next(checks),
                       log=lambda *a: None)
  assert len(steps) == stop_at

