"""The gap between the policy that sampled and the trainer's pi_old: importance weights
that correct for it (rollout correction: TIS / MIS / IcePop), and DeepSeek-V3.2's
off-policy sequence mask. Pure functions over arrays returning `(weights_BxT, metrics)`;
the weights go into any loss as `token_weights_BxT` (multiply several by each other to
combine them).

Shapes: the package legend (docs/shapes.md), read as in the loss library
(`gspo_jax.objectives.blocks`: B counts rows, R in the legend); its mask convention, n_i counted
tokens of row i. Both log-prob inputs are constants (`stop_gradient`), and the correction
is decoupled from the policy ratio: GSPO's s_i still uses the recomputed pi_old.

The in-graph sampler (`gspo_jax.rollout.sampling`) reports log-probs before top-p / top-k
filtering (of the temperature-scaled distribution), so they carry no log-of-kept-mass bias
(the trl#6789 pitfall); with filtering on, the tokens come from the filtered distribution
but their reported log-probs do not, and these weights do not correct for the filter.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp

from gspo_jax.objectives.blocks import Array, Metrics, row_lengths, token_log_ratio
from gspo_jax.utils import checks

__all__ = ["LEVELS", "MODES", "RolloutCorrectionConfig", "off_policy_sequence_mask",
           "rollout_correction"]

LEVELS = ("token", "sequence", "geometric")
MODES = ("truncate", "mask")
CORRECTION_LEVELS = ("none", *LEVELS)


@dataclasses.dataclass(frozen=True)
class RolloutCorrectionConfig:
  """Importance weights w = pi_old / pi_sampler on each token of the loss and the KL term
  (`rollout_correction`: TIS truncates, MIS / IcePop masks), for a sampler that
  differs from the trainer (e.g. rollout.sampler_dtype=bfloat16). pi_old is the trainer's
  recomputed forward, so this needs old_logp="recompute". Also DeepSeek-V3.2's off-policy
  sequence mask (`off_policy_sequence_mask`), on its own switch."""
  level: Literal["none", "token", "sequence", "geometric"] = "none"   # "none" = off
  mode: Literal["truncate", "mask"] = "truncate"
  threshold: float = 2.0            # C: truncate at it, or mask above it
  threshold_low: float | None = None   # mode="mask" only: mask below it (None = 1 / threshold)
  # delta: drop responses with A < 0 whose mean log(pi_sampler / pi_theta) exceeds it; 0 = off.
  off_policy_threshold: float = 0.0

  def __post_init__(self):
    checks.check_choice("config", "rollout_correction.level", self.level, CORRECTION_LEVELS)
    checks.check_choice("config", "rollout_correction.mode", self.mode, MODES)
    if not self.threshold > 0:
      raise ValueError(f"rollout_correction.threshold must be > 0; got {self.threshold}")
    if self.threshold_low is not None:
      if self.mode != "mask":
        raise ValueError("rollout_correction.threshold_low applies to rollout_correction."
                         f"mode='mask' (truncation caps from above only); mode is {self.mode!r}")
      if not 0 < self.threshold_low < self.threshold:
        raise ValueError(f"rollout_correction.threshold_low must be in (0, rollout_correction."
                         f"threshold={self.threshold}); got {self.threshold_low}")
    if self.level == "none":
      default = RolloutCorrectionConfig.__dataclass_fields__
      for name in ("mode", "threshold", "threshold_low"):
        if getattr(self, name) != default[name].default:
          raise ValueError(f"rollout_correction.{name} applies when rollout_correction.level "
                           f"is set (token, sequence or geometric); level is 'none'")
    if not self.off_policy_threshold >= 0:
      raise ValueError("rollout_correction.off_policy_threshold must be >= 0 (0 = off); "
                       f"got {self.off_policy_threshold}")

  @property
  def weights(self) -> bool:
    """Whether the update multiplies the loss by rollout-correction weights."""
    return self.level != "none"

  @property
  def needs_sampler_logp(self) -> bool:
    """Whether the batch keeps the sampler's log-probs next to the recomputed pi_old."""
    return self.weights or self.off_policy_threshold > 0


