"""gspo_jax.objectives.losses: hand-derived numbers, the identities a correct GSPO satisfies, padding,
edge cases and bad input; the losses rebuilt from the public blocks; the KL term.
Every numeric test runs in float32 and float64 (`dtype`).

Most tests take a loss, its metrics and its gradient from `evaluate`: one jitted program
per (static arguments, shapes, dtype) that computes every loss accepting those arguments,
so the cases of a test parametrized over the losses share one cold compile (run eagerly,
every small op and its autodiff compiles on its own, which made up most of this file's
runtime). Tests of eager behaviour (jit == eager, value checks on concrete input) and of
NaN/inf robustness (padding junk, empty rows, overflow) call the losses eagerly, op by
op: XLA's simplifications inside one program can hide a NaN that eager execution shows.
"""

import functools
import inspect
import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gspo_jax.objectives import losses as L
from tests.helpers import HAND_A, HAND_M, JUNK, arr, hand_batch, random_batch

LOSSES = {
    "gspo": L.gspo_loss,
    "gspo_token": L.gspo_token_loss,
    "grpo": L.grpo_loss,
}


@functools.partial(jax.jit, static_argnames=("names", "static"))
def _evaluate(logp, old, adv, mask, numbers, *, names, static):
  kw = {**dict(static), **numbers}
  out = {}
  for name in names:
    f = lambda lp: LOSSES[name](lp, old, adv, mask, **kw)
    (loss, metrics), g = jax.value_and_grad(f, has_aux=True)(logp)
    out[name] = loss, metrics, g
  return out


# Passed traced, so that tests differing only in these share one compiled program.
_TRACED = ("eps_low", "eps_high", "token_sum_norm")


def evaluate(name, logp, old, adv, mask, **kw):
  """(loss, metrics, dloss/dlogp) of LOSSES[name](logp, old, adv, mask, **kw), one program."""
  numbers = {k: v for k, v in kw.items() if k in _TRACED}
  static = tuple(sorted((k, v) for k, v in kw.items() if k not in _TRACED))
  # Every loss that takes these arguments, in one program: a test parametrized over the
  # losses compiles it once and its other cases hit the cache.
  if {"aggregation", "token_sum_norm"} & set(kw):
    names = ("grpo",)
  else:
    names = ("gspo_token", "grpo") if np.ndim(adv) == 2 else tuple(LOSSES)
  assert name in names, (name, names)
  out = _evaluate(logp, old, adv, mask, numbers, names=names, static=static)
  return out[name]


seq_log_ratio = jax.jit(L.sequence_log_ratio)


# ---------------------------------------------------------------- hand-derived values

# The hand batch (tests/helpers.py hand_batch), eps_low = eps_high = 0.2, clip range
# [0.8, 1.2]. Token log-ratios l = logp - old_logp ("*" = masked junk):
#   row 0: l = [0.1, -0.2, 0.4], A = +1,   n = 3
#   row 1: l = [0.3, *, *],      A = -1,   n = 1
#   row 2: l = [-0.3, -0.3, *],  A = -2,   n = 2
#   row 3: l = [0.5, 0.5, 0.5],  A = +0.5, n = 3
#   row 4: empty,                A = +3,   n = 0   (excluded: N = 4)
EPS = dict(eps_low=0.2, eps_high=0.2)


def test_gspo_hand_values(dtype, tol):
  logp, old, adv, mask = hand_batch(dtype)
  # log s = mean of counted l: row0 0.3/3 = 0.1, row1 0.3, row2 -0.3, row3 0.5.
  # row0: s = e^0.1 = 1.105 in [0.8, 1.2]          -> s A = e^0.1
  # row1: s = e^0.3 = 1.350 > 1.2 but A < 0         -> not clipped, s A = -e^0.3
  # row2: s = e^-0.3 = 0.741 < 0.8 and A < 0        -> clipped low, 0.8 * -2 = -1.6
  # row3: s = e^0.5 = 1.649 > 1.2 and A > 0         -> clipped high, 1.2 * 0.5 = 0.6
  expected = -(math.exp(0.1) - math.exp(0.3) - 1.6 + 0.6) / 4
  loss, m, g = evaluate("gspo", logp, old, adv, mask, **EPS)
  np.testing.assert_allclose(loss, expected, **tol)
  np.testing.assert_allclose(seq_log_ratio(logp, old, mask), [0.1, 0.3, -0.3, 0.5, 0.0], **tol)
  # Gradient: -m a_i s_i A_i / (N n_i); rows 2, 3 clipped (a = 0), row 4 empty.
  expected_g = np.zeros((5, 3))
  expected_g[0, :] = -math.exp(0.1) * 1.0 / (4 * 3)
  expected_g[1, 0] = -math.exp(0.3) * -1.0 / (4 * 1)
  np.testing.assert_allclose(g, expected_g, **tol)
  # 9 counted tokens; row2 (2 tokens) clipped low, row3 (3 tokens) clipped high.
  assert float(m["num_seqs"]) == 4 and float(m["num_tokens"]) == 9
  np.testing.assert_allclose([m["clip_frac_seq_low"], m["clip_frac_seq_high"], m["clip_frac_seq"]],
                             [1 / 4, 1 / 4, 2 / 4], **tol)
  np.testing.assert_allclose(
      [m["clip_frac_token_low"], m["clip_frac_token_high"], m["clip_frac_token"]],
      [2 / 9, 3 / 9, 5 / 9], **tol)
  np.testing.assert_allclose([m["ratio_min"], m["ratio_max"]], [math.exp(-0.3), math.exp(0.5)],
                             **tol)
  np.testing.assert_allclose(m["ratio_mean"], (math.exp(0.1) + math.exp(0.3) + math.exp(-0.3) +
                                               math.exp(0.5)) / 4, **tol)
  # approx_kl = mean over counted tokens of e^l - 1 - l.
  ls = [0.1, -0.2, 0.4, 0.3, -0.3, -0.3, 0.5, 0.5, 0.5]
  np.testing.assert_allclose(m["approx_kl"], np.mean([math.exp(x) - 1 - x for x in ls]), **tol)


