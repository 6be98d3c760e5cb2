"""Multi-turn RL with a calculator tool (configs/tool_multiplication.py): per-turn credit
with GSPO-token against GSPO on the episode reward and GRPO, over seeds.

3-digit multiplication that the 0.3M-parameter model solves by calling "[a*b]" and copying
the observation. Reward: 1 for the right answer, 0.1 for the first well-formed call (on
its turn). Variants (same cold start per seed, same data stream):
  gspo_token_turn   GSPO-token, each turn's tokens get its group-normalised return
  gspo_episode      GSPO, one advantage per episode from the summed reward
  grpo_episode      GRPO (0.2 / 0.27 per token), the same per-episode advantages

    python -m experiments.multiturn_tools [--quick] [--seeds 0 1] [--variants ...]

Writes runs/results/multiturn_tools[_quick]/{summary.json, heldout.png,
reward.png, tool_calls.png, malformed_calls.png} (experiments/results/ with --record).
"""

from __future__ import annotations

import dataclasses
import os
import sys

from experiments import _runs
from gspo_jax.config import LossConfig, SFTConfig
from gspo_jax.utils import configlib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

VARIANTS = {"gspo_token_turn": ("gspo_token", "turn"), "gspo_episode": ("gspo", "episode"),
            "grpo_episode": ("grpo", "episode")}
COLOURS = {"gspo_token_turn": "tab:blue", "gspo_episode": "tab:green", "grpo_episode": "tab:red"}


def config(variant: str, seed: int, args):
  cfg = configlib.load_config(os.path.join(ROOT, "configs", "tool_multiplication.py"))
  if args.quick:
    cfg = configlib.load_config(os.path.join(ROOT, "configs", "tool_multiplication.py:smoke"))
    cfg = dataclasses.replace(cfg, sft=SFTConfig(steps=4, batch_size=8, target_accuracy=0.0),
                              iterations=3, eval_every=3)
  loss, credit = VARIANTS[variant]
  return dataclasses.replace(cfg, seed=seed, loss=LossConfig(name=loss),
                             multiturn=dataclasses.replace(cfg.multiturn, credit=credit),
                             iterations=args.iterations or cfg.iterations)


def summarise(runs):
  out = {}
  for variant, items in runs.items():
    s = _runs.summarise(items)
    last = lambda key: [float(sum(r.get(key, 0.0) for r in it["rows"][-20:]) / 20)
                        for it in items]
    first = lambda key: [float(sum(r.get(key, 0.0) for r in it["rows"][:20]) / 20)
                         for it in items]
    s.update({"accuracy_first20": first("accuracy"), "accuracy_last20": last("accuracy"),
              "tool_calls_first20": first("env/tool_calls"),
              "tool_calls_last20": last("env/tool_calls"),
              "malformed_calls_first20": first("env/malformed_calls"),
              "malformed_calls_last20": last("env/malformed_calls")})
    out[variant] = s
  return out


def plot(runs, out):
  c = {"colours": COLOURS}
  return [
      _runs.plot_curves(runs, out, "heldout.png", "heldout_accuracy",
                        "held-out greedy accuracy (whole episodes)", **c),
      _runs.plot_curves(runs, out, "reward.png", "accuracy",
                        "training accuracy, sampled (mean of 10 iterations)", smooth=10, **c),
      _runs.plot_curves(runs, out, "tool_calls.png", "env/tool_calls",
                        "well-formed tool calls per episode (mean of 10)", smooth=10, **c),
      _runs.plot_curves(runs, out, "malformed_calls.png", "env/malformed_calls",
                        "malformed tool calls per episode (mean of 10)", smooth=10, **c)]


if __name__ == "__main__":
  _runs.main(sys.argv[1:], doc=__doc__, name="multiturn_tools", variants=VARIANTS,
             config=config, summarise=summarise, plot=plot, seeds=(0, 1))
