"""configs/smollm2_addition.py (SmolLM2-135M-Instruct, one-digit addition, no cold start)
with LoRA: rank-8 adapters (alpha 16) on every attention and MLP weight of the 30 layers,
the pretrained weights frozen (pi_ref, when a KL term is set, is the pretrained model).
docs/lora.md has its held-out curve beside full fine-tuning (experiments/lora_curve.py).

    python -m gspo_jax.train --config configs/smollm2_addition_lora.py
    python -m gspo_jax.train --config configs/smollm2_addition_lora.py --set lora.base_dtype=int8
"""

import dataclasses
import os

from gspo_jax.lora.adapters import LoRAConfig
from gspo_jax.utils.configlib import load_config

FULL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "smollm2_addition.py")


def get_config(arg: str | None = None):
  if arg not in (None, "smoke"):
    raise ValueError(f"unknown variant {arg!r} (this file has: smoke)")
  cfg = load_config(FULL if arg is None else f"{FULL}:{arg}")
  # Adapters start at B = 0 and move only through A B: ten times the full run's 1e-5 (the
  # LoRA literature's rule of thumb; not tuned on this task).
  return dataclasses.replace(cfg, lora=LoRAConfig(rank=8, alpha=16.0),
                             optim=dataclasses.replace(cfg.optim, learning_rate=1e-4))
