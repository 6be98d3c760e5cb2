"""A task that needs a tool: 3-digit multiplication with a calculator the model calls in
text (gspo_jax/tasks/tools.py, gspo_jax/multiturn/). A 0.3M-parameter model cannot
multiply in its head; it can copy the operands into "[a*b]", stop there, read the
observation "c;" and copy c. Reward: 1 for the right final answer, 0.1 for the first
well-formed call (a per-turn reward, `calculator_shaped`). Cold start on demonstrations
that hold the tool call (the observation tokens masked out), then GSPO-token with per-turn
credit (experiments/multiturn_tools.py compares GSPO on the episode reward and GRPO).
    python -m gspo_jax.train --config configs/tool_multiplication.py
    python -m gspo_jax.train --config configs/tool_multiplication.py:smoke --run-dir runs/smoke
    python -m gspo_jax.evaluate --run runs/<name> --k 4
"""

import dataclasses

from gspo_jax.config import (LossConfig, MultiTurnConfig, OptimConfig, RolloutConfig, SFTConfig,
                             TaskConfig, TrainConfig)
from gspo_jax.models.config import tiny


def get_config(arg: str | None = None) -> TrainConfig:
  cfg = TrainConfig(
      task=TaskConfig(name="tool_multiplication", digits=3),
      model=tiny(vocab_size=32, hidden=64, mlp_dim=128, num_heads=4, num_kv_heads=2,
                 head_dim=16),
      # max_new_tokens is the episode budget: "[123*456]" (9), "56088;" (6), "56088" + EOS (6).
      rollout=RolloutConfig(prompts_per_iter=16, group_size=8, max_new_tokens=28,
                            max_prompt_len=10, temperature=1.0),
      multiturn=MultiTurnConfig(env="calculator_shaped", stop_strings=("]",), max_obs_tokens=8,
                                max_turns=3, credit="turn"),
      optim=OptimConfig(learning_rate=3e-4, warmup_steps=5, grad_clip=1.0),
      # Deliberately short: a partly learned format leaves room for RL.
      sft=SFTConfig(steps=200, batch_size=64, learning_rate=3e-3, target_accuracy=0.3,
                    check_every=10, probe_size=128),
      loss=LossConfig(name="gspo_token"),
      num_minibatches=4,
      iterations=120,
      eval_every=20,
      eval_size=256,
      seed=0,
  )
  if arg == "smoke":
    return dataclasses.replace(
        cfg, model=tiny(vocab_size=32, hidden=32, mlp_dim=64, num_heads=2, num_kv_heads=1,
                        head_dim=16),
        rollout=dataclasses.replace(cfg.rollout, prompts_per_iter=4, group_size=4),
        sft=SFTConfig(steps=2, batch_size=8, target_accuracy=0.0),
        num_minibatches=2, iterations=2, eval_every=2, eval_size=8)
  if arg is not None:
    raise ValueError(f"unknown variant {arg!r} (this file has: smoke)")
  return cfg
