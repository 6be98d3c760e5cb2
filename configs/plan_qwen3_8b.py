"""Qwen3-8B's shapes at long-response RL sizes, for the TPU planner (docs/sharding_and_tpu.md):
B = 64 prompts x G = 8 responses, prompts of 256 tokens, 1,024 new tokens, 4 minibatches,
layers scanned, full remat, every chip on fsdp. Not a training recipe: the task is a stand-in
(the planner compiles shapes, it trains nothing and loads no weights).

    python -m gspo_jax.plan --config configs/plan_qwen3_8b.py --topology v5p:4x4x4
"""

import dataclasses

from gspo_jax.config import RolloutConfig, SFTConfig, TrainConfig
from gspo_jax.models.config import qwen3_8b
from gspo_jax.parallel.sharding import MeshConfig


def get_config(arg: str | None = None) -> TrainConfig:
  cfg = TrainConfig(
      model=qwen3_8b(scan_layers=True, remat="full"),
      rollout=RolloutConfig(prompts_per_iter=64, group_size=8, max_new_tokens=1024,
                            max_prompt_len=256),
      mesh=MeshConfig(data=1, fsdp=-1), sft=SFTConfig(steps=0), num_minibatches=4,
      eval_size=64)
  if arg == "smoke":  # the same shapes but 2 layers, a small batch and short responses
    return dataclasses.replace(
        cfg, model=dataclasses.replace(cfg.model, num_layers=2),
        rollout=dataclasses.replace(cfg.rollout, prompts_per_iter=8, group_size=4,
                                    max_new_tokens=64),
        iterations=2, eval_every=0, eval_size=16)
  if arg is not None:
    raise ValueError(f"unknown variant {arg!r} (this file has: smoke)")
  return cfg
