"""The public building blocks that GSPO, GSPO-token and GRPO are made of (`gspo_jax.objectives.losses`
assembles them; a variant can be assembled the same way).

Paper: Zheng et al., "Group Sequence Policy Optimization", arXiv:2507.18071 (v2).

Shapes: the package legend (docs/shapes.md), with one exception for the whole loss
library: B counts rows (responses in the (mini)batch, R in the legend), since a loss takes
whatever rows it is given; T = response tokens (padded length).
`mask_BxT` is 1 (or True) on counted response tokens and 0 elsewhere (padding, tool
output, ...); it need not be a prefix. n_i = |y_i| = sum_t mask_it, and
N = #{i : n_i > 0} is the number of non-empty rows. Empty rows take no part in any
mean (verl/tunix convention; TRL divides by B instead, i.e. its loss is N/B of ours).

Every block computes in at least float32 (bfloat16 input is upcast). `old_logp_BxT` and
`ref_logp_BxT` are constants (wrapped in `stop_gradient`). Values at masked positions
never reach the arithmetic (`where` before any exp/sum), so junk there - even NaN or
inf - changes neither the result nor the gradient, and masked positions get exactly zero
gradient. No clamps are applied to log-ratios (verl/tunix clamp to +-20 or cap log s at
10; the paper has none); float32 represents the ratio up to log-ratio ~88.
"""

from __future__ import annotations

import warnings
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from gspo_jax.utils import checks

Array = jax.Array
Metrics = dict[str, Array]

AGGREGATIONS = ("seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm")
KL_ESTIMATORS = ("k1", "k2", "k3")

__all__ = [
    "AGGREGATIONS", "KL_ESTIMATORS", "ObjectiveWarning", "Surrogate", "aggregate",
    "clipped_surrogate", "kl_penalty", "policy_metrics", "row_lengths", "sequence_log_ratio",
    "sign_aware_log_clip", "soft_gate_surrogate", "token_advantages", "token_log_ratio",
    "truncated_weight_surrogate", "weighted_mask",
]


class ObjectiveWarning(UserWarning):
  """A combination of arguments that is valid but changes the objective in a way that is
  easy to miss (e.g. a per-sequence objective aggregated by token-mean is length-weighted)."""


def _compute_dtype(x: Any) -> Any:
  return jnp.promote_types(jnp.result_type(x), jnp.float32)


def _masked(x_BxT: Array, m_BxT: Array, dtype) -> Array:
  """x where counted, 0 elsewhere; junk at masked positions never propagates."""
  return jnp.where(m_BxT, jnp.asarray(x_BxT).astype(dtype), jnp.zeros((), dtype))


def weighted_mask(mask_BxT: Array, token_weights_BxT: Array | None) -> Array:
  """The tokens that count once `token_weights_BxT` is applied: m_it and w_it != 0.

  A weight of exactly 0 removes its token from the loss, denominators (n_i, N) and the
  sequence ratio included: how `rollout_correction(mode="mask")` and the off-policy
  sequence mask drop tokens and rows. `None` returns `mask_BxT` unchanged.
  """
  if token_weights_BxT is None:
    return mask_BxT
  checks.check_token_arrays("weighted_mask", mask_BxT, token_weights_BxT=token_weights_BxT)
  m = jnp.asarray(mask_BxT).astype(bool)
  return m & (jax.lax.stop_gradient(jnp.asarray(token_weights_BxT)) != 0)


def row_lengths(mask_BxT: Array, dtype=jnp.float32) -> Array:
  """n_B: counted tokens per row, n_i = sum_t m_it. A row with n_i = 0 is empty.

  float32 counts are exact up to 2^24 tokens per row.
  """
  checks.check_rank("row_lengths", "mask_BxT", mask_BxT, 2, "B, T")
  checks.check_mask("row_lengths", "mask_BxT", mask_BxT)
  return jnp.sum(jnp.asarray(mask_BxT).astype(bool), axis=-1, dtype=dtype)


