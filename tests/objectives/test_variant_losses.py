"""The losses beside GSPO (gspo_jax/objectives/variants.py: SAPO, CISPO, GMPO, length-unbiased
GSPO), token weights, and the losses with rollout-correction weights and the off-policy
sequence mask: hand-derived numbers, the identities of issue 17, padding, jit / vmap /
grad, 8 simulated devices, bad input, and one training step of each new loss. The
correction functions' own hand values are in test_rollout_correction.py. Numeric tests run
in float32 and float64 (`dtype`)."""

import functools
import inspect
import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from gspo_jax import config as C
from gspo_jax.objectives import losses as L
from gspo_jax.utils import configlib
from tests.helpers import HAND_A, HAND_L, JUNK, arr, hand_batch, random_batch

NEW = ("luspo", "sapo", "sapo_seq", "cispo", "gmpo")
# Hyperparameters at which a random batch of log-ratio scale 0.1-0.3 clips some tokens/rows
# and not others (SAPO has no clip; CISPO's cap at 1.1 truncates some weights).
KW = {"gspo": dict(eps_low=0.05, eps_high=0.05), "gspo_token": dict(eps_low=0.05, eps_high=0.05),
      "grpo": dict(eps_low=0.1, eps_high=0.1), "luspo": dict(eps_low=0.05, eps_high=0.05),
      "sapo": dict(tau_pos=1.0, tau_neg=1.05), "sapo_seq": dict(tau_pos=0.5, tau_neg=2.0),
      "cispo": dict(eps_low=1.0, eps_high=0.1), "gmpo": dict(eps_low=0.1, eps_high=0.1)}
sig = lambda x: 1 / (1 + math.exp(-x))


def value_and_grad(name, logp, old, adv, mask, **kw):
  """((loss, metrics), dloss/dlogp) of LOSSES[name], eagerly (op by op)."""
  f = lambda lp: L.LOSSES[name](lp, old, adv, mask, **kw)
  return jax.value_and_grad(f, has_aux=True)(logp)


@functools.partial(jax.jit, static_argnames=("name", "static"))
def _jitted(logp, old, adv, mask, weights, numbers, *, name, static):
  return value_and_grad(name, logp, old, adv, mask, token_weights_BxT=weights, **numbers,
                        **dict(static))


def jvg(name, logp, old, adv, mask, token_weights_BxT=None, **kw):
  """value_and_grad in one compiled program (numeric hyperparameters traced, so tests that
  differ only in them share it)."""
  numbers = {k: v for k, v in kw.items() if isinstance(v, float)}
  static = tuple(sorted((k, v) for k, v in kw.items() if k not in numbers))
  return _jitted(logp, old, adv, mask, token_weights_BxT, numbers, name=name, static=static)


@functools.partial(jax.jit, static_argnames=("names",))
def _all(logp, old, adv, mask, weights, *, names):
  return {n: value_and_grad(n, logp, old, adv, mask, token_weights_BxT=weights, **KW[n])
          for n in names}


def all_losses(logp, old, adv, mask, weights=None, names=tuple(L.LOSSES)):
  """{name: ((loss, metrics), dloss/dlogp)} for every loss at KW, one compiled program."""
  return _all(logp, old, adv, mask, weights, names=names)


# ---------------------------------------------------------------- hand-derived values
# The hand batch of tests/helpers.py (token log-ratios l, "*" masked junk, old = -1.5):
#   row 0: l = [0.1, -0.2, 0.4], A = +1,  n = 3     row 1: l = [0.3, *, *],     A = -1, n = 1
#   row 2: l = [-0.3, -0.3, *], A = -2,  n = 2     row 3: l = [0.5, 0.5, 0.5], A = +0.5, n = 3
#   row 4: empty (A = 3, excluded): N = 4, 9 counted tokens.