def rollout_correction(old_logp_BxT: Array, sampler_logp_BxT: Array, mask_BxT: Array, *,
                       level: str = "token", mode: str = "truncate", threshold: float = 2.0,
                       threshold_low: float | None = None) -> tuple[Array, Metrics]:
  """Importance weights pi_old / pi_sampler for the tokens the sampler produced:

    log w_it = m_it (log pi_old(y_it) - log pi_sampler(y_it))
    level "token":      w_it                             (TIS / MIS per token)
          "sequence":   exp(sum_t log w_it), on every token of row i   (TRL's and verl's
                        sequence level: the product of the token weights)
          "geometric":  exp((1/n_i) sum_t log w_it), on every token of row i
    mode "truncate":    min(w, threshold)                (TIS; C = 2 as verl and tunix, TRL 3)
         "mask":        w inside [threshold_low, threshold], else 0 (MIS / IcePop: the kept
                        tokens keep their weight, as in IcePop and verl's mask mode;
                        threshold_low defaults to 1 / threshold, verl's default)

  A weight of 0 removes its token (a row, at the sequence levels) from the loss, numerators
  and denominators alike (`loss_blocks.weighted_mask`). When the sampler is pi_old every
  weight is exactly 1. The sequence level multiplies n_i token weights: a small per-token
  mismatch makes it tiny or huge on long responses (it underflows to 0, i.e. masks the row,
  past log w ~ -103 in float32); "geometric" does not have that length dependence.
  Bounds are compared in log space. Weights are 0 at masked positions, and junk there (NaN,
  inf) never reaches them.

  Args:
    old_logp_BxT: the trainer's recomputed log pi_old of the response tokens.
    sampler_logp_BxT: the sampler's log-probs of the same tokens.
    mask_BxT: 1 on counted tokens.
    level, mode: as above. threshold: > 0 (C). threshold_low: mode "mask" only, in
      (0, threshold).
  Returns:
    (weights_BxT, metrics), weights without gradient. Metrics: rollout_corr_kl (k3
    estimate of KL(pi_sampler || pi_old) per counted token, from the sampler's samples),
    rollout_corr_frac (fraction of counted tokens truncated or masked),
    rollout_corr_weight_mean / _max (the weights returned, over counted tokens),
    rollout_corr_log_weight_min / _max (log w before truncation or masking, in log space so
    that they stay finite where the sequence-level product overflows).
  """
  fn = "rollout_correction"
  checks.check_token_arrays(fn, mask_BxT, old_logp_BxT=old_logp_BxT,
                             sampler_logp_BxT=sampler_logp_BxT)
  checks.check_choice(fn, "level", level, LEVELS)
  checks.check_choice(fn, "mode", mode, MODES)
  checks.check_positive(fn, "threshold", threshold)
  if threshold_low is not None:
    if mode != "mask":
      raise ValueError(f"{fn}: threshold_low applies to mode='mask' (truncation caps from "
                       f"above only); mode is {mode!r}")
    checks.check_positive(fn, "threshold_low", threshold_low)
    if _is_number(threshold_low) and _is_number(threshold) and threshold_low >= threshold:
      raise ValueError(f"{fn}: threshold_low must be < threshold; got threshold_low="
                       f"{threshold_low!r}, threshold={threshold!r}")
  sg = jax.lax.stop_gradient
  m = jnp.asarray(mask_BxT).astype(bool)
  log_w_BxT = token_log_ratio(sg(old_logp_BxT), sg(sampler_logp_BxT), m)
  dtype = log_w_BxT.dtype
  n_B = row_lengths(m, dtype)
  if level == "token":
    log_weight = log_w_BxT
  else:
    sum_B = jnp.sum(log_w_BxT, axis=-1)
    row_B = sum_B if level == "sequence" else sum_B / jnp.maximum(n_B, 1)
    log_weight = jnp.broadcast_to(row_B[:, None], m.shape)
  raw = jnp.where(m, jnp.exp(log_weight), 0)
  log_high = jnp.log(jnp.asarray(threshold, dtype))
  if mode == "truncate":
    out = m & (log_weight > log_high)
    weights = jnp.where(out, jnp.asarray(threshold, dtype), raw)
  else:
    low = 1 / jnp.asarray(threshold, dtype) if threshold_low is None else threshold_low
    out = m & ((log_weight > log_high) | (log_weight < jnp.log(jnp.asarray(low, dtype))))
    weights = jnp.where(out, 0, raw)
  num_tokens = jnp.sum(n_B)
  mean = lambda x: jnp.sum(jnp.where(m, x, 0)) / jnp.maximum(num_tokens, 1)
  # An empty selection reports the values of identical policies (weight 1, log-weight 0).
  some = num_tokens > 0
  top = lambda x, empty: jnp.where(some, jnp.max(jnp.where(m, x, -jnp.inf)), empty)
  metrics = {
      "rollout_corr_kl": mean(jnp.exp(log_w_BxT) - 1 - log_w_BxT),
      "rollout_corr_frac": mean(out.astype(dtype)),
      "rollout_corr_weight_mean": jnp.where(some, mean(weights), 1),
      "rollout_corr_weight_max": top(weights, 1),
      "rollout_corr_log_weight_min": -top(-log_weight, 0),
      "rollout_corr_log_weight_max": top(log_weight, 0),
  }
  return sg(weights), {k: sg(v).astype(dtype) for k, v in metrics.items()}


