"""reasoning-gym on a real pretrained model: SmolLM2-135M-Instruct on chain_sum (sums and
differences of 2-3 numbers of 1-2 digits), answers in <answer> tags scored by
reasoning-gym's own verifier, no cold start. Needs the optional package reasoning-gym.

    pip install reasoning-gym==0.1.25
    python -m gspo_jax.models.gguf_convert --smollm2 --out models/smollm2-135m-instruct
    python -m gspo_jax.train --config configs/smollm2_gym.py
    python -m gspo_jax.train --config configs/smollm2_gym.py --set task.gym.name=countdown \\
        --set task.gym.kwargs='{"min_numbers": 3, "max_numbers": 4}' --set rollout.max_prompt_len=256
    python -m gspo_jax.train --config configs/smollm2_gym.py:smoke --run-dir runs/smoke
"""

import dataclasses
import json

from gspo_jax.config import (LossConfig, OptimConfig, RolloutConfig, SFTConfig, TaskConfig,
                             TrainConfig)
from gspo_jax.tasks import DataConfig
from gspo_jax.tasks.gym import GymConfig

# reasoning-gym's SYSTEM_PROMPTS["direct"] (reasoning_gym/utils.py, 0.1.25): its questions
# do not ask for the <answer> tag its verifiers read; this asks for it, with no reasoning
# first, which suits a 135M model and a short response budget.
DIRECT = ("Answer the question directly. Provide your answer between <answer> and </answer> "
          "tags. Do not return any preamble, explanation, or reasoning.")


def get_config(arg: str | None = None) -> TrainConfig:
  cfg = TrainConfig(
      task=TaskConfig(
          name="gym",
          gym=GymConfig(name="chain_sum", size=2000, seed=0, heldout_size=128,
                        kwargs=json.dumps({"min_terms": 2, "max_terms": 3,
                                           "min_digits": 1, "max_digits": 2})),
          data=DataConfig(system_prompt=DIRECT),
          # The verifier (reward/chain_sum) comes first and decides correctness; a small
          # bonus for exactly one <answer> tag, without which the verifier sees no answer.
          reward=("format_reward*0.1",)),
      pretrained="models/smollm2-135m-instruct",
      # ChatML with the system turn above and the question: 128 prompt tokens with margin
      # (setup refuses, naming the problem, any prompt that does not fit, before the
      # weights load). 32 new tokens: the tagged answer with room for a short preamble.
      rollout=RolloutConfig(prompts_per_iter=8, group_size=8, max_new_tokens=32,
                            max_prompt_len=128, temperature=1.0),
      optim=OptimConfig(learning_rate=2e-5, grad_clip=1.0),
      sft=SFTConfig(steps=0),
      loss=LossConfig(name="gspo"),
      num_minibatches=2,
      old_logp="sampler",  # float32 model: the sampler's log-probs are pi_old
      iterations=20,
      eval_every=10,
      eval_size=64,
      seed=0,
  )
  if arg == "smoke":
    # Do the model, the generated problems, the chat template and the verifier load and
    # run every phase? Two iterations of 4 x 4 rows and an 8-problem evaluation.
    return dataclasses.replace(
        cfg, rollout=dataclasses.replace(cfg.rollout, prompts_per_iter=4, group_size=4),
        iterations=2, eval_every=0, eval_size=8)
  if arg is not None:
    raise ValueError(f"unknown variant {arg!r} (this file has: smoke)")
  return cfg