def token_log_ratio(logp_BxT: Array, old_logp_BxT: Array, mask_BxT: Array) -> Array:
  """Masked token log-ratio l_it (w_it = exp(l_it) is the token ratio
  of GRPO, paper Eq. 2):

    l_it = m_it (log pi_theta(y_it) - sg[log pi_old(y_it)])

  Both inputs are masked before the subtraction, so l_it = 0 where m_it = 0 whatever they
  hold there, and the gradient w.r.t. logp is m_it (exactly 0 where masked).

  Args:
    logp_BxT: log pi_theta of the response tokens.
    old_logp_BxT: log pi_old (or any other constant policy) of the same tokens.
    mask_BxT: 1 on counted tokens.
  Returns:
    l_BxT in the compute dtype (at least float32).
  """
  checks.check_token_arrays("token_log_ratio", mask_BxT, logp_BxT=logp_BxT,
                             old_logp_BxT=old_logp_BxT)
  m = jnp.asarray(mask_BxT).astype(bool)
  dtype = _compute_dtype(logp_BxT)
  old = jax.lax.stop_gradient(old_logp_BxT)
  return _masked(logp_BxT, m, dtype) - _masked(old, m, dtype)


def sequence_log_ratio(logp_BxT: Array, old_logp_BxT: Array, mask_BxT: Array) -> Array:
  """Length-normalised sequence log-ratio, log s_i (paper Eq. 7, in log space).

    log s_i = (1/|y_i|) sum_t l_it,    l_it = token_log_ratio(...)_it

  so s_i = exp(log s_i) is the geometric mean of the token ratios. A row with no counted
  token gets 0 (s_i = 1).

  Args:
    logp_BxT, old_logp_BxT, mask_BxT: as in `token_log_ratio` (old is a constant).
  Returns:
    log_s_B, in the compute dtype (at least float32).
  """
  l_BxT = token_log_ratio(logp_BxT, old_logp_BxT, mask_BxT)
  n_B = row_lengths(mask_BxT, l_BxT.dtype)
  # An empty row: 0 / 1 = 0, i.e. s_i = 1.
  return jnp.sum(l_BxT, axis=-1) / jnp.maximum(n_B, 1)


def token_advantages(adv: Array, mask_BxT: Array) -> Array:
  """Per-token advantages A_it, 0 where m_it = 0.

  adv of shape (B,) is broadcast along each row (A_it = A_i, the paper's setting); shape
  (B, T) is taken as is (per-token credit). Junk at masked positions never propagates.

  Returns:
    adv_BxT in the compute dtype (at least float32).
  """
  checks.check_rank("token_advantages", "mask_BxT", mask_BxT, 2, "B, T")
  checks.check_rows_or_tokens("token_advantages", "adv", adv, jnp.shape(mask_BxT), "mask_BxT")
  checks.check_mask("token_advantages", "mask_BxT", mask_BxT)
  adv = jnp.asarray(adv)
  if adv.ndim == 1:
    adv = jnp.broadcast_to(adv[:, None], jnp.shape(mask_BxT))
  return _masked(adv, jnp.asarray(mask_BxT).astype(bool), _compute_dtype(adv))


class Surrogate(NamedTuple):
  """What `clipped_surrogate` returns; every field has the shape of its inputs.

  objective: min(r A, clip(r, 1 - eps_low, 1 + eps_high) A), the objective to maximise
    (the only field that carries a gradient).
  ratio: r = exp(log_ratio), without gradient.
  clipped_low: A < 0 and r < 1 - eps_low (the element contributes zero gradient).
  clipped_high: A > 0 and r > 1 + eps_high (the element contributes zero gradient).
  """
  objective: Array
  ratio: Array
  clipped_low: Array
  clipped_high: Array