def off_policy_sequence_mask(logp_BxT: Array, sampler_logp_BxT: Array, adv: Array,
                             mask_BxT: Array, *, threshold: float) -> tuple[Array, Metrics]:
  """DeepSeek-V3.2's off-policy sequence mask: drop the responses that have a negative
  advantage and drifted too far from the sampler,

    d_i = (1/n_i) sum_t m_it (log pi_sampler(y_it) - log pi_theta(y_it)),
    keep_i = not (A_i < 0 and d_i > threshold)

  d_i is the per-token KL(pi_sampler || pi_theta) estimate from the sampler's samples, with
  pi_theta the current policy (a constant here; TRL's `off_policy_mask_threshold`, which
  keeps A_i >= 0 or d_i <= threshold, is the same rule). Negative-advantage responses that
  are far off-policy are where a wrong push-down is most harmful; positive ones are kept.

  Args:
    logp_BxT: log pi_theta of the response tokens (stop-gradient applied).
    sampler_logp_BxT: the sampler's log-probs of the same tokens.
    adv: adv_B, one advantage per response.
    mask_BxT: 1 on counted tokens.
    threshold: delta, > 0.
  Returns:
    (weights_BxT, metrics): weights 1 on the counted tokens of kept rows, 0 elsewhere (pass
    as `token_weights_BxT`, or multiply into `rollout_correction` weights). Metrics:
    off_policy_masked_frac (fraction of non-empty rows dropped), off_policy_kl_mean (mean
    d_i over non-empty rows).
  """
  fn = "off_policy_sequence_mask"
  checks.check_token_arrays(fn, mask_BxT, logp_BxT=logp_BxT, sampler_logp_BxT=sampler_logp_BxT)
  checks.check_rank(fn, "adv", adv, 1, "B")
  checks.check_shape(fn, "adv", adv, jnp.shape(logp_BxT)[:1], "logp_BxT.shape[:1]")
  checks.check_positive(fn, "threshold", threshold)
  sg = jax.lax.stop_gradient
  m = jnp.asarray(mask_BxT).astype(bool)
  d_BxT = token_log_ratio(sg(sampler_logp_BxT), sg(logp_BxT), m)
  n_B = row_lengths(m, d_BxT.dtype)
  d_B = jnp.sum(d_BxT, axis=-1) / jnp.maximum(n_B, 1)
  drop_B = (n_B > 0) & (sg(jnp.asarray(adv)) < 0) & (d_B > threshold)
  weights = (m & ~drop_B[:, None]).astype(d_BxT.dtype)
  num_rows = jnp.maximum(jnp.sum(n_B > 0, dtype=d_BxT.dtype), 1)
  metrics = {"off_policy_masked_frac": jnp.sum(drop_B, dtype=d_BxT.dtype) / num_rows,
             "off_policy_kl_mean": jnp.sum(jnp.where(n_B > 0, d_B, 0)) / num_rows}
  return weights, metrics


def _is_number(x) -> bool:
  return isinstance(x, (int, float)) or (checks.is_concrete(x) and jnp.ndim(x) == 0)
