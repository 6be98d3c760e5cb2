"""What the training experiments share: run one (variant, seed), load finished runs, summarise
and plot their metrics. A run directory is <out>/runs/<variant>_seed<k>/ (metrics.jsonl,
summary.json); one whose summary.json is missing was interrupted and starts again.

Training seconds are the loop's own `time_iteration` (`gspo_jax.train.loop.iterate`): the wall
time from one iteration to the next, with the device phases overlapping as they do in a
run, and the held-out evaluations and checkpoints the loop runs between iterations
included (the same for every variant of an experiment)."""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import shutil
import sys
import time

import numpy as np

from experiments import _plots, _results
from gspo_jax.config import LossConfig, TrainConfig
from gspo_jax.train import loop as train
from gspo_jax.utils import configlib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# What one iteration's metrics row says it took (the loop writes it for every iteration).
TIME = "time_iteration"
# --task: the config file an experiment starts from. "addition": 1-5-token answers, where
# GSPO's sequence ratio and GRPO's token ratios nearly coincide; "long": the chain task's
# 113-token worked solutions (docs/training.md "The long task").
TASK_CONFIGS = {"addition": "addition_tiny.py", "long": "long_chain.py"}


def base_config(task: str, quick: bool) -> TrainConfig:
  """The config file of `task`, with --quick's tiny sizes (every phase runs, nothing is
  learned). The long task also reports clip fractions per length quartile."""
  cfg = configlib.load_config(os.path.join(ROOT, "configs", TASK_CONFIGS[task]))
  if task == "long":
    cfg = dataclasses.replace(cfg, length_clip_metrics=True)
  if not quick:
    return cfg
  # A 4x narrower model (the time is compiling and running it under the test suite's
  # unoptimised XLA flags, not learning); the long task at 5 steps (52-token solutions).
  cfg = dataclasses.replace(cfg, model=dataclasses.replace(
      cfg.model, hidden=32, mlp_dim=64, num_heads=2, num_kv_heads=1, head_dim=16))
  if task == "addition":
    return dataclasses.replace(
        cfg, rollout=dataclasses.replace(cfg.rollout, prompts_per_iter=8),
        sft=dataclasses.replace(cfg.sft, steps=5, target_accuracy=0.0, batch_size=16),
        iterations=6, eval_every=3, eval_size=16)
  return dataclasses.replace(
      cfg, task=dataclasses.replace(cfg.task, steps=5),
      rollout=dataclasses.replace(cfg.rollout, prompts_per_iter=8, group_size=4,
                                  max_new_tokens=60, max_prompt_len=24),
      sft=dataclasses.replace(cfg.sft, steps=5, batch_size=16, target_accuracy=0.0),
      iterations=6, eval_every=3, eval_size=16)


def loss_config(loss: str, seed: int, quick: bool, iterations: int | None,
                task: str = "addition") -> TrainConfig:
  """The task's config file (`base_config`) with `loss`, eps unset so that each loss
  clips at its own (the paper's) range whatever the config file sets. gspo_vs_grpo.py's
  runs; precision_training.py changes where pi_old comes from on top of it."""
  cfg = base_config(task, quick)
  if iterations:
    cfg = dataclasses.replace(cfg, iterations=iterations)
  return dataclasses.replace(cfg, loss=LossConfig(name=loss), seed=seed)


def iteration_samples(cfg: dict) -> int:
  """Responses sampled (and scored) per iteration, from the run's config.json: the
  paper's Figure 1 x axis ("training compute" in samples): (prompts_per_iter + oversample)
  x group_size."""
  r = cfg["rollout"]
  return int((r["prompts_per_iter"] + r.get("oversample", 0)) * r["group_size"])