def clipped_surrogate(log_ratio: Array, adv: Array, *, eps_low, eps_high) -> Surrogate:
  """Elementwise PPO surrogate (the min-clip term of paper Eqs. 2, 5 and 13):

    min(r A, clip(r, 1 - eps_low, 1 + eps_high) A),    r = exp(log_ratio)

  Written as an explicit branch so that clipping is exact and gradients are defined:
  an element is clipped iff (A > 0 and r > 1 + eps_high) or (A < 0 and r < 1 - eps_low);
  it then contributes the constant bound * A and exactly zero gradient (its ratio is
  replaced by exp(0) before the product, so a ratio that overflowed cannot leak 0 * inf
  into the gradient). Otherwise it contributes r A with gradient r A d(log_ratio).
  At a tie (r exactly on a bound) the element counts as not clipped.

  Args:
    log_ratio: any shape, e.g. log s_B (GSPO) or l_BxT (GRPO). adv: the same shape.
    eps_low, eps_high: the clip range [1 - eps_low, 1 + eps_high], > 0.
  Returns:
    Surrogate(objective, ratio, clipped_low, clipped_high), in the compute dtype.
  """
  fn = "clipped_surrogate"
  checks.check_shape(fn, "adv", adv, jnp.shape(log_ratio), "log_ratio")
  checks.check_positive(fn, "eps_low", eps_low)
  checks.check_positive(fn, "eps_high", eps_high)
  dtype = _compute_dtype(log_ratio)
  log_ratio = jnp.asarray(log_ratio).astype(dtype)
  adv = jnp.asarray(adv).astype(dtype)
  ratio = jnp.exp(log_ratio)
  clipped_high = (adv > 0) & (ratio > 1 + eps_high)
  clipped_low = (adv < 0) & (ratio < 1 - eps_low)
  clipped = clipped_high | clipped_low
  live_ratio = jnp.exp(jnp.where(clipped, jnp.zeros_like(log_ratio), log_ratio))
  bound = jnp.where(clipped_high, 1 + eps_high, 1 - eps_low).astype(dtype)
  objective = jnp.where(clipped, bound * adv, live_ratio * adv)
  return Surrogate(objective, jax.lax.stop_gradient(ratio), clipped_low, clipped_high)


def soft_gate_surrogate(log_ratio: Array, adv: Array, *, tau_pos, tau_neg) -> Surrogate:
  """SAPO's soft gate in place of the clip (arXiv 2511.20347), elementwise:

    f(r) A,   f(r) = (4/tau) sigmoid(tau (r - 1)),   tau = tau_pos if A > 0 else tau_neg

  f(1) = 2/tau and f'(1) = 1: at r = 1 the gradient is A dlog r for any tau. Nothing is
  clipped (flags all False). Where tau (r - 1) > 40, sigmoid is exactly 1 in float32 and
  float64, so the element is taken as the constant 4/tau (zero gradient): the plain
  formula's value and gradient, without 0 * inf = NaN once r overflows. Any shape.
  """
  fn = "soft_gate_surrogate"
  checks.check_shape(fn, "adv", adv, jnp.shape(log_ratio), "log_ratio")
  checks.check_positive(fn, "tau_pos", tau_pos)
  checks.check_positive(fn, "tau_neg", tau_neg)
  dtype = _compute_dtype(log_ratio)
  log_ratio, adv = jnp.asarray(log_ratio).astype(dtype), jnp.asarray(adv).astype(dtype)
  tau = jnp.where(adv > 0, tau_pos, tau_neg).astype(dtype)
  ratio = jnp.exp(log_ratio)
  saturated = jax.lax.stop_gradient(tau * (ratio - 1)) > 40
  live = jnp.exp(jnp.where(saturated, jnp.zeros_like(log_ratio), log_ratio))
  gate = jnp.where(saturated, 4 / tau, 4 / tau * jax.nn.sigmoid(tau * (live - 1)))
  never = jnp.zeros(jnp.shape(log_ratio), bool)
  return Surrogate(gate * adv, jax.lax.stop_gradient(ratio), never, never)