def test_sapo_token_hand_values(dtype, tol):
  logp, old, adv, mask = hand_batch(dtype)
  (loss, m), g = jvg("sapo", logp, old, adv, mask)  # tau_pos 1, tau_neg 1.05
  # f(r) = (4/tau) sigmoid(tau (r - 1)):
  #   row 0 (tau 1):    f(e^.1) = 2.10507, f(e^-.2) = 1.81923, f(e^.4) = 2.48214, times A = 1
  #   row 1 (tau 1.05): f(e^.3) = 2.25074, times -1
  #   row 2 (tau 1.05): f(e^-.3) = 1.64717 on both tokens, times -2
  #   row 3 (tau 1):    f(e^.5) = 2.62689 on all three, times 0.5
  # L = -(1/4)(6.40644/3 - 2.25074 - 3.29434 + 1.31344) = 0.52404
  f = lambda l, tau: 4 / tau * sig(tau * (math.exp(l) - 1))
  rows = [sum(f(l, 1.0) for l in (0.1, -0.2, 0.4)) / 3, -f(0.3, 1.05), -2 * f(-0.3, 1.05),
          0.5 * f(0.5, 1.0)]
  np.testing.assert_allclose(loss, -sum(rows) / 4, **tol)
  np.testing.assert_allclose(loss, 0.5240372, rtol=1e-6)
  # dL/dl_it = -A f'(r) r / (N n_i), f'(r) = 4 sigmoid (1 - sigmoid); nothing is clipped.
  fprime = lambda l, tau: 4 * sig(tau * (math.exp(l) - 1)) * (1 - sig(tau * (math.exp(l) - 1)))
  want = np.zeros((5, 3))
  for i, (ls, a, tau) in enumerate([(HAND_L[0], 1.0, 1.0), (HAND_L[1][:1], -1.0, 1.05),
                                    (HAND_L[2][:2], -2.0, 1.05), (HAND_L[3], 0.5, 1.0)]):
    for t, l in enumerate(ls):
      want[i, t] = -a * fprime(l, tau) * math.exp(l) / (4 * len(ls))
  np.testing.assert_allclose(g, want, **tol)
  np.testing.assert_allclose(g[0], [-0.09184, -0.06767, -0.11709], atol=1e-5)
  assert float(m["clip_frac_token"]) == 0 and float(m["num_seqs"]) == 4


def test_sapo_sequence_hand_values(dtype, tol):
  logp, old, adv, mask = hand_batch(dtype)
  (loss, m), g = jvg("sapo_seq", logp, old, adv, mask, tau_pos=1.0, tau_neg=1.05)
  # The gate on s_i = e^{.1}, e^{.3}, e^{-.3}, e^{.5} (the row means of l):
  #   f(s) A = 2.10507, -2.25074, -2*1.64717 = -3.29434, 0.5*2.62689 = 1.31344
  # L = -(1/4)(2.10507 - 2.25074 - 3.29434 + 1.31344) = 0.53164
  np.testing.assert_allclose(loss, 0.5316390, rtol=1e-6)
  # dL/dl_it = -A f'(s) s / (N n_i): every token of a row gets the same gradient.
  f1 = lambda l, tau: 4 * sig(tau * (math.exp(l) - 1)) * (1 - sig(tau * (math.exp(l) - 1)))
  for i, (log_s, a, tau, n) in enumerate([(0.1, 1, 1.0, 3), (0.3, -1, 1.05, 1), (-0.3, -2, 1.05, 2),
                                          (0.5, 0.5, 1.0, 3)]):
    np.testing.assert_allclose(g[i, :n], -a * f1(log_s, tau) * math.exp(log_s) / (4 * n), **tol)
  np.testing.assert_allclose(m["ratio_mean"], np.mean(np.exp([0.1, 0.3, -0.3, 0.5])), **tol)


def test_cispo_hand_values(dtype, tol):
  logp, old, adv, mask = hand_batch(dtype)
  (loss, m), g = jvg("cispo", logp, old, adv, mask, eps_low=1.0, eps_high=0.2)
  # Weights sg[clip(r, 0, 1.2)]: row0 [e^.1 = 1.10517, e^-.2 = .81873, 1.2 (e^.4 = 1.49)],
  # row1 1.2 (e^.3 = 1.35), row2 e^-.3 = .74082 twice, row3 1.2 (e^.5) three times.
  # Token-mean of w A log pi_theta (log pi_theta = -1.5 + l) over the 9 tokens:
  #   w A logp: 1.10517*-1.4, .81873*-1.7, 1.2*-1.1, -1.2*-1.2, 2 * (-2*.74082*-1.8),
  #             3 * (.5*1.2*-1.0)  ->  sum = 0.71481,  L = -0.71481/9 = -0.079423
  np.testing.assert_allclose(loss, -0.0794233, rtol=1e-5)
  w = np.array([[math.exp(0.1), math.exp(-0.2), 1.2], [1.2, 0, 0], [math.exp(-0.3)] * 2 + [0],
                [1.2] * 3, [0, 0, 0]])
  # dL/dlogp_it = -w_it A_i / 9: no token loses its gradient, the capped ones keep 1.2 A / 9.
  np.testing.assert_allclose(g, -w * np.asarray(HAND_A)[:, None] / 9, **tol)
  # Truncated weights (r > 1.2): row0 t2, row1, row3 x3 = 5 of 9 tokens, rows 0, 1, 3.
  np.testing.assert_allclose([m["clip_frac_token_high"], m["clip_frac_token_low"],
                              m["clip_frac_seq"]], [5 / 9, 0, 3 / 4], **tol)


