"""Held-out evaluation: greedy decoding with the in-graph sampler, exact-answer accuracy.

    python -m gspo_jax.evaluate --run runs/addition_tiny [--step N]
"""

from __future__ import annotations

import argparse
import dataclasses

import jax
import numpy as np
from flax import nnx

from gspo_jax import sampling
from gspo_jax import train as T


def evaluate(params, graphdef, task, tok, examples, cfg: "T.TrainConfig", batch: int = 256):
  """Greedy accuracy and mean reward on `examples`."""
  scfg = sampling.SamplerConfig(group_size=1, max_new_tokens=cfg.rollout.max_new_tokens,
                                eos_id=tok.eos_id, pad_id=tok.pad_id,
                                max_prompt_len=cfg.rollout.max_prompt_len, greedy=True,
                                vocab_limit=tok.vocab_size)
  model = nnx.merge(graphdef, params)
  correct, rewards = [], []
  for start in range(0, len(examples), batch):
    chunk = examples[start:start + batch]
    prompts, lens = T.encode_prompts(tok, chunk, cfg.rollout.max_prompt_len)
    rollout = sampling.sample_groups(model, prompts, lens, jax.random.key(0), scfg)
    texts = T.decode_completions(tok, rollout.tokens_BxGxT[:, 0], rollout.mask_BxGxT[:, 0])
    correct += [task.is_correct(e, c) for e, c in zip(chunk, texts)]
    rewards += [task.reward(e, c) for e, c in zip(chunk, texts)]
  return {"accuracy": float(np.mean(correct)), "reward": float(np.mean(rewards))}


def main(argv=None):
  parser = argparse.ArgumentParser(description="Held-out accuracy of a training run's checkpoint")
  parser.add_argument("--run", required=True, help="run directory written by gspo_jax.train")
  parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: newest)")
  parser.add_argument("--size", type=int, default=None, help="held-out problems (default: config)")
  args = parser.parse_args(argv)
  run = T.load_run(args.run, step=args.step)
  cfg = run.cfg if args.size is None else dataclasses.replace(run.cfg, eval_size=args.size)
  result = evaluate(run.state.params, run.graphdef, run.task, run.tok, T.heldout(run.task, cfg), cfg)
  print(f"step {int(run.state.step)}: held-out accuracy {result['accuracy']:.3f}, "
        f"reward {result['reward']:.3f} on {cfg.eval_size} problems")


if __name__ == "__main__":
  main()
