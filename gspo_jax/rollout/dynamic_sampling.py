"""DAPO's dynamic sampling with static shapes (arXiv 2503.14476, section 3.2).

A group whose rewards are all equal has zero advantage everywhere: it adds no gradient
and only dilutes the batch. DAPO samples more prompts until B informative groups are in
hand; a compiled program cannot wait for a data-dependent number of rollouts, so here
every iteration samples a fixed B_s = B + `rollout.oversample` prompts (one sampler
program, one prepare program) and the update keeps exactly B groups (one update program):

  informative_i = (groups with >= 2 valid responses whose rewards are not all equal)
  order = stable_argsort(not informative)[:B]

i.e. the informative groups first, in sampling order, then, if fewer than B are
informative, the degenerate groups in sampling order to fill the batch (they keep their
advantage of exactly 0 and are counted in `dynamic_fill`). Shapes: the package legend
(docs/shapes.md); B_s groups sampled (`Bs` in names), B kept.

Where it runs: inside the update program, on device. The rewards are scored on the host,
but they go to the device for the update anyway, and selecting there keeps the prepare
phase (pi_old, pi_ref) dispatched before scoring and overlapping it (selecting on the host
first would serialise prepare behind the reward functions), keeps the selection global
across hosts in multi-host runs without gathering rewards to one process, and is a stable
argsort of B_s booleans. The price: prepare computes pi_old (and pi_ref) for the
oversampled groups too, B_s / B times its work.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

Array = jax.Array


def informative_groups(rewards_BsxG: Array, valid_BsxG: Array | None = None) -> Array:
  """informative_Bs: the group has at least 2 valid responses and their rewards are not
  all equal, i.e. its group-normalised advantages are not all 0 (`group_advantages`
  returns exactly 0 for the others). valid_BsxG: bool, the responses that take part (None:
  all; `truncation="mask"` passes the non-empty rows)."""
  r = jnp.asarray(rewards_BsxG)
  valid = jnp.ones(r.shape, bool) if valid_BsxG is None else jnp.asarray(valid_BsxG, bool)
  hi = jnp.max(jnp.where(valid, r, -jnp.inf), axis=1)
  lo = jnp.min(jnp.where(valid, r, jnp.inf), axis=1)
  return (jnp.sum(valid, axis=1) >= 2) & (hi > lo)


def select_groups(rewards_BsxG: Array, valid_BsxG: Array | None, keep: int
                  ) -> tuple[Array, dict[str, Array]]:
  """(order_B, metrics): the indices of the `keep` (= B) groups to train on, informative
  ones first in sampling order, then degenerate ones in sampling order (see the module
  docstring). Metrics: degenerate_groups_frac (of the B_s sampled groups, TRL's
  `frac_reward_zero_std`), dynamic_fill (of the B kept groups, the degenerate fill)."""
  Bs = rewards_BsxG.shape[0]
  if not 0 < keep <= Bs:
    raise ValueError(f"select_groups: keep must be in [1, {Bs}] (groups sampled); got {keep}")
  informative_Bs = informative_groups(rewards_BsxG, valid_BsxG)
  order_B = jnp.argsort(~informative_Bs, stable=True)[:keep]
  metrics = {"degenerate_groups_frac": 1.0 - jnp.mean(informative_Bs.astype(jnp.float32)),
             "dynamic_fill": 1.0 - jnp.mean(informative_Bs[order_B].astype(jnp.float32))}
  return order_B, metrics


def take_groups(batch: Any, order_B: Array, flat: tuple[str, ...] = ("old_experts",)) -> Any:
  """The groups `order_B` of a grouped batch (`step.Batch`): every (B_s, ...) field by its
  leading index; the fields named in `flat` hold (B_s*G, ...) rows (each array of a tuple
  field, e.g. the per-MoE-layer expert choices), taken group by group."""
  G = batch.tokens_BxGxT.shape[1]

  def take(name, x):
    if name in flat:
      return x.reshape(-1, G, *x.shape[1:])[order_B].reshape(-1, *x.shape[1:])
    return x[order_B]

  return batch.replace(**{f.name: jax.tree.map(functools.partial(take, f.name),
                                               getattr(batch, f.name))
                          for f in dataclasses.fields(batch)})