@pytest.mark.parametrize("name", ["gspo", "gspo_token"])
def test_gspo_asymmetric_clip_range(name, dtype, tol):
  # Same batch, eps_low = 0.3, eps_high = 0.7: range [0.7, 1.7].
  # row2: s = e^-0.3 = 0.741 >= 0.7 -> no longer clipped: s A = -2 e^-0.3
  # row3: s = e^0.5 = 1.649 <= 1.7  -> no longer clipped: s A = 0.5 e^0.5
  logp, old, adv, mask = hand_batch(dtype)
  loss, m, _ = evaluate(name, logp, old, adv, mask, eps_low=0.3, eps_high=0.7)
  expected = -(math.exp(0.1) - math.exp(0.3) - 2 * math.exp(-0.3) + 0.5 * math.exp(0.5)) / 4
  np.testing.assert_allclose(loss, expected, **tol)
  assert float(m["clip_frac_seq"]) == 0.0
  # eps_low = 0.25 (bound 0.75) clips row 2 again, eps_high = 0.6 (bound 1.6) clips row 3;
  # the bounds themselves are the clipped values: 0.75 * -2 and 1.6 * 0.5.
  loss, m, _ = evaluate(name, logp, old, adv, mask, eps_low=0.25, eps_high=0.6)
  np.testing.assert_allclose(loss, -(math.exp(0.1) - math.exp(0.3) - 1.5 + 0.8) / 4, **tol)
  np.testing.assert_allclose([m["clip_frac_seq_low"], m["clip_frac_seq_high"]], [0.25, 0.25], **tol)


def _grpo_row_objectives():
  # Token ratios w = e^l, clip [0.8, 1.2]:
  # row0 (A=+1): e^0.1 kept, e^-0.2 = 0.819 kept (A>0: only the high side clips), e^0.4 = 1.49 -> 1.2
  # row1 (A=-1): e^0.3 kept (A<0: only the low side clips)        -> -e^0.3
  # row2 (A=-2): e^-0.3 = 0.741 < 0.8 -> 0.8 * -2 = -1.6 on both tokens
  # row3 (A=+.5): e^0.5 > 1.2 -> 1.2 * 0.5 = 0.6 on all three tokens
  return [[math.exp(0.1), math.exp(-0.2), 1.2], [-math.exp(0.3)], [-1.6, -1.6], [0.6, 0.6, 0.6]]


def test_grpo_hand_values_each_aggregation(dtype, tol):
  logp, old, adv, mask = hand_batch(dtype)
  rows = _grpo_row_objectives()
  total = sum(sum(r) for r in rows)
  expected = {
      "seq-mean-token-mean": -sum(sum(r) / len(r) for r in rows) / 4,
      "token-mean": -total / 9,
  }
  for mode, value in expected.items():
    loss, _, _ = evaluate("grpo", logp, old, adv, mask, aggregation=mode, **EPS)
    np.testing.assert_allclose(loss, value, **tol)
  loss, m, _ = evaluate("grpo", logp, old, adv, mask, aggregation="seq-mean-token-sum-norm",
                        token_sum_norm=5.0, **EPS)
  np.testing.assert_allclose(loss, -total / (4 * 5.0), **tol)
  # Default normaliser is T = 3.
  loss, _, _ = evaluate("grpo", logp, old, adv, mask, aggregation="seq-mean-token-sum-norm", **EPS)
  np.testing.assert_allclose(loss, -total / (4 * 3.0), **tol)
  # Clipped tokens: row0 t2 (high), row2 both (low), row3 all three (high): 6 of 9.
  np.testing.assert_allclose([m["clip_frac_token_low"], m["clip_frac_token_high"]], [2 / 9, 4 / 9],
                             **tol)
  # Rows with any clipped token: 0, 2, 3.
  np.testing.assert_allclose(m["clip_frac_seq"], 3 / 4, **tol)
  # Gradient, seq-mean-token-mean (the default): -m a_it w_it A_i / (N n_i).
  _, _, g = evaluate("grpo", logp, old, adv, mask, **EPS)
  expected_g = np.zeros((5, 3))
  expected_g[0, :2] = [-math.exp(0.1) / 12, -math.exp(-0.2) / 12]
  expected_g[1, 0] = math.exp(0.3) / 4
  np.testing.assert_allclose(g, expected_g, **tol)


def test_gspo_token_hand_values_with_token_advantages(dtype, tol):
  logp, old, _, mask = hand_batch(dtype)
  adv_BxT = arr([[1.0, -1.0, 2.0], [-1.0, 0, 0], [-2.0, 1.0, 0], [0.5, -0.5, 0.5], [1, 1, 1]],
                dtype)
  # Every token of row i carries s_i; clipping uses the sign of A_it:
  # row0 s = e^0.1 inside the range     -> s * (1 - 1 + 2) / 3
  # row1 s = e^0.3, A = -1 (no low clip) -> -e^0.3
  # row2 s = e^-0.3 < 0.8: t0 A=-2 clipped -> -1.6; t1 A=+1 not clipped -> e^-0.3; mean over 2
  # row3 s = e^0.5 > 1.2: t0, t2 A=+.5 clipped -> 0.6; t1 A=-.5 kept -> -0.5 e^0.5; mean over 3
  s0, s1, s2, s3 = (math.exp(x) for x in (0.1, 0.3, -0.3, 0.5))
  rows = [s0 * 2 / 3, -s1, (-1.6 + s2) / 2, (0.6 - 0.5 * s3 + 0.6) / 3]
  loss, m, g = evaluate("gspo_token", logp, old, adv_BxT, mask, **EPS)
  np.testing.assert_allclose(loss, -sum(rows) / 4, **tol)
  # Gradient: -m a_it s_i A_it / (N n_i).
  expected_g = np.zeros((5, 3))
  expected_g[0] = [-s0 * a / 12 for a in (1.0, -1.0, 2.0)]
  expected_g[1, 0] = s1 / 4
  expected_g[2, 1] = -s2 * 1.0 / 8
  expected_g[3, 1] = s3 * 0.5 / 12
  np.testing.assert_allclose(g, expected_g, **tol)
  np.testing.assert_allclose([m["clip_frac_token_low"], m["clip_frac_token_high"]], [1 / 9, 2 / 9],
                             **tol)


