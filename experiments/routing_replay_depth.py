"""Stage B of experiments/preregistered.md part 4: GRPO free vs GRPO with Routing Replay vs
GSPO free on the 16-layer MoE, 4 paired seeds, analysed as registered. Written before any of
its runs finished.

The runs are `experiments/routing_replay.py`'s (the registered command below, one process
per seed, as the amendment in preregistered.md says); each finished run's small files
(config.json, metrics.jsonl, summary.json, provenance.json) are committed under
experiments/results/routing_replay_depth/runs/. This reads them and writes
experiments/results/routing_replay_depth/stage_b.json:

- B1 (primary): held-out accuracy after 40 iterations, paired over the seeds: (i) GRPO
  replay - GRPO free, (ii) GSPO free - GRPO free, (iii) GSPO free - GRPO replay; 95%
  t-intervals, paired t-test p values and their Holm adjustment over the three.
- B2: collapses per variant (section 7's rule on the evaluations every 5 iterations), GRPO
  free against each of the other two by Fisher's exact test.
- B3: training reward, mean of the 40 iterations, paired as B1.
- Descriptive: routing_changed, approx KL, the smallest and largest ratios (per run, the
  medians over iterations and the extremes).

It refuses to analyse until every registered run has finished (no interim looks).

    python -m experiments.routing_replay --task long --layers 16 --seeds S \\
        --variants grpo_free grpo_replay gspo_free --set sft.check_every=5 eval_every=5 \\
        --out experiments/results/routing_replay_depth          # S = 0, 1, 2, 3
    python -m experiments.routing_replay_depth

Stage C (registered after stage B's results): the same at `--layers 8` (or 4), runs under
experiments/results/routing_replay_depth_L<L>/, over the first 4 seeds whose cold start
reached its target (`stage_c_seeds`, from each seed's committed coldstart_seed<S>.log):

    python -m experiments.routing_replay_depth --layers 8        # writes stage_c.json
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np

from experiments import _results, _stats
from experiments.claim1_powered import collapsed
from gspo_jax.train import coldstart

NAME = "routing_replay_depth"
VARIANTS = ("grpo_free", "grpo_replay", "gspo_free")
SEEDS = (0, 1, 2, 3)
ITERATIONS = 40
# B1 and B3's comparisons (a, b): a - b per seed.
COMPARISONS = (("grpo_replay", "grpo_free"), ("gspo_free", "grpo_free"),
               ("gspo_free", "grpo_replay"))
DESCRIPTIVE = ("routing_changed", "approx_kl", "ratio_min", "ratio_max", "clip_frac_token",
               "clip_frac_seq")


def read_run(run_dir: str) -> dict | None:
  """One finished run's endpoints; None when it has not finished (no summary.json)."""
  if not os.path.exists(os.path.join(run_dir, "summary.json")):
    return None
  summary = json.load(open(os.path.join(run_dir, "summary.json")))
  cfg = json.load(open(os.path.join(run_dir, "config.json")))
  rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))
          if line.strip()]
  start = float(summary["heldout_accuracy_start"])
  out = {"iterations": len(rows), "layers": cfg["model"]["num_layers"],
         "routing": cfg["routing"], "loss": cfg["loss"]["name"],
         "heldout_start": start, "heldout_end": float(summary["heldout_accuracy_end"]),
         "heldout_curve": [[0, start]] + [[int(r["step"]), float(r["heldout_accuracy"])]
                                          for r in rows if "heldout_accuracy" in r],
         "reward_mean": float(np.mean([r["reward_mean"] for r in rows])),
         "collapsed": collapsed(rows, start)}
  for key in DESCRIPTIVE:
    vals = [r[key] for r in rows if key in r]
    if vals:
      out[f"{key}_median"] = float(np.median(vals))
      out[f"{key}_extreme"] = float(min(vals) if key == "ratio_min" else max(vals))
  if os.path.exists(os.path.join(run_dir, "provenance.json")):
    out["provenance"] = json.load(open(os.path.join(run_dir, "provenance.json")))
  return out


def holm(ps: list[float]) -> list[float]:
  """Holm's step-down adjustment: the k-th smallest p times (m - k + 1), made monotone,
  capped at 1; returned in the input order."""
  m = len(ps)
  order = sorted(range(m), key=lambda i: ps[i])
  adjusted, running = [0.0] * m, 0.0
  for k, i in enumerate(order):
    running = max(running, min(1.0, (m - k) * ps[i]))
    adjusted[i] = running
  return adjusted


