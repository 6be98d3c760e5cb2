"""GSPO, GSPO-token, GRPO and length-unbiased GSPO objectives, the KL term, and the registry
of every policy loss (`LOSSES`, `LOSS_DEFAULTS`; SAPO, CISPO and GMPO live in
`gspo_jax.objectives.variants` and are re-exported here): pure functions over arrays.

Paper: Zheng et al., "Group Sequence Policy Optimization", arXiv:2507.18071 (v2).

Each loss is a few lines over the public blocks of `gspo_jax.objectives.blocks` (re-exported
here, with the same shape legend and mask conventions), so a variant can be assembled
the same way:

    log_s_B = sequence_log_ratio(logp_BxT, old_logp_BxT, mask_BxT)
    surrogate = clipped_surrogate(log_s_B, adv_B, eps_low=3e-4, eps_high=4e-4)
    pg_loss = -aggregate(surrogate.objective, mask_BxT)                    # = gspo_loss
    metrics = policy_metrics(pg_loss, surrogate,
                             token_log_ratio(logp_BxT, old_logp_BxT, mask_BxT), mask_BxT)

Every loss is called `LOSSES[name](logp_BxT, old_logp_BxT, adv, mask_BxT, **hyperparameters)`
and returns `(loss, metrics)`: the loss to *minimise* (the negated objective) and a flat
dict of scalars (`policy_metrics`). `LOSS_DEFAULTS[name]` holds each loss's default
hyperparameters, which are also its keyword defaults. Every loss also takes
`token_weights_BxT=None`: constants multiplying each token's term (rollout-correction
weights, `gspo_jax.objectives.rollout_correction`); a weight of exactly 0 removes the token from numerators and
denominators alike (`weighted_mask`). The KL penalty is not part of the losses: a train
step adds `kl_coef * kl_loss(logp_BxT, ref_logp_BxT, mask_BxT, ...)[0]` (the paper uses
none).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from gspo_jax.objectives import variants
from gspo_jax.objectives.blocks import (
  AGGREGATIONS,
  KL_ESTIMATORS,
  Array,
  Metrics,
  ObjectiveWarning,
  Surrogate,
  aggregate,
  clipped_surrogate,
  kl_penalty,
  policy_metrics,
  row_lengths,
  sequence_log_ratio,
  sign_aware_log_clip,
  soft_gate_surrogate,
  token_advantages,
  token_log_ratio,
  truncated_weight_surrogate,
  weighted_mask,
)
from gspo_jax.objectives.rollout_correction import off_policy_sequence_mask, rollout_correction
from gspo_jax.objectives.variants import cispo_loss, gmpo_loss, sapo_loss, sapo_seq_loss
from gspo_jax.utils import checks

__all__ = [
    "AGGREGATIONS", "KL_ESTIMATORS", "LOSSES", "LOSS_DEFAULTS", "ObjectiveWarning", "Surrogate",
    "aggregate", "cispo_loss", "clipped_surrogate", "gmpo_loss", "grpo_loss", "gspo_loss",
    "gspo_token_loss", "kl_loss", "kl_penalty", "luspo_loss", "off_policy_sequence_mask",
    "policy_metrics", "rollout_correction", "row_lengths", "sapo_loss", "sapo_seq_loss",
    "sequence_log_ratio", "sign_aware_log_clip", "soft_gate_surrogate", "token_advantages",
    "token_log_ratio", "truncated_weight_surrogate", "weighted_mask",
]

# Each loss's own default hyperparameters (the paper's: GSPO 3e-4 / 4e-4 on the sequence
# ratio, GRPO 0.2 / 0.27 on the token ratios; LUSPO is GSPO's; SAPO, CISPO and GMPO in
# `variants.DEFAULTS`), and the keyword defaults of the loss functions. A config takes
# these unless it sets them.
LOSS_DEFAULTS = {
    "gspo": {"eps_low": 3e-4, "eps_high": 4e-4},
    "gspo_token": {"eps_low": 3e-4, "eps_high": 4e-4},
    "grpo": {"eps_low": 0.2, "eps_high": 0.27, "aggregation": "seq-mean-token-mean"},
    "luspo": {"eps_low": 3e-4, "eps_high": 4e-4},
    **variants.DEFAULTS,
}
_GSPO, _GSPO_TOKEN, _GRPO, _LUSPO = (LOSS_DEFAULTS[k] for k in
                                     ("gspo", "gspo_token", "grpo", "luspo"))


def _check_inputs(fn: str, logp_BxT, old_logp_BxT, adv, mask_BxT, eps_low, eps_high,
                  token_weights_BxT=None, per_sequence: str = "") -> None:
  """Checked here too, so that an error names the loss that was called."""
  variants.check_inputs(fn, logp_BxT, old_logp_BxT, adv, mask_BxT, token_weights_BxT,
                              per_sequence=per_sequence)
  checks.check_positive(fn, "eps_low", eps_low)
  checks.check_positive(fn, "eps_high", eps_high)


def gspo_loss(logp_BxT: Array, old_logp_BxT: Array, adv: Array, mask_BxT: Array, *,
              eps_low: float = _GSPO["eps_low"], eps_high: float = _GSPO["eps_high"],
              length_weighting: bool = False,
              token_weights_BxT: Array | None = None) -> tuple[Array, Metrics]:
  """Sequence-level GSPO loss (paper Eq. 5, negated):

    L = -(1/N) sum_i min(s_i A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i),
    s_i = exp(sequence_log_ratio(...)_i)

  Clipping drops whole responses. Gradient w.r.t. the token log-probs:
  dL/dlogp_it = -m_it a_i s_i A_i / (N n_i), with a_i = 0 for clipped rows.
  Defaults are the paper's clip ranges (3e-4, 4e-4).

  length_weighting=True is length-unbiased GSPO (LUSPO, arXiv 2602.05261): each response's
  term is weighted by its length, L = -(1/N) sum_i n_i min(...)_i, so every token of a row
  gets the gradient -a_i s_i A_i / N whatever the row's length, where GSPO's carries 1/n_i
  (LUSPO reports that GSPO drifts toward shorter responses). Scale: the mean over the N non-empty rows of n_i times GSPO's
  term, as TRL's `loss_type="luspo"` computes it (up to TRL's division by all B rows);
  the loss and gradient are larger than GSPO's by about the mean response length, so
  the learning rate that suits GSPO is about that factor too large for it.

  With `token_weights_BxT` the row's term is broadcast to its tokens and weighted per token:
  -(1/N) sum_i (1/n_i) sum_t w_it min(...)_i (times n_i with length_weighting).

  Args:
    logp_BxT, old_logp_BxT: log-probs of the response tokens under pi_theta and pi_old
      (old is a constant).
    adv: adv_B, one advantage per response (use `gspo_token_loss` for per-token ones).
    mask_BxT: 1 on counted tokens.
    eps_low, eps_high: clip range [1 - eps_low, 1 + eps_high] on s_i.
  Returns:
    (loss, metrics); metrics as in `policy_metrics`, ratios and clipping of s_i.
  """
  fn = "gspo_loss"
  _check_inputs(fn, logp_BxT, old_logp_BxT, adv, mask_BxT, eps_low, eps_high,
                token_weights_BxT, per_sequence="gspo_token_loss")
  m = weighted_mask(mask_BxT, token_weights_BxT)
  log_s_B = sequence_log_ratio(logp_BxT, old_logp_BxT, m)
  # An empty row takes no part in the mean; zeroing its advantage also keeps junk there
  # out of the gradient.
  n_B = row_lengths(m)
  adv_B = jnp.where(n_B > 0, adv, 0)
  surrogate = clipped_surrogate(log_s_B, adv_B, eps_low=eps_low, eps_high=eps_high)
  objective_B = surrogate.objective * n_B if length_weighting else surrogate.objective
  pg_loss = -aggregate(objective_B, m, token_weights_BxT=token_weights_BxT)
  l_BxT = token_log_ratio(logp_BxT, old_logp_BxT, m)
  return pg_loss, policy_metrics(pg_loss, surrogate, l_BxT, m)


def luspo_loss(logp_BxT: Array, old_logp_BxT: Array, adv: Array, mask_BxT: Array, *,
               eps_low: float = _LUSPO["eps_low"], eps_high: float = _LUSPO["eps_high"],
               token_weights_BxT: Array | None = None) -> tuple[Array, Metrics]:
  """`gspo_loss(..., length_weighting=True)`, length-unbiased GSPO (`--set loss=luspo`)."""
  _check_inputs("luspo_loss", logp_BxT, old_logp_BxT, adv, mask_BxT, eps_low, eps_high,
                token_weights_BxT, per_sequence="gspo_token_loss")
  return gspo_loss(logp_BxT, old_logp_BxT, adv, mask_BxT, eps_low=eps_low, eps_high=eps_high,
                   length_weighting=True, token_weights_BxT=token_weights_BxT)


def gspo_token_loss(logp_BxT: Array, old_logp_BxT: Array, adv: Array, mask_BxT: Array, *,
                    eps_low: float = _GSPO_TOKEN["eps_low"],
                    eps_high: float = _GSPO_TOKEN["eps_high"],
                    token_weights_BxT: Array | None = None) -> tuple[Array, Metrics]:
  """GSPO-token loss (paper Eqs. 13-14, negated):

    s_it = sg[s_i] * pi_theta(y_it) / sg[pi_theta(y_it)]
    L = -(1/N) sum_i (1/n_i) sum_t m_it min(s_it A_it, clip(s_it, 1 - eps_low, 1 + eps_high) A_it)

  s_it has the value s_i and the gradient s_i dlog pi_theta(y_it), so
  dL/dlogp_it = -m_it a_it s_i A_it / (N n_i) (a_it = 0 where clipped). With A_it = A_i
  for every t this equals `gspo_loss` in value and gradient; it differs, and admits
  per-token credit, when advantages vary along the response. Clipping is decided per
  token on the shared value s_i with the sign of A_it.

  Args:
    adv: per-token advantages adv_BxT, or per-sequence adv_B (broadcast along each row).
    Other arguments as in `gspo_loss`.
  Returns:
    (loss, metrics); ratios are s_i, one per non-empty row, clipping is per token.
  """
  _check_inputs("gspo_token_loss", logp_BxT, old_logp_BxT, adv, mask_BxT, eps_low, eps_high,
                token_weights_BxT)
  sg = jax.lax.stop_gradient
  mask_BxT = weighted_mask(mask_BxT, token_weights_BxT)
  l_BxT = token_log_ratio(logp_BxT, old_logp_BxT, mask_BxT)
  log_s_B = sequence_log_ratio(logp_BxT, old_logp_BxT, mask_BxT)
  # l - sg(l) is exactly 0 in value and has the gradient of log pi_theta (old is a
  # constant); adding sg(log s) last keeps the forward value bit-identical to log s_i
  # (order noted in SkyRL / verl PR #2775).
  log_s_BxT = (l_BxT - sg(l_BxT)) + sg(log_s_B)[:, None]
  surrogate = clipped_surrogate(log_s_BxT, token_advantages(adv, mask_BxT), eps_low=eps_low,
                                eps_high=eps_high)
  pg_loss = -aggregate(surrogate.objective, mask_BxT, token_weights_BxT=token_weights_BxT)
  # s_it has the value s_i: report it once per row, as gspo_loss does.
  return pg_loss, policy_metrics(pg_loss, surrogate, l_BxT, mask_BxT, ratio=jnp.exp(log_s_B))


def grpo_loss(logp_BxT: Array, old_logp_BxT: Array, adv: Array, mask_BxT: Array, *,
              eps_low: float = _GRPO["eps_low"], eps_high: float = _GRPO["eps_high"],
              aggregation: str = _GRPO["aggregation"],
              token_sum_norm: float | None = None,
              token_weights_BxT: Array | None = None) -> tuple[Array, Metrics]:
  """Token-level GRPO loss, the paper's baseline (paper Eq. 2, negated):

    w_it = pi_theta(y_it) / pi_old(y_it) = exp(token_log_ratio(...)_it)
    L = -aggregate_it( min(w_it A_it, clip(w_it, 1 - eps_low, 1 + eps_high) A_it) )

  with `aggregation` one of AGGREGATIONS: "seq-mean-token-mean" (the paper's
  (1/G) sum_i (1/|y_i|) sum_t), "token-mean" (DAPO), "seq-mean-token-sum-norm" (Dr. GRPO,
  normaliser `token_sum_norm`, default T). Default clip ranges are the paper's GRPO
  baseline (0.2, 0.27). No dual-clip.

  Args:
    adv: per-sequence adv_B (the paper's A_it = A_i), or per-token adv_BxT.
    Other arguments as in `gspo_loss`.
  Returns:
    (loss, metrics); ratios and clipping are those of w_it over counted tokens.
  """
  fn = "grpo_loss"
  _check_inputs(fn, logp_BxT, old_logp_BxT, adv, mask_BxT, eps_low, eps_high,
                token_weights_BxT)
  checks.check_choice(fn, "aggregation", aggregation, AGGREGATIONS)
  mask_BxT = weighted_mask(mask_BxT, token_weights_BxT)
  l_BxT = token_log_ratio(logp_BxT, old_logp_BxT, mask_BxT)
  surrogate = clipped_surrogate(l_BxT, token_advantages(adv, mask_BxT), eps_low=eps_low,
                                eps_high=eps_high)
  pg_loss = -aggregate(surrogate.objective, mask_BxT, mode=aggregation,
                       token_sum_norm=token_sum_norm, token_weights_BxT=token_weights_BxT)
  return pg_loss, policy_metrics(pg_loss, surrogate, l_BxT, mask_BxT)


LOSSES = {"gspo": gspo_loss, "gspo_token": gspo_token_loss, "grpo": grpo_loss,
          "luspo": luspo_loss, "sapo": sapo_loss, "sapo_seq": sapo_seq_loss,
          "cispo": cispo_loss, "gmpo": gmpo_loss}


def kl_loss(logp_BxT: Array, ref_logp_BxT: Array, mask_BxT: Array, *, estimator: str = "k3",
            aggregation: str = "seq-mean-token-mean",
            token_sum_norm: float | None = None,
            token_weights_BxT: Array | None = None) -> tuple[Array, Metrics]:
  """The KL(pi_theta || pi_ref) term a train step adds as `kl_coef * kl`:

    kl = aggregate(kl_penalty(logp_BxT, ref_logp_BxT, mask_BxT, estimator), mask_BxT,
                   mode=aggregation, token_sum_norm=token_sum_norm)

  `token_weights_BxT`: pass the policy loss's to weight (and drop) the same tokens (TRL
  multiplies the KL term by its importance weights too).

  Pass the policy loss's aggregation (and token_sum_norm); GSPO and GSPO-token aggregate
  seq-mean-token-mean. `ref_logp_BxT` is a constant. The paper's objectives have no KL
  term (kl_coef = 0).

  Returns:
    (kl, {"kl": kl}) with kl a scalar in the compute dtype.
  """
  fn = "kl_loss"
  checks.check_token_arrays(fn, mask_BxT, logp_BxT=logp_BxT, ref_logp_BxT=ref_logp_BxT)
  checks.check_choice(fn, "estimator", estimator, KL_ESTIMATORS)
  checks.check_choice(fn, "aggregation", aggregation, AGGREGATIONS)
  mask_BxT = weighted_mask(mask_BxT, token_weights_BxT)
  kl_BxT = kl_penalty(logp_BxT, ref_logp_BxT, mask_BxT, estimator=estimator)
  kl = aggregate(kl_BxT, mask_BxT, mode=aggregation, token_sum_norm=token_sum_norm,
                 token_weights_BxT=token_weights_BxT)
  return kl, {"kl": jax.lax.stop_gradient(kl)}
