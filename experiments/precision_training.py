"""Experiment 4 of the paper (second part): training with a bfloat16 sampler's log-probs as
pi_old, against recomputing pi_old in the float32 trainer.

The paper (section 5.4) argues that sequence-level likelihoods tolerate the precision gap
between an inference engine and the trainer, so GSPO could use the sampler's likelihoods
directly and skip the recomputation. Every variant here samples in bfloat16 (parameters and
activations cast; `rollout.sampler_dtype`) and trains in float32 on configs/addition_tiny.py:

  gspo_recompute / grpo_recompute: pi_old recomputed by the float32 trainer (the default)
  gspo_sampler   / grpo_sampler:   pi_old = the bfloat16 sampler's log-probs (`old_logp=sampler`)

    python experiments/precision_training.py --quick
    python experiments/precision_training.py --seeds 0          # full, 300 iterations each
    python experiments/precision_training.py --plot-only

Writes under --out: runs/<variant>_seed<k>/, summary.json, reward.png, heldout.png,
clip_fraction.png.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from experiments import _runs  # noqa: E402
from experiments.gspo_vs_grpo import config as base_config  # noqa: E402
from gspo_jax import train as T  # noqa: E402

VARIANTS = {f"{loss}_{src}": (loss, src) for loss in ("gspo", "grpo")
            for src in ("recompute", "sampler")}
COLOURS = {"gspo_recompute": "tab:blue", "gspo_sampler": "tab:cyan",
           "grpo_recompute": "tab:orange", "grpo_sampler": "tab:red"}


def config(variant: str, seed: int, quick: bool, iterations: int | None) -> T.TrainConfig:
  loss, source = VARIANTS[variant]
  cfg = base_config(loss, seed, quick, iterations)
  return dataclasses.replace(cfg, old_logp=source, rollout=dataclasses.replace(
      cfg.rollout, sampler_dtype="bfloat16"))


def plot(runs, out: str) -> list[str]:
  c = {"colours": COLOURS}
  return [
      _runs.plot_curves(runs, out, "reward.png", "reward_mean",
                        "training reward (mean of 20 iterations)", smooth=20, **c),
      _runs.plot_curves(runs, out, "heldout.png", "heldout_accuracy", "held-out greedy accuracy",
                        **c),
      _runs.plot_curves(runs, out, "clip_fraction.png", "clip_frac_token",
                        "fraction of tokens clipped (floored at 1e-5)", log=True, floor=1e-5,
                        **c)]


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--quick", action="store_true", help="tiny sizes, 6 iterations")
  parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
  parser.add_argument("--seeds", nargs="+", type=int, default=[0])
  parser.add_argument("--iterations", type=int, default=None, help="override the config's")
  parser.add_argument("--plot-only", action="store_true", help="only summarise finished runs")
  parser.add_argument("--out", default=None,
                      help="default: experiments/results/precision_training[_quick]")
  args = parser.parse_args(argv)
  out = args.out or os.path.join(ROOT, "experiments", "results",
                                 "precision_training_quick" if args.quick else
                                 "precision_training")
  os.makedirs(out, exist_ok=True)
  if not args.plot_only:
    for seed in args.seeds:
      for v in args.variants:
        _runs.run_one(out, v, seed, config(v, seed, args.quick, args.iterations))
  runs = _runs.load_runs(out)
  summary = {v: _runs.summarise(items) for v, items in runs.items()}
  _runs.write_summary(out, summary)
  print("wrote", os.path.join(out, "summary.json"), *plot(runs, out))
  return summary


if __name__ == "__main__":
  main()
