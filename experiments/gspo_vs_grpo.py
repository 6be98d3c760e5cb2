"""Experiments 1 and 2 of the paper: GSPO vs GRPO training efficiency, and clipping fractions.

Same task, model, data stream and seeds; each loss with its own clip range, the paper's
(`losses.LOSS_DEFAULTS`: GSPO 3e-4 / 4e-4, GRPO 0.2 / 0.27); each rollout batch split into
4 minibatches, so later updates are off-policy.
The cold start is deterministic per seed, so GSPO and GRPO start from the same policy.

    python experiments/gspo_vs_grpo.py --quick                    # a few minutes on 2 CPU cores
    python experiments/gspo_vs_grpo.py --seeds 0 1 2              # full: configs/addition_tiny.py
    python experiments/gspo_vs_grpo.py --losses grpo --seeds 0    # one part (run parts in parallel),
    python experiments/gspo_vs_grpo.py --plot-only                # then summarise what is there

Writes under --out: runs/<loss>_seed<k>/ (metrics.jsonl ...), summary.json, and plots
reward.png, heldout.png, reward_vs_time.png, clip_fraction.png.
"""

from __future__ import annotations

import dataclasses
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from experiments import _runs  # noqa: E402
from gspo_jax import configlib  # noqa: E402
from gspo_jax.config import TrainConfig  # noqa: E402

LOSSES = ("gspo", "grpo")


def config(loss: str, seed: int, quick: bool, iterations: int | None) -> TrainConfig:
  """configs/addition_tiny.py with `loss`, eps unset so that each loss clips at its own
  (the paper's) range whatever the config file sets."""
  cfg = configlib.load_config(os.path.join(ROOT, "configs", "addition_tiny.py"))
  if quick:
    cfg = dataclasses.replace(
        cfg, rollout=dataclasses.replace(cfg.rollout, prompts_per_iter=16),
        sft=dataclasses.replace(cfg.sft, steps=60, target_accuracy=0.0, batch_size=64),
        iterations=6, eval_every=3, eval_size=64)
  if iterations:
    cfg = dataclasses.replace(cfg, iterations=iterations)
  return dataclasses.replace(cfg, loss=loss, eps_low=None, eps_high=None, seed=seed)


def summarise(runs: dict[str, list[dict]]) -> dict:
  out = {loss: _runs.summarise(items) for loss, items in runs.items()}
  if {"gspo", "grpo"} <= set(out):
    grpo = float(np.mean(out["grpo"]["clip_frac_token_mean"]))
    out["clip_ratio_gspo_over_grpo"] = (  # None: GRPO clipped no token at all
        float(np.mean(out["gspo"]["clip_frac_token_mean"])) / grpo if grpo > 0 else None)
  return out


def plot(runs: dict[str, list[dict]], out: str) -> list[str]:
  colours = {"gspo": "tab:blue", "grpo": "tab:orange"}
  return _runs.standard_plots(runs, out, colours) + [_runs.plot_curves(
      runs, out, "reward_vs_time.png", "reward_mean", "training reward (mean of 20 iterations)",
      smooth=20, x="time", colours=colours)]


def main(argv=None):
  return _runs.main(argv, doc=__doc__, name="gspo_vs_grpo", variants=LOSSES, seeds=(0, 1, 2),
                    flag="--losses", summarise=summarise, plot=plot,
                    config=lambda loss, seed, a: config(loss, seed, a.quick, a.iterations))


if __name__ == "__main__":
  main()