# ------------------------------------------------------------------------ identities


@pytest.mark.parametrize("name", list(LOSSES))
def test_on_policy_ratio_is_one_and_gradient_closed_form(name, dtype, tol):
  # Identity 1: logp = old_logp -> every ratio is exactly 1, nothing clipped,
  # L = -(1/N) sum_i A_i, dL/dlogp_it = -m_it A_i / (N n_i), for all three losses.
  logp, _, adv, mask = random_batch(1, dtype, empty_rows=(2,))
  loss, m, g = evaluate(name, logp, logp, adv, mask)
  n = np.asarray(mask).sum(1)
  valid = n > 0
  N = valid.sum()
  np.testing.assert_allclose(loss, -np.asarray(adv)[valid].sum() / N, **tol)
  assert float(m["ratio_min"]) == 1.0 and float(m["ratio_max"]) == 1.0
  assert float(m["clip_frac_token"]) == 0.0 and float(m["clip_frac_seq"]) == 0.0
  assert float(m["approx_kl"]) == 0.0
  np.testing.assert_array_equal(seq_log_ratio(logp, logp, mask), np.zeros(len(n)))
  expected = -np.asarray(mask) * (np.asarray(adv) / (N * np.maximum(n, 1)))[:, None]
  np.testing.assert_allclose(g, expected, **tol)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gspo_token_equals_gspo_for_sequence_advantages(seed, dtype, tol):
  # Identity 2, at a clip range where some rows are clipped and some are not.
  logp, old, adv, mask = random_batch(seed, dtype, B=8, scale=0.1, empty_rows=(5,))
  eps = dict(eps_low=0.01, eps_high=0.015)
  adv_BxT = jnp.asarray(np.broadcast_to(np.asarray(adv)[:, None], mask.shape))
  l_seq, m_seq, g_seq = evaluate("gspo", logp, old, adv, mask, **eps)
  l_tok, m_tok, g_tok = evaluate("gspo_token", logp, old, adv_BxT, mask, **eps)
  assert 0 < float(m_seq["clip_frac_seq"]) < 1, "batch should mix clipped and unclipped rows"
  np.testing.assert_allclose(l_tok, l_seq, **tol)
  for k in m_seq:
    np.testing.assert_allclose(m_tok[k], m_seq[k], err_msg=k, **tol)
  np.testing.assert_allclose(g_tok, g_seq, **tol)
  # A per-sequence adv_B passed to gspo_token_loss is broadcast: same result.
  np.testing.assert_allclose(evaluate("gspo_token", logp, old, adv, mask, **eps)[0], l_seq, **tol)


def test_gspo_token_differs_from_gspo_for_token_advantages(dtype):
  logp, old, adv, mask = random_batch(3, dtype, scale=0.02)
  rng = np.random.default_rng(3)
  adv_BxT = arr(np.asarray(adv)[:, None] + rng.normal(0, 1, mask.shape), dtype)
  m_ = np.asarray(mask)
  adv_mean = arr(np.sum(np.asarray(adv_BxT) * m_, 1) / np.sum(m_, 1), dtype)
  l_seq, _, g_seq = evaluate("gspo", logp, old, adv_mean, mask, eps_low=10.0, eps_high=10.0)
  l_tok, _, g_tok = evaluate("gspo_token", logp, old, adv_BxT, mask, eps_low=10.0, eps_high=10.0)
  # Without clipping the two losses have the same value (sum_t A_it / n_i = mean A),
  # but GSPO-token gives each token its own advantage.
  np.testing.assert_allclose(l_tok, l_seq, rtol=1e-5)
  assert np.max(np.abs(np.asarray(g_tok) - np.asarray(g_seq))) > 1e-3


@pytest.mark.parametrize("seed", [0, 1])
def test_gspo_gradient_closed_form_with_clipping(seed, dtype, tol):
  # Identity 3: dL/dlogp_it = -m_it a_i s_i A_i / (N n_i), a_i = 0 for clipped rows.
  logp, old, adv, mask = random_batch(seed + 10, dtype, B=10, scale=0.1, empty_rows=(0,))
  eps = dict(eps_low=0.02, eps_high=0.03)
  _, _, g = evaluate("gspo", logp, old, adv, mask, **eps)
  log_s = np.asarray(seq_log_ratio(logp, old, mask))
  s, a_, m = np.exp(log_s), np.asarray(adv), np.asarray(mask)
  n = m.sum(1)
  N = (n > 0).sum()
  clipped = ((a_ > 0) & (s > 1.03)) | ((a_ < 0) & (s < 0.98))
  assert clipped.any() and (~clipped & (n > 0)).any()
  expected = -m * (np.where(clipped, 0.0, s * a_) / (N * np.maximum(n, 1)))[:, None]
  np.testing.assert_allclose(g, expected, **tol)


@pytest.mark.parametrize("name", list(LOSSES))
def test_padding_changes_nothing(name, dtype, tol):
  # Identity 5: junk (even NaN/inf) at masked positions and extra padded columns change
  # neither loss nor gradient; masked positions get exactly zero gradient. The loss is
  # pg_loss + 0.1 * kl_loss, as a train step adds the KL term.
  logp, old, adv, mask = random_batch(4, dtype, B=6, T=5, scale=0.1, prefix=False,
                                      empty_rows=(3,))
  eps = dict(eps_low=0.05, eps_high=0.05)
  ref = logp + 0.3
  adv_in = adv if name != "gspo_token" else jnp.broadcast_to(adv[:, None], mask.shape) + 0.1 * logp

  def fn(lp, o, a, mk, r):
    pg_loss, metrics = LOSSES[name](lp, o, a, mk, **eps)
    kl, kl_metrics = L.kl_loss(lp, r, mk)
    return pg_loss + 0.1 * kl, {**metrics, **kl_metrics}

  (loss, metrics), g = jax.value_and_grad(fn, has_aux=True)(logp, old, adv_in, mask, ref)

  m = np.asarray(mask, bool)
  rng = np.random.default_rng(0)
  junk = lambda x: arr(np.where(m, np.asarray(x), rng.choice(JUNK, size=m.shape)), dtype)
  adv_junk = adv_in if name != "gspo_token" else junk(adv_in)
  # 3 extra columns of NaN junk, masked out.
  pad = lambda x, v=np.nan: jnp.concatenate([x, jnp.full((x.shape[0], 3), v, x.dtype)], 1)
  mask_p = pad(mask, 0)
  adv_p = adv_junk if name != "gspo_token" else pad(adv_junk)
  (loss_p, metrics_p), g_p = jax.value_and_grad(fn, has_aux=True)(
      pad(junk(logp)), pad(junk(old)), adv_p, mask_p, pad(junk(ref)))
  np.testing.assert_allclose(loss_p, loss, **tol)
  for k in metrics:
    np.testing.assert_allclose(metrics_p[k], metrics[k], err_msg=k, **tol)
  g_p = np.asarray(g_p)
  np.testing.assert_allclose(g_p[:, :5], g, **tol)
  assert np.all(g_p[:, :5][~m] == 0.0) and np.all(g_p[:, 5:] == 0.0)


