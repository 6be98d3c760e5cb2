"""A LoRA config's held-out curve beside full fine-tuning's: each trained from its own config
file, the same seed, the curve from each run's evaluations.

    python -m experiments.lora_curve --variant full --config configs/smollm2_addition.py \
        --set iterations=60 eval_every=20 eval_size=128 --record
    python -m experiments.lora_curve --variant lora --config configs/smollm2_addition_lora.py \
        --set iterations=60 eval_every=20 eval_size=128 --record

One variant per command, so that the process's peak resident memory (`ru_maxrss`) is that
run's. `--from-run DIR` records a run that finished training but whose command did not get
to write its record: its curve from DIR's metrics.jsonl (no step-0 point: that evaluation
is not in the file), its bytes from its checkpoint, and no seconds or memory (null). Each command adds its variant to <out>/summary.json (default runs/results/lora_curve/,
experiments/results/lora_curve/ with --record, or --name): the config, the overrides, the
held-out curve ([[step, accuracy], ...], step 0 before any update), the wall seconds of the
training call, the peak memory, and the update's state in bytes (adapters or parameters,
with their optimiser state) beside the frozen base's.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import shutil
import time

from experiments import _bench, _results
from gspo_jax.lora import adapters as lora
from gspo_jax.train import loop as T
from gspo_jax.utils import configlib


def curve(run_dir: str, start: float | None) -> list[list[float]]:
  """[[0, start], [step, held-out accuracy], ...] from the run's metrics.jsonl (without the
  step-0 point when `start` is None)."""
  with open(os.path.join(run_dir, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f]
  return [[0, start]] * (start is not None) + [[r["step"], r["heldout_accuracy"]]
                                               for r in rows if "heldout_accuracy" in r]


def state_bytes(cfg, run_dir: str) -> dict:
  """The trained run's update state and frozen base in bytes (`run.load_run`)."""
  from gspo_jax.train.run import load_run
  run = load_run(run_dir)
  out = {"param_bytes": lora.num_bytes(run.state.params),
         "opt_bytes": lora.num_bytes(run.state.opt_state),
         "frozen_base_bytes": 0 if run.frozen is None else lora.num_bytes(run.frozen.params)}
  out["update_state_bytes"] = out["param_bytes"] + out["opt_bytes"]
  return out


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--variant", required=True, choices=("full", "lora"))
  p.add_argument("--config", required=True)
  p.add_argument("--set", dest="overrides", nargs="+", default=[], metavar="KEY=VALUE")
  p.add_argument("--name", default="lora_curve", help="the results folder's name")
  p.add_argument("--out", default=None, help="default: runs/results/<name>")
  p.add_argument("--from-run", default=None, metavar="DIR",
                 help="record this finished run of the variant instead of training one")
  _results.add_record_arg(p)
  args = p.parse_args(argv)
  cfg = configlib.apply_overrides(configlib.load_config(args.config), args.overrides)
  if (args.variant == "lora") != (cfg.lora.rank > 0):
    raise SystemExit(f"--variant {args.variant}: {args.config} has lora.rank = {cfg.lora.rank}")
  out = args.out or os.path.join(_results.results_dir(args.record), args.name)
  run_dir = args.from_run or os.path.join(out, "runs", args.variant)
  if args.from_run:
    saved = configlib.load_json(type(cfg), os.path.join(run_dir, "config.json"))
    if cfg.pretrained:  # the run saved `model` as the pretrained directory gave it
      saved = dataclasses.replace(saved, model=cfg.model)
    if saved != cfg:
      raise SystemExit(f"--from-run {run_dir}: its config.json is not {args.config} with "
                       f"{args.overrides}")
    start, seconds, rss = None, None, None
  else:
    if os.path.isdir(run_dir):
      shutil.rmtree(run_dir)
    t0 = time.perf_counter()
    start = T.train(cfg, run_dir, progress=False, checkpoint_every=0,
                    keep=1)["heldout_accuracy_start"]
    seconds = time.perf_counter() - t0
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
  record = {"config": args.config, "overrides": args.overrides, "seed": cfg.seed,
            "iterations": cfg.iterations, "eval_size": cfg.eval_size,
            "learning_rate": cfg.optim.learning_rate,
            "lora": {"rank": cfg.lora.rank, "alpha": cfg.lora.alpha,
                     "targets": list(cfg.lora.targets), "base_dtype": cfg.lora.base_dtype},
            "heldout_curve": curve(run_dir, start),
            "train_seconds": seconds, "peak_rss_mib": rss,
            **state_bytes(cfg, run_dir), "machine": _bench.machine()}
  path = os.path.join(out, "summary.json")
  both = json.load(open(path)) if os.path.exists(path) else {}
  both[args.variant] = record
  os.makedirs(out, exist_ok=True)
  with open(path, "w") as f:
    json.dump(both, f, indent=2)
  print(f"{args.variant}: held-out {record['heldout_curve']}, {seconds} s, peak RSS "
        f"{rss} MiB; wrote {path}")
  return record


if __name__ == "__main__":
  main()