def test_gmpo_hand_values(dtype, tol):
  logp, old, adv, mask = hand_batch(dtype)
  (loss, m), g = jvg("gmpo", logp, old, adv, mask, eps_low=0.2, eps_high=0.2)
  # Log-space clip to [-0.2, 0.2], only in the direction A rewards:
  #   row0 (A>0): [0.1, -0.2, 0.4 -> 0.2], rho = e^{0.1/3} = 1.03390
  #   row1 (A<0): 0.3 stays (an A<0 row is floored only), rho = e^.3 = 1.34986
  #   row2 (A<0): -0.3 -> -0.2 twice, rho = e^-.2 = .81873
  #   row3 (A>0): 0.5 -> 0.2 three times, rho = e^.2 = 1.22140
  # L = -(1/4)(1.03390 - 1.34986 - 2*.81873 + .5*1.22140) = 0.33568
  np.testing.assert_allclose(loss, 0.3356810, rtol=1e-6)
  # dL/dl_it = -rho_i A_i / (N n_i) on unclipped tokens, 0 on clipped ones.
  want = np.zeros((5, 3))
  want[0, :2] = -math.exp(0.1 / 3) / 12
  want[1, 0] = math.exp(0.3) / 4
  np.testing.assert_allclose(g, want, **tol)
  # Clipped tokens: row0 t2 (high), row2 both (low), row3 all (high): 6 of 9.
  np.testing.assert_allclose([m["clip_frac_token_low"], m["clip_frac_token_high"],
                              m["clip_frac_seq"]], [2 / 9, 4 / 9, 3 / 4], **tol)


def test_luspo_hand_values(dtype, tol):
  logp, old, adv, mask = hand_batch(dtype)
  (loss, m), g = jvg("luspo", logp, old, adv, mask, eps_low=0.2, eps_high=0.2)
  # GSPO's row terms at [0.8, 1.2] (tests/objectives/test_losses.py): e^.1, -e^.3, -1.6 (clipped),
  # 0.6 (clipped), each times n_i = 3, 1, 2, 3:
  # L = -(1/4)(3 e^.1 - e^.3 - 3.2 + 1.8) = -0.14141
  np.testing.assert_allclose(loss, -0.1414135, rtol=1e-6)
  # dL/dlogp_it = -n_i a_i s_i A_i / (N n_i) = -a_i s_i A_i / N: the same for every length.
  want = np.zeros((5, 3))
  want[0] = -math.exp(0.1) / 4
  want[1, 0] = math.exp(0.3) / 4
  np.testing.assert_allclose(g, want, **tol)
  assert float(m["clip_frac_seq"]) == 0.5


# ------------------------------------------------------------------------- identities


@pytest.mark.parametrize("tau", [(1.0, 1.05), (0.3, 4.0)])
def test_sapo_at_ratio_one_is_the_policy_gradient(tau, dtype, tol):
  # f'(1) = 1: at theta = theta_old both levels give -m A_i / (N n_i) for any tau, the
  # on-policy policy gradient (= GRPO's and, for the sequence level, GSPO's there).
  logp, _, adv, mask = random_batch(31, dtype, empty_rows=(2,))
  n = np.asarray(mask).sum(-1)
  want = -np.asarray(mask) * (np.asarray(adv) / (np.sum(n > 0) * np.maximum(n, 1)))[:, None]
  for name in ("sapo", "sapo_seq"):
    _, g = jvg(name, logp, logp, adv, mask, tau_pos=tau[0], tau_neg=tau[1])
    np.testing.assert_allclose(g, want, err_msg=name, **tol)
  _, g_gspo = jvg("gspo", logp, logp, adv, mask)
  np.testing.assert_allclose(g, g_gspo, **tol)