def test_sequence_ratio_is_geometric_mean(dtype, tol):
  # Identity 6: shifting every counted l of a row by c gives s = e^c ...
  logp, _, _, mask = random_batch(5, dtype)
  c = np.linspace(-2.0, 2.0, logp.shape[0])
  old = logp - arr(c[:, None] * np.ones(logp.shape), dtype)
  np.testing.assert_allclose(seq_log_ratio(logp, old, mask), c, **tol)
  # ... and repeating a row's tokens k times leaves s unchanged.
  logp, old, _, _ = random_batch(6, dtype, B=3, T=4)
  full = jnp.ones((3, 4))
  tiled = lambda x: jnp.asarray(np.tile(np.asarray(x), (1, 3)))
  np.testing.assert_allclose(seq_log_ratio(tiled(logp), tiled(old), tiled(full)),
                             seq_log_ratio(logp, old, full), **tol)


@pytest.mark.parametrize("name", list(LOSSES))
def test_permuting_rows_permutes_nothing_else(name, dtype, tol):
  # Identity 7: permuting rows leaves the loss and metrics unchanged and permutes gradients.
  logp, old, adv, mask = random_batch(7, dtype, B=8, scale=0.1)
  eps = dict(eps_low=0.05, eps_high=0.05)
  perm = np.random.default_rng(7).permutation(8)
  p = lambda x: jnp.asarray(np.asarray(x)[perm])
  l1, m1, g1 = evaluate(name, logp, old, adv, mask, **eps)
  l2, m2, g2 = evaluate(name, p(logp), p(old), p(adv), p(mask), **eps)
  np.testing.assert_allclose(l2, l1, **tol)
  for k in m1:
    np.testing.assert_allclose(m2[k], m1[k], err_msg=k, **tol)
  np.testing.assert_allclose(g2, np.asarray(g1)[perm], **tol)


def test_gspo_invariant_to_token_order_within_a_row(dtype, tol):
  logp, old, adv, _ = random_batch(8, dtype, scale=0.1)
  mask = jnp.ones(logp.shape)
  perm = np.random.default_rng(8).permutation(logp.shape[1])
  p = lambda x: jnp.asarray(np.asarray(x)[:, perm])
  l1, _, _ = evaluate("gspo", logp, old, adv, mask, eps_low=0.05, eps_high=0.05)
  l2, _, _ = evaluate("gspo", p(logp), p(old), adv, mask, eps_low=0.05, eps_high=0.05)
  np.testing.assert_allclose(l2, l1, **tol)


def test_seq_mean_equals_token_mean_when_lengths_are_equal(dtype, tol):
  # Identity 8.
  logp, old, adv, _ = random_batch(9, dtype, scale=0.2)
  mask = jnp.ones(logp.shape)
  a = evaluate("grpo", logp, old, adv, mask, aggregation="seq-mean-token-mean")[0]
  b = evaluate("grpo", logp, old, adv, mask, aggregation="token-mean")[0]
  np.testing.assert_allclose(a, b, **tol)


@pytest.mark.parametrize("name", list(LOSSES))
def test_old_logp_is_a_constant(name, dtype):
  # pi_old is the sampling policy: no gradient may flow into it, even when the caller
  # passes a differentiable array.
  logp, old, adv, mask = random_batch(10, dtype, scale=0.1)

  @jax.jit
  def grads(logp, old, adv, mask):
    return (jax.grad(lambda o: LOSSES[name](logp, o, adv, mask)[0])(old),
            jax.grad(lambda o: jnp.sum(L.sequence_log_ratio(logp, o, mask)))(old))

  g_old, g_seq = grads(logp, old, adv, mask)
  assert np.all(np.asarray(g_old) == 0)
  assert np.all(np.asarray(g_seq) == 0)


# ---------------------------------------------------- the losses rebuilt from public blocks


def gspo_from_blocks(logp, old, adv_B, mask, *, eps_low, eps_high):
  """GSPO (paper Eq. 5) from the public blocks only."""
  log_s_B = L.sequence_log_ratio(logp, old, mask)
  surrogate = L.clipped_surrogate(log_s_B, adv_B, eps_low=eps_low, eps_high=eps_high)
  pg_loss = -L.aggregate(surrogate.objective, mask)
  return pg_loss, L.policy_metrics(pg_loss, surrogate, L.token_log_ratio(logp, old, mask), mask)


def grpo_from_blocks(logp, old, adv, mask, *, eps_low, eps_high, aggregation):
  """GRPO (paper Eq. 2) from the public blocks only."""
  l_BxT = L.token_log_ratio(logp, old, mask)
  surrogate = L.clipped_surrogate(l_BxT, L.token_advantages(adv, mask), eps_low=eps_low,
                                  eps_high=eps_high)
  pg_loss = -L.aggregate(surrogate.objective, mask, mode=aggregation)
  return pg_loss, L.policy_metrics(pg_loss, surrogate, l_BxT, mask)


