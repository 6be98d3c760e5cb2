"""Generate text from a Hugging Face model directory with the in-graph sampler.

    python -m gspo_jax.generate --model DIR --prompt "The capital of France is" [--prompt ...]
        [--max-new-tokens 32] [--temperature 0.7 --top-p 0.9 --num-samples 4] [--seed 0]

Greedy unless --temperature is given. Prompts are used as plain text (chat templates are
the bring-your-own-task issue's).
"""

from __future__ import annotations

import argparse

import jax
import numpy as np

from gspo_jax import sampling
from gspo_jax.hf_tokenizer import load_tokenizer
from gspo_jax.models import hf


def encode(tok, prompts: list[str]) -> tuple[np.ndarray, np.ndarray]:
  """[bos] + ids (no bos when the tokenizer has none), right-padded: (ids_BxP, lens_B)."""
  bos = [] if tok.bos_id is None else [tok.bos_id]
  rows = [bos + tok.encode(p) for p in prompts]
  for p, row in zip(prompts, rows):
    if not row:
      raise ValueError(f"prompt {p!r} encodes to no tokens and the tokenizer has no BOS token")
  ids = np.full((len(rows), max(map(len, rows))), tok.pad_id, np.int32)
  for i, row in enumerate(rows):
    ids[i, :len(row)] = row
  return ids, np.array([len(r) for r in rows], np.int32)


def generate(model, tok, prompts: list[str], *, max_new_tokens: int = 32,
             temperature: float | None = None, top_p: float = 1.0, top_k: int = 0,
             num_samples: int = 1, seed: int = 0) -> list[list[str]]:
  """`num_samples` completions per prompt (text up to, not including, EOS)."""
  ids, lens = encode(tok, prompts)
  cfg = sampling.SamplerConfig(group_size=num_samples, max_new_tokens=max_new_tokens,
                               eos_id=tok.eos_id, pad_id=tok.pad_id, max_prompt_len=ids.shape[1],
                               temperature=temperature or 1.0, greedy=temperature is None,
                               top_p=top_p, top_k=top_k, vocab_limit=tok.vocab_size)
  rollout = sampling.sample_groups(model, ids, lens, jax.random.key(seed), cfg)
  tokens, mask = np.asarray(rollout.tokens_BxGxT), np.asarray(rollout.mask_BxGxT)
  return [[tok.decode([t for t, m in zip(tokens[b, g], mask[b, g]) if m and t != tok.eos_id])
           for g in range(num_samples)] for b in range(len(prompts))]


def main(argv=None):
  parser = argparse.ArgumentParser(description="Sample from a Hugging Face model directory")
  parser.add_argument("--model", required=True, help="directory with config.json, safetensors "
                      "and tokenizer.json (or tokenizer.model)")
  parser.add_argument("--prompt", action="append", required=True, help="repeat for a batch")
  parser.add_argument("--max-new-tokens", type=int, default=32)
  parser.add_argument("--temperature", type=float, default=None, help="default: greedy")
  parser.add_argument("--top-p", type=float, default=1.0)
  parser.add_argument("--top-k", type=int, default=0)
  parser.add_argument("--num-samples", type=int, default=1)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--dtype", default=None, help="parameter dtype (default: as stored)")
  args = parser.parse_args(argv)
  model = hf.load(args.model, param_dtype=args.dtype)
  tok = load_tokenizer(args.model)
  outs = generate(model, tok, args.prompt, max_new_tokens=args.max_new_tokens,
                  temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                  num_samples=args.num_samples, seed=args.seed)
  for prompt, completions in zip(args.prompt, outs):
    for c in completions:
      print(f"{prompt}{c}")


if __name__ == "__main__":
  main()
