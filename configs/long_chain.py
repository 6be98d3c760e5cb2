"""The long task (docs/training.md "The long task"): a chain of 11 labelled additions and
subtractions whose solution writes every running total, 113 tokens per response, on a
0.31M-parameter Qwen3-style model on CPU. Cold start to partial accuracy, then 40 GSPO
iterations (the paper's clip range, no KL); about 15 minutes on a loaded 2-core CPU.
    python -m gspo_jax.train --config configs/long_chain.py
    python -m gspo_jax.train --config configs/long_chain.py:smoke --run-dir runs/long_smoke
"""

import dataclasses

from gspo_jax.config import (LossConfig, OptimConfig, RolloutConfig, SFTConfig, TaskConfig,
                             TrainConfig)
from gspo_jax.models.config import tiny


def get_config(arg: str | None = None) -> TrainConfig:
  cfg = TrainConfig(
      # 11 steps: solutions of 11 * 10 + 3 = 113 characters, 112 tokens
      task=TaskConfig(name="chain", digits=1, steps=11),
      model=tiny(vocab_size=48, hidden=128, mlp_dim=256, num_heads=4, num_kv_heads=2,
                 head_dim=32),
      # 112 solution tokens + EOS, and room for a few more; prompts 36 tokens + BOS.
      # Sampling at 0.7: at 1.0 one slip in 113 tokens is likely (train accuracy 0.17 against
      # 0.41 greedy) and held-out accuracy stayed flat at learning rate 1e-4 (3e-4 collapsed).
      rollout=RolloutConfig(prompts_per_iter=32, group_size=8, max_new_tokens=120,
                            max_prompt_len=40, temperature=0.7),
      optim=OptimConfig(learning_rate=1e-4, warmup_steps=5, grad_clip=1.0),
      sft=SFTConfig(steps=600, batch_size=64, learning_rate=3e-3, target_accuracy=0.3,
                    check_every=25, probe_size=128),
      loss=LossConfig(name="gspo"),
      num_minibatches=4,
      iterations=40,
      eval_every=20,
      eval_size=256,
      seed=0,
  )
  if arg == "smoke":
    # Does every phase run at these lengths? Two iterations on a smaller model; it learns
    # nothing.
    return dataclasses.replace(
        cfg,
        model=tiny(vocab_size=48, hidden=32, mlp_dim=64, num_heads=2, num_kv_heads=1,
                   head_dim=16),
        rollout=dataclasses.replace(cfg.rollout, prompts_per_iter=8, group_size=4),
        sft=SFTConfig(steps=2, batch_size=8, target_accuracy=0.0),
        num_minibatches=2, iterations=2, eval_every=0, eval_size=16)
  if arg is not None:
    raise ValueError(f"unknown variant {arg!r} (this file has: smoke)")
  return cfg