def gspo_token_from_blocks(logp, old, adv, mask, *, eps_low, eps_high):
  """GSPO-token (paper Eqs. 13-14) from the public blocks only."""
  sg = jax.lax.stop_gradient
  l_BxT = L.token_log_ratio(logp, old, mask)
  log_s_B = L.sequence_log_ratio(logp, old, mask)
  surrogate = L.clipped_surrogate((l_BxT - sg(l_BxT)) + sg(log_s_B)[:, None],
                                  L.token_advantages(adv, mask), eps_low=eps_low,
                                  eps_high=eps_high)
  pg_loss = -L.aggregate(surrogate.objective, mask)
  return pg_loss, L.policy_metrics(pg_loss, surrogate, l_BxT, mask, ratio=jnp.exp(log_s_B))


def test_losses_rebuilt_from_public_blocks_equal_the_losses(dtype, tol):
  # Random batch with an empty row, non-prefix masks and junk (NaN, inf) at masked
  # positions, at a clip range where some rows or tokens are clipped and some are not.
  logp, old, adv, mask = random_batch(23, dtype, B=8, T=6, scale=0.1, prefix=False,
                                      empty_rows=(2,))
  m = np.asarray(mask, bool)
  junk = lambda x: arr(np.where(m, np.asarray(x), np.random.default_rng(23).choice(JUNK, m.shape)),
                       dtype)
  logp, old = junk(logp), junk(old)
  adv_BxT = junk(np.asarray(adv)[:, None] + np.random.default_rng(24).normal(0, 1, m.shape))
  eps = dict(eps_low=0.02, eps_high=0.03)
  pairs = {
      "gspo": (lambda lp: L.gspo_loss(lp, old, adv, mask, **eps),
               lambda lp: gspo_from_blocks(lp, old, adv, mask, **eps)),
      "gspo_token": (lambda lp: L.gspo_token_loss(lp, old, adv_BxT, mask, **eps),
                     lambda lp: gspo_token_from_blocks(lp, old, adv_BxT, mask, **eps)),
      "grpo": (lambda lp: L.grpo_loss(lp, old, adv, mask, aggregation="token-mean", **eps),
               lambda lp: grpo_from_blocks(lp, old, adv, mask, aggregation="token-mean", **eps)),
  }
  run = jax.jit(lambda lp: {name: tuple(jax.value_and_grad(f, has_aux=True)(lp) for f in fs)
                            for name, fs in pairs.items()})
  for name, (((loss, metrics), g), ((loss_b, metrics_b), g_b)) in run(logp).items():
    assert 0 < float(metrics["clip_frac_token"]) < 1, name
    assert np.all(np.isfinite(g)) and np.any(np.asarray(g) != 0), name
    np.testing.assert_allclose(loss_b, loss, err_msg=name, **tol)
    assert metrics_b.keys() == metrics.keys(), name
    for k in metrics:
      np.testing.assert_allclose(metrics_b[k], metrics[k], err_msg=f"{name}: {k}", **tol)
    np.testing.assert_allclose(g_b, g, err_msg=name, **tol)


@pytest.mark.parametrize("name", list(LOSSES))
def test_signature_and_keyword_defaults_are_loss_defaults(name):
  params = inspect.signature(LOSSES[name]).parameters
  # One calling convention: LOSSES[name](logp, old_logp, adv, mask, **hyperparameters).
  assert list(params)[:4] == ["logp_BxT", "old_logp_BxT", "adv", "mask_BxT"]
  defaults = {k: p.default for k, p in params.items() if p.kind is p.KEYWORD_ONLY}
  table = L.LOSS_DEFAULTS[name]
  assert {k: defaults.get(k, "missing") for k in table} == table
  # No KL arguments (the KL term is kl_loss); besides the token weights every loss takes,
  # token_sum_norm (None = T) is GRPO's only extra and length_weighting (LUSPO) GSPO's.
  extra = {"grpo": {"token_sum_norm"}, "gspo": {"length_weighting"}}.get(name, set())
  assert set(defaults) - set(table) == extra | {"token_weights_BxT"}
  assert set(L.LOSS_DEFAULTS) == set(L.LOSSES) >= set(LOSSES)


def test_clipped_surrogate_hand_values(dtype, tol):
  # eps 0.2, clip range [0.8, 1.2]:
  #   r = 1.5, A = +1: clipped high -> 1.2 * 1      r = 0.5, A = -1: clipped low -> 0.8 * -1
  #   r = 1.1, A = +1: kept -> 1.1                  r = 1.5, A = -1: kept (A < 0 clips low only)
  #   r = 0.5, A = +2: kept (A > 0 clips high only) -> 1.0
  # d objective / d log r = r A where kept, exactly 0 where clipped.
  log_r = arr(np.log([1.5, 0.5, 1.1, 1.5, 0.5]), dtype)
  adv = arr([1.0, -1.0, 1.0, -1.0, 2.0], dtype)
  f = jax.jit(lambda lr: L.clipped_surrogate(lr, adv, eps_low=0.2, eps_high=0.2))
  out = f(log_r)
  assert isinstance(out, L.Surrogate)
  np.testing.assert_allclose(out.objective, [1.2, -0.8, 1.1, -1.5, 1.0], **tol)
  np.testing.assert_allclose(out.ratio, [1.5, 0.5, 1.1, 1.5, 0.5], **tol)
  np.testing.assert_array_equal(out.clipped_high, [True, False, False, False, False])
  np.testing.assert_array_equal(out.clipped_low, [False, True, False, False, False])
  g = jax.grad(lambda lr: jnp.sum(f(lr).objective))(log_r)
  np.testing.assert_allclose(g, [0.0, 0.0, 1.1, -1.5, 1.0], **tol)
  assert float(g[0]) == 0.0 and float(g[1]) == 0.0
  # The ratio is reported without gradient.
  assert np.all(np.asarray(jax.grad(lambda lr: jnp.sum(f(lr).ratio))(log_r)) == 0)


