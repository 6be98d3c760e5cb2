"""Claim 1 with power (experiments/preregistered.md, part 5): the compact record of its runs.

The runs are `experiments/gspo_vs_grpo.py`'s (the registered command below); their folders
(metrics, checkpoints, tokenizers) are not committed. This reads every run folder and writes
what the registered analysis needs, per variant and seed, into one committed file,
experiments/results/claim1_powered/part5.json: the held-out accuracy at the cold start and
at every evaluation (iterations 5, 10, ..., 40), the training reward over the last 10
iterations, collapse (section 7's rule, `stability_map.collapsed`), clip fractions, and
each run's provenance (commit, command, machine, load averages, seconds). The summary.json
that gspo_vs_grpo.py writes beside it keeps its own keys (its `reward_last50` is the mean
of all 40 iterations here).

    python -m experiments.gspo_vs_grpo --task long --losses gspo grpo gspo_len --eps-tokens 63 \\
        --seeds 0 1 2 3 4 5 6 7 8 9 --iterations 40 \\
        --set task.steps=6 rollout.max_new_tokens=72 num_minibatches=8 eval_every=5 \\
              eval_size=512 sft.check_every=5 sft.probe_size=256 \\
        --out experiments/results/claim1_powered
    python -m experiments.claim1_powered --runs experiments/results/claim1_powered

The analysis and the README's tables: experiments/_readme_claim1.py.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os

import numpy as np

from experiments import _results

VARIANTS = ("gspo", "grpo", "gspo_len")
SEEDS = tuple(range(10))
NAME = "claim1_powered"
FILE = "part5.json"
# What the registration fixes for every run (config.json keys), checked on each run.
SETTING = {("task", "steps"): 6, ("rollout", "max_new_tokens"): 72, ("num_minibatches",): 8,
           ("rollout", "prompts_per_iter"): 32, ("rollout", "group_size"): 8,
           ("optim", "learning_rate"): 1e-4, ("iterations",): 40, ("eval_every",): 5,
           ("eval_size",): 512, ("sft", "check_every"): 5, ("sft", "probe_size"): 256,
           ("sft", "target_accuracy"): 0.3}
EPS = {"gspo": (3e-4, 4e-4), "grpo": (0.2, 0.27),
       "gspo_len": (0.2 / 63 ** 0.5, 0.27 / 63 ** 0.5)}


def _get(cfg: dict, path: tuple):
  for k in path:
    cfg = cfg[k]
  return cfg


def collapsed(rows: list[dict], start: float) -> bool:
  """Section 7's rule, as experiments/stability_map.py applies it: every held-out evaluation
  after the run's halfway iteration is below the cold start's accuracy."""
  half = len(rows) / 2
  late = [r["heldout_accuracy"] for r in rows if "heldout_accuracy" in r and r["step"] > half]
  return bool(late) and all(a < start for a in late)


def _eps(loss: dict) -> list[float]:
  """The run's clip range: its config's, or where unset (None) its loss's default, the
  paper's (`losses.LOSS_DEFAULTS`), as the loss applies it."""
  if loss["eps_low"] is not None and loss["eps_high"] is not None:
    return [loss["eps_low"], loss["eps_high"]]
  from gspo_jax.objectives import losses
  default = losses.LOSS_DEFAULTS[loss["name"]]
  return [loss["eps_low"] if loss["eps_low"] is not None else default["eps_low"],
          loss["eps_high"] if loss["eps_high"] is not None else default["eps_high"]]


