"""The tabular stand-in: a small GSPO run on CPU (`python -m gspo_jax.demo --config configs/demo.py`).

Paper settings where they apply: GSPO clip range (3e-4, 4e-4), each rollout batch split
into 4 minibatches, G responses per prompt with group-normalised rewards, no KL.
"""

import dataclasses

from gspo_jax.demo import DemoConfig


def get_config(arg: str | None = None) -> DemoConfig:
  cfg = DemoConfig(
      loss="gspo",
      eps_low=3e-4,
      eps_high=4e-4,
      num_minibatches=4,
      group_size=8,
      prompts_per_iter=16,
      iterations=200,
      learning_rate=0.05,
  )
  if arg == "smoke":
    # Does the demo still run end to end? Three iterations, each one logged.
    return dataclasses.replace(cfg, iterations=3, log_every=1)
  if arg is not None:
    raise ValueError(f"unknown variant {arg!r} (this file has: smoke)")
  return cfg