def iteration_flops(cfg: dict, row: dict) -> float:
  """Model FLOPs of one iteration, from the run's config.json and its metrics row: 2 per
  active matmul parameter per token forward, 6 forward + backward.

    sampling  2 W (B P + B G steps) + 2 D V B G steps  (prefill once per prompt, then
              `decode_steps` steps for all B G rows: the loop runs until the longest ends)
    pi_old    2 W R S + 2 D V R T       (teacher forcing over R = B G rows, S = P + T)
    update    3 x pi_old                (every minibatch, forward + backward)
    pi_ref    1 x pi_old when loss.kl_coef > 0

  W = active matmul weights of the layers (attention, SwiGLU or the top-k experts and the
  router); attention's score and value products, a few percent at these lengths, are left
  out, as is the held-out evaluation. Every program runs on static shapes, so only
  `decode_steps` differs between iterations and variants."""
  m, r = cfg["model"], cfg["rollout"]
  D, L, V = m["hidden"], m["num_layers"], m["vocab_size"]
  attn = D * m["num_heads"] * m["head_dim"] * 2 + 2 * D * m["num_kv_heads"] * m["head_dim"]
  if m.get("num_experts"):
    mlp = 3 * D * m["moe_mlp_dim"] * m["experts_per_token"] + D * m["num_experts"]
  else:
    mlp = 3 * D * m["mlp_dim"]
  W = L * (attn + mlp)
  B, G, P, T = r["prompts_per_iter"], r["group_size"], r["max_prompt_len"], r["max_new_tokens"]
  steps = row.get("decode_steps", T)
  sample = 2 * W * (B * P + B * G * steps) + 2 * D * V * B * G * steps
  teacher = 2 * W * B * G * (P + T) + 2 * D * V * B * G * T
  return float(sample + teacher * (4 + (cfg["loss"].get("kl_coef", 0) > 0)))
# Metrics logged only at evaluations whose step-0 value is in the run's summary.json.
STARTS = {"heldout_accuracy": "heldout_accuracy_start"}
COLOURS = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple")


