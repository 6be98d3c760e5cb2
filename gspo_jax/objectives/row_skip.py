"""Skipping the backward pass of rows whose gradient is exactly zero (`row_skip.enabled`).

Shapes: the package legend (docs/shapes.md); R = b*g rows of one minibatch, U its units
(rows, or whole groups when `share_prompts` keeps groups together), K a bucket's units.

Without a KL term, a row contributes exactly zero gradient to the policy losses when
  - it is empty (no counted token, n_i = 0: masked out by truncation="mask" or weights),
  - its advantage is zero (every row of a group whose rewards are all equal), or
  - its clip removes all of it: GSPO / LUSPO: s_i clipped on the side of A_i's sign;
    GSPO-token and GRPO: every counted token with A_it != 0 clipped (`clipped_surrogate`);
    GMPO: every counted token clipped in log space (rho_i is then a constant).
SAPO's gate and CISPO's truncated weight leave clipped tokens a gradient, so for them only
the first two apply (`LIVE_ROWS`).

`value_and_grad` (the update's gradient with `StepConfig.row_skip`) runs in two passes:
  1. a forward pass at the current parameters over the whole minibatch: the loss and
     every metric (exactly the full update's), and which rows are live (`live_rows`);
  2. the gradient over a bucket of K units: the live units first (a stable sort), the
     smallest of K = U, ceil(U (n-1)/n), ..., ceil(U/n) that holds them (n =
     `row_skip.buckets`; a `lax.switch`, one compiled backward per size; no live row: an
     exact zero gradient). Inside the bucket
     every row that pass 1 found dead gets mask 0, so it takes no part in the loss, and
     the bucket's loss is rescaled to the minibatch's denominator:
       grad L = grad L_bucket * max(D_bucket, 1) / max(D, 1),
     D = N (non-empty rows; seq-mean-token-mean, seq-mean-token-sum-norm) or the counted
     tokens (token-mean), `denominator`. Dead rows still count in D.
K = U is pass 1's own backward (`jax.vjp`): the plain full gradient, at the full update's
cost. The result equals the full update up to float32 summation order; a row within float32
rounding of a clip bound may be judged on either side by the two passes (as it may by two
compilations of the full update).
The cost: pass 1 keeps its residuals (the full update's memory), and a bucket of K < U
units adds a forward and backward over K units (about K/U of a full update) to pass 1's
forward (about a third): K = U/2 saves about a sixth of the minibatch's step, U/4 about
40% (docs/update_speed.md). Peak memory is pass 1's residuals plus the bucket's.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp

from gspo_jax.objectives import blocks as lb

Array = jax.Array

# The aggregation of the losses without an `aggregation` hyperparameter.
_SEQ_MEAN = "seq-mean-token-mean"


@dataclasses.dataclass(frozen=True)
class RowSkipConfig:
  """`row_skip.*`: skip the backward pass of rows with exactly zero gradient."""
  enabled: bool = False
  # Bucket sizes: n evenly spaced fractions of the minibatch's units, U * k / n for
  # k = n, ..., 1 (rounded up); one compiled backward pass each.
  buckets: int = 4

  def __post_init__(self):
    if not isinstance(self.enabled, bool):
      raise ValueError(f"row_skip.enabled must be a bool; got {self.enabled!r}")
    if isinstance(self.buckets, bool) or not isinstance(self.buckets, int) \
        or self.buckets < 2:
      raise ValueError(f"row_skip.buckets must be an int >= 2 (bucket sizes: the minibatch "
                       f"times k / buckets, k = buckets, ..., 1); got {self.buckets!r}")


@dataclasses.dataclass(frozen=True)
class RowSkip:
  """What the train step reads (`programs.step_config` resolves it from the config): the
  loss's name (a key of `LIVE_ROWS`), its hyperparameters and the number of buckets."""
  loss: str
  hyperparameters: tuple[tuple[str, Any], ...]
  buckets: int = 4

  @property
  def kwargs(self) -> dict[str, Any]:
    return dict(self.hyperparameters)

  @property
  def aggregation(self) -> str:
    return self.kwargs.get("aggregation", _SEQ_MEAN)


def refusals(*, kl_coef: float, off_policy_threshold: float) -> list[str]:
  """The settings that give dead rows a gradient or decide the rows from pi_theta again
  inside the backward pass (what `TrainConfig` refuses with the skip on, by field name)."""
  out = []
  if kl_coef:
    out.append(f"loss.kl_coef={kl_coef} (the KL term gives every row a gradient)")
  if off_policy_threshold:
    out.append(f"rollout_correction.off_policy_threshold={off_policy_threshold} (its mask "
               "is decided from pi_theta inside each pass)")
  return out


