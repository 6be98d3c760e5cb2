"""Held-out evaluation: greedy decoding with the in-graph sampler, exact-answer accuracy.

    python -m gspo_jax.evaluate --run runs/addition_tiny [--step N]
"""

from __future__ import annotations

import argparse
import dataclasses

import jax
import numpy as np
from flax import nnx

from gspo_jax import sampling, sharding
from gspo_jax import train as T


def evaluate(params, graphdef, task, tok, examples, cfg: "T.TrainConfig", *, mesh=None,
             batch: int = 256):
  """Greedy accuracy and mean reward on `examples`.

  With a mesh, each chunk is padded (with copies of its last problem, not counted) to a
  multiple of the batch mesh axes; each process decodes and scores its own rows, and the
  results are gathered over processes."""
  scfg = sampling.SamplerConfig(group_size=1, max_new_tokens=cfg.rollout.max_new_tokens,
                                eos_id=tok.eos_id, pad_id=tok.pad_id,
                                max_prompt_len=cfg.rollout.max_prompt_len, greedy=True,
                                vocab_limit=tok.vocab_size)
  ways = 1 if mesh is None else sharding.batch_ways(mesh)
  batch = -(-batch // ways) * ways
  model = nnx.merge(graphdef, params)
  correct, rewards = [], []
  for start in range(0, len(examples), batch):
    chunk = list(examples[start:start + batch])
    n = len(chunk)
    chunk += chunk[-1:] * (-n % ways)
    rows = slice(0, len(chunk)) if mesh is None else sharding.local_rows(
        sharding.batch_sharding(mesh), len(chunk))
    prompts, lens = T.encode_prompts(tok, chunk[rows], cfg.rollout.max_prompt_len)
    if mesh is not None:
      prompts, lens = T.feed(prompts, mesh, len(chunk)), T.feed(lens, mesh, len(chunk))
    rollout = sampling.sample_groups(model, prompts, lens, jax.random.key(0), scfg, mesh=mesh)
    texts = T.decode_completions(tok, sharding.to_host(rollout.tokens_BxGxT)[:, 0],
                                 sharding.to_host(rollout.mask_BxGxT)[:, 0])
    scored = np.array([(task.is_correct(e, c), task.reward(e, c))
                       for e, c in zip(chunk[rows], texts)], np.float64).reshape(-1, 2)
    scored = sharding.gather_rows(scored)[:n]
    correct += list(scored[:, 0])
    rewards += list(scored[:, 1])
  return {"accuracy": float(np.mean(correct)), "reward": float(np.mean(rewards))}


def main(argv=None):
  parser = argparse.ArgumentParser(description="Held-out accuracy of a training run's checkpoint")
  parser.add_argument("--run", required=True, help="run directory written by gspo_jax.train")
  parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: newest)")
  parser.add_argument("--size", type=int, default=None, help="held-out problems (default: config)")
  args = parser.parse_args(argv)
  run = T.load_run(args.run, step=args.step)
  cfg = run.cfg if args.size is None else dataclasses.replace(run.cfg, eval_size=args.size)
  result = evaluate(run.state.params, run.graphdef, run.task, run.tok, T.heldout(run.task, cfg), cfg,
                    mesh=run.layout.mesh)
  print(f"step {int(run.state.step)}: held-out accuracy {result['accuracy']:.3f}, "
        f"reward {result['reward']:.3f} on {cfg.eval_size} problems")


if __name__ == "__main__":
  main()
