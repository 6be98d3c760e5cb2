"""Where does each loss stay stable? Response length x minibatches per rollout x learning
rate, for GSPO and GRPO, on the long task (configs/long_chain.py).

The paper's stability claim is about off-policy updates of long responses: GRPO's
per-token ratios get noisier with length and with each further minibatch drawn from one
rollout, GSPO's length-normalised sequence ratio does not. The grid:

  length       short / medium / long = task.steps 3 / 6 / 11: worked solutions of 33 / 63
               / 113 tokens (max_new_tokens 40 / 72 / 120);
  minibatches  1, 4, 16 per rollout (one on-policy update, then 3 or 15 off-policy ones);
  lr           1e-4 (the long config's) and 3e-4;
  loss         GSPO and GRPO at the paper's clip ranges.

Collapse, defined before any run: a run has collapsed when every held-out evaluation in
the second half of its iterations is below the cold start's held-out accuracy (it fell
below where RL began and did not come back). Each length has its own cold start per seed,
shared by every cell of that length.

    python -m experiments.stability_map --quick                   # tiny sizes, 2 cells
    python -m experiments.stability_map --seeds 0                 # the whole grid, 36 runs
    python -m experiments.stability_map --lengths long --losses grpo   # a part
    python -m experiments.stability_map --plot-only

Writes under --out (default runs/results/stability_map[_quick]; experiments/results/ with --record):
<length>/runs/<loss>_mb<M>_lr<lr>_seed<k>/, summary.json, stability_map.png (final
held-out gain per cell, k/n seeds collapsed) and clip_vs_length.png (clip fractions
against response length).
"""

from __future__ import annotations

import argparse
import dataclasses
import os

import numpy as np

from experiments import _plots, _results, _runs
from gspo_jax.config import LossConfig, TrainConfig

LENGTHS = {"short": (3, 40), "medium": (6, 72), "long": (11, 120)}   # task.steps, max_new_tokens
MINIBATCHES = (1, 4, 16)
LRS = (1e-4, 3e-4)
LOSSES = ("gspo", "grpo")


def variant(loss: str, minibatches: int, lr: float) -> str:
  return f"{loss}_mb{minibatches}_lr{lr:g}"


def config(length: str, loss: str, minibatches: int, lr: float, seed: int, quick: bool,
           iterations: int | None) -> TrainConfig:
  """configs/long_chain.py at `length` with 20 iterations, held-out evaluated every 5 on 128
  problems; each loss at its own (the paper's) clip range."""
  steps, max_new = LENGTHS[length]
  cfg = _runs.base_config("long", quick)
  if quick:  # base_config's quick sizes, at the shortest length
    steps, max_new = min(steps, 3), min(max_new, 40)
  else:
    cfg = dataclasses.replace(cfg, iterations=20, eval_every=5, eval_size=128)
  cfg = dataclasses.replace(
      cfg, task=dataclasses.replace(cfg.task, steps=steps),
      rollout=dataclasses.replace(cfg.rollout, max_new_tokens=max_new),
      num_minibatches=minibatches, optim=dataclasses.replace(cfg.optim, learning_rate=lr),
      loss=LossConfig(name=loss), seed=seed)
  return dataclasses.replace(cfg, iterations=iterations) if iterations else cfg


def collapsed(rows: list[dict], start: float) -> bool:
  """Every held-out evaluation after the run's halfway iteration is below `start` (the cold
  start's accuracy); False when there is none."""
  half = len(rows) / 2
  late = [r["heldout_accuracy"] for r in rows if "heldout_accuracy" in r and r["step"] > half]
  return bool(late) and all(a < start for a in late)


def summarise(out: str, lengths) -> dict:
  cells = {}
  for length in lengths:
    for name, items in _runs.load_runs(os.path.join(out, length)).items():
      cell = {"seeds": [], "heldout_start": [], "heldout_end": [], "collapsed": [],
              "clip_frac_token_mean": [], "clip_frac_seq_mean": [], "response_length_mean": []}
      for it in items:
        start = it["summary"]["heldout_accuracy_start"]
        cell["seeds"].append(it["seed"])
        cell["heldout_start"].append(start)
        cell["heldout_end"].append(it["summary"]["heldout_accuracy_end"])
        cell["collapsed"].append(collapsed(it["rows"], start))
        for key in ("clip_frac_token", "clip_frac_seq", "response_length"):
          cell[f"{key}_mean"].append(float(np.mean([r[key] for r in it["rows"]])))
        # What the collapse rule reads and the text quotes: every evaluation, the extreme ratio.
        cell.setdefault("heldout_curve", []).append(_runs.heldout_curves([it])[0])
        cell.setdefault("ratio_max_max", []).append(max(r["ratio_max"] for r in it["rows"]))
      cell["heldout_gain_mean"] = float(np.mean(np.subtract(cell["heldout_end"],
                                                            cell["heldout_start"])))
      cells[f"{length}/{name}"] = cell
  return {"cells": cells, "collapsed_runs": sum(sum(c["collapsed"]) for c in cells.values()),
          "runs": sum(len(c["seeds"]) for c in cells.values())}