def note(loss: str) -> str:
  """What the skip covers under `loss` (logged once when a run starts with it)."""
  if loss in ("sapo", "sapo_seq", "cispo"):
    return (f"row_skip: loss.name={loss!r} gives clipped tokens a gradient: only rows with "
            "zero advantage or no counted token are skipped")
  return (f"row_skip: rows of loss.name={loss!r} with zero advantage, no counted token, "
          "or every token clipped skip the backward pass")


def _clip_live(l_RxT, adv_RxT, m_RxT, eps_low, eps_high):
  """Counted tokens with a nonzero advantage whose `clipped_surrogate` clip leaves them a
  gradient (l_RxT: the log-ratio each token's clip is decided on)."""
  s = lb.clipped_surrogate(l_RxT, adv_RxT, eps_low=eps_low, eps_high=eps_high)
  return m_RxT & (adv_RxT != 0) & ~(s.clipped_low | s.clipped_high)


def _gspo(logp, old, adv, m, *, eps_low, eps_high, **_):
  log_s_R = lb.sequence_log_ratio(logp, old, m)
  log_s_RxT = jnp.broadcast_to(log_s_R[:, None], m.shape)
  return _clip_live(log_s_RxT, lb.token_advantages(adv, m), m, eps_low, eps_high)


def _grpo(logp, old, adv, m, *, eps_low, eps_high, **_):
  return _clip_live(lb.token_log_ratio(logp, old, m), lb.token_advantages(adv, m), m,
                    eps_low, eps_high)


def _gmpo(logp, old, adv, m, *, eps_low, eps_high, **_):
  adv_RxT = lb.token_advantages(adv, m)
  _, low, high = lb.sign_aware_log_clip(lb.token_log_ratio(logp, old, m), adv_RxT,
                                        eps_low=eps_low, eps_high=eps_high)
  return m & (adv_RxT != 0) & ~(low | high)


def _advantage_only(logp, old, adv, m, **_):
  del logp, old
  return m & (lb.token_advantages(adv, m) != 0)


# Per loss: (logp_RxT, old_logp_RxT, adv_R or adv_RxT, m_RxT bool, **hyperparameters) ->
# live_RxT, the tokens through which the row can have a gradient. A row is live iff any.
LIVE_ROWS: dict[str, Callable[..., Array]] = {
    "gspo": _gspo, "luspo": _gspo, "gspo_token": _gspo, "grpo": _grpo, "gmpo": _gmpo,
    "sapo": _advantage_only, "sapo_seq": _advantage_only, "cispo": _advantage_only,
}


def live_rows(loss: str, logp_RxT: Array, old_logp_RxT: Array, adv: Array, mask_RxT: Array,
              token_weights_RxT: Array | None = None, **hyperparameters) -> Array:
  """live_R (bool): the rows whose loss term under `loss` can have a nonzero gradient at
  these log-probs; every other row's gradient is exactly zero. `adv`: adv_R or adv_RxT;
  `token_weights_RxT`: weights of 0 remove tokens (`loss_blocks.weighted_mask`)."""
  m = jnp.asarray(lb.weighted_mask(mask_RxT, token_weights_RxT)).astype(bool)
  live_RxT = LIVE_ROWS[loss](logp_RxT, old_logp_RxT, adv, m, **hyperparameters)
  return jnp.any(live_RxT, axis=-1)


def denominator(mask_RxT: Array, aggregation: str, token_weights_RxT: Array | None = None):
  """D of `loss_blocks.aggregate` for these rows: N (rows with a counted token) or, for
  token-mean, the counted tokens; at least 1 (as `aggregate` divides)."""
  n_R = lb.row_lengths(lb.weighted_mask(mask_RxT, token_weights_RxT))
  d = jnp.sum(n_R) if aggregation == "token-mean" else jnp.sum(n_R > 0, dtype=jnp.float32)
  return jnp.maximum(d, 1.0)


