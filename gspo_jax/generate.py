"""Generate text from a Hugging Face model directory with the in-graph sampler.

    python -m gspo_jax.generate --model DIR --prompt "The capital of France is" [--prompt ...]
        [--max-new-tokens 32] [--temperature 0.7 --top-p 0.9 --num-samples 4] [--seed 0]

Greedy unless --temperature is given (--temperature 0 is greedy too). Prompts are used as
plain text (chat templates are the bring-your-own-task issue's), encoded as transformers'
`tokenizer.encode(prompt)` does: with the tokenizer's own BOS where it has one (Llama 2 /
3), nothing added for Qwen.
"""

from __future__ import annotations

import argparse

import jax
import numpy as np

from gspo_jax.models import hf
from gspo_jax.rollout import sampling
from gspo_jax.tasks import text
from gspo_jax.tasks.hf_tokenizer import load_tokenizer


def generate(model, tok, prompts: list[str], *, max_new_tokens: int = 32,
             temperature: float | None = None, top_p: float = 1.0, top_k: int = 0,
             num_samples: int = 1, seed: int = 0) -> list[list[str]]:
  """`num_samples` completions per prompt: text up to, not including, EOS (other special
  tokens show as U+FFFD, see `text.decode_completions`). temperature None or 0 = greedy."""
  if temperature is not None and not temperature >= 0:
    raise ValueError(f"--temperature must be >= 0 (0 = greedy); got {temperature}")
  greedy = not temperature
  ids_BxP, lens_B = text.encode_prompts(tok, prompts)  # as wide as the longest prompt
  cfg = sampling.SamplerConfig(group_size=num_samples, max_new_tokens=max_new_tokens,
                               eos_id=tok.eos_id, pad_id=tok.pad_id,
                               max_prompt_len=ids_BxP.shape[1], temperature=temperature or 1.0,
                               greedy=greedy, top_p=top_p, top_k=top_k,
                               vocab_limit=tok.vocab_size)
  rollout = sampling.sample_groups(model, ids_BxP, lens_B, jax.random.key(seed), cfg)
  B, G, T = rollout.tokens_BxGxT.shape
  texts = text.decode_completions(tok, np.asarray(rollout.tokens_BxGxT).reshape(B * G, T),
                                  np.asarray(rollout.mask_BxGxT).reshape(B * G, T))
  return [texts[b * G:(b + 1) * G] for b in range(B)]


def main(argv=None):
  parser = argparse.ArgumentParser(description="Sample from a Hugging Face model directory")
  parser.add_argument("--model", required=True, help="directory with config.json, safetensors "
                      "and tokenizer.json (or tokenizer.model)")
  parser.add_argument("--prompt", action="append", required=True, help="repeat for a batch")
  parser.add_argument("--max-new-tokens", type=int, default=32)
  parser.add_argument("--temperature", type=float, default=None, help="default (and 0): greedy")
  parser.add_argument("--top-p", type=float, default=1.0)
  parser.add_argument("--top-k", type=int, default=0)
  parser.add_argument("--num-samples", type=int, default=1)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--dtype", default=None, help="parameter dtype (default: as stored)")
  args = parser.parse_args(argv)
  if args.temperature is not None and not args.temperature >= 0:
    parser.error(f"--temperature must be >= 0 (0 = greedy); got {args.temperature}")
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
