"""Qwen3-30B-A3B's shapes (the GSPO paper's MoE model: 48 MoE layers, 128 experts, top-8,
ragged dispatch, untied embeddings) at the 8B plan's RL sizes (configs/plan_qwen3_8b.py:
64 prompts x 8 responses, 256 + 1,024 tokens, 4 minibatches, scanned layers, full remat),
for the TPU planner (docs/sharding_and_tpu.md). Experts split 4 ways (`mesh.expert=4`: with
K = 8 the expert axis's all-gather / reduce-scatter send half the bytes a dropless
all-to-all would; and each mesh axis of a TPU torus must be a product of its physical
axes, so 8 does not fit v5p:4x4x4), the other chips on fsdp. Not a training recipe: the
planner compiles shapes and loads nothing.

    python -m gspo_jax.plan --config configs/plan_qwen3_30b_a3b.py --topology v5p:4x4x4
    # before expert parallelism: every chip on fsdp, experts split by their width
    python -m gspo_jax.plan --config configs/plan_qwen3_30b_a3b.py --topology v5p:4x4x4 \\
        --set mesh.expert=1
"""

import dataclasses
import os

from gspo_jax.models.config import qwen3_30b_a3b
from gspo_jax.parallel.sharding import MeshConfig
from gspo_jax.utils.configlib import load_config

DENSE_PLAN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "plan_qwen3_8b.py")


def get_config(arg: str | None = None):
  if arg not in (None, "smoke"):
    raise ValueError(f"unknown variant {arg!r} (this file has: smoke)")
  cfg = load_config(DENSE_PLAN if arg is None else f"{DENSE_PLAN}:{arg}")
  model = qwen3_30b_a3b(scan_layers=True, remat="full", tie_embeddings=False,
                        num_layers=cfg.model.num_layers if arg else 48)
  return dataclasses.replace(cfg, model=model, mesh=MeshConfig(data=1, fsdp=-1, expert=4))
