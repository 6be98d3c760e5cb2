"""Experiments 1 and 2 of the paper: GSPO vs GRPO training efficiency, and clipping fractions.

Same task, model, data stream and seeds; the paper's clip ranges (GSPO 3e-4 / 4e-4, GRPO
0.2 / 0.27); each rollout batch split into 4 minibatches, so later updates are off-policy.
The cold start is deterministic per seed, so GSPO and GRPO start from the same policy.

    python experiments/gspo_vs_grpo.py --quick                    # a few minutes on 2 CPU cores
    python experiments/gspo_vs_grpo.py --seeds 0 1 2              # full: configs/addition_tiny.py
    python experiments/gspo_vs_grpo.py --losses grpo --seeds 0    # one part (run parts in parallel),
    python experiments/gspo_vs_grpo.py --plot-only                # then summarise what is there

Writes under --out: runs/<loss>_seed<k>/ (metrics.jsonl ...), summary.json, and plots
reward.png, heldout.png, reward_vs_time.png, clip_fraction.png.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from experiments import _runs  # noqa: E402
from gspo_jax import configlib  # noqa: E402
from gspo_jax import train as T  # noqa: E402

CLIP = {"gspo": (3e-4, 4e-4), "grpo": (0.2, 0.27)}


def config(loss: str, seed: int, quick: bool, iterations: int | None) -> T.TrainConfig:
  cfg = configlib.load_config(os.path.join(ROOT, "configs", "addition_tiny.py"))
  if quick:
    cfg = dataclasses.replace(
        cfg, rollout=dataclasses.replace(cfg.rollout, prompts_per_iter=16),
        sft=dataclasses.replace(cfg.sft, steps=60, target_accuracy=0.0, batch_size=64),
        iterations=6, eval_every=3, eval_size=64)
  if iterations:
    cfg = dataclasses.replace(cfg, iterations=iterations)
  return dataclasses.replace(cfg, loss=loss, eps_low=CLIP[loss][0], eps_high=CLIP[loss][1],
                             seed=seed)


def summarise(runs: dict[str, list[dict]]) -> dict:
  out = {loss: _runs.summarise(items) for loss, items in runs.items()}
  if {"gspo", "grpo"} <= set(out):
    grpo = float(np.mean(out["grpo"]["clip_frac_token_mean"]))
    out["clip_ratio_gspo_over_grpo"] = (  # None: GRPO clipped no token at all
        float(np.mean(out["gspo"]["clip_frac_token_mean"])) / grpo if grpo > 0 else None)
  return out


def plot(runs: dict[str, list[dict]], out: str) -> list[str]:
  c = {"colours": {"gspo": "tab:blue", "grpo": "tab:orange"}}
  smoothed = "training reward (mean of 20 iterations)"
  return [
      _runs.plot_curves(runs, out, "reward.png", "reward_mean", smoothed, smooth=20, **c),
      _runs.plot_curves(runs, out, "reward_vs_time.png", "reward_mean", smoothed, smooth=20,
                        x="time", **c),
      _runs.plot_curves(runs, out, "heldout.png", "heldout_accuracy", "held-out greedy accuracy",
                        **c),
      _runs.plot_curves(runs, out, "clip_fraction.png", "clip_frac_token",
                        "fraction of tokens clipped (floored at 1e-5)", log=True, floor=1e-5, **c)]


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--quick", action="store_true", help="tiny sizes, 6 iterations")
  parser.add_argument("--losses", nargs="+", default=["gspo", "grpo"], choices=sorted(CLIP))
  parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
  parser.add_argument("--iterations", type=int, default=None, help="override the config's")
  parser.add_argument("--plot-only", action="store_true", help="only summarise finished runs")
  parser.add_argument("--out", default=None,
                      help="default: experiments/results/gspo_vs_grpo[_quick]")
  args = parser.parse_args(argv)
  out = args.out or os.path.join(ROOT, "experiments", "results",
                                 "gspo_vs_grpo_quick" if args.quick else "gspo_vs_grpo")
  os.makedirs(out, exist_ok=True)
  if not args.plot_only:
    for seed in args.seeds:
      for loss in args.losses:
        _runs.run_one(out, loss, seed, config(loss, seed, args.quick, args.iterations))
  runs = _runs.load_runs(out)
  summary = summarise(runs)
  _runs.write_summary(out, summary)
  files = plot(runs, out)
  print("wrote", os.path.join(out, "summary.json"), *files)
  return summary


if __name__ == "__main__":
  main()
