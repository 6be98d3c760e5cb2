"""SAPO, CISPO and GMPO: the policy losses researchers compare GSPO with, as pure functions
over arrays, each a few lines of the public blocks of `gspo_jax.objectives.blocks`.

They have the calling convention of `gspo_jax.objectives.losses` (which re-exports them and lists
them in `LOSSES` / `LOSS_DEFAULTS`): `loss_fn(logp_BxT, old_logp_BxT, adv, mask_BxT,
**hyperparameters) -> (loss, metrics)`, metrics from `policy_metrics`. Shapes (docs/shapes.md)
and mask convention as in `gspo_jax.objectives.blocks`: B counts responses (rows), T response tokens, n_i counted tokens
of row i, N non-empty rows (the batch mean is over those N, as in verl/tunix; TRL divides
by all B rows).

`token_weights_BxT` (every loss): constants multiplying each token's term, e.g.
`gspo_jax.objectives.rollout_correction.rollout_correction` weights; a weight of exactly 0 removes the token from
numerators and denominators alike (and from the ratios), see `loss_blocks.weighted_mask`.
A per-response term (sequence SAPO, GMPO) is broadcast to its tokens before weighting, so
under seq-mean-token-mean it is weighted by the row mean of its tokens' weights (TRL's
order: per-token loss times the weights, then aggregation).

Where the peers (TRL 1.16, verl 0.9.1) disagree, the docstrings say which one is followed.
"""

from __future__ import annotations

import jax.numpy as jnp

