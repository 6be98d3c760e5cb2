"""Seconds per iteration of a checkout's own training loop, for before/after comparisons.

    python -m experiments.loop_timing --trees OLD_CHECKOUT NEW_CHECKOUT [--rounds 3]

Each round runs every tree once, in turn (A B A B ...), each in a fresh process that imports
`gspo_jax` from that tree and calls its `train.train` on one config (the `benchmark.py
iteration` shape: 2-digit addition, 64 prompts x G = 8, up to 5 new tokens, width 128,
2 layers, 4 minibatches, no cold start, no evaluation). The time of an iteration is the
interval between consecutive metrics records (`MetricsWriter.write`), so the loop is timed
as it runs, host syncs included; the first `--skip` intervals (compilation) are left out.
The report is the median per tree and the ratio of medians, paired by round.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time


def time_tree(tree: str, iterations: int, skip: int, seed: int) -> dict:
  """One tree's intervals, in the process `main` starts with PYTHONPATH = the tree (so
  `gspo_jax` is that tree's; the report records which file was imported)."""
  from gspo_jax.train import loop as train
  from gspo_jax.train import metrics
  try:
    from gspo_jax.config import RolloutConfig, SFTConfig, TrainConfig
  except ImportError:  # a checkout from before gspo_jax/config.py
    from gspo_jax.train.loop import RolloutConfig, SFTConfig, TrainConfig
  from gspo_jax.models.config import tiny
  stamps = []
  write = metrics.MetricsWriter.write

  def timed_write(self, *args, **kwargs):
    stamps.append(time.perf_counter())
    return write(self, *args, **kwargs)

  metrics.MetricsWriter.write = timed_write
  cfg = TrainConfig(model=tiny(vocab_size=32, hidden=128, mlp_dim=512, num_heads=4,
                               num_kv_heads=2, head_dim=32, num_layers=2),
                    rollout=RolloutConfig(prompts_per_iter=64, group_size=8, max_new_tokens=5,
                                          max_prompt_len=8),
                    sft=SFTConfig(steps=0), num_minibatches=4, iterations=iterations,
                    eval_every=0, eval_size=8, seed=seed)
  with tempfile.TemporaryDirectory() as run_dir:
    train.train(cfg, run_dir, checkpoint_every=0, keep=1, progress=False)
  gaps = [b - a for a, b in zip(stamps, stamps[1:])][skip:]
  import gspo_jax
  return {"tree": tree, "imported": gspo_jax.__file__, "median_s": statistics.median(gaps), "mean_s": statistics.mean(gaps),
          "intervals": len(gaps)}


def tree_env(tree: str) -> dict:
  """The environment of a child timing `tree`: its checkout first on PYTHONPATH, so the child
  imports that tree's `gspo_jax` (this script imports nothing of the package itself)."""
  path = [os.path.abspath(tree), os.environ.get("PYTHONPATH", "")]
  return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in path if p)}


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--trees", nargs="+", required=True, help="checkout roots, timed in turn")
  p.add_argument("--rounds", type=int, default=3)
  p.add_argument("--iterations", type=int, default=40)
  p.add_argument("--skip", type=int, default=5, help="first intervals left out (compiling)")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--out", default=None, help="JSON report")
  p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # internal: time this tree
  args = p.parse_args(argv)
  if args.one:
    print(json.dumps(time_tree(args.one, args.iterations, args.skip, args.seed)))
    return
  runs = {t: [] for t in args.trees}
  for r in range(args.rounds):
    for tree in args.trees:
      out = subprocess.run([sys.executable, os.path.abspath(__file__), "--trees", tree,
                            "--one", tree, "--iterations", str(args.iterations), "--skip",
                            str(args.skip), "--seed", str(args.seed)],
                           capture_output=True, text=True, check=True,
                           cwd=tempfile.gettempdir(), env=tree_env(tree))
      result = json.loads(out.stdout.strip().splitlines()[-1])
      runs[tree].append(result)
      print(f"round {r}: {tree}: {result['median_s'] * 1e3:.1f} ms per iteration (median)",
            flush=True)
  base, *others = args.trees
  report = {"config": "64 prompts x G=8, 5 new tokens, width 128, 2 layers, 4 minibatches",
            "iterations": args.iterations, "skip": args.skip, "rounds": runs, "ratios": {}}
  for tree in others:
    paired = [a["median_s"] / b["median_s"] for a, b in zip(runs[base], runs[tree])]
    report["ratios"][tree] = {"base_over_tree_paired": paired,
                              "median_paired": statistics.median(paired)}
    print(f"{base} / {tree}: {statistics.median(paired):.3f}x (median of {len(paired)} rounds; "
          f"> 1 means {tree} is faster)")
  if args.out:
    with open(args.out, "w") as f:
      json.dump(report, f, indent=2)


if __name__ == "__main__":
  main()