def bucket_sizes(units: int, buckets: int) -> tuple[int, ...]:
  """(U, ceil(U (n-1)/n), ..., ceil(U/n)) for n buckets, duplicates dropped (small
  minibatches)."""
  sizes = [-(-units * k // buckets) for k in range(buckets, 0, -1)]
  return tuple(dict.fromkeys(sizes))


def _flat(x):
  return x.reshape(-1, x.shape[-1])


def _take_units(mb, idx_K: Array, layout: dict[str, str]):
  """The minibatch's units idx_K (a tree map: every field by its rows, `step.ROW_LAYOUT`;
  "flat" fields hold b*g rows, taken as b units of g)."""
  b, g = mb.rows.tokens_BxGxT.shape[:2]

  def take(path, x):
    names = [k.name for k in path if isinstance(k, jax.tree_util.GetAttrKey)]
    if names[0] == "rows" and layout.get(names[-1], "group") == "flat":
      return x.reshape(b, g, *x.shape[1:])[idx_K].reshape(-1, *x.shape[1:])
    return x[idx_K]
  return jax.tree_util.tree_map_with_path(take, mb)


def value_and_grad(loss_fn, forward_fn, layout: dict[str, str], params, graphdef, mb, cfg):
  """((loss, metrics), grads) as `jax.value_and_grad(loss_fn, has_aux=True)` gives them for
  the minibatch `mb`, with the backward pass over the live rows' bucket (module
  docstring). Called by `step.apply_step` when `cfg.row_skip` is set, with
  loss_fn = `step.minibatch_loss`, forward_fn = `step.policy_logprobs` and
  layout = `step.ROW_LAYOUT`. Adds the metrics `row_skip_dead_frac` (rows with zero
  gradient) and `row_skip_saved_frac` (rows left out of the backward pass), each a share
  of the minibatch's rows."""
  skip: RowSkip = cfg.row_skip
  rows = mb.rows
  replay = rows.old_experts if cfg.routing in ("replay", "rollout_replay") else None

  def full(p):  # pass 1, its residuals kept for the full-size branch's backward
    forward = forward_fn(p, graphdef, rows, cfg, replay=replay)
    loss, metrics = loss_fn(p, graphdef, mb, cfg, forward)
    return loss, (metrics, jax.lax.stop_gradient(forward[0]))

  loss, full_vjp, (metrics, logp_bxgxT) = jax.vjp(full, params, has_aux=True)
  b, g = rows.tokens_BxGxT.shape[:2]
  adv = mb.adv_bxg.reshape((b * g, -1) if mb.adv_bxg.ndim == 3 else (-1,))
  weights = None if mb.token_weights_bxgxT is None else _flat(mb.token_weights_bxgxT)
  mask_RxT = _flat(rows.mask_BxGxT)
  live_R = live_rows(skip.loss, _flat(logp_bxgxT), _flat(rows.old_logp_BxGxT), adv, mask_RxT,
                     weights, **{k: v for k, v in skip.kwargs.items() if k != "aggregation"})
  live_bxg = live_R.reshape(b, g)
  live_U = jnp.any(live_bxg, axis=1) if g > 1 else live_bxg[:, 0]
  units = live_U.shape[0]
  sizes = bucket_sizes(units, skip.buckets)
  order_U = jnp.argsort(~live_U, stable=True)           # live units first, in order
  d_full = denominator(mask_RxT, skip.aggregation, weights)

  def bucket_grad(k):
    if k == len(sizes):  # no live row: the gradient is exactly zero
      return jax.tree.map(jnp.zeros_like, params)
    if k == 0:           # every size: pass 1's own backward, the plain full gradient
      return full_vjp(jnp.ones_like(loss))[0]
    idx_K = order_U[:sizes[k]]
    sub = _take_units(mb, idx_K, layout)
    mask_KxGxT = sub.rows.mask_BxGxT
    mask_KxGxT = jnp.where(live_bxg[idx_K][..., None], mask_KxGxT,
                           jnp.zeros((), mask_KxGxT.dtype))
    sub = sub.replace(rows=sub.rows.replace(mask_BxGxT=mask_KxGxT))
    w = None if sub.token_weights_bxgxT is None else _flat(sub.token_weights_bxgxT)
    scale = denominator(_flat(sub.rows.mask_BxGxT), skip.aggregation, w) / d_full
    return jax.grad(lambda p: loss_fn(p, graphdef, sub, cfg)[0] * scale)(params)

  count = jnp.sum(live_U)
  fits = [count <= s for s in sizes]                     # sizes fall: True, then False
  branch = jnp.where(count == 0, len(sizes), jnp.sum(jnp.stack(fits)) - 1)
  grads = jax.lax.switch(branch, [lambda k=k: bucket_grad(k) for k in range(len(sizes) + 1)])
  used_U = jnp.asarray(sizes + (0,), jnp.float32)[branch]
  metrics = {**metrics, "row_skip_dead_frac": 1.0 - jnp.mean(live_R.astype(jnp.float32)),
             "row_skip_saved_frac": 1.0 - used_U / units}
  return (loss, metrics), grads