def test_cispo_on_policy_is_token_mean_grpo_and_keeps_clipped_tokens(dtype, tol):
  logp, old, adv, mask = random_batch(32, dtype, scale=0.3, empty_rows=(1,))
  eps = dict(eps_low=0.2, eps_high=0.2)
  (_, _), g_c = jvg("cispo", logp, logp, adv, mask, **eps)
  (_, _), g_g = jvg("grpo", logp, logp, adv, mask, aggregation="token-mean", **eps)
  np.testing.assert_allclose(g_c, g_g, **tol)
  # Off-policy: where GRPO's clip zeroes a token, CISPO keeps -clip(r) A / sum(n).
  (_, mc), g_c = jvg("cispo", logp, old, adv, mask, **eps)
  (_, mg), g_g = jvg("grpo", logp, old, adv, mask, aggregation="token-mean", **eps)
  m = np.asarray(mask, bool)
  zeroed = m & (np.asarray(g_g) == 0)
  assert zeroed.sum() >= 3 and float(mg["clip_frac_token"]) > 0
  r = np.exp(np.asarray(logp) - np.asarray(old))
  a_BxT = np.broadcast_to(np.asarray(adv)[:, None], m.shape)
  want = -np.clip(r, 0.8, 1.2) * a_BxT / m.sum()
  assert np.all(np.asarray(g_c)[zeroed] != 0)
  np.testing.assert_allclose(np.asarray(g_c)[m], want[m], **tol)


def test_gmpo_with_wide_eps_is_unclipped_gspo(dtype, tol):
  logp, old, adv, mask = random_batch(33, dtype, scale=0.3, prefix=False, empty_rows=(0,))
  (loss, m), g = jvg("gmpo", logp, old, adv, mask, eps_low=1e6, eps_high=1e6)
  (loss_s, m_s), g_s = jvg("gspo", logp, old, adv, mask, eps_low=1e6, eps_high=1e6)
  assert float(m["clip_frac_token"]) == 0 and float(m_s["clip_frac_seq"]) == 0
  np.testing.assert_allclose(loss, loss_s, **tol)
  np.testing.assert_allclose(g, g_s, **tol)
  np.testing.assert_allclose(m["ratio_mean"], m_s["ratio_mean"], **tol)
  # At the defaults (0.4 in log space) this batch clips some tokens, and GMPO differs.
  (loss_d, m_d), _ = jvg("gmpo", logp, old, adv, mask)
  assert float(m_d["clip_frac_token"]) > 0 and abs(float(loss_d) - float(loss)) > 1e-4


def test_luspo_is_gspo_with_rows_weighted_by_length(dtype, tol):
  logp, old, adv, mask = random_batch(34, dtype, scale=0.1, empty_rows=(4,))
  eps = dict(eps_low=0.01, eps_high=0.01)
  n = np.asarray(mask).sum(-1)
  (loss, m), g = jvg("luspo", logp, old, adv, mask, **eps)
  assert 0 < float(m["clip_frac_seq"]) < 1
  # min(s A n, clip(s) A n) = n min(s A, clip(s) A) for n > 0: advantages scaled by n_i ...
  (loss_a, _), g_a = jvg("gspo", logp, old, adv * arr(n, dtype), mask, **eps)
  # ... or token weights n_i on every token of row i (row mean of the weights = n_i).
  w = arr(np.broadcast_to(n[:, None], mask.shape), dtype)
  (loss_w, _), g_w = jvg("gspo", logp, old, adv, mask, token_weights_BxT=w, **eps)
  for other, g_other in ((loss_a, g_a), (loss_w, g_w)):
    np.testing.assert_allclose(loss, other, **tol)
    np.testing.assert_allclose(g, g_other, **tol)
  # With equal lengths n it is n times GSPO.
  full = jnp.ones_like(mask)
  (l1, _), _ = jvg("luspo", logp, old, adv, full, **eps)
  (l2, _), _ = jvg("gspo", logp, old, adv, full, **eps)
  np.testing.assert_allclose(l1, mask.shape[1] * l2, **tol)