def truncated_weight_surrogate(log_ratio: Array, logp: Array, adv: Array, *, eps_low,
                               eps_high) -> Surrogate:
  """CISPO's term (MiniMax-M1, arXiv 2506.13585), elementwise, any shape:

    sg[clip(r, 1 - eps_low, 1 + eps_high)] A logp,    r = exp(log_ratio), logp = log pi_theta

  The weight is clipped, not the term: every element keeps the gradient sg[clip(r)] A dlogp.
  Flags mark truncated weights whatever the sign of A (r > 1 + eps_high, r < 1 - eps_low).
  The value is verl's and TRL's (it holds log pi_theta, so it is not comparable with other
  losses' values).
  """
  fn = "truncated_weight_surrogate"
  checks.check_shape(fn, "logp", logp, jnp.shape(log_ratio), "log_ratio")
  checks.check_shape(fn, "adv", adv, jnp.shape(log_ratio), "log_ratio")
  checks.check_positive(fn, "eps_low", eps_low)
  checks.check_positive(fn, "eps_high", eps_high)
  dtype = _compute_dtype(log_ratio)
  ratio = jax.lax.stop_gradient(jnp.exp(jnp.asarray(log_ratio).astype(dtype)))
  weight = jnp.clip(ratio, 1 - eps_low, 1 + eps_high)
  objective = weight * jnp.asarray(adv).astype(dtype) * jnp.asarray(logp).astype(dtype)
  return Surrogate(objective, ratio, ratio < 1 - eps_low, ratio > 1 + eps_high)


def sign_aware_log_clip(log_ratio: Array, adv: Array, *, eps_low, eps_high
                        ) -> tuple[Array, Array, Array]:
  """GMPO's token clipping in log space (arXiv 2507.20673), elementwise, any shape:

    l~ = sgn(A) min(sgn(A) l, sgn(A) clip(l, -eps_low, eps_high))

  (A > 0: l capped at eps_high; A < 0: floored at -eps_low; A = 0: unchanged). A clipped
  element is the constant bound (zero gradient). Returns (l~, clipped_low, clipped_high).
  """
  fn = "sign_aware_log_clip"
  checks.check_shape(fn, "adv", adv, jnp.shape(log_ratio), "log_ratio")
  checks.check_positive(fn, "eps_low", eps_low)
  checks.check_positive(fn, "eps_high", eps_high)
  log_ratio = jnp.asarray(log_ratio).astype(_compute_dtype(log_ratio))
  high = (jnp.asarray(adv) > 0) & (log_ratio > eps_high)
  low = (jnp.asarray(adv) < 0) & (log_ratio < -eps_low)
  bound = jnp.where(high, eps_high, -eps_low).astype(log_ratio.dtype)
  return jnp.where(high | low, bound, log_ratio), low, high