def test_row_lengths_token_advantages_and_per_sequence_aggregate(dtype, tol):
  mask = jnp.asarray(HAND_M, jnp.float32)
  n = L.row_lengths(mask)
  np.testing.assert_array_equal(n, [3, 1, 2, 3, 0])
  adv = arr(HAND_A, dtype)
  adv_BxT = L.token_advantages(adv, mask)
  np.testing.assert_array_equal(adv_BxT, np.asarray(HAND_A)[:, None] * np.asarray(HAND_M))
  junk_BxT = arr(np.where(np.asarray(HAND_M, bool), np.asarray(adv_BxT), np.nan), dtype)
  np.testing.assert_array_equal(L.token_advantages(junk_BxT, mask), adv_BxT)
  # Per-sequence values x_B = HAND_A stand for x_it = x_i on counted tokens; row 4 is empty
  # (its value, even NaN, is ignored). Row sums n_i x_i = [3, -1, -4, 1.5], N = 4, 9 tokens.
  x_B = arr(HAND_A[:4] + [np.nan], dtype)
  want = {"seq-mean-token-mean": (1 - 1 - 2 + 0.5) / 4, "token-mean": -0.5 / 9,
          "seq-mean-token-sum-norm": -0.5 / (4 * 3)}
  for mode, value in want.items():
    # Any mode but seq-mean-token-mean length-weights a per-sequence x_B: warned.
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter("always")
      np.testing.assert_allclose(L.aggregate(x_B, mask, mode=mode), value, err_msg=mode, **tol)
    assert [w.category for w in caught] == ([] if mode == "seq-mean-token-mean" else
                                            [L.ObjectiveWarning]), mode
    np.testing.assert_allclose(L.aggregate(adv_BxT, mask, mode=mode), value, err_msg=mode, **tol)


# -------------------------------------------------------------------------- KL term


def test_kl_estimators_hand_values(dtype, tol):
  # d = ref - logp = [0.5, -1.0]:  k1 = -d, k2 = d^2/2, k3 = e^d - d - 1.
  logp = arr([[-1.0, -2.0, 4.0]], dtype)
  ref = arr([[-0.5, -3.0, np.nan]], dtype)
  mask = jnp.asarray([[1, 1, 0]])
  d = np.array([0.5, -1.0])
  want = {"k1": -d, "k2": d * d / 2, "k3": np.exp(d) - d - 1}
  kls = jax.jit(lambda a, b, m: {est: L.kl_penalty(a, b, m, estimator=est) for est in want})(
      logp, ref, mask)
  for est, w in want.items():
    np.testing.assert_allclose(kls[est], [[w[0], w[1], 0.0]], **tol)


# KL hand batch: d = ref - logp ("*" = masked junk), row 2 empty, N = 2.
#   row 0: d = [0.5, -1.0, *]   n = 2
#   row 1: d = [0.2, *, *]      n = 1
KL_LOGP = [[-1.0, -2.0, 4.0], [-0.7, np.nan, 1.0], [np.inf, 0.0, -3.0]]
KL_REF = [[-0.5, -3.0, np.nan], [-0.5, 2.0, np.inf], [1.0, 2.0, 3.0]]
KL_M = [[1, 1, 0], [1, 0, 0], [0, 0, 0]]


def test_kl_loss_hand_values_each_aggregation(dtype, tol):
  logp, ref, mask = arr(KL_LOGP, dtype), arr(KL_REF, dtype), jnp.asarray(KL_M, jnp.float32)
  # k2 = d^2/2: row 0 [0.125, 0.5] (sum 0.625, mean 0.3125), row 1 [0.02].
  want = {"seq-mean-token-mean": (0.3125 + 0.02) / 2, "token-mean": 0.645 / 3,
          "seq-mean-token-sum-norm": 0.645 / (2 * 3)}  # default normaliser T = 3

  @jax.jit
  def run(logp, ref, mask):
    out = {mode: L.kl_loss(logp, ref, mask, estimator="k2", aggregation=mode) for mode in want}
    out["norm4"] = L.kl_loss(logp, ref, mask, estimator="k2",
                             aggregation="seq-mean-token-sum-norm", token_sum_norm=4.0)
    k2 = lambda lp, r: L.kl_loss(lp, r, mask, estimator="k2")[0]
    return out, jax.grad(k2)(logp, ref), jax.grad(k2, argnums=1)(logp, ref)

  out, g, g_ref = run(logp, ref, mask)
  for mode, value in want.items():
    kl, metrics = out[mode]
    np.testing.assert_allclose(kl, value, err_msg=mode, **tol)
    assert list(metrics) == ["kl"] and float(metrics["kl"]) == float(kl)
  np.testing.assert_allclose(out["norm4"][0], 0.645 / (2 * 4), **tol)
  # dk2/dlogp = -d, over N n_i: row 0 -[0.5, -1.0] / 4, row 1 -0.2 / 2; 0 where masked.
  np.testing.assert_allclose(g, [[-0.125, 0.25, 0], [-0.1, 0, 0], [0, 0, 0]], **tol)
  # The reference is a constant: no gradient reaches it.
  assert np.all(np.asarray(g_ref) == 0)


def test_policy_loss_plus_kl_term_gradient_on_policy(dtype, tol):
  # The KL term is added by the caller: L = pg_loss + c * kl_loss (k3, seq-mean-token-mean).
  # On policy, with d = ref - logp and dk3/dlogp = 1 - e^d, for every loss:
  #   dL/dlogp_it = m_it (-A_i + c (1 - e^d_it)) / (N n_i)
  logp, _, adv, mask = random_batch(11, dtype, scale=0.1, empty_rows=(1,))
  ref = logp + arr(np.random.default_rng(11).normal(0, 0.3, logp.shape), dtype)
  c = 0.25

  @jax.jit
  def grads(logp, adv, mask, ref):
    total = lambda f: lambda lp: f(lp, logp, adv, mask)[0] + c * L.kl_loss(lp, ref, mask)[0]
    return {name: jax.grad(total(f))(logp) for name, f in LOSSES.items()}

  m, a = np.asarray(mask), np.asarray(adv)
  n = m.sum(1)
  d = np.asarray(ref) - np.asarray(logp)
  expected = m * (-a[:, None] + c * (1 - np.exp(d))) / ((n > 0).sum() * np.maximum(n, 1))[:, None]
  for name, g in grads(logp, adv, mask, ref).items():
    np.testing.assert_allclose(g, expected, err_msg=name, **tol)


# ------------------------------------------------------------------- transformations


