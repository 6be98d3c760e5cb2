"""Qwen3-30B-A3B's shapes (the GSPO paper's MoE model: 48 MoE layers, 128 experts, top-8,
ragged dispatch) at the 8B plan's RL sizes, for the TPU planner (docs/sharding_and_tpu.md):
B = 64 prompts x G = 8 responses, prompts of 256 tokens, 1,024 new tokens, 4 minibatches,
layers scanned, full remat. Experts split 4 ways (`mesh.expert=4`: with K = 8 the expert
axis's all-gather / reduce-scatter send half the bytes a dropless all-to-all would; and a
TPU torus's mesh axes must each be a product of its physical axes, so 8 does not fit
v5p:4x4x4), the other chips on fsdp. Not a training recipe: the planner compiles shapes and loads nothing.

    python -m gspo_jax.plan --config configs/plan_qwen3_30b_a3b.py --topology v5p:4x4x4
    # before expert parallelism: every chip on fsdp, experts split by their width
    python -m gspo_jax.plan --config configs/plan_qwen3_30b_a3b.py --topology v5p:4x4x4 \
        --set mesh.expert=1
"""

import dataclasses

from gspo_jax.config import RolloutConfig, SFTConfig, TrainConfig
from gspo_jax.models.config import qwen3_30b_a3b
from gspo_jax.sharding import MeshConfig


def get_config(arg: str | None = None) -> TrainConfig:
  cfg = TrainConfig(
      model=qwen3_30b_a3b(scan_layers=True, remat="full", tie_embeddings=False),
      rollout=RolloutConfig(prompts_per_iter=64, group_size=8, max_new_tokens=1024,
                            max_prompt_len=256),
      mesh=MeshConfig(data=1, fsdp=-1, expert=4), sft=SFTConfig(steps=0), num_minibatches=4,
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
