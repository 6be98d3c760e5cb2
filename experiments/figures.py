"""Redraw, from the committed summaries alone, every figure of experiments/README.md that a
summary holds the numbers for:

    python -m experiments.figures             # writes under experiments/results/
    python -m experiments.figures --out DIR   # the same figures elsewhere

  <dir>/paired.png          each comparison's per-seed differences, mean and 95% t-interval
                            (the README's paired tables: readme_tables.PAIRED)
  stability_map/stability_map.png   mean gain per cell, k/n seeds collapsed
  routing_replay{,_long}/ratio_extremes.png   smallest and largest ratio of every run
  claim1_powered/paired.png the registered paired comparisons of preregistered.md part 5
                            over its analysis set (experiments/_readme_claim1.py)
  routing_replay_depth{,_L4}/paired.png   part 4 stage B's (16 layers) and stage C's
                            (4 layers) B1 and B3 comparisons (experiments/_readme_replay_depth.py)
  <dir>/figure1.png         the paper's Figure 1 view (training reward and held-out against
                            responses sampled and FLOPs), for every summary that keeps its
                            runs' reward curves (`reward_curve`, summaries written since)

The curves (reward, held-out, clip fraction against iteration) need the runs' per-iteration
metrics, so only the experiment scripts' --plot-only draws them.
"""

from __future__ import annotations

import argparse
import json
import os

from experiments import _plots, _readme_claim1, _readme_replay_depth, _results
from experiments._tables import load
from experiments.readme_tables import PAIRED

LENGTHS = ("short", "medium", "long")
COLUMNS = [(lr, mb) for lr in (1e-4, 3e-4) for mb in (1, 4, 16)]


def paired_figures(out: str) -> list[str]:
  """One paired.png per results folder, its comparisons in the README's order."""
  by_dir: dict[str, list] = {}
  for _, (folder, comparisons) in PAIRED.items():
    by_dir.setdefault(folder, []).extend(comparisons())
  return [_plots.paired([(c[0], c[1], c[2]) for c in cmp], os.path.join(out, folder),
                        "paired.png", title=f"{folder}: a − b per seed, 95% t-interval")
          for folder, cmp in by_dir.items()]


def stability_cells(summary: dict) -> dict:
  """The summary's cells keyed (length, loss, lr, minibatches) for `_plots.stability_map`."""
  cells = {}
  for key, c in summary["cells"].items():
    length, variant = key.split("/")
    loss, mb, lr = variant.split("_")
    cells[(length, loss, float(lr[2:]), int(mb[2:]))] = {
        "gains": [e - s for s, e in zip(c["heldout_start"], c["heldout_end"])],
        "collapsed": c["collapsed"]}
  return cells


def ratio_runs(summary: dict) -> dict:
  keys = ("ratio_min_min", "ratio_max_max", "ratio_min_mean", "ratio_max_mean")
  return {v: {k: s[k] for k in keys} for v, s in summary.items() if "ratio_min_min" in s}


def figure1_entries(path: str) -> dict:
  """variant -> {reward_curve, heldout_curve} of a summary written by `_runs.summarise`
  ({} when it has no reward curves)."""
  if not os.path.exists(path):
    return {}
  summary = json.load(open(path))
  return {v: s for v, s in summary.items()
          if isinstance(s, dict) and "reward_curve" in s and "heldout_curve" in s}


def main(argv=None) -> list[str]:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--out", default=_results.RESULTS, help="default: experiments/results/")
  args = parser.parse_args(argv)
  paths = paired_figures(args.out)
  paths.append(_plots.stability_map(stability_cells(load("stability_map")),
                                    os.path.join(args.out, "stability_map"), LENGTHS, COLUMNS))
  for name in ("routing_replay", "routing_replay_long"):
    paths.append(_plots.ratio_extremes(ratio_runs(load(name)), os.path.join(args.out, name)))
  for name in sorted(os.listdir(_results.RESULTS)):
    entries = figure1_entries(os.path.join(_results.RESULTS, name, "summary.json"))
    if entries:
      paths.append(_plots.figure1(entries, os.path.join(args.out, name)))
  paths.append(_plots.paired(_readme_claim1.figure_comparisons(),
                             os.path.join(args.out, _readme_claim1.NAME), "paired.png",
                             title="claim 1 with power (part 5): a − b per seed, 95% t-interval"))
  for stage, (folder, _) in _readme_replay_depth.STAGES.items():
    d = _readme_replay_depth.load(stage=stage)
    paths.append(_plots.paired(
        _readme_replay_depth.figure_comparisons(d), os.path.join(args.out, folder), "paired.png",
        title=f"MoE at {d['layers']} layers (part 4 stage {stage}): a − b per seed, 95% t-interval"))
  print("wrote", *paths, sep="\n  ")
  return paths


if __name__ == "__main__":
  main()