@pytest.mark.parametrize("name", list(LOSSES))
def test_jit_vmap_grad(name, dtype, tol):
  logp, old, adv, mask = random_batch(12, dtype, scale=0.1)
  eps = dict(eps_low=0.05, eps_high=0.05)
  f = functools.partial(LOSSES[name], **eps)
  eager, eager_m = f(logp, old, adv, mask)
  jitted_f = jax.jit(f)
  jitted, jitted_m = jitted_f(logp, old, adv, mask)
  np.testing.assert_allclose(jitted, eager, **tol)
  for k in eager_m:
    np.testing.assert_allclose(jitted_m[k], eager_m[k], err_msg=k, **tol)
  # vmap over an extra leading axis (K independent minibatches); each minibatch alone
  # through the jitted loss (just shown equal to the eager one).
  stack = lambda *xs: jnp.asarray(np.stack([np.asarray(x) for x in xs]))
  batches = [random_batch(s, dtype, scale=0.1) for s in (20, 21, 22)]
  vm, vm_m = jax.vmap(f)(*[stack(*parts) for parts in zip(*batches)])
  for i, b in enumerate(batches):
    li, mi = jitted_f(*b)
    np.testing.assert_allclose(vm[i], li, **tol)
    np.testing.assert_allclose(vm_m["clip_frac_token"][i], mi["clip_frac_token"], **tol)
  g = jax.jit(jax.grad(lambda lp: f(lp, old, adv, mask)[0]))(logp)
  np.testing.assert_allclose(g, jax.grad(lambda lp: f(lp, old, adv, mask)[0])(logp), **tol)
  assert np.all(np.isfinite(g))


def test_building_blocks_jit_vmap_grad(dtype, tol):
  logp, old, _, mask = random_batch(13, dtype)
  for f in (L.sequence_log_ratio,
            L.token_log_ratio,
            lambda a, b, m: L.kl_penalty(a, b, m),
            lambda a, b, m: L.aggregate(a - b, m, mode="token-mean")):
    np.testing.assert_allclose(jax.jit(f)(logp, old, mask), f(logp, old, mask), **tol)
    vm = jax.vmap(f)(jnp.stack([logp, old]), jnp.stack([old, logp]), jnp.stack([mask, mask]))
    np.testing.assert_allclose(vm[1], f(old, logp, mask), **tol)
    g = jax.grad(lambda x: jnp.sum(f(x, old, mask)))(logp)
    assert np.all(np.isfinite(g)) and np.all(np.asarray(g)[np.asarray(mask) == 0] == 0)


# ------------------------------------------------------------------------ edge cases


@pytest.mark.parametrize("name", list(LOSSES))
def test_all_rows_empty(name, dtype):
  logp, old, adv, _ = random_batch(14, dtype)
  mask = jnp.zeros(logp.shape)
  (loss, m), g = jax.value_and_grad(lambda lp: LOSSES[name](lp, old, adv, mask), has_aux=True)(logp)
  assert float(loss) == 0.0 and np.all(np.asarray(g) == 0)
  assert float(m["num_seqs"]) == 0 and float(m["num_tokens"]) == 0
  assert all(np.isfinite(float(v)) for v in m.values())
  assert float(m["ratio_min"]) == 1.0 and float(m["clip_frac_token"]) == 0.0


@pytest.mark.parametrize("name", list(LOSSES))
def test_single_token_responses(name, dtype, tol):
  # T = 1: s_i = w_i1, so all three losses coincide (one token per row).
  logp, old, adv, mask = random_batch(15, dtype, T=1, scale=0.1)
  eps = dict(eps_low=0.05, eps_high=0.06)
  loss, _, _ = evaluate(name, logp, old, adv, mask, **eps)
  ref, _, _ = evaluate("gspo", logp, old, adv, mask, **eps)
  np.testing.assert_allclose(loss, ref, **tol)


@pytest.mark.parametrize("name", list(LOSSES))
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_far_off_policy_no_overflow(name, sign, dtype):
  # Log-ratios of +-50 per token (s = e^{+-50}): finite loss, finite gradients.
  logp, _, adv, mask = random_batch(16, dtype)
  old = logp - sign * 50.0
  (loss, m), g = jax.value_and_grad(lambda lp: LOSSES[name](lp, old, adv, mask), has_aux=True)(logp)
  assert np.isfinite(float(loss)) and np.all(np.isfinite(np.asarray(g)))
  assert all(np.isfinite(float(v)) for v in m.values())
  # Rows whose advantage pushes further away are clipped whole and get zero gradient.
  a, g = np.asarray(adv), np.asarray(g)
  pushes_away = (a > 0) if sign > 0 else (a < 0)
  assert np.all(g[pushes_away] == 0)


@pytest.mark.parametrize("name", list(LOSSES))
def test_overflowed_clipped_ratio_leaks_no_nan_into_the_gradient(name):
  # float32 exp overflows past log-ratio ~88. A row pushed that far in the direction its
  # advantage rewards is clipped: the loss stays finite and its gradient is exactly 0
  # (a plain min(r A, clip(r) A) would give d/dl = 0 * inf = NaN).
  logp, _, _, mask = random_batch(19, np.float32)
  adv = jnp.ones(logp.shape[0])
  old = logp - 100.0
  (loss, _), g = jax.value_and_grad(lambda lp: LOSSES[name](lp, old, adv, mask), has_aux=True)(logp)
  assert np.isfinite(float(loss)) and np.all(np.asarray(g) == 0)


def test_gspo_value_is_continuous_at_the_clip_boundary(dtype):
  # Identity 10: at s on a bound both branches agree, so the value is continuous.
  logp = arr([[0.0]], dtype)
  for adv, log_s in ((1.0, math.log(1.2)), (-1.0, math.log(0.8))):
    old = np.asarray([[-log_s]], dtype)
    vals = [float(evaluate("gspo", logp, arr(old + d, dtype), arr([adv], dtype), jnp.ones((1, 1)),
                           eps_low=0.2, eps_high=0.2)[0]) for d in (-1e-4, 0.0, 1e-4)]
    assert abs(vals[0] - vals[1]) < 1e-3 and abs(vals[2] - vals[1]) < 1e-3