def test_zero_weights_leave_numerators_and_denominators_alike(dtype, tol):
  # Mask-mode weights are 0 on dropped tokens and w elsewhere: every loss with them equals
  # the loss on the mask without those tokens, with the same weights on the rest (so a
  # dropped token is gone from the sums, the counts n_i and N, and from s_i) ...
  logp, old, adv, mask = random_batch(36, dtype, B=8, T=6, scale=0.2, prefix=False)
  sampler = old - arr(np.random.default_rng(36).normal(0, 0.6, mask.shape), dtype)
  w, m = L.rollout_correction(old, sampler, mask, mode="mask", threshold=1.5)
  assert 0.1 < float(m["rollout_corr_frac"]) < 0.9
  kept = mask * (np.asarray(w) != 0)
  weighted = all_losses(logp, old, adv, mask, w)
  restricted = all_losses(logp, old, adv, kept, w)
  # ... and with 0/1 weights (a sequence-level mask), the loss without weights.
  w01 = jnp.asarray(np.asarray(w) != 0, dtype)
  ones = all_losses(logp, old, adv, mask, w01)
  unweighted = all_losses(logp, old, adv, kept)
  for name in L.LOSSES:
    for (a, ga), (b, gb) in ((weighted[name], restricted[name]), (ones[name], unweighted[name])):
      np.testing.assert_allclose(a[0], b[0], err_msg=name, **tol)
      for k in a[1]:
        np.testing.assert_allclose(a[1][k], b[1][k], err_msg=f"{name}: {k}", **tol)
      np.testing.assert_allclose(ga, gb, err_msg=name, **tol)
  # The KL term drops and weights the same tokens.
  kl = lambda mk, w: L.kl_loss(logp, old + 0.3, mk, token_weights_BxT=w)[0]
  np.testing.assert_allclose(kl(mask, w01), kl(kept, None), **tol)
  np.testing.assert_allclose(kl(mask, w), kl(kept, w), **tol)
  # The weights do change the loss (w != 1 on kept tokens).
  assert abs(float(weighted["grpo"][0][0]) - float(ones["grpo"][0][0])) > 1e-4


def test_token_weights_multiply_each_token_term(dtype, tol):
  # GRPO token-mean with weights w: -sum m w obj / sum m (for w != 0): against the blocks.
  logp, old, adv, mask = random_batch(37, dtype, scale=0.1)
  w = arr(np.random.default_rng(37).uniform(0.5, 2.0, mask.shape), dtype)
  (loss, _), _ = jvg("grpo", logp, old, adv, mask, aggregation="token-mean",
                                token_weights_BxT=w, eps_low=0.1, eps_high=0.1)
  obj = L.clipped_surrogate(L.token_log_ratio(logp, old, mask), L.token_advantages(adv, mask),
                            eps_low=0.1, eps_high=0.1).objective
  m = np.asarray(mask)
  np.testing.assert_allclose(loss, -np.sum(m * np.asarray(w) * np.asarray(obj)) / m.sum(), **tol)


# ------------------------------------------------- padding, transformations, devices


def _padded(x, junk, v=np.nan):
  """x with junk at masked positions and 3 extra masked columns of v."""
  x = arr(junk(x), x.dtype)
  return jnp.concatenate([x, jnp.full((x.shape[0], 3), v, x.dtype)], 1)


def test_padding_junk_changes_nothing(dtype, tol):
  # NaN/inf junk at masked positions (logp, old, sampler, weights) and 3 extra padded
  # columns change no loss, gradient, weight or metric; masked positions get zero gradient.
  logp, old, adv, mask = random_batch(38, dtype, B=6, T=5, scale=0.1, prefix=False,
                                      empty_rows=(3,))
  sampler = old + arr(np.random.default_rng(38).normal(0, 0.3, mask.shape), dtype)
  m = np.asarray(mask, bool)
  rng = np.random.default_rng(0)
  junk = lambda x: np.where(m, np.asarray(x), rng.choice(JUNK, size=m.shape))

  def everything(lp, o, s, a, mk):
    w, rc = L.rollout_correction(o, s, mk, mode="mask", threshold=1.3)
    w_seq, rc_seq = L.rollout_correction(o, s, mk, level="geometric")
    opm, om = L.off_policy_sequence_mask(lp, s, a, mk, threshold=0.05)
    out = {"rc": (w, rc), "rc_seq": (w_seq, rc_seq), "opm": (opm, om)}
    for name in L.LOSSES:
      out[name] = value_and_grad(name, lp, o, a, mk, token_weights_BxT=w * opm, **KW[name])
    return out

  run = jax.jit(everything)
  ref = run(logp, old, sampler, adv, mask)
  pad_m = jnp.concatenate([mask, jnp.zeros((6, 3), mask.dtype)], 1)
  got = run(_padded(logp, junk), _padded(old, junk), _padded(sampler, junk, np.inf), adv, pad_m)
  for key in ("rc", "rc_seq", "opm"):
    np.testing.assert_allclose(got[key][0][:, :5], ref[key][0], err_msg=key, **tol)
    assert np.all(np.asarray(got[key][0])[:, 5:] == 0)
    for k in ref[key][1]:
      np.testing.assert_allclose(got[key][1][k], ref[key][1][k], err_msg=k, **tol)
  assert 0 < float(ref["rc"][1]["rollout_corr_frac"]) < 1
  for name in L.LOSSES:
    ((loss, metrics), g), ((loss_p, metrics_p), g_p) = ref[name], got[name]
    np.testing.assert_allclose(loss_p, loss, err_msg=name, **tol)
    for k in metrics:
      np.testing.assert_allclose(metrics_p[k], metrics[k], err_msg=f"{name}: {k}", **tol)
    g_p = np.asarray(g_p)
    np.testing.assert_allclose(g_p[:, :5], g, err_msg=name, **tol)
    assert np.all(g_p[:, :5][~m] == 0) and np.all(g_p[:, 5:] == 0), name


