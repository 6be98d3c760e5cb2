"""GSPO, GRPO and GSPO + truncated importance sampling at staleness 0 / 1 / 2 / 4: does
GSPO's tight band saturate when the sampler runs ahead of the trainer, and does correction
fix it? (preregistered in experiments/preregistered.md before any run)

The medium chain task (configs/long_chain.py at task.steps=6: 63-token worked solutions,
max_new_tokens 72), 32 prompts x 8 responses in 4 minibatches, lr 1e-4, 20 iterations,
held-out (128 problems, greedy) every 5 -- the stability map's medium / 4-minibatch / 1e-4
cell -- with the sampler `asynchronous.max_staleness` = k versions behind (fixed lag,
gspo_jax/parallel/placement.py). Variants:

  gspo_k<k>      GSPO, pi_old = the sampling version's (its ratio spans the staleness)
  grpo_k<k>      GRPO, likewise
  gspo_tis_k<k>  GSPO with pi_old recomputed at the trainer's version (asynchronous.pi_old=
                 "proximal") and every token weighted by min(pi_old / pi_sampler, 2)
                 (rollout_correction.level=token, truncate): the staleness is corrected
                 rather than clipped

Endpoints (fixed before the runs): held-out gain (iteration 20 minus the cold start),
collapse (every held-out evaluation after iteration 10 below the cold start, the
stability map's rule), the fraction of responses clipped (clip_frac_seq, mean over
iterations) and the sampler-trainer KL (k3, per token, mean over iterations: the first
minibatch's approx_kl_first for gspo / grpo, the rollout correction's rollout_corr_kl for
gspo_tis -- both KL between the trainer's policy at the update's start and the sampler's).
One cold start per seed shared by every variant.

    python -m experiments.async_staleness --quick
    python -m experiments.async_staleness --seeds 0 1 2 3
    python -m experiments.async_staleness --plot-only

Writes under --out: runs/<variant>_seed<k>/, summary.json, staleness.png.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from experiments import _plots, _runs, _stats, stability_map
from gspo_jax.config import RolloutCorrectionConfig, TrainConfig
from gspo_jax.parallel.placement import AsyncConfig

STALENESS = (0, 1, 2, 4)
LOSSES = ("gspo", "grpo", "gspo_tis")
VARIANTS = {f"{loss}_k{k}": (loss, k) for loss in LOSSES for k in STALENESS}
COLOURS = {"gspo": "tab:blue", "grpo": "tab:orange", "gspo_tis": "tab:green"}


def config(variant: str, seed: int, quick: bool, iterations: int | None) -> TrainConfig:
  loss, k = VARIANTS[variant]
  cfg = stability_map.config("medium", "gspo" if loss == "gspo_tis" else loss, 4, 1e-4, seed,
                             quick, iterations)
  if loss == "gspo_tis":
    cfg = dataclasses.replace(cfg, rollout_correction=RolloutCorrectionConfig(
        level="token", mode="truncate", threshold=2.0))
  return dataclasses.replace(cfg, asynchronous=AsyncConfig(
      max_staleness=k, pi_old="proximal" if loss == "gspo_tis" else "behaviour"))


def gap_key(loss: str) -> str:
  return "rollout_corr_kl" if loss == "gspo_tis" else "approx_kl_first"


def summarise(runs: dict) -> dict:
  cells = {}
  for name, items in runs.items():
    loss, k = VARIANTS[name]
    cell = {"loss": loss, "staleness": k, "seeds": [], "heldout_start": [], "heldout_end": [],
            "heldout_gain": [], "collapsed": [], "clip_frac_seq_mean": [],
            "clip_frac_token_mean": [], "sampler_trainer_kl_mean": []}
    for it in sorted(items, key=lambda it: it["seed"]):
      start, end = it["summary"]["heldout_accuracy_start"], it["summary"]["heldout_accuracy_end"]
      cell["seeds"].append(it["seed"])
      cell["heldout_start"].append(start)
      cell["heldout_end"].append(end)
      cell["heldout_gain"].append(end - start)
      cell["collapsed"].append(stability_map.collapsed(it["rows"], start))
      for key in ("clip_frac_seq", "clip_frac_token"):
        cell[f"{key}_mean"].append(float(np.mean([r[key] for r in it["rows"]])))
      cell["sampler_trainer_kl_mean"].append(
          float(np.mean([r.get(gap_key(loss), np.nan) for r in it["rows"]])))
    cells[name] = cell
  return {"cells": cells, "runs": sum(len(c["seeds"]) for c in cells.values()),
          "paired": paired(cells)}


def paired(cells: dict) -> dict:
  """Paired over seeds: each loss at staleness k against itself at 0 (held-out gain and
  clip fraction), and GSPO + TIS against GSPO at the same k."""
  out = {}
  def add(label, a, b, key):
    if a in cells and b in cells:
      seeds = sorted(set(cells[a]["seeds"]) & set(cells[b]["seeds"]))
      if len(seeds) >= 2:
        pick = lambda c: [c[key][c["seeds"].index(s)] for s in seeds]
        out[label] = {"seeds": seeds, **_stats.paired(pick(cells[a]), pick(cells[b]))}
  for k in STALENESS[1:]:
    for loss in LOSSES:
      add(f"{loss}: gain k{k} - k0", f"{loss}_k{k}", f"{loss}_k0", "heldout_gain")
      add(f"{loss}: clip_frac_seq k{k} - k0", f"{loss}_k{k}", f"{loss}_k0", "clip_frac_seq_mean")
    add(f"k{k}: gain gspo_tis - gspo", f"gspo_tis_k{k}", f"gspo_k{k}", "heldout_gain")
  return out


def plot(runs: dict, out: str) -> list[str]:
  summary = summarise(runs)
  fig, axes = _plots.figure(ncols=3, figsize=(15, 4))
  for ax, key, label in zip(axes, ("heldout_gain", "clip_frac_seq_mean",
                                   "sampler_trainer_kl_mean"),
                            ("held-out gain after 20 iterations", "fraction of responses clipped",
                             "sampler-trainer KL per token (k3)")):
    for n, loss in enumerate(LOSSES):
      xs, means, half = [], [], []
      for k in STALENESS:
        c = summary["cells"].get(f"{loss}_k{k}")
        if not c:
          continue
        x = k + (n - 1) * 0.12
        ax.scatter([x] * len(c[key]), c[key], color=COLOURS[loss], alpha=0.4, s=14)
        xs.append(x)
        means.append(float(np.mean(c[key])))
        m = len(c[key])
        half.append(_stats.t_quantile(0.975, m - 1) * _stats.sample_std(c[key]) / np.sqrt(m)
                    if m > 1 else 0.0)
      if xs:
        ax.errorbar(xs, means, yerr=half, color=COLOURS[loss], marker="o", capsize=3,
                    label=loss.replace("_", " + ").upper())
    ax.set_xlabel("asynchronous.max_staleness")
    ax.set_ylabel(label)
    ax.set_xticks(list(STALENESS))
  axes[0].legend(fontsize=7, loc="lower left")
  fig.subplots_adjust(wspace=0.35)
  return [_plots.save(fig, None, out, "staleness.png")]


def main(argv=None):
  return _runs.main(
      argv, doc=__doc__, name="async_staleness", variants=VARIANTS,
      config=lambda v, seed, a: config(v, seed, a.quick, a.iterations),
      summarise=summarise, plot=plot)


if __name__ == "__main__":
  main()
