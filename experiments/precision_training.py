"""Experiment 4 of the paper (second part): training with a bfloat16 sampler's log-probs as
pi_old, against recomputing pi_old in the float32 trainer.

The paper (section 5.4) argues that sequence-level likelihoods tolerate the precision gap
between an inference engine and the trainer, so GSPO could use the sampler's likelihoods
directly and skip the recomputation. Every variant here samples in bfloat16 (parameters and
activations cast; `rollout.sampler_dtype`) and trains in float32 on configs/addition_tiny.py:

  gspo_recompute / grpo_recompute: pi_old recomputed by the float32 trainer (the default)
  gspo_sampler   / grpo_sampler:   pi_old = the bfloat16 sampler's log-probs (`old_logp=sampler`)
  gspo_corrected / grpo_corrected: pi_old recomputed, and every token's term weighted by
                                   min(pi_old / pi_sampler, 2) (truncated importance sampling,
                                   `rollout_correction.level=token`; docs/losses.md), on request

    python -m experiments.precision_training --quick
    python -m experiments.precision_training --seeds 0          # full, 300 iterations each
    python -m experiments.precision_training --plot-only
    python -m experiments.precision_training --task long --seeds 0 1 2   # configs/long_chain.py
    python -m experiments.precision_training --task long --seeds 0 1 \
        --variants gspo_recompute gspo_corrected grpo_recompute grpo_corrected

Writes under --out: runs/<variant>_seed<k>/, summary.json, reward.png, heldout.png,
clip_fraction.png.
"""

from __future__ import annotations

import dataclasses

from experiments import _runs
from gspo_jax.config import RolloutCorrectionConfig, TrainConfig

VARIANTS = {f"{loss}_{src}": (loss, src) for loss in ("gspo", "grpo")
            for src in ("recompute", "sampler", "corrected")}
DEFAULT = tuple(v for v in VARIANTS if not v.endswith("_corrected"))
COLOURS = {"gspo_recompute": "tab:blue", "gspo_sampler": "tab:cyan", "gspo_corrected": "tab:green",
           "grpo_recompute": "tab:orange", "grpo_sampler": "tab:red", "grpo_corrected": "tab:brown"}


def config(variant: str, seed: int, quick: bool, iterations: int | None,
           task: str = "addition") -> TrainConfig:
  loss, source = VARIANTS[variant]
  cfg = _runs.loss_config(loss, seed, quick, iterations, task)
  corrected = source == "corrected"
  cfg = dataclasses.replace(cfg, old_logp="recompute" if corrected else source,
                            rollout=dataclasses.replace(cfg.rollout, sampler_dtype="bfloat16"))
  if corrected:
    cfg = dataclasses.replace(cfg, rollout_correction=RolloutCorrectionConfig(
        level="token", mode="truncate", threshold=2.0))
  return cfg


def main(argv=None):
  return _runs.main(
      argv, doc=__doc__, name="precision_training", variants=VARIANTS, default_variants=DEFAULT,
      config=lambda v, seed, a: config(v, seed, a.quick, a.iterations, a.task),
      summarise=lambda runs: {v: _runs.summarise(items) for v, items in runs.items()},
      plot=lambda runs, out: _runs.standard_plots(runs, out, COLOURS))


if __name__ == "__main__":
  main()
