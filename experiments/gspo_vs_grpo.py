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
import json
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from experiments import _plots  # noqa: E402
from gspo_jax import configlib  # noqa: E402
from gspo_jax import train as T  # noqa: E402

CLIP = {"gspo": (3e-4, 4e-4), "grpo": (0.2, 0.27)}
PHASES = ("time_sample", "time_score", "time_old_logp", "time_update")


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


def run_one(out: str, loss: str, seed: int, quick: bool, iterations: int | None) -> str:
  run_dir = os.path.join(out, "runs", f"{loss}_seed{seed}")
  if os.path.exists(os.path.join(run_dir, "summary.json")):
    print(f"{run_dir}: done already")
    return run_dir
  if os.path.isdir(run_dir):  # an interrupted run: start it again
    import shutil
    shutil.rmtree(run_dir)
  summary = T.train(config(loss, seed, quick, iterations), run_dir, progress=False,
                    checkpoint_every=0, keep=1)
  with open(os.path.join(run_dir, "summary.json"), "w") as f:
    json.dump({k: v for k, v in summary.items() if k != "last"}, f, indent=2)
  return run_dir


def load_runs(out: str) -> dict[str, list[dict]]:
  """loss -> [{seed, metrics (list of rows), summary}] for every finished run."""
  runs: dict[str, list[dict]] = {}
  base = os.path.join(out, "runs")
  for name in sorted(os.listdir(base)) if os.path.isdir(base) else []:
    path = os.path.join(base, name)
    if not os.path.exists(os.path.join(path, "summary.json")):
      continue
    loss, seed = name.rsplit("_seed", 1)
    rows = [json.loads(l) for l in open(os.path.join(path, "metrics.jsonl"))]
    summary = json.load(open(os.path.join(path, "summary.json")))
    runs.setdefault(loss, []).append({"seed": int(seed), "rows": rows, "summary": summary})
  return runs


def curve(rows, key):
  pts = [(r["step"], r[key]) for r in rows if key in r]
  return np.array([p[0] for p in pts]), np.array([p[1] for p in pts], float)


def summarise(runs: dict[str, list[dict]]) -> dict:
  out = {}
  for loss, items in runs.items():
    last = lambda key, n=50: [float(np.mean([r[key] for r in it["rows"][-n:]])) for it in items]
    mean_over = lambda key: [float(np.mean([r[key] for r in it["rows"]])) for it in items]
    start = [it["summary"]["heldout_accuracy_start"] for it in items]
    end = [it["summary"]["heldout_accuracy_end"] for it in items]
    wall = [float(sum(sum(r[p] for p in PHASES) for r in it["rows"])) for it in items]
    out[loss] = {
        "seeds": [it["seed"] for it in items], "iterations": len(items[0]["rows"]),
        "heldout_start": start, "heldout_end": end,
        "heldout_gain_mean": float(np.mean(np.subtract(end, start))),
        "heldout_gain_std": float(np.std(np.subtract(end, start))),
        "reward_last50": last("reward_mean"),
        "clip_frac_token_mean": mean_over("clip_frac_token"),
        "clip_frac_seq_mean": mean_over("clip_frac_seq"),
        "train_seconds": wall}
  if {"gspo", "grpo"} <= set(out):
    grpo = float(np.mean(out["grpo"]["clip_frac_token_mean"]))
    out["clip_ratio_gspo_over_grpo"] = (  # None: GRPO clipped no token at all
        float(np.mean(out["gspo"]["clip_frac_token_mean"])) / grpo if grpo > 0 else None)
  return out


def plot(runs: dict[str, list[dict]], out: str) -> list[str]:
  colours = {"gspo": "tab:blue", "grpo": "tab:orange"}
  files = []

  def figure(name, key, ylabel, x="step", smooth=1):
    fig, ax = _plots.figure()
    for loss, items in sorted(runs.items()):
      for i, it in enumerate(items):
        steps, ys = curve(it["rows"], key)
        if not len(ys):
          continue
        if smooth > 1 and len(ys) >= smooth:
          ys = np.convolve(ys, np.ones(smooth) / smooth, mode="valid")
          steps = steps[smooth - 1:]
        xs = steps
        if x == "time":
          t = np.cumsum([sum(r[p] for p in PHASES) for r in it["rows"]])
          xs = t[steps - 1]
        ax.plot(xs, ys, color=colours.get(loss), alpha=0.8,
                label=f"{loss.upper()}" if i == 0 else None)
    ax.set_xlabel("training seconds (sample+score+old log-probs+update)" if x == "time" else
                  "iteration")
    ax.set_ylabel(ylabel)
    files.append(_plots.save(fig, ax, out, name))

  figure("reward.png", "reward_mean", "training reward (mean of 20 iterations)", smooth=20)
  figure("reward_vs_time.png", "reward_mean", "training reward (mean of 20 iterations)",
         x="time", smooth=20)
  figure("heldout.png", "heldout_accuracy", "held-out greedy accuracy")
  fig, ax = _plots.figure()
  for loss, items in sorted(runs.items()):
    for i, it in enumerate(items):
      steps, ys = curve(it["rows"], "clip_frac_token")
      ax.plot(steps, np.maximum(ys, 1e-5), color=colours.get(loss), alpha=0.8,
              label=loss.upper() if i == 0 else None)
  ax.set_yscale("log")
  ax.set_xlabel("iteration")
  ax.set_ylabel("fraction of tokens clipped (floored at 1e-5)")
  files.append(_plots.save(fig, ax, out, "clip_fraction.png"))
  return files


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
        run_one(out, loss, seed, args.quick, args.iterations)
  runs = load_runs(out)
  summary = summarise(runs)
  with open(os.path.join(out, "summary.json"), "w") as f:
    json.dump(summary, f, indent=2)
  files = plot(runs, out)
  print(json.dumps(summary, indent=2))
  print("wrote", os.path.join(out, "summary.json"), *files)
  return summary


if __name__ == "__main__":
  main()