def test_eager_equals_jit_and_vmap(dtype, tol):
  batches = [random_batch(s, dtype, scale=0.2) for s in (40, 41, 42)]
  sampler = lambda b: b[1] + 0.2 * jnp.sin(b[0])
  stack = lambda *xs: jnp.stack(xs)
  jitted = [all_losses(*b, names=NEW) for b in batches]
  logp, old, adv, mask = batches[0]
  for name in NEW:  # eager, op by op, against the compiled program
    (loss, metrics), g = value_and_grad(name, logp, old, adv, mask, **KW[name])
    ((loss_j, metrics_j), g_j) = jitted[0][name]
    np.testing.assert_allclose(loss, loss_j, err_msg=name, **tol)
    np.testing.assert_allclose(g, g_j, err_msg=name, **tol)
    assert np.all(np.isfinite(g)) and np.any(np.asarray(g) != 0), name
  vm = jax.jit(jax.vmap(lambda *b: all_losses(*b, names=NEW)))(
      *[stack(*parts) for parts in zip(*batches)])
  for i in range(3):
    for name in NEW:
      np.testing.assert_allclose(vm[name][0][0][i], jitted[i][name][0][0], err_msg=name, **tol)
      np.testing.assert_allclose(vm[name][1][i], jitted[i][name][1], err_msg=name, **tol)
  corr = lambda b: (L.rollout_correction(b[1], sampler(b), b[3], level="geometric", mode="mask",
                                         threshold=1.1),
                    L.off_policy_sequence_mask(b[0], sampler(b), b[2], b[3], threshold=0.01))
  eager = corr(batches[0])
  vm = jax.vmap(lambda *b: corr(b))(*[stack(*parts) for parts in zip(*batches)])
  for (w, m), (w_v, m_v) in zip(eager, vm):
    np.testing.assert_allclose(w_v[0], w, **tol)
    for k in m:
      np.testing.assert_allclose(m_v[k][0], m[k], err_msg=k, **tol)


def test_sharded_equals_single_device(dtype, tol):
  # 8 simulated devices, rows x tokens sharded: every loss with weights from both
  # corrections, and the corrections themselves, against one device.
  logp, old, adv, mask = random_batch(43, dtype, B=16, T=8, scale=0.2, empty_rows=(3,))
  sampler = old + arr(np.random.default_rng(43).normal(0, 0.3, mask.shape), dtype)

  def everything(lp, o, s, a, mk):
    w, rc = L.rollout_correction(o, s, mk, level="geometric", mode="mask", threshold=1.2)
    opm, om = L.off_policy_sequence_mask(lp, s, a, mk, threshold=0.05)
    out = {name: value_and_grad(name, lp, o, a, mk, token_weights_BxT=w * opm, **KW[name])
           for name in L.LOSSES}
    return out, (w, rc), (opm, om)

  ref = jax.jit(everything)(logp, old, sampler, adv, mask)
  assert 0 < float(ref[1][1]["rollout_corr_frac"]) < 1
  assert 0 < float(ref[2][1]["off_policy_masked_frac"]) < 1
  mesh = jax.make_mesh((4, 2), ("data", "seq"), axis_types=(AxisType.Auto,) * 2)
  tok, row = NamedSharding(mesh, P("data", "seq")), NamedSharding(mesh, P("data"))
  got = jax.jit(everything, in_shardings=(tok, tok, tok, row, tok))(
      *[jax.device_put(x, s) for x, s in zip((logp, old, sampler, adv, mask),
                                             (tok, tok, tok, row, tok))])
  for name in L.LOSSES:
    assert len(got[0][name][1].sharding.device_set) == 8
  flat_ref, flat_got = jax.tree_util.tree_leaves_with_path(ref), jax.tree.leaves(got)
  for (path, a), b in zip(flat_ref, flat_got):
    np.testing.assert_allclose(b, a, err_msg=jax.tree_util.keystr(path), **tol)


