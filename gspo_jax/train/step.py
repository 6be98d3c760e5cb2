"""The train step as pure functions: pi_old (`prepare`), then minibatch updates (`update`).

Shapes: the package legend (docs/shapes.md). A minibatch holds `b` prompts with `g` rows
each: b = B / num_minibatches and g = G when `share_prompts` keeps groups whole, else
b = B*G / num_minibatches single rows (g = 1) drawn from any group.

The model is bound in here and nowhere else in the update path: `graphdef` (its structure)
and `params` (an nnx.State of its nnx.Param variables; a LoRA run's adapters) are merged
inside the traced functions (`lora.model_of`). `gspo_jax.train.programs` compiles each as one
`jax.jit` with its shardings and donation and a `StepConfig` resolved once from the run's
config (`programs.step_config`): this module reads no user config. Adding a batch field
takes one declaration on `Batch` (docs/adding_a_feature.md).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import flax.struct
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from gspo_jax.lora import adapters as lora
from gspo_jax.objectives import losses, row_skip
from gspo_jax.objectives.advantages import group_advantages, turn_advantages
from gspo_jax.objectives.rollout_correction import (
  RolloutCorrectionConfig,
  off_policy_sequence_mask,
  rollout_correction,
)
from gspo_jax.parallel import sharding
from gspo_jax.rollout import dynamic_sampling, lengths
from gspo_jax.rollout.sampling import Rollout
from gspo_jax.rollout.teacher_forcing import response_logprobs
from gspo_jax.train.optim import current_lr
from gspo_jax.utils import rng

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class KLTerm:
  """`coef * losses.kl_loss(..., estimator, aggregation)` added to the loss when the batch
  carries pi_ref's log-probs (the policy loss's aggregation: `LossConfig.kl_aggregation`)."""
  coef: float
  estimator: str = "k3"
  aggregation: str = "seq-mean-token-mean"


@dataclasses.dataclass(frozen=True)
class StepConfig:
  """Everything the train step reads, resolved once per run (`programs.step_config` builds
  it from a `TrainConfig`; research code may build one directly).

  `loss(logp_RxT, old_logp_RxT, adv, mask_RxT, **extra) -> (loss, metrics)` is a loss of
  `losses.LOSSES` with its hyperparameters bound (`functools.partial`); `extra` is
  `token_weights_BxT` when the rollout correction or the off-policy mask weights tokens."""
  loss: Callable[..., tuple[Array, dict[str, Array]]]
  num_minibatches: int = 1
  temperature: float = 1.0          # the sampler's: log-probs are of the tempered policy
  share_prompts: bool = False       # teacher forcing computes each prompt once per group
  old_logp: str = "recompute"       # "sampler": the sampler's log-probs are pi_old
  routing: str = "free"             # MoE: free / track / replay / rollout_replay
  kl: KLTerm | None = None          # with a reference policy (its log-probs in the batch)
  truncation: str = "count"         # count / mask / overlong (`gspo_jax.rollout.lengths`)
  max_new_tokens: int = 0           # T, for truncation="overlong"
  overlong_cache: int = 0
  correction: RolloutCorrectionConfig = RolloutCorrectionConfig()
  # Dynamic sampling: the batch holds more groups than this, the update keeps this many
  # (`dynamic_sampling.select_groups`); 0 = every group of the batch.
  keep_groups: int = 0
  turn_credit: bool = False         # multi-turn: per-turn rewards -> per-token advantages
  length_clip_metrics: bool = False  # clip fractions per length quartile
  row_skip: row_skip.RowSkip | None = None  # backward over live rows only (`gspo_jax.objectives.row_skip`)
  prepare_chunks: int = 1           # prepare's teacher forcing in this many groups of prompts


@flax.struct.dataclass
class TrainState:
  params: Any                     # nnx.State of the policy's nnx.Param variables
  opt_state: optax.OptState
  step: Array                     # RL iterations completed (the loop keeps its own host copy)
  key: Array                      # the run's key; every device stream derives from it (rng.py)


@flax.struct.dataclass
class Batch:
  """One rollout batch, grouped (B, G, ...): what `prepare` returns and `update` consumes
  with the rewards. Rewards are not in it: the host scores them while `prepare` runs."""
  prompts_BxP: Array
  prompt_lens_B: Array
  tokens_BxGxT: Array
  mask_BxGxT: Array
  old_logp_BxGxT: Array
  ref_logp_BxGxT: Array | None = None
  # pi_old's expert choices per MoE layer, (B*G, S, K) int32 each (routing track / replay).
  old_experts: tuple[Array, ...] | None = None
  # The sampler's log-probs next to the recomputed pi_old (0 where masked); present only
  # when the rollout correction or the off-policy mask reads them.
  sampler_logp_BxGxT: Array | None = None
  # Multi-turn episodes with multiturn.credit="turn": the turn of each model token (-1 where
  # it does not count), what per-turn rewards become per-token advantages by.
  turn_BxGxT: Array | None = None


# How each Batch field's leading axes hold rows, for the minibatch split (`split_minibatches`):
#   "group":  (B, G, ...), one entry per response, grouped by prompt (every field not listed);
#   "prompt": (B, ...), one entry per prompt;
#   "flat":   (B*G, ...), one entry per response, row-major.
# Every field is split by rows, so one row sharding covers any Batch (`sharding.rows`).
ROW_LAYOUT = {"prompts_BxP": "prompt", "prompt_lens_B": "prompt", "old_experts": "flat"}


@flax.struct.dataclass
class Minibatch:
  """`b` prompts with `g` responses each (see the module legend) and their advantages."""
  rows: Batch                     # prompts_bxP, tokens_bxgxT, ...; old_experts (b*g, S, K)
  adv_bxg: Array                  # (b, g), or per token (b, g, T) with turn credit
  # Rollout-correction weights (`correction_weights`), 0 where masked; None when off.
  token_weights_bxgxT: Array | None = None


def policy_logprobs(params, graphdef, rows: Batch, cfg: StepConfig, *, replay=None, chunks=1):
  """Teacher-forced log-probs (b, g, T) of `rows` and the RouterInfo (None when chunked)."""
  model = lora.model_of(graphdef, params)
  return response_logprobs(model, rows.prompts_BxP, rows.prompt_lens_B, rows.tokens_BxGxT,
                           temperature=cfg.temperature, replay=replay,
                           share_prompts=cfg.share_prompts, chunks=chunks)


def prepare(params, ref_params, rollout: Rollout, prompts_BxP, lens_B, *, graphdef,
            cfg: StepConfig) -> Batch:
  """pi_old (recomputed, or the sampler's with `old_logp="sampler"`), pi_ref (when ref_params
  is given; both in `cfg.prepare_chunks` groups of prompts) and, when `cfg.routing` is not
  "free", pi_old's expert choices (from the teacher-forced pass, also when its log-probs are
  the sampler's); with "rollout_replay" (R3) the *sampler's* recorded choices
  (`Rollout.experts`), which pi_old's forward replays too. pi_ref routes freely.

  `truncation="mask"` zeroes the mask of truncated rows here, where the sampler's
  `truncated_BxG` is known and before anything reads the mask: the batch's mask is then
  the one record of which rows take part, and the loss (which averages over non-empty
  rows), the KL term, the advantages (`update`) and the metrics all leave them out alike.
  The teacher-forced log-probs do not depend on the mask, so pi_old is unchanged."""
  mask = rollout.mask_BxGxT
  if cfg.truncation == "mask":
    mask = jnp.where(rollout.truncated_BxG[..., None], jnp.zeros((), mask.dtype), mask)
  rows = Batch(prompts_BxP, lens_B, rollout.tokens_BxGxT, mask, rollout.logp_BxGxT)
  old, experts, chunks = rollout.logp_BxGxT, None, cfg.prepare_chunks
  if cfg.routing == "rollout_replay":  # R3: pi_old routes as the sampler did
    old, experts = _rollout_replay_old(params, graphdef, rows, rollout, cfg), rollout.experts
  elif cfg.old_logp == "recompute" or cfg.routing != "free":
    recomputed, router = policy_logprobs(params, graphdef, rows, cfg, chunks=chunks)
    old = recomputed if cfg.old_logp == "recompute" else old
    experts = None if cfg.routing == "free" else router.indices
  ref = None if ref_params is None else policy_logprobs(ref_params, graphdef, rows, cfg,
                                                        chunks=chunks)[0]
  sampler = rollout.logp_BxGxT * mask if cfg.correction.needs_sampler_logp else None
  return rows.replace(old_logp_BxGxT=old * mask, ref_logp_BxGxT=ref, old_experts=experts,
                      sampler_logp_BxGxT=sampler)


def _rollout_replay_old(params, graphdef, rows: Batch, rollout: Rollout, cfg: StepConfig):
  """pi_old under Rollout Routing Replay: the trainer's forward with the sampler's expert
  choices forced (the sampler's own log-probs with `old_logp="sampler"`)."""
  if cfg.old_logp == "sampler":
    return rollout.logp_BxGxT
  return policy_logprobs(params, graphdef, rows, cfg, replay=rollout.experts)[0]


def minibatch_loss(params, graphdef, mb: Minibatch, cfg: StepConfig, forward=None):
  """`cfg.loss` (+ kl.coef * KL when the minibatch carries pi_ref's log-probs) on one
  minibatch, and with `cfg.length_clip_metrics` its clip fractions per length quartile
  (`lengths.clip_by_length`, no gradient). `forward`: pi_theta's (logp, router), if run.

  Token weights (the minibatch's rollout-correction weights, times DeepSeek-V3.2's
  off-policy sequence mask of pi_theta against the sampler with
  `correction.off_policy_threshold`) multiply each token's term of the loss and
  of the KL term alike; a weight of 0 removes the token from both, denominators included."""
  rows = mb.rows
  if rows.ref_logp_BxGxT is not None and cfg.kl is None:
    raise ValueError("the minibatch carries pi_ref's log-probs but StepConfig.kl is None")
  replay = rows.old_experts if cfg.routing in ("replay", "rollout_replay") else None
  logp, router = forward or policy_logprobs(params, graphdef, rows, cfg, replay=replay)
  flat = lambda x: x.reshape(-1, x.shape[-1])
  mask = flat(rows.mask_BxGxT)
  adv = mb.adv_bxg.reshape(mask.shape if mb.adv_bxg.ndim == 3 else (-1,))
  args = (flat(logp), flat(rows.old_logp_BxGxT), adv, mask)
  weights, metrics = token_weights(flat(logp), mb, cfg)
  extra = {} if weights is None else {"token_weights_BxT": weights}
  loss, loss_metrics = cfg.loss(*args, **extra)
  metrics = {**loss_metrics, **metrics}
  if cfg.length_clip_metrics:
    metrics = {**metrics, **lengths.clip_by_length(cfg.loss, *args, **extra)}
  if rows.ref_logp_BxGxT is not None:
    kl, kl_metrics = losses.kl_loss(flat(logp), flat(rows.ref_logp_BxGxT), mask,
                                    estimator=cfg.kl.estimator, aggregation=cfg.kl.aggregation,
                                    **extra)
    loss = loss + cfg.kl.coef * kl
    metrics = {**metrics, **kl_metrics, "loss": jax.lax.stop_gradient(loss)}
  if cfg.routing == "track":
    metrics = {**metrics, "routing_changed": routing_changed(router.indices, rows.old_experts,
                                                             mask)}
  return loss, metrics


def token_weights(logp_RxT: Array, mb: Minibatch, cfg: StepConfig):
  """(weights_RxT or None, metrics): the minibatch's rollout-correction weights, times the
  off-policy sequence mask when `correction.off_policy_threshold` > 0 (it reads
  pi_theta, so it is decided here, per minibatch; `logp_RxT` enters as a constant)."""
  flat = lambda x: x.reshape(-1, x.shape[-1])
  weights = None if mb.token_weights_bxgxT is None else flat(mb.token_weights_bxgxT)
  delta = cfg.correction.off_policy_threshold
  if not delta:
    return weights, {}
  keep, metrics = off_policy_sequence_mask(
      logp_RxT, flat(mb.rows.sampler_logp_BxGxT), mb.adv_bxg.reshape(-1),
      flat(mb.rows.mask_BxGxT), threshold=delta)
  return (keep if weights is None else weights * keep), metrics


def correction_weights(batch: Batch, cfg: StepConfig):
  """(weights_BxGxT, metrics) of `rollout_correction.rollout_correction` over the whole
  batch (the metrics are the iteration's, over all its counted tokens), or (None, {}) when
  `correction.level` is "none". The weights depend on pi_old and the sampler only, so they
  are computed once per iteration, before the minibatches."""
  rc = cfg.correction
  if not rc.weights:
    return None, {}
  flat = lambda x: x.reshape(-1, x.shape[-1])
  weights, metrics = rollout_correction(
      flat(batch.old_logp_BxGxT), flat(batch.sampler_logp_BxGxT), flat(batch.mask_BxGxT),
      level=rc.level, mode=rc.mode, threshold=rc.threshold, threshold_low=rc.threshold_low)
  return weights.reshape(batch.mask_BxGxT.shape), metrics


def routing_changed(new_experts, old_experts, mask_RxT: Array) -> Array:
  """Fraction of (response token, MoE layer) pairs whose top-k expert *set* differs between
  two forwards of the same rows (paper section 5.3: ~10% per update at 48 layers).

  new_experts, old_experts: per MoE layer (R, S, K) int expert indices; mask_RxT: which
  response tokens count. Order within the top k does not matter (sets are compared)."""
  T = mask_RxT.shape[1]
  changed = [jnp.any(jnp.sort(n[:, -T:], -1) != jnp.sort(o[:, -T:], -1), -1)
             for n, o in zip(new_experts, old_experts)]
  per_layer = [jnp.sum(c * mask_RxT) / jnp.maximum(jnp.sum(mask_RxT), 1.0) for c in changed]
  return jnp.mean(jnp.stack(per_layer))


def apply_step(state_parts, mb: Minibatch, *, graphdef, tx, cfg: StepConfig):
  """One optax step on one minibatch; skipped (params and optimiser state unchanged) if the
  loss or the gradient is not finite, or if no token of the minibatch counts (every row
  masked out by `truncation="mask"`: an optax step on a zero gradient would still move the
  parameters by AdamW's momentum, which dropping those rows would not)."""
  params, opt_state = state_parts
  grad_fn = jax.value_and_grad(minibatch_loss, has_aux=True) if cfg.row_skip is None else \
      lambda *a: row_skip.value_and_grad(minibatch_loss, policy_logprobs, ROW_LAYOUT, *a)
  (_, metrics), grads = grad_fn(params, graphdef, mb, cfg)
  grad_norm = optax.tree.norm(grads)
  ok = jnp.isfinite(grad_norm) & jnp.isfinite(metrics["loss"])
  if cfg.truncation == "mask":
    ok = ok & (jnp.sum(mb.rows.mask_BxGxT) > 0)
  if mb.token_weights_bxgxT is not None:  # every token weighted out: as if dropped, too
    ok = ok & (jnp.sum(mb.token_weights_bxgxT) > 0)
  updates, new_opt = tx.update(grads, opt_state, params)
  new_params = optax.apply_updates(params, updates)
  keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(ok, a, b), new, old)
  metrics = {**metrics, "grad_norm": grad_norm, "skipped_updates": 1.0 - ok,
             "learning_rate": current_lr(opt_state)}
  return (keep(new_params, params), keep(new_opt, opt_state)), metrics


