"""Real-model GSPO recipes: Qwen3 0.6B-8B on reasoning-gym's grade-school math
(`gsm_symbolic`) with thinking-length responses, planned for Cloud TPU slices
(`python -m gspo_jax.plan`; the table in docs/sharding_and_tpu.md).

Each `configs/qwen3_*_math.py` is `recipe(size)`: the checkpoint directory
`models/qwen3-<size>` (Hugging Face layout; `pretrained`), G = 16 responses per prompt,
prompts of up to 512 tokens, up to 2,048 new tokens, the paper's clip range, 4 minibatches
per rollout, prepare in 4 chunks of prompts, scanned layers with full remat, float32
master weights with bfloat16 compute.
The mesh and the batch are the planned ones for the slice named in `SLICES`.

The planner compiles shapes, not weights: plan a recipe before downloading anything with
`--set pretrained=` (the preset's shapes are the checkpoint's: parameter counts equal the
model cards', tests/models/test_model.py).
"""

from __future__ import annotations

import dataclasses
import json

from gspo_jax.config import (
  LossConfig,
  OptimConfig,
  RolloutConfig,
  SFTConfig,
  TaskConfig,
  TrainConfig,
)
from gspo_jax.models import config as model_config
from gspo_jax.parallel.sharding import MeshConfig
from gspo_jax.tasks import DataConfig
from gspo_jax.tasks.gym import GymConfig

# size -> (model preset, slice it is planned on, mesh, prompts per iteration)
SLICES = {
    "0.6b": (model_config.qwen3_0_6b, "v5e:2x4", MeshConfig(data=1, fsdp=8), 16),
    "1.7b": (model_config.qwen3_1_7b, "v5e:4x4", MeshConfig(data=1, fsdp=16), 32),
    "4b": (model_config.qwen3_4b, "v5p:2x2x2", MeshConfig(data=1, fsdp=8), 32),
    "8b": (model_config.qwen3_8b, "v5p:4x4x4", MeshConfig(data=1, fsdp=64), 64),
}

THINK = ("Solve the problem. Think step by step, then give the final number between "
         "<answer> and </answer> tags.")


def recipe(size: str, variant: str | None = None) -> TrainConfig:
  if size not in SLICES:
    raise ValueError(f"unknown recipe size {size!r}; the recipes are {sorted(SLICES)}")
  preset, _, mesh, prompts = SLICES[size]
  cfg = TrainConfig(
      pretrained=f"models/qwen3-{size}",
      model=preset(scan_layers=True, remat="full"),
      task=TaskConfig(name="gym", gym=GymConfig(name="gsm_symbolic", size=20000, seed=0,
                                                heldout_size=256, kwargs=json.dumps({})),
                      data=DataConfig(system_prompt=THINK), reward=("format_reward*0.1",)),
      rollout=RolloutConfig(prompts_per_iter=prompts, group_size=16, max_new_tokens=2048,
                            max_prompt_len=512, temperature=1.0),
      optim=OptimConfig(learning_rate=1e-6, grad_clip=1.0),
      sft=SFTConfig(steps=0), loss=LossConfig(name="gspo"), mesh=mesh,
      num_minibatches=4, prepare_chunks=4, iterations=200, eval_every=20, eval_size=256,
      seed=0)
  if variant == "smoke":  # the same job, tiny: 2 iterations of 2 x 4 rows and 8 problems
    return dataclasses.replace(
        cfg, rollout=dataclasses.replace(cfg.rollout, prompts_per_iter=2, group_size=4,
                                         max_new_tokens=64),
        mesh=MeshConfig(), prepare_chunks=2, iterations=2, eval_every=0, eval_size=8)
  if variant is not None:
    raise ValueError(f"unknown variant {variant!r} (this file has: smoke)")
  return cfg
