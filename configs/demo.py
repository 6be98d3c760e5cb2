"""The README's main job: a small GSPO run on CPU (`python -m gspo_jax.demo --config configs/demo.py`).

Paper settings where they apply: GSPO clip range (3e-4, 4e-4), each rollout batch split
into 4 minibatches, G responses per prompt with group-normalised rewards, no KL.
"""

from gspo_jax.demo import DemoConfig


def get_config() -> DemoConfig:
  return DemoConfig(
      loss="gspo",
      eps_low=3e-4,
      eps_high=4e-4,
      num_minibatches=4,
      group_size=8,
      prompts_per_iter=16,
      iterations=200,
      learning_rate=0.05,
  )
