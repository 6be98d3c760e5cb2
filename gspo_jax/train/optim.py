"""The optimisers of a run (the `optim` config group, `config.OptimConfig`, sets the RL one).

    make_optimizer(OptimConfig) -> the RL update's AdamW (global-norm clip, schedule)
    sft_optimizer(steps, learning_rate) -> the cold start's AdamW
    current_lr(opt_state) -> the learning rate the next step uses (a metric)
"""

from __future__ import annotations

from typing import Any

import jax
import optax

from gspo_jax.config import OptimConfig

Array = jax.Array


def make_optimizer(cfg: OptimConfig) -> optax.GradientTransformation:
  lr: Any = cfg.learning_rate
  if cfg.decay_steps:
    lr = optax.warmup_cosine_decay_schedule(0.0, cfg.learning_rate, max(cfg.warmup_steps, 1),
                                            cfg.decay_steps, cfg.learning_rate * 0.1)
  elif cfg.warmup_steps:
    lr = optax.linear_schedule(0.0, cfg.learning_rate, cfg.warmup_steps)
  parts = [optax.clip_by_global_norm(cfg.grad_clip)] if cfg.grad_clip else []
  parts.append(optax.inject_hyperparams(optax.adamw)(learning_rate=lr, b1=cfg.b1, b2=cfg.b2,
                                                     weight_decay=cfg.weight_decay))
  return optax.chain(*parts)


def current_lr(opt_state) -> Array:
  """The injected learning rate (the schedule's state has the same name; take the array)."""
  return optax.tree_utils.tree_get(opt_state, "learning_rate",
                                   filtering=lambda _, value: isinstance(value, jax.Array))


def sft_optimizer(steps: int, learning_rate: float) -> optax.GradientTransformation:
  """The cold start's AdamW (`sft.steps`, `sft.learning_rate`): linear warmup over the first
  tenth, then cosine decay."""
  warmup = max(steps // 10, 1)
  schedule = optax.warmup_cosine_decay_schedule(0.0, learning_rate, warmup,
                                                max(steps, warmup + 1))
  return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.0))