def test_bf16_inputs_are_computed_in_float32():
  logp, old, adv, mask = random_batch(17, np.float32, scale=0.1)
  bf16 = lambda x: jnp.asarray(np.asarray(x).astype(jnp.bfloat16))
  loss16, m16, _ = evaluate("gspo", bf16(logp), bf16(old), adv, mask)
  assert loss16.dtype == jnp.float32 and m16["ratio_mean"].dtype == jnp.float32


# ------------------------------------------------------------------------ bad input


def _bad_input_cases():
  logp = jnp.zeros((2, 3))
  adv = jnp.zeros(2)
  mask = jnp.ones((2, 3))
  surrogate = L.clipped_surrogate(adv, adv, eps_low=0.2, eps_high=0.2)
  return [
      ("gspo_loss: old_logp_BxT", lambda: L.gspo_loss(logp, jnp.zeros((2, 4)), adv, mask)),
      ("mask_BxT", lambda: L.gspo_loss(logp, logp, adv, jnp.ones((3, 3)))),
      # The advantage argument is `adv` in every loss, and errors say so.
      (r"gspo_loss: adv\b", lambda: L.gspo_loss(logp, logp, jnp.zeros(3), mask)),
      (r"gspo_loss: adv\b.*gspo_token_loss",
       lambda: L.gspo_loss(logp, logp, jnp.zeros((2, 3)), mask)),
      (r"gspo_token_loss: adv\b", lambda: L.gspo_token_loss(logp, logp, jnp.zeros((2, 4)), mask)),
      (r"grpo_loss: adv\b", lambda: L.grpo_loss(logp, logp, jnp.zeros(5), mask)),
      ("logp_BxT", lambda: L.gspo_loss(jnp.zeros((2, 3, 1)), logp, adv, mask)),
      ("logp_BxT", lambda: L.gspo_loss(jnp.zeros((2, 3), jnp.int32), logp, adv, mask)),
      ("mask_BxT", lambda: L.gspo_loss(logp, logp, adv, jnp.full((2, 3), 0.5))),
      ("mask_BxT", lambda: L.grpo_loss(logp, logp, adv, jnp.asarray([[1, 2, 0], [1, 1, 1]]))),
      ("mask_BxT", lambda: L.sequence_log_ratio(logp, logp, -mask)),
      ("eps_low", lambda: L.gspo_loss(logp, logp, adv, mask, eps_low=0.0)),
      ("eps_high", lambda: L.gspo_token_loss(logp, logp, adv, mask, eps_high=-1e-4)),
      ("eps_low", lambda: L.grpo_loss(logp, logp, adv, mask, eps_low=-0.2)),
      ("aggregation", lambda: L.grpo_loss(logp, logp, adv, mask, aggregation="seq-mean")),
      ("mode", lambda: L.aggregate(logp, mask, mode="token-sum")),
      ("token_sum_norm", lambda: L.aggregate(logp, mask, mode="seq-mean-token-sum-norm",
                                             token_sum_norm=0)),
      ("kl_loss: estimator", lambda: L.kl_loss(logp, logp, mask, estimator="k4")),
      ("kl_loss: aggregation", lambda: L.kl_loss(logp, logp, mask, aggregation="seq-mean")),
      ("kl_loss: ref_logp_BxT", lambda: L.kl_loss(logp, jnp.zeros((2, 2)), mask)),
      ("kl_penalty: ref_logp_BxT", lambda: L.kl_penalty(logp, jnp.zeros((2, 2)), mask)),
      # The public blocks check their own arguments.
      ("token_log_ratio: old_logp_BxT", lambda: L.token_log_ratio(logp, jnp.zeros(2), mask)),
      ("row_lengths: mask_BxT", lambda: L.row_lengths(jnp.full((2, 3), 0.5))),
      (r"token_advantages: adv\b", lambda: L.token_advantages(jnp.zeros(3), mask)),
      (r"clipped_surrogate: adv\b",
       lambda: L.clipped_surrogate(adv, jnp.zeros(3), eps_low=0.2, eps_high=0.2)),
      ("clipped_surrogate: eps_low",
       lambda: L.clipped_surrogate(adv, adv, eps_low=0.0, eps_high=0.2)),
      ("aggregate: x", lambda: L.aggregate(jnp.zeros((2, 4)), mask)),
      ("aggregate: x", lambda: L.aggregate(jnp.zeros(3), mask)),
      ("aggregate: x", lambda: L.aggregate(jnp.zeros(()), mask)),
      ("policy_metrics: surrogate.clipped_low",
       lambda: L.policy_metrics(0.0, surrogate._replace(clipped_low=jnp.zeros(3, bool)), logp,
                                mask)),
      ("policy_metrics: ratio", lambda: L.policy_metrics(0.0, surrogate, logp, mask,
                                                         ratio=jnp.zeros((2, 4)))),
  ]


@pytest.mark.parametrize("case", range(len(_bad_input_cases())))
def test_bad_input_names_the_argument(case):
  name, call = _bad_input_cases()[case]
  with pytest.raises(ValueError, match=name):
    call()


def test_shape_errors_also_raise_under_jit():
  f = jax.jit(lambda lp, o, a, m: L.gspo_loss(lp, o, a, m)[0])
  with pytest.raises(ValueError, match="old_logp_BxT"):
    f(jnp.zeros((2, 3)), jnp.zeros((2, 4)), jnp.zeros(2), jnp.ones((2, 3)))
  # Traced eps cannot be checked (a schedule may produce it) but works.
  g = jax.jit(lambda e: L.gspo_loss(jnp.zeros((2, 3)), jnp.zeros((2, 3)), jnp.ones(2),
                                    jnp.ones((2, 3)), eps_low=e, eps_high=e)[0])
  assert float(g(0.1)) == -1.0


def test_bool_mask_equals_float_mask(dtype, tol):
  logp, old, adv, mask = random_batch(18, dtype, scale=0.1)
  a, _, _ = evaluate("gspo", logp, old, adv, mask)
  b, _, _ = evaluate("gspo", logp, old, adv, jnp.asarray(np.asarray(mask).astype(bool)))
  np.testing.assert_allclose(a, b, **tol)