def cold_start(out: str, seed: int, cfg: TrainConfig) -> str:
  """The cold-started policy of `seed`, made once per experiment directory and shared by its
  variants (which must differ only in RL settings): a run of 0 RL iterations whose step-0
  checkpoint (with its tokenizer) each variant resumes from. The cold start is deterministic
  per seed, so this equals cold-starting every variant, once instead of once per variant."""
  run_dir = os.path.join(out, "runs", f"coldstart_seed{seed}")
  done = os.path.join(run_dir, "done")
  os.makedirs(os.path.dirname(run_dir), exist_ok=True)
  # Processes that share `out` (the README runs an experiment's halves side by side) take
  # turns: without the lock, the second removed the first's half-written cold start.
  with open(f"{run_dir}.lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    if not os.path.exists(done):
      if os.path.isdir(run_dir):
        shutil.rmtree(run_dir)
      # The cold start's progress (and whether it reached its target) is printed, not
      # logged as metrics: keep a copy beside the run, to be committed with the results.
      with open(f"{run_dir}.log", "w") as log, contextlib.redirect_stdout(_Tee(sys.stdout, log)):
        train.train(dataclasses.replace(cfg, iterations=0), run_dir, progress=False,
                    checkpoint_every=0, keep=1)
      open(done, "w").close()
  return run_dir


class _Tee:
  """A stdout that writes to every stream it was given."""

  def __init__(self, *streams):
    self.streams = streams

  def write(self, text: str) -> int:
    for stream in self.streams:
      stream.write(text)
    return len(text)

  def flush(self) -> None:
    for stream in self.streams:
      stream.flush()


def run_one(out: str, name: str, seed: int, cfg: TrainConfig) -> str:
  run_dir = os.path.join(out, "runs", f"{name}_seed{seed}")
  if os.path.exists(os.path.join(run_dir, "summary.json")):
    print(f"{run_dir}: done already")
    return run_dir
  if os.path.isdir(run_dir):
    shutil.rmtree(run_dir)
  start = cold_start(out, seed, cfg)
  os.makedirs(run_dir)
  shutil.copytree(os.path.join(start, "checkpoints"), os.path.join(run_dir, "checkpoints"))
  shutil.copy(os.path.join(start, "tokenizer.model"), run_dir)
  started, load = time.time(), os.getloadavg()
  summary = train.train(cfg, run_dir, resume=True, progress=False, checkpoint_every=0, keep=1)
  # How this run was made (its commit, command, CPU, load): a long experiment spans
  # sessions and machines' moods, so each run keeps its own.
  with open(os.path.join(run_dir, "provenance.json"), "w") as f:
    json.dump(_results.provenance(started, load), f, indent=2)
  with open(os.path.join(run_dir, "summary.json"), "w") as f:
    json.dump({k: v for k, v in summary.items() if k != "last"}, f, indent=2)
  return run_dir


# --plot-only on a folder without one finished run: an error, not empty plots.
NO_RUNS = ("--out / --plot-only: no finished run under {out} (a run is finished once its "
           "summary.json is written); run the experiment first or pass the --out it wrote to")


def load_runs(out: str) -> dict[str, list[dict]]:
  """variant -> [{seed, rows (metrics.jsonl), summary}] for every finished run."""
  runs: dict[str, list[dict]] = {}
  base = os.path.join(out, "runs")
  for name in sorted(os.listdir(base)) if os.path.isdir(base) else []:
    path = os.path.join(base, name)
    if not os.path.exists(os.path.join(path, "summary.json")):
      continue
    variant, seed = name.rsplit("_seed", 1)
    rows = [json.loads(l) for l in open(os.path.join(path, "metrics.jsonl"))]
    summary = json.load(open(os.path.join(path, "summary.json")))
    # Runs saved before the config grouped its fields still load (TrainConfig.migrate).
    cfg = TrainConfig.migrate(json.load(open(os.path.join(path, "config.json"))))
    for row in rows:
      row["flops"] = iteration_flops(cfg, row)
      row["samples"] = iteration_samples(cfg)
    runs.setdefault(variant, []).append({"seed": int(seed), "rows": rows, "summary": summary})
  return runs


def curve(rows, key):
  pts = [(r["step"], r[key]) for r in rows if key in r]
  return np.array([p[0] for p in pts]), np.array([p[1] for p in pts], float)


def summarise(items: list[dict], mean_keys=("clip_frac_token", "clip_frac_seq")) -> dict:
  """Per seed: held-out start/end, training reward over the last 50 iterations, the mean of
  `mean_keys` over training, training seconds."""
  last = lambda key, n=50: [float(np.mean([r[key] for r in it["rows"][-n:]])) for it in items]
  start = [it["summary"]["heldout_accuracy_start"] for it in items]
  end = [it["summary"]["heldout_accuracy_end"] for it in items]
  out = {"seeds": [it["seed"] for it in items], "iterations": len(items[0]["rows"]),
         "heldout_start": start, "heldout_end": end,
         "heldout_gain_mean": float(np.mean(np.subtract(end, start))),
         "heldout_gain_std": float(np.std(np.subtract(end, start))),
         "reward_last50": last("reward_mean"),
         "heldout_curve": heldout_curves(items),
         "reward_curve": reward_curves(items),
         "train_seconds": [float(sum(r[TIME] for r in it["rows"])) for it in items]}
  for key in mean_keys:  # None: the metric was not logged (e.g. routing_changed under replay)
    vals = [[r[key] for r in it["rows"] if key in r] for it in items]
    out[f"{key}_mean"] = [float(np.mean(v)) if v else None for v in vals]
  return out


def series(run: dict, key: str, *, smooth: int = 1, x: str = "step"):
  """(xs, ys) of metric `key` of one run ({rows, summary}): optionally a running mean over
  `smooth` iterations; a metric of STARTS begins at step 0 with its summary value; x is the
  iteration, or (x="time" / "flops") the loop's seconds / model FLOPs after it."""
  steps, ys = curve(run["rows"], key)
  if not len(ys):
    return steps, ys
  if smooth > 1 and len(ys) >= smooth:
    ys = np.convolve(ys, np.ones(smooth) / smooth, mode="valid")
    steps = steps[smooth - 1:]
  elif key in STARTS and STARTS[key] in run["summary"]:
    steps = np.concatenate([[0], steps]).astype(int)
    ys = np.concatenate([[run["summary"][STARTS[key]]], ys])
  if x not in ("time", "flops", "samples"):
    return steps, ys
  per_iteration = [r[{"time": TIME}.get(x, x)] for r in run["rows"]]
  return np.cumsum([0.0] + per_iteration)[steps], ys


def plot_curves(runs: dict[str, list[dict]], out: str, name: str, key: str, ylabel: str, *,
                colours: dict[str, str] | None = None, smooth: int = 1, x: str = "step",
                log: bool = False, floor: float = 0.0) -> str:
  """One line per (variant, seed) of metric `key`, one colour per variant, optionally a
  running mean over `smooth` iterations, against iteration or (x="time") training seconds."""
  colours = colours or {v: COLOURS[i % len(COLOURS)] for i, v in enumerate(sorted(runs))}
  fig, ax = _plots.figure()
  for variant, items in sorted(runs.items()):
    for i, it in enumerate(items):
      xs, ys = series(it, key, smooth=smooth, x=x)
      if not len(ys):
        continue
      ax.plot(xs, np.maximum(ys, floor) if floor else ys, color=colours.get(variant), alpha=0.8,
              label=variant.upper().replace("_", " ") if i == 0 else None)
  if log:
    ax.set_yscale("log")
  ax.set_xlabel(XLABELS.get(x, "iteration"))
  ax.set_ylabel(ylabel)
  return _plots.save(fig, ax, out, name)


def plot_range(runs: dict[str, list[dict]], out: str, name: str, keys: tuple[str, str],
               ylabel: str, *, colours: dict[str, str] | None = None) -> str:
  """Both ends of a per-iteration range, (low, high) = `keys`, one colour per variant: the
  high end solid, the low end dashed, on a log scale (ratios above and below 1)."""
  colours = colours or {v: COLOURS[i % len(COLOURS)] for i, v in enumerate(sorted(runs))}
  fig, ax = _plots.figure()
  for variant, items in sorted(runs.items()):
    for i, it in enumerate(items):
      for key, style in zip(keys, ("--", "-")):
        xs, ys = series(it, key)
        if len(ys):
          ax.plot(xs, ys, style, color=colours.get(variant), alpha=0.8,
                  label=f"{variant.upper().replace('_', ' ')} ({key})" if i == 0 else None)
  ax.axhline(1, color="black", lw=0.8)
  ax.set_yscale("log")
  ax.set_xlabel("iteration")
  ax.set_ylabel(ylabel)
  return _plots.save(fig, ax, out, name)


XLABELS = {"time": "training seconds (wall time of the loop's iterations)",
           "flops": "model FLOPs (experiments/_runs.py iteration_flops)",
           "samples": "responses sampled (experiments/_runs.py iteration_samples)"}


def reward_curves(items: list[dict]) -> list[list[list[float]]]:
  """Per seed, [[iteration, responses sampled after it, model FLOPs after it, training
  reward], ...]: the paper's Figure 1 axes, kept in the summary so that
  `experiments.figures` can redraw them without the runs."""
  out = []
  for it in items:
    samples, flops = 0, 0.0
    rows = []
    for r in it["rows"]:
      samples, flops = samples + r["samples"], flops + r["flops"]
      rows.append([int(r["step"]), int(samples), float(f"{flops:.4g}"),
                   round(float(r["reward_mean"]), 5)])
    out.append(rows)
  return out


def heldout_curves(items: list[dict]) -> list[list[list[float]]]:
  """Per seed, [[step, held-out accuracy], ...] from the cold start (step 0) on: the curve
  the held-out plots draw, kept in the summary so that the text can quote any point of it."""
  return [[[int(x), float(y)] for x, y in zip(*series(it, "heldout_accuracy"))] for it in items]


def write_summary(out: str, summary: dict) -> None:
  with open(os.path.join(out, "summary.json"), "w") as f:
    json.dump(summary, f, indent=2)
  print(json.dumps(summary, indent=2))


def standard_plots(runs, out: str, colours: dict[str, str]) -> list[str]:
  """reward.png (20-iteration running mean), heldout.png, clip_fraction.png (log scale),
  figure1.png (reward and held-out against responses sampled and FLOPs, `_plots.figure1`)."""
  c = {"colours": colours}
  curves = {v: {"reward_curve": reward_curves(items), "heldout_curve": heldout_curves(items)}
            for v, items in runs.items()}
  # figure1.png in figure1's own colours, as `python -m experiments.figures` redraws it
  return [_plots.figure1(curves, out),
      plot_curves(runs, out, "reward.png", "reward_mean", "training reward (mean of 20 iterations)",
                  smooth=20, **c),
      plot_curves(runs, out, "heldout.png", "heldout_accuracy", "held-out greedy accuracy", **c),
      plot_curves(runs, out, "clip_fraction.png", "clip_frac_token",
                  "fraction of tokens clipped (floored at 1e-5)", log=True, floor=1e-5, **c)]


def main(argv, *, doc: str, name: str, variants, config, summarise, plot, seeds=(0,),
         flag: str = "--variants", add_args=None, default_variants=None) -> dict:
  """The command line every training experiment shares: run each (seed, variant) not yet
  finished, then summarise and plot whatever is finished under
  runs/results/<name>[_long][_quick] (experiments/results/ with --record, or --out).
  `config(variant, seed, args)` builds the TrainConfig (`base_config(args.task, args.quick)`
  is the starting point); `add_args(parser)` adds the experiment's own flags; `default_variants` (all of `variants`
  if None) run when the flag is not given."""
  import argparse
  parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
  parser.add_argument("--quick", action="store_true", help="tiny sizes, 6 iterations")
  parser.add_argument("--task", default="addition", choices=list(TASK_CONFIGS),
                      help="addition: configs/addition_tiny.py; long: configs/long_chain.py")
  parser.add_argument(flag, dest="variants", nargs="+",
                      default=list(default_variants or variants), choices=list(variants))
  parser.add_argument("--seeds", nargs="+", type=int, default=list(seeds))
  parser.add_argument("--iterations", type=int, default=None, help="override the config's")
  parser.add_argument("--plot-only", action="store_true", help="only summarise finished runs")
  parser.add_argument("--set", dest="overrides", nargs="+", default=[], metavar="KEY=VALUE",
                      help="config overrides for every run (configlib.apply_overrides), e.g. "
                           "task.steps=6 num_minibatches=8 sft.check_every=5")
  parser.add_argument("--out", default=None,
                      help=f"default: runs/results/{name}[_long][_quick], or under "
                           "experiments/results/ with --record")
  _results.add_record_arg(parser)
  if add_args:
    add_args(parser)
  args = parser.parse_args(argv)
  suffix = ("_long" if args.task == "long" else "") + ("_quick" if args.quick else "")
  out = _results.out_path(args, name + suffix)
  if not args.plot_only:
    os.makedirs(out, exist_ok=True)
    for seed in args.seeds:
      for v in args.variants:
        run_one(out, v, seed, configlib.apply_overrides(config(v, seed, args), args.overrides))
  runs = load_runs(out)
  if not runs:
    parser.error(NO_RUNS.format(out=os.path.join(out, "runs")))
  summary = summarise(runs)
  write_summary(out, summary)
  print("wrote", os.path.join(out, "summary.json"), *plot(runs, out))
  return summary