def missing(runs_dir: str, seeds=SEEDS) -> list[str]:
  return [f"{v}_seed{s}" for s in seeds for v in VARIANTS
          if not os.path.exists(os.path.join(runs_dir, f"{v}_seed{s}", "summary.json"))]


def reached(runs_dir: str, seed: int) -> bool | None:
  """Whether seed's cold start reached its target, from its `coldstart_seed<seed>.log`
  (`_runs.cold_start`); None when there is no log (not run yet)."""
  path = os.path.join(runs_dir, f"coldstart_seed{seed}.log")
  if not os.path.exists(path):
    return None
  return coldstart.REACHED in open(path).read()


def stage_c_seeds(runs_dir: str, size: int = 4, most: int = 8) -> list[int]:
  """Stage C's analysis set: the first `size` of seeds 0..most-1 whose cold start reached
  its target (all of those that did, when seeds up to most-1 are run and fewer reached it).
  Refuses while the set is not yet known (a seed still to run)."""
  chosen = []
  for seed in range(most):
    got = reached(runs_dir, seed)
    if got is None:
      raise SystemExit(f"{runs_dir}: seed {seed}'s cold start has not run; {len(chosen)} of "
                       f"{size} seeds reached the target so far: run seed {seed} next")
    if got:
      chosen.append(seed)
    if len(chosen) == size:
      break
  return chosen


def analyse(runs_dir: str, seeds=SEEDS, layers: int = 16) -> dict:
  """B1-B3 and the descriptive figures over `seeds` (every run must have finished)."""
  gone = missing(runs_dir, seeds)
  if gone:
    raise SystemExit(f"{runs_dir}: {len(gone)} registered run(s) not finished ({', '.join(gone)}); "
                     "the registration reads no outcome before all have finished")
  runs = {v: [read_run(os.path.join(runs_dir, f"{v}_seed{s}")) for s in seeds] for v in VARIANTS}
  deviations = [f"{v} seed {s}: {r['iterations']} iterations, {r['layers']} layers"
                for v in VARIANTS for s, r in zip(seeds, runs[v])
                if r["iterations"] != ITERATIONS or r["layers"] != layers]
  for s_i, s in enumerate(seeds):  # a seed's variants share one cold start
    if len({runs[v][s_i]["heldout_start"] for v in VARIANTS}) != 1:
      deviations.append(f"seed {s}: the variants' cold starts differ")
  per = lambda key: {v: [r[key] for r in runs[v]] for v in VARIANTS}
  end, reward = per("heldout_end"), per("reward_mean")
  b1 = [{"a": a, "b": b, **_stats.paired(end[a], end[b])} for a, b in COMPARISONS]
  for c, p in zip(b1, holm([c["p"] for c in b1])):
    c["p_holm"] = p
  b3 = [{"a": a, "b": b, **_stats.paired(reward[a], reward[b])} for a, b in COMPARISONS]
  k = {v: int(sum(r["collapsed"] for r in runs[v])) for v in VARIANTS}
  n = len(seeds)
  b2 = {"collapsed": k, "n": n,
        "fisher_p": {v: _stats.fisher_exact(k["grpo_free"], n, k[v], n)
                     for v in ("grpo_replay", "gspo_free")}}
  return {"registration": f"experiments/preregistered.md, part 4, stage {'B' if layers == 16 else 'C'}",
          "seeds": list(seeds), "layers": layers, "B1_heldout_end": b1,
          "B1_replay_needed_reproduced": _stats.resolved(b1[0]) and b1[0]["mean"] > 0,
          "B2_collapses": b2, "B3_reward_mean": b3, "deviations": deviations,
          "runs": {v: {key: [r.get(key) for r in runs[v]] for key in runs[v][0]}
                   for v in VARIANTS}}


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--layers", type=int, default=16,
                  help="16: stage B (seeds 0-3); 8 or 4: stage C (seeds by its cold-start rule)")
  p.add_argument("--runs", default=None, help="default: the stage's results folder's runs/")
  p.add_argument("--out", default=None, help="default: stage_b.json / stage_c.json beside it")
  args = p.parse_args(argv)
  folder = os.path.join(_results.RESULTS, NAME if args.layers == 16 else f"{NAME}_L{args.layers}")
  runs = args.runs or os.path.join(folder, "runs")
  out = args.out or os.path.join(folder, "stage_b.json" if args.layers == 16 else "stage_c.json")
  seeds = SEEDS if args.layers == 16 else stage_c_seeds(runs)
  result = analyse(runs, seeds, args.layers)
  with open(out, "w") as f:
    json.dump(result, f, indent=2)
  print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=2))
  return result


if __name__ == "__main__":
  main()