from gspo_jax.objectives.blocks import (
  AGGREGATIONS,
  Array,
  Metrics,
  Surrogate,
  aggregate,
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
from gspo_jax.utils import checks

__all__ = ["DEFAULTS", "SAPO_LEVELS", "cispo_loss", "gmpo_loss", "sapo_loss", "sapo_seq_loss"]

SAPO_LEVELS = ("token", "sequence")

# The defaults of these losses, merged into `losses.LOSS_DEFAULTS` (the one table a config
# reads) and used as their keyword defaults:
#   SAPO: the paper's tau_pos 1.0, tau_neg 1.05 (verl and TRL likewise).
#   CISPO: eps_low 1.0 (no lower bound: the weight is clipped to [0, 5]) and eps_high 4.0
#     (cap 5, as recommended after MiniMax-M1 by ScaleRL; verl's 1 +- eps convention, TRL's
#     epsilon_high=5.0 is the same cap written as an absolute value); token-mean.
#   GMPO: eps 0.4 / 0.4 in log space (the paper's; its author suggested 0.2 after a
#     reported collapse at 0.4 on a 30B MoE).
DEFAULTS = {
    "sapo": {"tau_pos": 1.0, "tau_neg": 1.05},
    "sapo_seq": {"tau_pos": 1.0, "tau_neg": 1.05},
    "cispo": {"eps_low": 1.0, "eps_high": 4.0, "aggregation": "token-mean"},
    "gmpo": {"eps_low": 0.4, "eps_high": 0.4},
}
_SAPO, _CISPO, _GMPO = DEFAULTS["sapo"], DEFAULTS["cispo"], DEFAULTS["gmpo"]


def check_inputs(fn: str, logp_BxT, old_logp_BxT, adv, mask_BxT, token_weights_BxT, *,
                 per_sequence: str = "") -> None:
  """Shapes of a loss's arrays, checked under its own name. `per_sequence` (the loss to use
  instead) requires adv of shape (B,)."""
  checks.check_token_arrays(fn, mask_BxT, logp_BxT=logp_BxT, old_logp_BxT=old_logp_BxT)
  if per_sequence and jnp.ndim(adv) != 1:
    raise ValueError(f"{fn}: adv must have shape (B,) = ({jnp.shape(logp_BxT)[0]},), one "
                     f"advantage per response; got {jnp.shape(adv)}. For per-token "
                     f"advantages use {per_sequence}.")
  checks.check_rows_or_tokens(fn, "adv", adv, jnp.shape(logp_BxT), "logp_BxT")
  if token_weights_BxT is not None:
    checks.check_shape(fn, "token_weights_BxT", token_weights_BxT, jnp.shape(logp_BxT),
                        "logp_BxT")
    checks.check_float(fn, "token_weights_BxT", token_weights_BxT)


def sapo_loss(logp_BxT: Array, old_logp_BxT: Array, adv: Array, mask_BxT: Array, *,
              tau_pos: float = _SAPO["tau_pos"], tau_neg: float = _SAPO["tau_neg"],
              level: str = "token",
              token_weights_BxT: Array | None = None) -> tuple[Array, Metrics]:
  """Soft Adaptive Policy Optimization (SAPO, arXiv 2511.20347), negated:

    token:     L = -(1/N) sum_i (1/n_i) sum_t m_it f(r_it) A_it,   r_it = exp(l_it)
    sequence:  L = -(1/N) sum_i f(s_i) A_i,                       s_i as in gspo_loss
    f(r) = (4/tau) sigmoid(tau (r - 1)),  tau = tau_pos if A > 0 else tau_neg

  A smooth gate instead of a hard clip: f'(r) = 4 sigmoid (1 - sigmoid) is 1 at r = 1 and
  decays away from it, so no token's gradient is cut off at a boundary. At theta = theta_old
  the gradient is the plain policy gradient -A_it / (N n_i) per token for any tau, and the
  sequence level has GSPO's gradient there. Aggregation is seq-mean-token-mean, fixed (verl
  forces it for SAPO; TRL uses it too). The sequence level is TRL's
  `importance_sampling_level="sequence"` (the gate on s_i; verl has token level only).

  Args:
    adv: adv_B, or adv_BxT at the token level (the sequence level needs adv_B).
    tau_pos, tau_neg: gate temperatures (> 0) for positive / non-positive advantages.
    level: "token" or "sequence".
  Returns:
    (loss, metrics); no clipping (clip fractions 0); ratios r_it, or s_i per row.
  """
  fn = "sapo_loss"
  checks.check_choice(fn, "level", level, SAPO_LEVELS)
  check_inputs(fn, logp_BxT, old_logp_BxT, adv, mask_BxT, token_weights_BxT,
               per_sequence="level='token'" if level == "sequence" else "")
  checks.check_positive(fn, "tau_pos", tau_pos)
  checks.check_positive(fn, "tau_neg", tau_neg)
  m = weighted_mask(mask_BxT, token_weights_BxT)
  l_BxT = token_log_ratio(logp_BxT, old_logp_BxT, m)
  if level == "token":
    log_ratio, adv = l_BxT, token_advantages(adv, m)
  else:
    log_ratio, adv = sequence_log_ratio(logp_BxT, old_logp_BxT, m), _live_rows(adv, m)
  surrogate = soft_gate_surrogate(log_ratio, adv, tau_pos=tau_pos, tau_neg=tau_neg)
  pg_loss = -aggregate(surrogate.objective, m, token_weights_BxT=token_weights_BxT)
  return pg_loss, policy_metrics(pg_loss, surrogate, l_BxT, m)


def sapo_seq_loss(logp_BxT: Array, old_logp_BxT: Array, adv: Array, mask_BxT: Array, *,
                  tau_pos: float = DEFAULTS["sapo_seq"]["tau_pos"],
                  tau_neg: float = DEFAULTS["sapo_seq"]["tau_neg"],
                  token_weights_BxT: Array | None = None) -> tuple[Array, Metrics]:
  """`sapo_loss(..., level="sequence")`: the soft gate on GSPO's s_i (`--set loss=sapo_seq`)."""
  return sapo_loss(logp_BxT, old_logp_BxT, adv, mask_BxT, tau_pos=tau_pos, tau_neg=tau_neg,
                   level="sequence", token_weights_BxT=token_weights_BxT)


def cispo_loss(logp_BxT: Array, old_logp_BxT: Array, adv: Array, mask_BxT: Array, *,
               eps_low: float = _CISPO["eps_low"], eps_high: float = _CISPO["eps_high"],
               aggregation: str = _CISPO["aggregation"], token_sum_norm: float | None = None,
               token_weights_BxT: Array | None = None) -> tuple[Array, Metrics]:
  """Clipped IS-weight Policy Optimization (CISPO, MiniMax-M1, arXiv 2506.13585), negated:

    L = -aggregate_it( sg[clip(r_it, 1 - eps_low, 1 + eps_high)] A_it log pi_theta(y_it) )

  The importance weight is clipped and stop-gradiented, the term is not: every token keeps
  the gradient sg[clip(r)] A dlog pi_theta, including the tokens GRPO's clip zeroes. At
  theta = theta_old (r = 1) the gradient is token-mean GRPO's. The clip bounds use verl's
  1 +- eps convention (eps_high = 4 is TRL's `epsilon_high=5.0`); default aggregation is
  token-mean (MiniMax-M1, verl, TRL), any of AGGREGATIONS may be chosen. The loss value
  involves log pi_theta (verl's and TRL's value); only its gradient is meaningful.

  Args:
    adv: adv_B or adv_BxT. eps_low, eps_high: > 0; eps_low >= 1 means no lower bound.
    aggregation, token_sum_norm: as in `grpo_loss`.
  Returns:
    (loss, metrics); clip fractions count truncated weights (those tokens keep a scaled
    gradient), ratios r_it over counted tokens.
  """
  fn = "cispo_loss"
  check_inputs(fn, logp_BxT, old_logp_BxT, adv, mask_BxT, token_weights_BxT)
  checks.check_choice(fn, "aggregation", aggregation, AGGREGATIONS)
  checks.check_positive(fn, "eps_low", eps_low)
  checks.check_positive(fn, "eps_high", eps_high)
  m = weighted_mask(mask_BxT, token_weights_BxT)
  l_BxT = token_log_ratio(logp_BxT, old_logp_BxT, m)
  # log pi_theta at counted tokens only: junk at masked positions never reaches the product.
  logp_m = jnp.where(jnp.asarray(m).astype(bool), logp_BxT, jnp.zeros((), logp_BxT.dtype))
  surrogate = truncated_weight_surrogate(l_BxT, logp_m, token_advantages(adv, m),
                                         eps_low=eps_low, eps_high=eps_high)
  pg_loss = -aggregate(surrogate.objective, m, mode=aggregation, token_sum_norm=token_sum_norm,
                       token_weights_BxT=token_weights_BxT)
  return pg_loss, policy_metrics(pg_loss, surrogate, l_BxT, m)


def gmpo_loss(logp_BxT: Array, old_logp_BxT: Array, adv: Array, mask_BxT: Array, *,
              eps_low: float = _GMPO["eps_low"], eps_high: float = _GMPO["eps_high"],
              token_weights_BxT: Array | None = None) -> tuple[Array, Metrics]:
  """Geometric-Mean Policy Optimization (GMPO, arXiv 2507.20673), negated:

    l~_it = sign-aware clip of l_it to [-eps_low, eps_high] in log space (`sign_aware_log_clip`)
    rho_i = exp((1/n_i) sum_t m_it l~_it),    L = -(1/N) sum_i rho_i A_i

  The geometric mean of the clipped token ratios replaces GSPO's clipped s_i: clipping is
  per token (a clipped token loses its gradient, the rest of the row keeps it), in log space
  (the ratio range is [e^-eps_low, e^eps_high]). With eps wide enough that nothing clips,
  rho_i = s_i and this is GSPO without clipping. The mean is over the N non-empty rows
  (verl's `geo_mean` divides by all B rows and uses the row mean of token advantages; GMPO
  is defined for one advantage per response, so adv must be adv_B).

  Returns:
    (loss, metrics); clipping per token, ratios s_i (unclipped) per row.
  """
  fn = "gmpo_loss"
  check_inputs(fn, logp_BxT, old_logp_BxT, adv, mask_BxT, token_weights_BxT,
               per_sequence="sapo_loss or cispo_loss")
  checks.check_positive(fn, "eps_low", eps_low)
  checks.check_positive(fn, "eps_high", eps_high)
  m = weighted_mask(mask_BxT, token_weights_BxT)
  l_BxT = token_log_ratio(logp_BxT, old_logp_BxT, m)
  adv_B = _live_rows(adv, m)
  clipped_l_BxT, low, high = sign_aware_log_clip(l_BxT, token_advantages(adv_B, m),
                                                 eps_low=eps_low, eps_high=eps_high)
  # Clipped values at masked positions are 0 (l is 0 there, and 0 is inside the band).
  rho_B = jnp.exp(jnp.sum(clipped_l_BxT, axis=-1) / jnp.maximum(row_lengths(m), 1))
  surrogate = Surrogate(rho_B * adv_B, jnp.exp(sequence_log_ratio(logp_BxT, old_logp_BxT, m)),
                        low, high)
  pg_loss = -aggregate(surrogate.objective, m, token_weights_BxT=token_weights_BxT)
  return pg_loss, policy_metrics(pg_loss, surrogate, l_BxT, m)


def _live_rows(adv_B: Array, mask_BxT: Array) -> Array:
  """adv_B with empty rows zeroed: they take no part in the mean, and junk there stays out
  of the gradient."""
  return jnp.where(row_lengths(mask_BxT) > 0, adv_B, 0)
