"""The main job (configs/addition_tiny.py) with LoRA: the cold start trains the whole model,
which then stays frozen; GSPO trains rank-8 adapters on every attention and MLP weight
(docs/lora.md has its held-out accuracy and bytes beside the full run's).
    python -m gspo_jax.train --config configs/addition_tiny_lora.py
    python -m gspo_jax.train --config configs/addition_tiny_lora.py:smoke --run-dir runs/smoke_lora
"""

import dataclasses
import os

from gspo_jax.lora.adapters import LoRAConfig
from gspo_jax.utils.configlib import load_config

MAIN_JOB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "addition_tiny.py")


def get_config(arg: str | None = None):
  if arg not in (None, "smoke"):
    raise ValueError(f"unknown variant {arg!r} (this file has: smoke)")
  cfg = load_config(MAIN_JOB if arg is None else f"{MAIN_JOB}:{arg}")
  # Adapters start at B = 0 and move only through A B: a larger step than the full run's
  # 1e-4 (the LoRA literature's ~10x rule).
  return dataclasses.replace(cfg, lora=LoRAConfig(rank=8, alpha=32.0),
                             optim=dataclasses.replace(cfg.optim, learning_rate=1e-3))