@pytest.mark.parametrize("name", NEW)
def test_far_off_policy_and_overflow_stay_finite(name):
  # Log-ratios of +-50 (and +100, past float32's exp overflow): finite loss and gradients.
  logp, _, adv, mask = random_batch(44, np.float32)
  for shift in (50.0, -50.0, 100.0):
    if name in ("luspo", "gmpo") and shift == 100.0:
      adv = jnp.ones_like(adv)  # an A < 0 row has no upper bound there (as GSPO)
    (loss, m), g = value_and_grad(name, logp, logp - shift, adv, mask, **KW[name])
    assert np.isfinite(float(loss)) and np.all(np.isfinite(np.asarray(g))), (name, shift)
    if shift != 100.0:  # past the overflow the ratio metrics are inf, as for GSPO
      assert all(np.isfinite(float(v)) for v in m.values()), (name, shift)


def test_signatures_and_defaults():
  for name, fn in L.LOSSES.items():
    params = inspect.signature(fn).parameters
    assert list(params)[:4] == ["logp_BxT", "old_logp_BxT", "adv", "mask_BxT"], name
    defaults = {k: p.default for k, p in params.items() if p.kind is p.KEYWORD_ONLY}
    table = L.LOSS_DEFAULTS[name]
    assert {k: defaults.get(k, "missing") for k in table} == table, name
    assert defaults["token_weights_BxT"] is None, name
  assert L.LOSS_DEFAULTS["cispo"] == {"eps_low": 1.0, "eps_high": 4.0, "aggregation": "token-mean"}
  assert L.LOSS_DEFAULTS["sapo"] == {"tau_pos": 1.0, "tau_neg": 1.05}
  assert L.LOSS_DEFAULTS["gmpo"] == {"eps_low": 0.4, "eps_high": 0.4}


# --------------------------------------------------------- bad input and warnings


def _bad_cases():
  lp, adv, mask = jnp.zeros((2, 3)), jnp.zeros(2), jnp.ones((2, 3))
  rc = lambda **kw: L.rollout_correction(lp, lp, mask, **kw)
  return [
      ("sapo_loss: tau_pos", lambda: L.sapo_loss(lp, lp, adv, mask, tau_pos=0.0)),
      ("sapo_loss: tau_neg", lambda: L.sapo_loss(lp, lp, adv, mask, tau_neg=-1.0)),
      ("sapo_loss: level", lambda: L.sapo_loss(lp, lp, adv, mask, level="row")),
      (r"sapo_loss: adv\b.*level='token'",
       lambda: L.sapo_loss(lp, lp, jnp.zeros((2, 3)), mask, level="sequence")),
      ("cispo_loss: eps_high", lambda: L.cispo_loss(lp, lp, adv, mask, eps_high=0.0)),
      ("cispo_loss: aggregation", lambda: L.cispo_loss(lp, lp, adv, mask, aggregation="sum")),
      ("gmpo_loss: eps_low", lambda: L.gmpo_loss(lp, lp, adv, mask, eps_low=-0.1)),
      (r"gmpo_loss: adv\b", lambda: L.gmpo_loss(lp, lp, jnp.zeros((2, 3)), mask)),
      ("luspo_loss: eps_low", lambda: L.luspo_loss(lp, lp, adv, mask, eps_low=0.0)),
      ("gmpo_loss: old_logp_BxT", lambda: L.gmpo_loss(lp, jnp.zeros((2, 4)), adv, mask)),
      ("grpo_loss: token_weights_BxT",
       lambda: L.grpo_loss(lp, lp, adv, mask, token_weights_BxT=jnp.ones((2, 4)))),
      ("sapo_loss: token_weights_BxT",
       lambda: L.sapo_loss(lp, lp, adv, mask, token_weights_BxT=jnp.ones((2, 3), jnp.int32))),
      ("token_sum_norm applies to mode='seq-mean-token-sum-norm'",
       lambda: L.grpo_loss(lp, lp, adv, mask, token_sum_norm=4.0)),
      ("rollout_correction: sampler_logp_BxT",
       lambda: L.rollout_correction(lp, jnp.zeros((2, 4)), mask)),
      ("rollout_correction: level", lambda: rc(level="row")),
      ("rollout_correction: mode", lambda: rc(mode="clip")),
      ("rollout_correction: threshold", lambda: rc(threshold=0.0)),
      ("rollout_correction: threshold_low", lambda: rc(mode="mask", threshold_low=-0.5)),
      ("rollout_correction: threshold_low must be < threshold",
       lambda: rc(mode="mask", threshold=2.0, threshold_low=2.0)),
      ("rollout_correction: threshold_low applies to mode='mask'", lambda: rc(threshold_low=0.5)),
      ("off_policy_sequence_mask: threshold",
       lambda: L.off_policy_sequence_mask(lp, lp, adv, mask, threshold=0.0)),
      (r"off_policy_sequence_mask: adv\b",
       lambda: L.off_policy_sequence_mask(lp, lp, jnp.zeros((2, 3)), mask, threshold=0.1)),
      ("off_policy_sequence_mask: sampler_logp_BxT",
       lambda: L.off_policy_sequence_mask(lp, jnp.zeros(2), adv, mask, threshold=0.1)),
      ("soft_gate_surrogate: tau_pos", lambda: L.soft_gate_surrogate(adv, adv, tau_pos=0,
                                                                     tau_neg=1)),
  ]


