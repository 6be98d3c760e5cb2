"""Held-out evaluation of a run's checkpoint: greedy accuracy, and pass@k from n sampled
responses per prompt (the phase itself is `gspo_jax.train.evaluation`).

    python -m gspo_jax.evaluate --run runs/addition_tiny [--step N]
    python -m gspo_jax.evaluate --checkpoint runs/word_problems --data held_out.jsonl --k 8
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re

import jax

from gspo_jax.train.evaluation import evaluate, pass_at_k, sample_pass_at_k

__all__ = ["evaluate", "main", "pass_at_k", "run_evaluation", "sample_pass_at_k"]


def _locate(path: str, step: int | None) -> tuple[str, int | None]:
  """A run directory, or <run>/checkpoints/<step>, as (run directory, step)."""
  path = os.path.normpath(path)
  head, tail = os.path.split(path)
  if re.fullmatch(r"\d+", tail) and os.path.basename(head) == "checkpoints":
    return os.path.dirname(head), int(tail) if step is None else step
  return path, step


def _examples_to_show(greedy, samples, correct_counts, how_many: int) -> list[dict]:
  out = []
  for i, (example, texts) in enumerate(samples[:how_many]):
    out.append({"prompt": example.prompt, "answer": example.answer, "greedy": greedy[i],
                "samples": texts[:4], "correct_of_n": correct_counts[i]})
  return out


def run_evaluation(args) -> dict:
  run_dir, step = _locate(args.checkpoint or args.run, args.step)
  from gspo_jax.train.run import heldout, load_run
  run = load_run(run_dir, step=step)
  cfg = run.cfg if args.size is None else dataclasses.replace(run.cfg, eval_size=args.size)
  if args.data:
    from gspo_jax.tasks import DatasetTask, examples_from_file
    if not isinstance(run.task, DatasetTask):
      raise SystemExit(f"--data needs a run of task.name='dataset'; {run_dir} trained "
                       f"{cfg.task.name!r}")
    examples = examples_from_file(run.task, args.data)[:args.size]  # all unless --size
  else:
    examples = heldout(run.task, cfg)
  greedy = evaluate(run, run.state.params, examples)
  report = {"run": run_dir, "step": int(run.state.step), "data": args.data or "held-out set",
            "prompts": len(examples), "accuracy": greedy["accuracy"], "reward": greedy["reward"]}
  samples, counts = [(e, [g]) for e, g in zip(examples, greedy["greedy"])], [None] * len(examples)
  if args.k:
    n = max(args.n or args.k, args.k)
    sampled = sample_pass_at_k(run, run.state.params, examples, n=n, k=args.k, seed=args.seed)
    report.update({"k": args.k, "n": n, f"pass@{args.k}": sampled[f"pass@{args.k}"],
                   "sample_reward": sampled["sample_reward"],
                   "temperature": cfg.rollout.temperature,
                   "correct_counts": sampled["correct_counts"]})
    samples, counts = sampled["samples"], sampled["correct_counts"]
  report["examples"] = _examples_to_show(greedy["greedy"], samples, counts, args.examples)
  return report


def check_args(parser: argparse.ArgumentParser, args) -> None:
  """Refuse bad flags by their names before a checkpoint is loaded (the sampler would
  name its own field, or silently raise --n to --k)."""
  if args.k < 0:
    parser.error(f"--k must be >= 0 (0 = greedy only); got {args.k}")
  if args.n is not None and not args.k:
    parser.error("--n (samples per prompt) needs --k >= 1")
  if args.n is not None and args.n < args.k:
    parser.error(f"--n must be >= --k (pass@k draws k of n samples); got --n {args.n} "
                 f"--k {args.k}")
  for flag in ("size", "step"):
    value = getattr(args, flag)
    if value is not None and value < (1 if flag == "size" else 0):
      parser.error(f"--{flag} must be >= {1 if flag == 'size' else 0}; got {value}")
  if args.examples < 0:
    parser.error(f"--examples must be >= 0; got {args.examples}")


def main(argv=None):
  parser = argparse.ArgumentParser(description="Held-out accuracy (greedy) and pass@k of a "
                                   "training run's checkpoint")
  src = parser.add_mutually_exclusive_group(required=True)
  src.add_argument("--run", help="run directory written by python -m gspo_jax.train")
  src.add_argument("--checkpoint", help="run directory, or <run>/checkpoints/<step>")
  parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: newest)")
  parser.add_argument("--data", default=None, help="JSONL file of prompts (task='dataset' "
                      "runs; default: the run's held-out set)")
  parser.add_argument("--size", type=int, default=None, help="at most this many problems "
                      "(default: all of --data, else the config's eval_size)")
  parser.add_argument("--k", type=int, default=0, help="report pass@k (0 = greedy only)")
  parser.add_argument("--n", type=int, default=None, help="samples per prompt (>= k; default k)")
  parser.add_argument("--seed", type=int, default=0, help="sampling seed for pass@k")
  parser.add_argument("--examples", type=int, default=4, help="example completions in the report")
  parser.add_argument("--out", default=None, help="JSON report (default: <run>/eval_step<N>.json)")
  args = parser.parse_args(argv)
  check_args(parser, args)
  report = run_evaluation(args)
  line = (f"step {report['step']}: held-out accuracy {report['accuracy']:.3f}, "
          f"reward {report['reward']:.3f} on {report['prompts']} problems")
  if args.k:
    line += f"; pass@{args.k} {report[f'pass@{args.k}']:.3f} (n={report['n']})"
  print(line)
  if jax.process_index() == 0:
    out = args.out or os.path.join(report["run"], f"eval_step{report['step']}.json")
    with open(out, "w") as f:
      json.dump(report, f, indent=2)
    print(f"report: {out}")
  return report


if __name__ == "__main__":
  main()