def read_run(run_dir: str) -> dict | None:
  """One finished run's compact record; None when it did not finish (no summary.json)."""
  if not os.path.exists(os.path.join(run_dir, "summary.json")):
    return None
  load = lambda name: json.load(open(os.path.join(run_dir, name)))
  summary, cfg = load("summary.json"), load("config.json")
  rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl")) if line.strip()]
  start = float(summary["heldout_accuracy_start"])
  curve = [[0, start]] + [[int(r["step"]), float(r["heldout_accuracy"])]
                          for r in rows if "heldout_accuracy" in r]
  mean = lambda key, n=None: float(np.mean([r[key] for r in rows[-n if n else 0:]]))
  record = {
      "iterations": len(rows), "first_last_step": [int(rows[0]["step"]), int(rows[-1]["step"])],
      "heldout_start": start, "heldout_end": float(summary["heldout_accuracy_end"]),
      "heldout_curve": curve, "reward_last10": mean("reward_mean", 10),
      "reward_mean": mean("reward_mean"), "collapsed": collapsed(rows, start),
      "clip_frac_token_mean": mean("clip_frac_token"), "clip_frac_seq_mean": mean("clip_frac_seq"),
      "response_length_mean": mean("response_length"),
      "train_seconds": float(sum(r["time_iteration"] for r in rows)),
      "eps": _eps(cfg["loss"]), "loss": cfg["loss"]["name"],
      "setting": {".".join(k): _get(cfg, k) for k in SETTING},
      "finished_utc": datetime.datetime.fromtimestamp(
          os.path.getmtime(os.path.join(run_dir, "summary.json")),
          datetime.timezone.utc).strftime("%Y-%m-%d %H:%M")}
  if os.path.exists(os.path.join(run_dir, "provenance.json")):
    record["provenance"] = load("provenance.json")
  return record


def check(variant: str, seed: int, r: dict) -> list[str]:
  """Where a run departs from the registration (empty: it ran as registered)."""
  bad = [f"{k} = {v}, registered {SETTING[tuple(k.split('.'))]}"
         for k, v in r["setting"].items() if v != SETTING[tuple(k.split("."))]]
  if not np.allclose(r["eps"], EPS[variant], rtol=1e-6):
    bad.append(f"clip range {r['eps']}, registered {list(EPS[variant])}")
  if r["loss"] != ("gspo" if variant == "gspo_len" else variant):
    bad.append(f"loss {r['loss']}")
  evals = [s for s, _ in r["heldout_curve"][1:]]
  if evals != list(range(5, 41, 5)):
    bad.append(f"evaluations at {evals}, registered every 5 iterations to 40")
  elif r["heldout_curve"][-1][1] != r["heldout_end"]:
    bad.append("the last evaluation is not the summary's end")
  return [f"{variant} seed {seed}: {b}" for b in bad]


def compact(out: str, variants=VARIANTS, seeds=SEEDS) -> dict:
  """The committed record of every run under out/runs/ (see the module's docstring)."""
  record = {"registration": "experiments/preregistered.md, part 5", "variants": {},
            "coldstart_heldout": {}, "missing": [], "deviations": []}
  for variant in variants:
    v = record["variants"][variant] = {"seeds": []}
    for seed in seeds:
      r = read_run(os.path.join(out, "runs", f"{variant}_seed{seed}"))
      if r is None:
        record["missing"].append(f"{variant}_seed{seed}")
        continue
      record["deviations"] += check(variant, seed, r)
      v["seeds"].append(seed)
      for key, value in r.items():
        v.setdefault(key, []).append(value)
      # The cold start is shared by a seed's variants: every one must report the same.
      seen = record["coldstart_heldout"].setdefault(str(seed), r["heldout_start"])
      if seen != r["heldout_start"]:
        record["deviations"].append(f"seed {seed}: cold starts differ ({seen} vs "
                                    f"{r['heldout_start']})")
  provs = [p for v in record["variants"].values() for p in v.get("provenance", [])]
  if provs:
    loads = [x for p in provs for x in (p["load_average_before"][0], p["load_average_after"][0])]
    finished = sorted(t for v in record["variants"].values() for t in v.get("finished_utc", []))
    record["provenance"] = {
        "commits": sorted({p["commit"] for p in provs}),
        "dirty": sorted({p["dirty"] for p in provs}),
        "commands": sorted({p["command"] for p in provs}),
        "machines": sorted({p["machine"] for p in provs}),
        "load_1min_range": [min(loads), max(loads)],
        "run_seconds_range": [min(p["seconds"] for p in provs), max(p["seconds"] for p in provs)],
        "first_finished_utc": finished[0], "last_finished_utc": finished[-1]}
  return record


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--runs", required=True,
                      help="the registered command's --out (holding runs/<variant>_seed<k>/)")
  parser.add_argument("--out", default=os.path.join(_results.RESULTS, NAME, FILE))
  args = parser.parse_args(argv)
  record = compact(args.runs)
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  with open(args.out, "w") as f:
    json.dump(record, f, indent=1)
  print("wrote", args.out, "missing:", record["missing"] or "none",
        "deviations:", record["deviations"] or "none")
  return record


if __name__ == "__main__":
  main()
