"""Held-out evaluation: greedy accuracy, and pass@k from n sampled responses per prompt.

    python -m gspo_jax.evaluate --run runs/addition_tiny [--step N]
    python -m gspo_jax.evaluate --checkpoint runs/word_problems --data held_out.jsonl --k 8

pass@k is the unbiased estimator of Chen et al. 2021 ("Evaluating Large Language Models
Trained on Code", eq. 1): with n >= k samples of which c are correct,
    pass@k = 1 - C(n-c, k) / C(n, k),
averaged over prompts. It is the probability that at least one of k samples drawn without
replacement from the n is correct; n > k lowers the variance of the estimate.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re

import jax
import numpy as np

from gspo_jax import sharding, text


def pass_at_k(n: int, c, k: int):
  """Unbiased pass@k of one prompt (or an array of prompts) with `c` correct out of `n`.

  1 - C(n-c, k) / C(n, k), computed as 1 - prod_{i=n-c+1}^{n} (1 - k / i), which avoids
  huge binomials; exactly 1.0 when n - c < k (every k-subset holds a correct sample)."""
  if not 1 <= k <= n:
    raise ValueError(f"pass_at_k: need 1 <= k <= n; got k={k}, n={n}")
  c = np.asarray(c)
  if np.any((c < 0) | (c > n)):
    raise ValueError(f"pass_at_k: correct counts must lie in [0, n={n}]; got {c}")
  out = np.empty(c.shape, np.float64)
  for idx, ci in np.ndenumerate(c):
    out[idx] = 1.0 if n - ci < k else 1.0 - np.prod(1.0 - k / np.arange(n - ci + 1, n + 1))
  return out if out.ndim else float(out)


def _generate(run, respond, params, chunk, key):
  """Responses to this process's rows of `chunk`: (its examples, texts [rows][G])."""
  tok, mesh = run.tok, run.layout.mesh
  mine = sharding.local_part(chunk, mesh)
  prompts, lens = run.encode_prompts([e.prompt for e in mine])
  prompts, lens = sharding.feed(prompts, mesh, len(chunk)), sharding.feed(lens, mesh, len(chunk))
  tokens_BxGxT, shown_BxGxT = respond(params, prompts, lens, key, mine)
  tokens, shown = sharding.to_host(tokens_BxGxT), sharding.to_host(shown_BxGxT)
  b, G, L = tokens.shape
  texts = text.decode_completions(tok, tokens.reshape(b * G, L), shown.reshape(b * G, L))
  return mine, [texts[i * G:(i + 1) * G] for i in range(b)]


def _responses(run, respond, params, examples, *, batch: int, seed: int = 0):
  """Score the responses `respond` (a `Run.rollout.responder`) gives to each example, chunk
  by chunk (each chunk padded with copies of its last problem to a multiple of the batch
  mesh axes; padding not counted).

  Returns (correct_BxG bool, rewards_BxG, this process's (example, texts) pairs)."""
  ways = sharding.batch_ways(run.layout.mesh)
  batch = -(-batch // ways) * ways
  correct, rewards, shown = [], [], []
  for start in range(0, len(examples), batch):
    chunk = list(examples[start:start + batch])
    n = len(chunk)
    chunk += chunk[-1:] * (-n % ways)
    key = jax.random.fold_in(jax.random.key(seed), start)
    mine, texts = _generate(run, respond, params, chunk, key)
    G = len(texts[0]) if texts else 1
    flat_ex = [e for e in mine for _ in range(G)]
    r, c, _ = run.task.score_batch(flat_ex, [t for ts in texts for t in ts])
    scored = np.stack([np.asarray(c, np.float64), np.asarray(r, np.float64)], -1)
    scored = sharding.gather_rows(scored.reshape(len(mine), G, 2))[:n]
    correct.append(scored[..., 0] > 0.5)
    rewards.append(scored[..., 1])
    shown += list(zip(mine, texts))
  return np.concatenate(correct), np.concatenate(rewards), shown


def evaluate(run, params, examples, *, batch: int = 256):
  """Greedy accuracy and mean reward of the policy `params` on `examples` (G = 1, argmax
  decoding, the run's `Run.rollout.responder()`). `run` is a `gspo_jax.run.Run`. A
  multi-turn run decodes whole episodes with its environment, and the task scores each
  episode's text (model turns and observations); pass@k likewise.

  With a mesh, each process decodes and scores its own rows, and the results are gathered
  over processes."""
  correct, rewards, shown = _responses(run, run.rollout.responder(run), params, examples,
                                       batch=batch)
  return {"accuracy": float(correct.mean()), "reward": float(rewards.mean()),
          "greedy": [texts[0] for _, texts in shown]}


def sample_pass_at_k(run, params, examples, *, n: int, k: int, batch: int = 32, seed: int = 0):
  """pass@k (mean over examples) from n responses per example, sampled like the rollouts
  (temperature, top-p, top-k of cfg.rollout). Returns the metric, the mean reward, the
  per-example correct counts and this process's (example, texts)."""
  correct, rewards, shown = _responses(run, run.rollout.responder(run, n), params, examples,
                                       batch=batch, seed=seed)
  counts = correct.sum(-1)
  return {f"pass@{k}": float(np.mean(pass_at_k(n, counts, k))), "sample_reward":
          float(rewards.mean()), "correct_counts": counts.tolist(), "samples": shown}


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
  from gspo_jax.run import heldout, load_run
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
  src.add_argument("--run", help="run directory written by gspo_jax.train")
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
