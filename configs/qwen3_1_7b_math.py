"""Qwen3-1.7B with GSPO on reasoning-gym's gsm_symbolic, thinking-length responses (G = 16,
up to 2,048 new tokens), planned for a Cloud TPU slice: gspo_jax/plan/recipes.py and the table
in docs/sharding_and_tpu.md. Needs the checkpoint in models/qwen3-1.7b and reasoning-gym.

    python -m gspo_jax.plan --config configs/qwen3_1_7b_math.py --topology v5e:4x4 --set pretrained=
    python -m gspo_jax.train --config configs/qwen3_1_7b_math.py     # on the slice
"""

from gspo_jax.plan.recipes import recipe


def get_config(arg=None):
  return recipe("1.7b", arg)