def minibatch_order(key: Array, rows: int, group: int) -> Array:
  """A random order of the rows that keeps each run of `group` consecutive rows together
  (group = 1: any order), so equal slices of it hold whole groups."""
  perm = jax.random.permutation(key, rows // group)
  return (perm[:, None] * group + jnp.arange(group)[None, :]).reshape(rows)


def split_minibatches(key: Array, batch: Batch, adv_BxG: Array, cfg: StepConfig,
                      mesh: Mesh | None = None, weights_BxGxT: Array | None = None
                      ) -> Minibatch:
  """Shuffle and split into `num_minibatches` stacked minibatches (leading axis M). With
  `share_prompts` whole groups are shuffled (a group's prompt is then computed once);
  otherwise single rows from any group, each with its own prompt (g = 1).

  A tree map over every field of the batch, the advantages (B, G) or (B, G, T) and the
  token weights: each is taken by its rows as `ROW_LAYOUT` says, so a new Batch field
  reaches the minibatches with nothing else to change."""
  B, G = batch.tokens_BxGxT.shape[:2]
  M = cfg.num_minibatches
  if cfg.share_prompts:
    order = minibatch_order(key, B * G, G).reshape(B, G)[:, 0] // G   # groups
    prompt_of = order
    take = {"prompt": lambda x: x[order],
            "group": lambda x: x[order],
            "flat": lambda x: x.reshape(B, G, *x.shape[1:])[order].reshape(B * G, *x.shape[1:])}
  else:
    order = minibatch_order(key, B * G, 1)                               # rows
    prompt_of = order // G
    take = {"prompt": lambda x: x[prompt_of],
            "group": lambda x: x.reshape(B * G, 1, *x.shape[2:])[order],
            "flat": lambda x: x[order]}

  def split(path, x):
    names = [k.name for k in path if isinstance(k, jax.tree_util.GetAttrKey)]
    kind = ROW_LAYOUT.get(names[-1], "group") if names[0] == "rows" else "group"
    y = take[kind](x)
    return constrain(y.reshape(M, -1, *y.shape[1:]), mesh)

  whole = Minibatch(batch, adv_BxG, weights_BxGxT)
  return jax.tree_util.tree_map_with_path(split, whole)


def constrain(x_MxR: Array, mesh: Mesh | None) -> Array:
  """Each stacked minibatch's rows stay split over the batch mesh axes."""
  if mesh is None:
    return x_MxR
  spec = P(None, sharding.ACTIVATION_RULES["batch"], *([None] * (x_MxR.ndim - 2)))
  return jax.lax.with_sharding_constraint(x_MxR, NamedSharding(mesh, spec))


def update(state: TrainState, batch: Batch, rewards_BxG: Array, *, graphdef, tx,
           cfg: StepConfig, mesh: Mesh | None = None):
  """Group-normalised advantages from the rewards (paper Eq. 6), then `num_minibatches`
  optax steps (a `lax.scan`), all but the first off-policy. Returns the new state and the
  per-minibatch metrics averaged (skipped_updates summed, ratio_min/max over all; with
  `cfg.length_clip_metrics` the clip fractions per length quartile weighted by their
  bins' counts, `lengths.pool_minibatches`).

  `rewards_BxG` are the task's rewards, scored on the host. `cfg.truncation` acts here
  on them, where rewards meet the lengths (the batch's mask, on device) just before they
  become advantages: "overlong" adds DAPO's `lengths.overlong_penalty` of each response's
  length (reported as `overlong_penalty`, its mean; the host's reward metrics stay the
  task's, comparable across truncation modes), and "mask" normalises each group over the
  rows `prepare` left in the batch (non-empty mask). Rewards are not checked for NaN here
  (the loop's host scoring refuses them): a non-finite reward makes its rows' minibatches
  skipped and counted (`apply_step`).

  With `cfg.keep_groups` (DAPO's dynamic sampling, `rollout.oversample`) the batch and
  rewards hold B_s = `rollout.sampled_prompts` groups and the update keeps B =
  `keep_groups` of them, informative first (`dynamic_sampling.select_groups`, after the
  truncation shaping: a group is judged by the rewards its advantages come from);
  `degenerate_groups_frac` and
  `dynamic_fill` report what was sampled and what was filled. With `cfg.correction.level`
  the rollout-correction weights and their metrics (`correction_weights`) are the kept
  batch's.

  Multi-turn episodes with `cfg.turn_credit` (multiturn.credit="turn") pass the per-turn rewards
  rewards_BxGxK instead; each token gets its turn's group-normalised return
  (`advantages.turn_advantages` by `batch.turn_BxGxT`), adv_BxGxT (config.check_multiturn
  refuses the options above that read one advantage per sequence)."""
  if cfg.turn_credit:
    adv_BxGxT = turn_advantages(rewards_BxG, batch.turn_BxGxT)
    return _minibatch_steps(state, batch, adv_BxGxT, {}, graphdef=graphdef, tx=tx, cfg=cfg,
                            mesh=mesh)
  n_BxG = jnp.sum(batch.mask_BxGxT, axis=-1)
  extra = {}
  if cfg.truncation == "overlong":
    penalty_BxG = lengths.overlong_penalty(n_BxG, max_new_tokens=cfg.max_new_tokens,
                                           cache=cfg.overlong_cache)
    rewards_BxG = rewards_BxG + penalty_BxG
    extra["overlong_penalty"] = jnp.mean(penalty_BxG)
  valid_BxG = n_BxG > 0 if cfg.truncation == "mask" else None
  if cfg.keep_groups:  # dynamic sampling: B_s groups in, B kept (static shapes)
    order_B, picked = dynamic_sampling.select_groups(rewards_BxG, valid_BxG, cfg.keep_groups)
    flat = tuple(name for name, kind in ROW_LAYOUT.items() if kind == "flat")
    batch, rewards_BxG = dynamic_sampling.take_groups(batch, order_B, flat), rewards_BxG[order_B]
    valid_BxG = None if valid_BxG is None else valid_BxG[order_B]
    extra.update(picked)
  # No NaN check inside the program (a host callback would keep `update` out of the
  # persistent compile cache): the loop checked the rewards on the host; a NaN reached here
  # makes its group's minibatches non-finite, so they are skipped and counted. The barrier
  # keeps the advantages a separate buffer, as the callback did, so XLA does not fuse their
  # arithmetic into the losses (same rounding as advantages passed in).
  adv_BxG = jax.lax.optimization_barrier(
      group_advantages(rewards_BxG, valid_BxG=valid_BxG, check_nan=False))
  return _minibatch_steps(state, batch, adv_BxG, extra, graphdef=graphdef, tx=tx, cfg=cfg,
                          mesh=mesh)


def _over_live_minibatches(metrics: dict[str, Array]) -> dict[str, Array]:
  """truncation="mask" can empty a minibatch (every response truncated; `apply_step` skips
  it): the averages and the ratio range are over the minibatches that kept a row (none
  kept: 0 rows, ratios [1, 1]), and `empty_minibatches` counts the others."""
  live_M = metrics["num_seqs"] > 0
  n = jnp.maximum(jnp.sum(live_M), 1)
  out = {k: jnp.sum(jnp.where(live_M, v, 0)) / n for k, v in metrics.items()
         if not lengths.is_bin_count(k) and k != "skipped_updates" and v.ndim == 1}
  out["ratio_max"] = jnp.max(jnp.where(live_M, metrics["ratio_max"], 1.0))
  out["ratio_min"] = jnp.min(jnp.where(live_M, metrics["ratio_min"], 1.0))
  out["empty_minibatches"] = jnp.sum(~live_M).astype(jnp.float32)
  return out


def _minibatch_steps(state: TrainState, batch: Batch, adv_BxG: Array, extra, *, graphdef, tx,
                     cfg: StepConfig, mesh):
  """`update` after the advantages: the minibatch scan and its metrics summary."""
  weights_BxGxT, correction = correction_weights(batch, cfg)
  key = rng.device_key(state.key, state.step, "minibatch")
  minibatches = split_minibatches(key, batch, adv_BxG, cfg, mesh, weights_BxGxT)
  step = lambda parts, mb: apply_step(parts, mb, graphdef=graphdef, tx=tx, cfg=cfg)
  (params, opt_state), metrics = jax.lax.scan(step, (state.params, state.opt_state), minibatches)
  summary = {k: jnp.mean(v) for k, v in metrics.items() if not lengths.is_bin_count(k)}
  summary["skipped_updates"] = jnp.sum(metrics["skipped_updates"])
  summary["ratio_max"] = jnp.max(metrics["ratio_max"])
  summary["ratio_min"] = jnp.min(metrics["ratio_min"])
  if "approx_kl" in metrics:  # pi_theta at the update's start against pi_old: the staleness
    summary["approx_kl_first"] = metrics["approx_kl"][0]
  if cfg.truncation == "mask":
    summary.update(_over_live_minibatches(metrics))
  summary.update(lengths.pool_minibatches(metrics), **extra, **correction)
  return state.replace(params=params, opt_state=opt_state, step=state.step + 1), summary
