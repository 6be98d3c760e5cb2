"""Long responses: DAPO's overlong reward shaping, length bins, and the length metrics.

Shapes: the package legend (docs/shapes.md); R the rows of a minibatch, M minibatches,
T = rollout.max_new_tokens (L_max in DAPO's notation).

A response's length |y| is its counted tokens, n = sum_t m_t, EOS included (the sampler's
`lengths_BxG`; verl's DAPO reward counts the same). A truncated response (no EOS within
T tokens) has n = T.

What `TrainConfig.truncation` does with truncated responses, and where:

  "count"     nothing: they are scored and trained on like any other response.
  "mask"      `step.prepare` zeroes their rows of the mask, the one record of which
              tokens are in the batch, before anything reads it: their rows then give
              exactly zero gradient, leave every denominator of the loss (the losses
              average over non-empty rows), and `step.update` leaves them out of their
              group's mean and std (DAPO's overlong filtering; the rest of the batch is
              trained as if they had not been sampled).
  "overlong"  `step.update` adds `overlong_penalty` to the host's rewards before the
              group advantages (DAPO's soft overlong punishment, arXiv 2503.14476 Eq. 13).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array

NUM_BINS = 4       # quartiles of max_new_tokens
_BIN_COUNTS = ("num_tokens", "num_seqs")
# A per-bin clip fraction of the loss, and the count that weights it over minibatches.
_BINNED = {"clip_frac_token": "num_tokens", "clip_frac_seq": "num_seqs"}


def overlong_penalty(lengths_BxG: Array, *, max_new_tokens: int, cache: int) -> Array:
  """DAPO's soft overlong punishment (arXiv 2503.14476 Eq. 13), in tokens:

    r_len = clip(-(|y| - (L_max - L_cache)) / L_cache, -1, 0)

  0 up to L_max - L_cache tokens, then falling linearly to -1 at L_max (every truncated
  response gets -1). It is added to the task's reward before the group normalisation.

  Args:
    lengths_BxG: |y|, counted tokens per response (EOS included), any shape.
    max_new_tokens: L_max. cache: L_cache, 0 < L_cache < L_max.
  Returns:
    r_len, float32, in [-1, 0], the shape of lengths_BxG.
  """
  if not 0 < cache < max_new_tokens:
    raise ValueError(f"overlong_penalty: cache (L_cache = {cache}) must be in "
                     f"(0, max_new_tokens = {max_new_tokens})")
  n = jnp.asarray(lengths_BxG).astype(jnp.float32)
  return jnp.clip(-(n - (max_new_tokens - cache)) / cache, -1.0, 0.0)


def length_bins(lengths: Array, max_new_tokens: int) -> Array:
  """Quartile of max_new_tokens T each length falls in: bin k (0..3) holds the lengths
  in (k T / 4, (k + 1) T / 4], i.e. k = ceil(4 n / T) - 1; n = 0 (an empty row) gets -1.

  Fixed fractions of T rather than quantiles of each batch's lengths: a bin then means
  the same lengths at every iteration and in every run with the same T, so a drift of the
  length distribution shows as responses moving between bins instead of moving the bins.
  """
  n = jnp.asarray(lengths).astype(jnp.int32)
  return jnp.where(n > 0, (NUM_BINS * n - 1) // max_new_tokens, -1)


def length_stats(lengths_BxG: Array, truncated_BxG: Array, max_new_tokens: int
                 ) -> dict[str, Array]:
  """Response-length scalars of a rollout (on device, where the rollout lives):

    response_length, response_length_p90, response_length_max: mean, 90th percentile
      (linear interpolation between order statistics, numpy's default) and max of |y|
      over the B*G responses;
    truncated_frac: fraction of responses that hit max_new_tokens without EOS;
    response_frac_len_q1..q4: fraction of responses in each quartile bin of
      max_new_tokens (`length_bins`: q1 = (0, T/4], ..., q4 = (3T/4, T]).
  """
  n = jnp.asarray(lengths_BxG).astype(jnp.float32).reshape(-1)
  bins = length_bins(n, max_new_tokens)
  out = {"response_length": jnp.mean(n), "response_length_p90": jnp.quantile(n, 0.9),
         "response_length_max": jnp.max(n),
         "truncated_frac": jnp.mean(jnp.asarray(truncated_BxG).astype(jnp.float32))}
  for k in range(NUM_BINS):
    out[f"response_frac_len_q{k + 1}"] = jnp.mean((bins == k).astype(jnp.float32))
  return out


def clip_by_length(loss_fn, logp_RxT: Array, old_logp_RxT: Array, adv, mask_RxT: Array,
                   **loss_kwargs) -> dict[str, Array]:
  """The loss's own clip fractions restricted to the rows of each length bin.

  `loss_fn(logp_RxT, old_logp_RxT, adv, mask_RxT, **loss_kwargs) -> (loss, metrics)` is
  called once per bin with the mask of the other rows zeroed (no gradient flows: logp is
  wrapped in stop_gradient). Clipping is decided per row (GSPO's s_i) or per token
  (GRPO's w_it) and never depends on the other rows, so each bin reports exactly the
  clipping its rows had in the real loss, for any loss that reports `policy_metrics`.

  Returns, for k = 1..4 (the quartile bins of `length_bins`, T = mask_RxT.shape[1]):
    clip_frac_token_len_qk: clipped tokens / counted tokens of the bin's rows;
    clip_frac_seq_len_qk:   rows with a clipped token / the bin's non-empty rows;
    num_tokens_len_qk, num_seqs_len_qk: those denominators (`pool_minibatches` weights
      the fractions by them over minibatches and drops them).
  A bin without rows reports 0 with count 0.
  """
  T = mask_RxT.shape[-1]
  sg = jax.lax.stop_gradient
  bins_R = length_bins(jnp.sum(mask_RxT.astype(jnp.int32), axis=-1), T)
  out = {}
  for k in range(NUM_BINS):
    mask_k = jnp.where((bins_R == k)[:, None], mask_RxT, jnp.zeros((), mask_RxT.dtype))
    _, m = loss_fn(sg(logp_RxT), old_logp_RxT, adv, mask_k, **loss_kwargs)
    for name in (*_BINNED, *_BIN_COUNTS):
      if name in m:
        out[f"{name}_len_q{k + 1}"] = sg(m[name])
  return out


def pool_minibatches(metrics_M: dict[str, Array]) -> dict[str, Array]:
  """Per-bin clip fractions over M minibatches (stacked metrics from the update's scan),
  each weighted by its bin's count in each minibatch: pooled = sum_M frac * count /
  sum_M count (0 for a bin empty in every minibatch). Returns only the pooled fractions;
  the counts are not reported."""
  out = {}
  for k in range(1, NUM_BINS + 1):
    for frac, count in _BINNED.items():
      f, c = metrics_M.get(f"{frac}_len_q{k}"), metrics_M.get(f"{count}_len_q{k}")
      if f is not None and c is not None:
        out[f"{frac}_len_q{k}"] = jnp.sum(f * c) / jnp.maximum(jnp.sum(c), 1)
  return out


def is_bin_count(name: str) -> bool:
  """A per-bin count from `clip_by_length` (pooled away, not reported)."""
  return any(name.startswith(f"{c}_len_q") for c in _BIN_COUNTS)