def plot(summary: dict, out: str, lengths, minibatches, lrs) -> str:
  """stability_map.png (`_plots.stability_map`): per loss, rows = length, columns = (lr,
  minibatches); colour = mean held-out gain, text = seeds collapsed of seeds run."""
  from experiments.figures import stability_cells
  return _plots.stability_map(stability_cells(summary), out, lengths,
                              [(lr, m) for lr in lrs for m in minibatches], LOSSES)


def plot_clipping(summary: dict, out: str, minibatches, lrs) -> str:
  """Clip fractions against mean response length (the three lengths), one line per loss,
  off-policy minibatch count and learning rate (mean over seeds): the fraction of tokens
  clipped and the fraction of responses with at least one clipped token. One minibatch is
  left out: every ratio is exactly 1 there."""
  fig, axes = _plots.figure(ncols=2, figsize=(10, 3.6))
  for loss, colour in zip(LOSSES, ("tab:blue", "tab:red")):
    for lr in lrs:
      for m, marker in zip([m for m in minibatches if m > 1], "os^v"):
        cells = [summary["cells"].get(f"{length}/{variant(loss, m, lr)}") for length in LENGTHS]
        cells = [c for c in cells if c]
        if not cells:
          continue
        x = [np.mean(c["response_length_mean"]) for c in cells]
        for ax, key in zip(axes, ("clip_frac_token_mean", "clip_frac_seq_mean")):
          ax.plot(x, [max(np.mean(c[key]), 1e-5) for c in cells], color=colour, marker=marker,
                  linestyle="-" if lr == min(lrs) else "--",
                  label=f"{loss.upper()} {m} mb lr {lr:g}")
  for ax, title in zip(axes, ("tokens clipped", "responses with a clipped token")):
    ax.set_yscale("log")
    ax.set_xlabel("mean response length (tokens)")
    ax.set_title(title)
  return _plots.save(fig, axes[1], out, "clip_vs_length.png", grid=False, legend_size=6)


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--quick", action="store_true", help="tiny sizes, 2 iterations per cell")
  parser.add_argument("--lengths", nargs="+", default=list(LENGTHS), choices=list(LENGTHS))
  parser.add_argument("--minibatches", nargs="+", type=int, default=list(MINIBATCHES))
  parser.add_argument("--lrs", nargs="+", type=float, default=list(LRS))
  parser.add_argument("--losses", nargs="+", default=list(LOSSES), choices=list(LOSSES))
  parser.add_argument("--seeds", nargs="+", type=int, default=[0])
  parser.add_argument("--iterations", type=int, default=None, help="override (default 20)")
  parser.add_argument("--plot-only", action="store_true")
  parser.add_argument("--out", default=None)
  _results.add_record_arg(parser)
  args = parser.parse_args(argv)
  out = _results.out_path(args, "stability_map_quick" if args.quick else "stability_map")
  if not args.plot_only:
    for seed in args.seeds:
      for length in args.lengths:
        for loss in args.losses:
          for lr in args.lrs:
            for m in args.minibatches:
              cfg = config(length, loss, m, lr, seed, args.quick, args.iterations)
              _runs.run_one(os.path.join(out, length), variant(loss, m, lr), seed, cfg)
  summary = summarise(out, [l for l in LENGTHS if os.path.isdir(os.path.join(out, l))])
  if not summary["runs"]:
    parser.error(_runs.NO_RUNS.format(out=os.path.join(out, "<length>", "runs")))
  _runs.write_summary(out, summary)
  minibatches = sorted(set(MINIBATCHES) | set(args.minibatches))
  lrs = sorted(set(LRS) | set(args.lrs))
  print("wrote", os.path.join(out, "summary.json"),
        plot(summary, out, list(LENGTHS), minibatches, lrs),
        plot_clipping(summary, out, minibatches, lrs))
  return summary


if __name__ == "__main__":
  main()