def aggregate(x: Array, mask_BxT: Array, *, mode: str = "seq-mean-token-mean",
              token_sum_norm: float | None = None,
              token_weights_BxT: Array | None = None) -> Array:
  """Reduce per-token values x_BxT, or per-sequence values x_B, to a scalar (docs/losses.md,
  Aggregation). A per-sequence x_B stands for x_it = x_i on every counted token of row i.

    "seq-mean-token-mean"     (1/N) sum_i (1/n_i) sum_t m x      (paper: GRPO Eq. 2, GSPO
                              Eq. 5 (where it is (1/N) sum_i x_i), GSPO-token Eq. 13)
    "token-mean"              sum m x / sum m                    (DAPO)
    "seq-mean-token-sum-norm" sum m x / (N * token_sum_norm)     (Dr. GRPO; token_sum_norm
                              defaults to T, the padded length: set it to the maximum
                              generation length so the scale is the same every batch)

  N counts non-empty rows only. `token_weights_BxT` (constants) multiply each token's value
  (x_B broadcast first: under seq-mean-token-mean a row's value is weighted by its weights'
  row mean); a weight of 0 removes its token from the denominators too (`weighted_mask`).
  A per-sequence x_B with another mode weights each row by its length n_i: warned
  (ObjectiveWarning), as it silently length-weights GSPO's mean over responses.

  Args:
    x: x_BxT (values at masked positions are ignored) or x_B (values of empty rows are
      ignored).
    mask_BxT: 1 on counted tokens.
    token_sum_norm: only with mode="seq-mean-token-sum-norm" (an error otherwise).
  Returns:
    A scalar in the compute dtype.
  """
  fn = "aggregate"
  checks.check_rank(fn, "mask_BxT", mask_BxT, 2, "B, T")
  checks.check_choice(fn, "mode", mode, AGGREGATIONS)
  if token_sum_norm is not None:
    checks.check_positive(fn, "token_sum_norm", token_sum_norm)
    if mode != "seq-mean-token-sum-norm":
      raise ValueError(f"{fn}: token_sum_norm applies to mode='seq-mean-token-sum-norm'; "
                       f"mode is {mode!r} (it would be ignored)")
  shape_BxT = jnp.shape(mask_BxT)
  checks.check_rows_or_tokens(fn, "x", x, shape_BxT, "mask_BxT")
  if jnp.ndim(x) == 1 and mode != "seq-mean-token-mean":
    warnings.warn(f"{fn}: a per-sequence x_B with mode={mode!r} weights each response by its "
                  "length n_i (not GSPO's paper Eq. 5; gspo_loss(length_weighting=True) if "
                  "meant)", ObjectiveWarning, stacklevel=2)
  m = jnp.asarray(mask_BxT).astype(bool)
  dtype = _compute_dtype(x)
  if token_weights_BxT is not None:
    # Weighted: broadcast x_B to its tokens and take the BxT path with x * w.
    m = weighted_mask(m, token_weights_BxT)
    w_BxT = _masked(jax.lax.stop_gradient(token_weights_BxT), m, dtype)
    x = jnp.broadcast_to(jnp.asarray(x)[:, None], shape_BxT) if jnp.ndim(x) == 1 else x
    x = _masked(x, m, dtype) * w_BxT
  n_B = row_lengths(m, dtype)
  num_seqs = jnp.maximum(jnp.sum(n_B > 0, dtype=dtype), 1)
  if jnp.ndim(x) == 1:
    mean_B = _masked(x, n_B > 0, dtype)
    sum_B = n_B * mean_B
  else:
    sum_B = jnp.sum(_masked(x, m, dtype), axis=-1)
    mean_B = sum_B / jnp.maximum(n_B, 1)
  if mode == "seq-mean-token-mean":
    return jnp.sum(mean_B) / num_seqs
  if mode == "token-mean":
    return jnp.sum(sum_B) / jnp.maximum(jnp.sum(n_B), 1)
  norm = shape_BxT[-1] if token_sum_norm is None else token_sum_norm
  return jnp.sum(sum_B) / (num_seqs * norm)


def kl_penalty(logp_BxT: Array, ref_logp_BxT: Array, mask_BxT: Array, *,
               estimator: str = "k3") -> Array:
  """Per-token estimate of KL(pi_theta || pi_ref) (Schulman's k1/k2/k3), 0 where masked.

  With d = log pi_ref - log pi_theta:  k1 = -d,  k2 = d^2 / 2,  k3 = exp(d) - d - 1.
  k3 is non-negative and has the lowest variance; it is the default (as in verl's
  "low_var_kl", without verl's clamps). `ref_logp_BxT` is a constant.

  Returns:
    kl_BxT in the compute dtype.
  """
  fn = "kl_penalty"
  checks.check_token_arrays(fn, mask_BxT, logp_BxT=logp_BxT, ref_logp_BxT=ref_logp_BxT)
  checks.check_choice(fn, "estimator", estimator, KL_ESTIMATORS)
  d = -token_log_ratio(logp_BxT, ref_logp_BxT, mask_BxT)  # 0 where masked: so is every k
  if estimator == "k1":
    return -d
  if estimator == "k2":
    return 0.5 * d * d
  return jnp.exp(d) - d - 1


def _masked_mean(x, valid, count) -> Array:
  return jnp.sum(jnp.where(valid, x, 0)) / jnp.maximum(count, 1)


