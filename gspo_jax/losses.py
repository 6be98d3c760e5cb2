"""GSPO, GSPO-token and GRPO objectives: pure functions over arrays.

Paper: Zheng et al., "Group Sequence Policy Optimization", arXiv:2507.18071 (v2).

Legend: B = responses in the (mini)batch, T = response tokens (padded length).
`mask_BxT` is 1 (or True) on counted response tokens and 0 elsewhere (padding, tool
output, ...); it need not be a prefix. n_i = |y_i| = sum_t mask_it, and
N = #{i : n_i > 0} is the number of non-empty rows. Empty rows take no part in any
mean (verl/tunix convention; TRL divides by B instead, i.e. its loss is N/B of ours).

Every loss returns `(loss, metrics)`: the loss to *minimise* (the negated objective) and
a flat dict of scalars. Log-probs are upcast to at least float32. `old_logp_BxT` and
`ref_logp_BxT` are constants (wrapped in `stop_gradient`). Values at masked positions
never reach the arithmetic (`where` before any exp/sum), so junk there - even NaN or
inf - changes neither the loss nor the gradient, and masked positions get exactly zero
gradient.

No clamps are applied to log-ratios (verl/tunix clamp to +-20 or cap log s at 10; the
paper has none). float32 represents the ratio up to log-ratio ~88.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from gspo_jax import _checks
from gspo_jax.logprobs import token_logprobs, token_logprobs_from_hidden  # noqa: F401  (re-export)

Array = jax.Array
Metrics = dict[str, Array]

AGGREGATIONS = ("seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm")
KL_ESTIMATORS = ("k1", "k2", "k3")


# ----------------------------------------------------------------------------- helpers


def _compute_dtype(x: Array) -> Any:
  return jnp.promote_types(jnp.result_type(x), jnp.float32)


def _validate_tokens(fn: str, logp_BxT, old_logp_BxT, mask_BxT) -> None:
  _checks.check_rank(fn, "logp_BxT", logp_BxT, 2, "B, T")
  _checks.check_float(fn, "logp_BxT", logp_BxT)
  _checks.check_shape(fn, "old_logp_BxT", old_logp_BxT, logp_BxT.shape, "logp_BxT")
  _checks.check_float(fn, "old_logp_BxT", old_logp_BxT)
  _checks.check_shape(fn, "mask_BxT", mask_BxT, logp_BxT.shape, "logp_BxT")
  _checks.check_mask(fn, "mask_BxT", mask_BxT)


def _validate_eps(fn: str, eps_low, eps_high) -> None:
  _checks.check_positive(fn, "eps_low", eps_low)
  _checks.check_positive(fn, "eps_high", eps_high)


def _masked(x_BxT: Array, m_BxT: Array, dtype) -> Array:
  """x where counted, 0 elsewhere; junk at masked positions never propagates."""
  return jnp.where(m_BxT, x_BxT.astype(dtype), jnp.zeros((), dtype))


def _lengths(m_BxT: Array, dtype) -> tuple[Array, Array, Array]:
  """(n_B, valid_B, N): counted tokens per row, non-empty rows, and max(#non-empty, 1)."""
  n_B = jnp.sum(m_BxT, axis=-1, dtype=dtype)
  valid_B = n_B > 0
  num_seqs = jnp.maximum(jnp.sum(valid_B, dtype=dtype), 1)
  return n_B, valid_B, num_seqs


def _log_ratio(logp_BxT, old_logp_BxT, m_BxT, dtype) -> tuple[Array, Array]:
  """(masked logp, masked token log-ratio l_it = logp - old_logp)."""
  logp = _masked(logp_BxT, m_BxT, dtype)
  old = _masked(jax.lax.stop_gradient(old_logp_BxT), m_BxT, dtype)
  return logp, logp - old


def _seq_log_ratio(logratio_BxT: Array, n_B: Array) -> Array:
  # Rows with no counted token: 0 / 1 = 0, i.e. s_i = 1.
  return jnp.sum(logratio_BxT, axis=-1) / jnp.maximum(n_B, 1)


def _masked_mean(x, valid, count) -> Array:
  return jnp.sum(jnp.where(valid, x, 0)) / jnp.maximum(count, 1)


def _masked_extreme(reduce, x, valid, fill, count) -> Array:
  # An empty selection reports 1 (the ratio of identical policies), not +-inf.
  return jnp.where(count > 0, reduce(jnp.where(valid, x, fill)), jnp.ones((), x.dtype))


# ------------------------------------------------------------------- public building blocks


def sequence_log_ratio(logp_BxT: Array, old_logp_BxT: Array, mask_BxT: Array) -> Array:
  """Length-normalised sequence log-ratio, log s_i (paper Eq. 7, in log space).

    log s_i = (1/|y_i|) sum_t m_it (log pi_theta(y_it) - log pi_old(y_it))

  so s_i = exp(log s_i) is the geometric mean of the token ratios. A row with no counted
  token gets 0 (s_i = 1).

  Args:
    logp_BxT: log pi_theta of the response tokens.
    old_logp_BxT: log pi_old of the same tokens (treated as a constant).
    mask_BxT: 1 on counted tokens.
  Returns:
    log_s_B, in the compute dtype (at least float32).
  """
  fn = "sequence_log_ratio"
  _validate_tokens(fn, logp_BxT, old_logp_BxT, mask_BxT)
  m = mask_BxT.astype(bool)
  dtype = _compute_dtype(logp_BxT)
  _, logratio_BxT = _log_ratio(logp_BxT, old_logp_BxT, m, dtype)
  n_B, _, _ = _lengths(m, dtype)
  return _seq_log_ratio(logratio_BxT, n_B)


def clipped_surrogate(log_ratio: Array, adv: Array, *, eps_low, eps_high):
  """Elementwise PPO surrogate min(r A, clip(r, 1 - eps_low, 1 + eps_high) A), r = exp(log_ratio).

  Written as an explicit branch so that clipping is exact and gradients are defined:
  an element is clipped iff (A > 0 and r > 1 + eps_high) or (A < 0 and r < 1 - eps_low);
  it then contributes the constant bound * A and exactly zero gradient (its ratio is
  replaced by exp(0) before the product, so a ratio that overflowed cannot leak 0 * inf
  into the gradient). Otherwise it contributes r A with gradient r A d(log_ratio).
  At a tie (r exactly on a bound) the element counts as not clipped.

  Args:
    log_ratio: any shape. adv: same shape.
  Returns:
    (objective, ratio, clipped_low, clipped_high), all of the input's shape.
  """
  ratio = jnp.exp(log_ratio)
  clipped_high = (adv > 0) & (ratio > 1 + eps_high)
  clipped_low = (adv < 0) & (ratio < 1 - eps_low)
  clipped = clipped_high | clipped_low
  live_ratio = jnp.exp(jnp.where(clipped, jnp.zeros_like(log_ratio), log_ratio))
  bound = jnp.where(clipped_high, 1 + eps_high, 1 - eps_low).astype(log_ratio.dtype)
  objective = jnp.where(clipped, bound * adv, live_ratio * adv)
  return objective, jax.lax.stop_gradient(ratio), clipped_low, clipped_high


def aggregate(x_BxT: Array, mask_BxT: Array, *, mode: str = "seq-mean-token-mean",
              token_sum_norm: float | None = None) -> Array:
  """Reduce per-token values to a scalar (GSPO_SPEC section 8).

    "seq-mean-token-mean"     (1/N) sum_i (1/n_i) sum_t m x      (paper, GRPO and GSPO-token)
    "token-mean"              sum m x / sum m                    (DAPO)
    "seq-mean-token-sum-norm" sum m x / (N * token_sum_norm)     (Dr. GRPO; token_sum_norm
                              defaults to T, the padded length: set it to the maximum
                              generation length so the scale is the same every batch)

  N counts non-empty rows only (an empty row has no token to average).
  """
  fn = "aggregate"
  _checks.check_choice(fn, "mode", mode, AGGREGATIONS)
  if token_sum_norm is not None:
    _checks.check_positive(fn, "token_sum_norm", token_sum_norm)
  m = mask_BxT.astype(bool)
  dtype = _compute_dtype(x_BxT)
  x = _masked(x_BxT, m, dtype)
  n_B, valid_B, num_seqs = _lengths(m, dtype)
  if mode == "seq-mean-token-mean":
    return jnp.sum(jnp.sum(x, axis=-1) / jnp.maximum(n_B, 1)) / num_seqs
  if mode == "token-mean":
    return jnp.sum(x) / jnp.maximum(jnp.sum(n_B), 1)
  norm = x_BxT.shape[-1] if token_sum_norm is None else token_sum_norm
  return jnp.sum(x) / (num_seqs * norm)


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
  _validate_tokens(fn, logp_BxT, ref_logp_BxT, mask_BxT)
  _checks.check_choice(fn, "estimator", estimator, KL_ESTIMATORS)
  return _kl(logp_BxT, ref_logp_BxT, mask_BxT.astype(bool), estimator)


def _kl(logp_BxT, ref_logp_BxT, m_BxT, estimator) -> Array:
  dtype = _compute_dtype(logp_BxT)
  logp = _masked(logp_BxT, m_BxT, dtype)
  ref = _masked(jax.lax.stop_gradient(ref_logp_BxT), m_BxT, dtype)
  d = ref - logp  # zero at masked positions, so every estimator is 0 there
  if estimator == "k1":
    return -d
  if estimator == "k2":
    return 0.5 * d * d
  return jnp.exp(d) - d - 1


# -------------------------------------------------------------------------- the losses


def _with_kl(fn, pg_loss, logp_BxT, m_BxT, ref_logp_BxT, kl_coef, kl_estimator, reduce):
  """pg_loss + kl_coef * reduce(kl_BxT); returns (loss, kl metrics)."""
  _checks.check_choice(fn, "kl_estimator", kl_estimator, KL_ESTIMATORS)
  if ref_logp_BxT is None:
    if not (_checks.is_concrete(kl_coef) and np.ndim(kl_coef) == 0 and float(kl_coef) == 0):
      raise ValueError(f"{fn}: kl_coef={kl_coef!r} needs ref_logp_BxT (the reference policy's "
                       "log-probs); pass it, or leave kl_coef at 0")
    return pg_loss, {}
  _checks.check_shape(fn, "ref_logp_BxT", ref_logp_BxT, logp_BxT.shape, "logp_BxT")
  _checks.check_float(fn, "ref_logp_BxT", ref_logp_BxT)
  kl = reduce(_kl(logp_BxT, ref_logp_BxT, m_BxT, kl_estimator))
  return pg_loss + kl_coef * kl, {"kl": jax.lax.stop_gradient(kl)}


def _metrics(*, loss, pg_loss, extra, ratio, ratio_valid, ratio_count, clipped_low_BxT,
             clipped_high_BxT, logratio_BxT, m_BxT, n_B, valid_B) -> Metrics:
  """Flat dict of scalars shared by all losses.

  ratio_*: the ratio that is clipped (s_i for GSPO / GSPO-token, w_it for GRPO), over
  non-empty rows or counted tokens. clip_frac_token_*: fraction of counted tokens whose
  gradient is removed by clipping; clip_frac_seq_*: fraction of non-empty rows with at
  least one clipped token (for GSPO a row is clipped whole). approx_kl: k3 estimate of
  KL(pi_old || pi_theta) per counted token, from samples of pi_old.
  """
  sg = jax.lax.stop_gradient
  dtype = n_B.dtype
  num_tokens = jnp.sum(n_B)
  num_rows = jnp.sum(valid_B, dtype=dtype)
  low, high = clipped_low_BxT & m_BxT, clipped_high_BxT & m_BxT
  tok_frac = lambda c: jnp.sum(c, dtype=dtype) / jnp.maximum(num_tokens, 1)
  seq_frac = lambda c: jnp.sum(jnp.any(c, axis=-1) & valid_B, dtype=dtype) / jnp.maximum(num_rows, 1)
  lr = sg(logratio_BxT)
  approx_kl = jnp.sum(jnp.where(m_BxT, jnp.exp(lr) - 1 - lr, 0)) / jnp.maximum(num_tokens, 1)
  return {
      "loss": sg(loss),
      "pg_loss": sg(pg_loss),
      **extra,
      "clip_frac_token": tok_frac(low | high),
      "clip_frac_token_low": tok_frac(low),
      "clip_frac_token_high": tok_frac(high),
      "clip_frac_seq": seq_frac(low | high),
      "clip_frac_seq_low": seq_frac(low),
      "clip_frac_seq_high": seq_frac(high),
      "ratio_mean": _masked_mean(ratio, ratio_valid, ratio_count),
      "ratio_min": _masked_extreme(jnp.min, ratio, ratio_valid, jnp.inf, ratio_count),
      "ratio_max": _masked_extreme(jnp.max, ratio, ratio_valid, -jnp.inf, ratio_count),
      "approx_kl": approx_kl,
      "num_tokens": num_tokens,
      "num_seqs": num_rows,
  }


def gspo_loss(logp_BxT: Array, old_logp_BxT: Array, adv_B: Array, mask_BxT: Array, *,
              eps_low=3e-4, eps_high=4e-4, ref_logp_BxT: Array | None = None,
              kl_coef=0.0, kl_estimator: str = "k3") -> tuple[Array, Metrics]:
  """Sequence-level GSPO loss (paper Eq. 5, negated):

    L = -(1/N) sum_i min(s_i A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i)
        + kl_coef * KL,        s_i = exp(sequence_log_ratio(...)_i)

  Clipping drops whole responses. Gradient w.r.t. the token log-probs:
  dL/dlogp_it = -m_it a_i s_i A_i / (N n_i), with a_i = 0 for clipped rows.
  Defaults are the paper's clip ranges (3e-4, 4e-4) and no KL (beta = 0, as in the paper).

  Args:
    logp_BxT, old_logp_BxT: log-probs of the response tokens under pi_theta and pi_old.
    adv_B: one advantage per response (use `gspo_token_loss` for per-token advantages).
    mask_BxT: 1 on counted tokens.
    eps_low, eps_high: clip range [1 - eps_low, 1 + eps_high] on s_i.
    ref_logp_BxT, kl_coef, kl_estimator: optional KL(pi_theta || pi_ref) penalty,
      aggregated seq-mean-token-mean.
  Returns:
    (loss, metrics).
  """
  fn = "gspo_loss"
  _validate_tokens(fn, logp_BxT, old_logp_BxT, mask_BxT)
  _validate_eps(fn, eps_low, eps_high)
  if jnp.ndim(adv_B) != 1:
    raise ValueError(f"{fn}: adv_B must have shape (B,) = ({logp_BxT.shape[0]},), one advantage "
                     f"per response; got {jnp.shape(adv_B)}. For per-token advantages use "
                     "gspo_token_loss.")
  _checks.check_shape(fn, "adv_B", adv_B, logp_BxT.shape[:1], "logp_BxT.shape[:1]")
  m = mask_BxT.astype(bool)
  dtype = _compute_dtype(logp_BxT)
  _, logratio_BxT = _log_ratio(logp_BxT, old_logp_BxT, m, dtype)
  n_B, valid_B, num_seqs = _lengths(m, dtype)
  log_s_B = _seq_log_ratio(logratio_BxT, n_B)
  adv = jnp.where(valid_B, adv_B.astype(dtype), 0)
  obj_B, s_B, low_B, high_B = clipped_surrogate(log_s_B, adv, eps_low=eps_low, eps_high=eps_high)
  pg_loss = -jnp.sum(jnp.where(valid_B, obj_B, 0)) / num_seqs
  reduce = lambda kl_BxT: aggregate(kl_BxT, m)
  loss, extra = _with_kl(fn, pg_loss, logp_BxT, m, ref_logp_BxT, kl_coef, kl_estimator, reduce)
  metrics = _metrics(loss=loss, pg_loss=pg_loss, extra=extra, ratio=s_B, ratio_valid=valid_B,
                     ratio_count=jnp.sum(valid_B), clipped_low_BxT=low_B[:, None],
                     clipped_high_BxT=high_B[:, None], logratio_BxT=logratio_BxT, m_BxT=m,
                     n_B=n_B, valid_B=valid_B)
  return loss, metrics


def _token_adv(fn: str, adv, logp_BxT, m_BxT, dtype) -> Array:
  """Accept adv_B or adv_BxT; return a masked adv_BxT."""
  if jnp.ndim(adv) == 1:
    _checks.check_shape(fn, "adv", adv, logp_BxT.shape[:1], "logp_BxT.shape[:1]")
    adv = jnp.broadcast_to(adv[:, None], logp_BxT.shape)
  else:
    _checks.check_shape(fn, "adv", adv, logp_BxT.shape, "logp_BxT (or (B,))")
  return _masked(adv, m_BxT, dtype)


def gspo_token_loss(logp_BxT: Array, old_logp_BxT: Array, adv_BxT: Array, mask_BxT: Array, *,
                    eps_low=3e-4, eps_high=4e-4, ref_logp_BxT: Array | None = None,
                    kl_coef=0.0, kl_estimator: str = "k3") -> tuple[Array, Metrics]:
  """GSPO-token loss (paper Eqs. 13-14, negated):

    s_it = sg[s_i] * pi_theta(y_it) / sg[pi_theta(y_it)]
    L = -(1/N) sum_i (1/n_i) sum_t m_it min(s_it A_it, clip(s_it, 1 - eps_low, 1 + eps_high) A_it)

  s_it has the value s_i and the gradient s_i dlog pi_theta(y_it), so
  dL/dlogp_it = -m_it a_it s_i A_it / (N n_i) (a_it = 0 where clipped). With A_it = A_i
  for every t this equals `gspo_loss` in value and gradient; it differs, and admits
  per-token credit, when advantages vary along the response. Clipping is decided per
  token on the shared value s_i with the sign of A_it.

  Args:
    adv_BxT: per-token advantages; a per-sequence adv_B of shape (B,) is broadcast.
    Other arguments as in `gspo_loss`.
  Returns:
    (loss, metrics).
  """
  fn = "gspo_token_loss"
  _validate_tokens(fn, logp_BxT, old_logp_BxT, mask_BxT)
  _validate_eps(fn, eps_low, eps_high)
  m = mask_BxT.astype(bool)
  dtype = _compute_dtype(logp_BxT)
  adv = _token_adv(fn, adv_BxT, logp_BxT, m, dtype)
  logp, logratio_BxT = _log_ratio(logp_BxT, old_logp_BxT, m, dtype)
  n_B, valid_B, _ = _lengths(m, dtype)
  log_s_B = _seq_log_ratio(logratio_BxT, n_B)
  sg = jax.lax.stop_gradient
  # (logp - sg(logp)) is exactly 0 in value; adding sg(log s) last keeps the forward value
  # bit-identical to log s_i (order noted in SkyRL / verl PR #2775).
  log_s_BxT = (logp - sg(logp)) + sg(log_s_B)[:, None]
  obj_BxT, s_BxT, low, high = clipped_surrogate(log_s_BxT, adv, eps_low=eps_low,
                                                 eps_high=eps_high)
  pg_loss = -aggregate(obj_BxT, m)
  reduce = lambda kl_BxT: aggregate(kl_BxT, m)
  loss, extra = _with_kl(fn, pg_loss, logp_BxT, m, ref_logp_BxT, kl_coef, kl_estimator, reduce)
  del s_BxT  # its value is s_i broadcast; report s_i once per row
  s_B = jax.lax.stop_gradient(jnp.exp(log_s_B))
  metrics = _metrics(loss=loss, pg_loss=pg_loss, extra=extra, ratio=s_B, ratio_valid=valid_B,
                     ratio_count=jnp.sum(valid_B), clipped_low_BxT=low, clipped_high_BxT=high,
                     logratio_BxT=logratio_BxT, m_BxT=m, n_B=n_B, valid_B=valid_B)
  return loss, metrics


def grpo_loss(logp_BxT: Array, old_logp_BxT: Array, adv_B: Array, mask_BxT: Array, *,
              eps_low=0.2, eps_high=0.27, aggregation: str = "seq-mean-token-mean",
              token_sum_norm: float | None = None, ref_logp_BxT: Array | None = None,
              kl_coef=0.0, kl_estimator: str = "k3") -> tuple[Array, Metrics]:
  """Token-level GRPO loss, the paper's baseline (paper Eq. 2, negated):

    w_it = pi_theta(y_it) / pi_old(y_it)
    L = -aggregate_it( min(w_it A_i, clip(w_it, 1 - eps_low, 1 + eps_high) A_i) )

  with `aggregation` one of AGGREGATIONS: "seq-mean-token-mean" (the paper's
  (1/G) sum_i (1/|y_i|) sum_t), "token-mean" (DAPO), "seq-mean-token-sum-norm" (Dr. GRPO,
  normaliser `token_sum_norm`, default T). Default clip ranges are the paper's GRPO
  baseline (0.2, 0.27). No dual-clip.

  Args:
    adv_B: per-sequence advantages (B,); per-token (B, T) advantages are also accepted.
    Other arguments as in `gspo_loss`; the KL term uses the same aggregation.
  Returns:
    (loss, metrics).
  """
  fn = "grpo_loss"
  _validate_tokens(fn, logp_BxT, old_logp_BxT, mask_BxT)
  _validate_eps(fn, eps_low, eps_high)
  _checks.check_choice(fn, "aggregation", aggregation, AGGREGATIONS)
  m = mask_BxT.astype(bool)
  dtype = _compute_dtype(logp_BxT)
  adv = _token_adv(fn, adv_B, logp_BxT, m, dtype)
  _, logratio_BxT = _log_ratio(logp_BxT, old_logp_BxT, m, dtype)
  n_B, valid_B, _ = _lengths(m, dtype)
  obj_BxT, w_BxT, low, high = clipped_surrogate(logratio_BxT, adv, eps_low=eps_low,
                                                 eps_high=eps_high)
  reduce = lambda x_BxT: aggregate(x_BxT, m, mode=aggregation, token_sum_norm=token_sum_norm)
  pg_loss = -reduce(obj_BxT)
  loss, extra = _with_kl(fn, pg_loss, logp_BxT, m, ref_logp_BxT, kl_coef, kl_estimator, reduce)
  metrics = _metrics(loss=loss, pg_loss=pg_loss, extra=extra, ratio=w_BxT, ratio_valid=m,
                     ratio_count=jnp.sum(n_B), clipped_low_BxT=low, clipped_high_BxT=high,
                     logratio_BxT=logratio_BxT, m_BxT=m, n_B=n_B, valid_B=valid_B)
  return loss, metrics


LOSSES = {"gspo": gspo_loss, "gspo_token": gspo_token_loss, "grpo": grpo_loss}

# Each loss's own default hyperparameters (the paper's: GSPO 3e-4 / 4e-4 on the sequence
# ratio, GRPO 0.2 / 0.27 on the token ratios). A config takes these unless it sets them.
LOSS_DEFAULTS = {
    "gspo": {"eps_low": 3e-4, "eps_high": 4e-4},
    "gspo_token": {"eps_low": 3e-4, "eps_high": 4e-4},
    "grpo": {"eps_low": 0.2, "eps_high": 0.27, "aggregation": "seq-mean-token-mean"},
}


def kl_loss(logp_BxT: Array, ref_logp_BxT: Array, mask_BxT: Array, *, estimator: str = "k3",
            aggregation: str = "seq-mean-token-mean") -> tuple[Array, Metrics]:
  """The KL(pi_theta || pi_ref) term a train step adds as `kl_coef * kl`: the per-token
  estimate `kl_penalty` reduced by `aggregate` (use the policy loss's aggregation).

  Returns:
    (kl, {"kl": kl}) with kl a scalar in the compute dtype.
  """
  kl = aggregate(kl_penalty(logp_BxT, ref_logp_BxT, mask_BxT, estimator=estimator), mask_BxT,
                 mode=aggregation)
  return kl, {"kl": jax.lax.stop_gradient(kl)}
