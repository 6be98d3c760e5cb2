"""Qwen3-8B with GSPO on reasoning-gym's gsm_symbolic, thinking-length responses (G = 16,
up to 2,048 new tokens), planned for a Cloud TPU slice: gspo_jax/plan/recipes.py and the table
in docs/sharding_and_tpu.md. Needs the checkpoint in models/qwen3-8b and reasoning-gym.

    python -m gspo_jax.plan --config configs/qwen3_8b_math.py --topology v5p:4x4x4 --set pretrained=
    python -m gspo_jax.train --config configs/qwen3_8b_math.py     # on the slice
"""

from gspo_jax.plan.recipes import recipe


def get_config(arg=None):
  return recipe("8b", arg)