def _masked_extreme(reduce, x, valid, fill, count) -> Array:
  # An empty selection reports 1 (the ratio of identical policies), not +-inf.
  return jnp.where(count > 0, reduce(jnp.where(valid, x, fill)), jnp.ones((), x.dtype))


def policy_metrics(pg_loss: Array, surrogate: Surrogate, log_ratio_BxT: Array,
                   mask_BxT: Array, *, ratio: Array | None = None) -> Metrics:
  """The flat dict of scalars (no gradient) every policy loss reports.

  Args:
    pg_loss: the policy-gradient loss; reported as "loss" and "pg_loss".
    surrogate: the `clipped_surrogate` result whose clipping is reported. Flags of shape
      (B,) are one decision per response (it clips every token of the row, GSPO); flags of
      shape (B, T) are per token.
    log_ratio_BxT: token_log_ratio l_it of pi_theta against pi_old, for approx_kl.
    mask_BxT: 1 on counted tokens.
    ratio: the ratio to summarise, if not surrogate.ratio: shape (B,) is summarised over
      non-empty rows, (B, T) over counted tokens (GSPO-token passes s_B, once per row).
  Returns:
    clip_frac_token{,_low,_high}: fraction of counted tokens whose gradient clipping
      removes; clip_frac_seq{,_low,_high}: fraction of non-empty rows with a clipped token;
      ratio_mean/min/max (1 when nothing is counted); approx_kl: k3 estimate of
      KL(pi_old || pi_theta) per counted token, from samples of pi_old; num_tokens,
      num_seqs (N); loss and pg_loss.
  """
  fn = "policy_metrics"
  checks.check_token_arrays(fn, mask_BxT, log_ratio_BxT=log_ratio_BxT)
  ratio = surrogate.ratio if ratio is None else ratio
  for name, x in (("ratio", ratio), ("surrogate.clipped_low", surrogate.clipped_low),
                  ("surrogate.clipped_high", surrogate.clipped_high)):
    checks.check_rows_or_tokens(fn, name, x, jnp.shape(mask_BxT), "mask_BxT")
  sg = jax.lax.stop_gradient
  m = jnp.asarray(mask_BxT).astype(bool)
  lr = sg(log_ratio_BxT)
  dtype = lr.dtype
  n_B = row_lengths(m, dtype)
  nonempty_B = n_B > 0
  num_tokens, num_rows = jnp.sum(n_B), jnp.sum(nonempty_B, dtype=dtype)
  per_token = lambda c: (c if c.ndim == 2 else c[:, None]) & m
  low, high = per_token(surrogate.clipped_low), per_token(surrogate.clipped_high)
  tok_frac = lambda c: jnp.sum(c, dtype=dtype) / jnp.maximum(num_tokens, 1)
  seq_frac = lambda c: jnp.sum(jnp.any(c, axis=-1), dtype=dtype) / jnp.maximum(num_rows, 1)
  ratio = sg(ratio)
  valid, count = (m, num_tokens) if ratio.ndim == 2 else (nonempty_B, num_rows)
  approx_kl = jnp.sum(jnp.where(m, jnp.exp(lr) - 1 - lr, 0)) / jnp.maximum(num_tokens, 1)
  return {
      "loss": sg(pg_loss),
      "pg_loss": sg(pg_loss),
      "clip_frac_token": tok_frac(low | high),
      "clip_frac_token_low": tok_frac(low),
      "clip_frac_token_high": tok_frac(high),
      "clip_frac_seq": seq_frac(low | high),
      "clip_frac_seq_low": seq_frac(low),
      "clip_frac_seq_high": seq_frac(high),
      "ratio_mean": _masked_mean(ratio, valid, count),
      "ratio_min": _masked_extreme(jnp.min, ratio, valid, jnp.inf, count),
      "ratio_max": _masked_extreme(jnp.max, ratio, valid, -jnp.inf, count),
      "approx_kl": approx_kl,
      "num_tokens": num_tokens,
      "num_seqs": num_rows,
  }