@pytest.mark.parametrize("case", range(len(_bad_cases())))
def test_bad_input_names_the_argument(case):
  name, call = _bad_cases()[case]
  with pytest.raises(ValueError, match=name):
    call()


def test_length_weighting_a_per_sequence_objective_is_warned():
  x_B, mask = jnp.ones(2), jnp.ones((2, 3))
  with pytest.warns(L.ObjectiveWarning, match="weights each response by its length"):
    L.aggregate(x_B, mask, mode="token-mean")
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    L.aggregate(x_B, mask)  # seq-mean-token-mean: GSPO's own, no warning
    L.luspo_loss(jnp.zeros((2, 3)), jnp.zeros((2, 3)), x_B, mask)


# ------------------------------------------------------------------- config and train


def test_config_takes_each_loss_defaults_and_refuses_what_does_not_apply():
  cfg = lambda *sets: configlib.apply_overrides(C.TrainConfig(), list(sets))
  assert cfg("loss=sapo").loss.kwargs() == {"tau_pos": 1.0, "tau_neg": 1.05}
  assert cfg("loss=sapo_seq", "loss.tau_neg=2.0").loss.kwargs() == {"tau_pos": 1.0,
                                                                   "tau_neg": 2.0}
  assert cfg("loss=cispo").loss.kwargs() == L.LOSS_DEFAULTS["cispo"]
  assert cfg("loss=cispo").loss.kl_aggregation == "token-mean"
  assert cfg("loss=gmpo", "loss.eps_high=0.2").loss.kwargs() == {"eps_low": 0.4,
                                                                "eps_high": 0.2}
  assert cfg("loss=luspo").loss.kwargs() == {"eps_low": 3e-4, "eps_high": 4e-4}
  # Refused, not ignored: GSPO with token-mean aggregation would be length-weighted.
  for sets, msg in ((("loss.aggregation=token-mean",),
                     "loss.aggregation applies to loss.name='grpo'/'cispo'"),
                    (("loss=sapo", "loss.eps_low=0.2"), "loss.eps_low applies to"),
                    (("loss.tau_pos=2.0",), "loss.tau_pos applies to loss.name='sapo'/'sapo_seq'"),
                    (("loss=sapo", "loss.tau_pos=0"), "loss.tau_pos must be > 0")):
    with pytest.raises(configlib.ConfigError, match=msg):
      cfg(*sets)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
  from gspo_jax.train import run as R
  from tests.helpers import tiny_cfg
  return R.setup(tiny_cfg(), str(tmp_path_factory.mktemp("run")))


@pytest.mark.slow  # one update program per loss (~5 s each, nearly all compiling)
@pytest.mark.parametrize("name", NEW)
def test_one_training_step_of_each_new_loss(tiny_run, name):
  # The train step calls LOSSES[loss.name](flat logp, flat old, adv, mask, **loss.kwargs()).
  from tests.helpers import leaves, random_rewards, rollout, tiny_cfg
  run = tiny_run.reconfigure(tiny_cfg(loss=C.LossConfig(name=name)))
  before = leaves(run.state.params)
  r = rollout(run)
  new, m = run.programs.update(jax.tree.map(jnp.copy, run.state), r.batch, random_rewards(r, 0))
  assert int(new.step) == 1 and float(m["skipped_updates"]) == 0
  assert all(np.isfinite(float(v)) for v in m.values())
  assert any(np.any(a != b) for a, b in zip(before, leaves(new.params)))
