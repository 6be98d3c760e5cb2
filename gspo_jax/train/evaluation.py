"""Held-out evaluation as a phase of a run: greedy accuracy, and pass@k from n sampled
responses per prompt, through the run's rollout (`Run.rollout.responder`), so a multi-turn
run is scored on whole episodes. The command line is `python -m gspo_jax.evaluate`.

pass@k is the unbiased estimator of Chen et al. 2021 ("Evaluating Large Language Models
Trained on Code", eq. 1): with n >= k samples of which c are correct,
    pass@k = 1 - C(n-c, k) / C(n, k),
averaged over prompts. It is the probability that at least one of k samples drawn without
replacement from the n is correct; n > k lowers the variance of the estimate.
"""

from __future__ import annotations

import jax
import numpy as np

from gspo_jax.parallel import sharding
from gspo_jax.tasks import text


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
  decoding, the run's `Run.rollout.responder()`). `run` is a `gspo_jax.train.run.Run`. A
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
